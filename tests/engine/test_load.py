"""A short run of examples/load_test.py against the real server on configs/flash as shipped (the guard adapter
decides both rails), the full run: 32 clients, 2 minutes.

The test asks for the same greedy answer under load as alone (no cross-talk between concurrent conversations). A
greedy reply depends on how its prompt's tokens were rounded through the model: the CPU int4 kernel rounds a row by
the chunk it runs in (blocks of 16 rows, and the chunk's length). Until 2026-12-07 this test ran with ``guard:
probe``: with the guard the answers parted under load (16 wrong in one 40-second run), because the guard brought
the session to the conversation without its answer header, a chunk a few tokens shorter than the generation's own.
Now the input rail's guard first brings the session to the generation's prompt as its prefill would, and leaves it
at a multiple of 16 tokens of it (``Engine.read(then=...)``, engine/session_runner.py ``ROW_BLOCK``), where the
generation's prefill resumes with the rows rounded as in a whole prefill: tests/engine/test_prefill_rounding.py
checks the K/V bit for bit."""

import asyncio
import sys

import pytest

from tests.conftest import ROOT, Server, make_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    cfg = make_config(tmp)
    assert (cfg / "config.yml").read_text().count("    guard: auto") == 2   # configs/flash as shipped
    s = Server(cfg, tmp / "server.log").wait()
    yield s
    s.stop()


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
