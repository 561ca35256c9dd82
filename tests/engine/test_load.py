"""A short run of examples/load_test.py against the real server (the full run: 32 clients, 2 minutes).

The test asks for the same greedy answer under load as alone (no cross-talk between concurrent conversations). A
greedy reply depends on how its prompt's tokens were chunked through the model (float rounding differs by chunk
size). With configs/flash's guard adapter the answers still part under load: 16 wrong answers in one 40-second run
on 2026-12-07 (parting after a few tokens), although the guard's branch now brings the session to the conversation
as the generation holds it before its question runs; where the rest of the difference comes from (the conversation's
partial last page recomputed with the answer header when another request took the session in between, most
likely) is not found yet (issue 47). So the server here decides by the probe alone (``guard: probe``), whose check
is the generation's own prefill, and equal answers stay the test of cross-talk; tests/rails/test_guard.py checks
that the guard's reads leave the generation's pages the base model's."""

import asyncio
import sys

import pytest

from tests.conftest import ROOT, Server, make_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    cfg = make_config(tmp)
    yml = (cfg / "config.yml").read_text()
    assert yml.count("    guard: auto") == 2
    (cfg / "config.yml").write_text(yml.replace("    guard: auto", "    guard: probe"))
    s = Server(cfg, tmp / "server.log").wait()
    yield s
    s.stop()


def test_concurrent_mixed_load_has_no_errors_and_no_cross_talk(probe_server):
    server = probe_server
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
