"""A short run of examples/load_test.py against the real server (the full run: 32 clients, 2 minutes)."""

import asyncio
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_concurrent_mixed_load_has_no_errors_and_no_cross_talk(server):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import load_test
    finally:
        sys.path.pop(0)
    report = asyncio.run(load_test.run(server.url, server.proc.pid, clients=8, seconds=40, warmup=20))
    print(report)
    assert report["requests"] >= 8 and report["server_errors"] == 0
    assert report["wrong_answers"] == 0, report["wrong_examples"]
    assert report["rss_growth"] < 0.10, report
