"""The real NeMo Guardrails server over HTTP on 127.0.0.1 (``flashguard serve``)."""

import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT, Server, make_config

pytestmark = pytest.mark.slow
Q = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}


def test_chat_completion(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={**Q, "model": "flashguard"}, timeout=120)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_chat_completion_streaming(server):
    text, frames = "", 0
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**Q, "model": "flashguard", "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames += 1
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    assert "Paris" in text and frames >= 1


def test_different_model_names_share_the_weights(server):
    for name in ("model-a", "model-b"):
        r = httpx.post(server.url + "/v1/chat/completions", json={**Q, "model": name}, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    assert server.log().count("flashguard: loading") == 1   # the one start-up line: one load


def test_prompt_longer_than_context_is_a_4xx(server):
    long = "hello " * 9000
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "flashguard", "messages": [{"role": "user", "content": long}]}, timeout=120)
    assert r.status_code == 400, r.text
    assert "context" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,needle", [
    ({"model": "flashguard", "messages": []}, "messages is empty"),
    ({"model": "flashguard"}, "messages is missing"),
    ({"model": "flashguard", "messages": "hi"}, "messages must be a list of messages, not str"),
    ({"model": "flashguard", "messages": [{"content": "hi"}]}, "messages[0]"),
    ({"model": "flashguard", "messages": Q["messages"], "max_tokens": -3}, "max_tokens"),
])
def test_bad_requests_are_a_4xx(server, body, needle):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"]


def test_not_json_is_a_4xx(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{nope", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_server_still_healthy_after_bad_input(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={**Q, "model": "flashguard"}, timeout=120)
    assert r.status_code == 200


def test_serve_refuses_a_bad_config_with_the_key(tmp_path):
    cfg = make_config(tmp_path, "models:\n  - type: main\n    engine: flashguard\n    model: x\n"
                                "    parameters:\n      temperatur: 0.5\npassthrough: true\n")
    p = subprocess.run([sys.executable, "-m", "flashguard.cli", "serve", "--config", str(cfg), "--port", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and "models[main].parameters.temperatur" in p.stderr


def test_nemo_server_answers_a_bad_config_with_a_4xx(tmp_path):
    cfg = make_config(tmp_path, "models:\n  - type: main\n    engine: flashguard\n    model: x\n"
                                "    parameters:\n      model_path: /no/such/model\npassthrough: true\n")
    # NeMo's own server (no preload): the error comes with the first request.
    s = Server.__new__(Server)
    from tests.conftest import free_port

    s.port = free_port()
    s.url = f"http://127.0.0.1:{s.port}"
    s.log_path = tmp_path / "nemo.log"
    s._log = open(s.log_path, "w")
    s.proc = subprocess.Popen([sys.executable, "-m", "nemoguardrails", "server", "--config", str(cfg), "--port",
                               str(s.port), "--disable-chat-ui", "--default-config-id", "cfg"], stdout=s._log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        s.wait()
        r = httpx.post(s.url + "/v1/chat/completions", json={**Q, "model": "x"}, timeout=120)
        assert r.status_code == 400
        assert "models[main].parameters.model_path" in s.log()
    finally:
        s.stop()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM is TerminateProcess on Windows: no handler runs")
def test_a_terminated_server_removes_its_kv_pages_folder(tmp_path):
    """``kill`` (SIGTERM), the usual way to stop a server: uvicorn shuts down and raises the signal again; the KV
    pages' L3 folder (the conversation in another form) must still go with the process."""
    from flashguard.kv.disk import PREFIX

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = Server(ROOT / "configs" / "flash", tmp_path / "server.log", env={"TMPDIR": str(tmp)}).wait()
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={**Q, "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        folders = [p for p in tmp.iterdir() if p.name.startswith(PREFIX)]
        assert folders, f"no L3 folder under {tmp}: {list(tmp.iterdir())}"
    finally:
        s.stop()
    assert s.proc.returncode is not None
    assert not [p for p in tmp.iterdir() if p.name.startswith(PREFIX)], s.log()
