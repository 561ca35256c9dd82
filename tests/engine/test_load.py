"""A short run of examples/load_test.py against the real server (the full run: 32 clients, 2 minutes), with
configs/flash's default guard.

The test asks for the same greedy answer under load as alone (no cross-talk between concurrent conversations). A
greedy reply depends on how its prompt's tokens were chunked through the model (float rounding differs by chunk
size), so the guard's branch brings the session to the conversation exactly as the generation holds it before it
runs its question (``Engine._read_guarded``): the input rail's check leaves the conversation chunked as a request
without rails would have it."""

import asyncio
import sys

import pytest

from tests.conftest import ROOT, Server, make_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    cfg = make_config(tmp)
    assert (cfg / "config.yml").read_text().count("    guard: auto") == 2   # the default guard, as shipped
    s = Server(cfg, tmp / "server.log").wait()
    yield s
    s.stop()


def test_concurrent_mixed_load_has_no_errors_and_no_cross_talk(guarded_server):
    server = guarded_server
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
