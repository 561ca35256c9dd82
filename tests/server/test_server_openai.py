"""The official ``openai`` client against ``flashguard serve`` over real HTTP on 127.0.0.1 (embedded model).

What a client of an OpenAI-compatible server relies on: ``usage``, ``finish_reason`` ("stop", "length",
"content_filter"), ``role`` in the first delta, the usage chunk of ``stream_options.include_usage``,
``models.list()``, text parts, a 400 naming each unsupported field, the same refusal in both modes, and a
request log that holds no conversation text unless ``--verbose``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, Server, free_port, make_config

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
Q = [{"role": "user", "content": "What is the capital of France?"}]


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _launch(config, log_path, *extra) -> Server:
    """``flashguard serve`` with extra arguments (conftest's Server, another command line), started: ``.wait()``
    for it to answer."""
    s = Server.__new__(Server)
    s.port, s.log_path = free_port(), log_path
    s.url = f"http://127.0.0.1:{s.port}"
    s._log = open(log_path, "w")
    s.proc = subprocess.Popen([sys.executable, "-m", "flashguard.cli", "serve", "--config", str(config), "--port",
                               str(s.port), *extra], stdout=s._log, stderr=subprocess.STDOUT, cwd=ROOT)
    return s


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


def blocking_config(tmp):
    """A config whose moderation rail blocks every reply (threshold 0.001)."""
    cfg = make_config(tmp)
    yml = (cfg / "config.yml").read_text()
    assert "threshold: 0.64" in yml
    assert "probe: auto" in yml   # the question's verdict (probe: off) is the one a threshold decides
    # only the output rail's probe goes off (the input rail keeps its probe, which lets the question through:
    # the reply is what gets blocked)
    out = "    probe: auto\n    question:"
    assert out in yml
    (cfg / "config.yml").write_text(yml.replace("threshold: 0.64", "threshold: 0.001").replace(
        out, "    probe: off\n    question:").replace("    guard: auto\n", "    guard: question\n", 1))
    return cfg


def input_blocking_config(tmp):
    """A config whose input rail blocks every question (its Yes/No question decides, probe off, at threshold
    0.001), so no LLM call is made."""
    cfg = make_config(tmp)
    yml = (cfg / "config.yml").read_text()
    rail = ("  flashguard_input_moderation:\n    guard: auto          # as above: the guard adapter alone (the keys below: the fallback without a guard)\n"
            "    probe: auto")
    assert rail in yml
    (cfg / "config.yml").write_text(yml.replace(rail, "  flashguard_input_moderation:\n    guard: question\n"
                                                      "    probe: off\n    threshold: 0.001"))
    return cfg


@pytest.fixture(scope="module")
def blocking_servers(tmp_path_factory):
    """The two servers below, started at once (each loads the model in its own process)."""
    out, inp = tmp_path_factory.mktemp("blocking"), tmp_path_factory.mktemp("input_blocking")
    servers = {"output": _launch(blocking_config(out), out / "server.log", "--verbose"),
               "input": _launch(input_blocking_config(inp), inp / "server.log")}
    try:
        for s in servers.values():
            s.wait()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def blocking_server(blocking_servers):
    """A server whose moderation rail blocks every reply (threshold 0.001), started with --verbose."""
    return blocking_servers["output"]


@pytest.fixture(scope="module")
def input_blocking_server(blocking_servers):
    """A server whose input rail blocks every question (its Yes/No question decides, probe off, at threshold
    0.001), so no LLM call is made."""
    return blocking_servers["input"]


def _stream(client, **kwargs):
    chunks = list(client.chat.completions.create(model="flashguard", messages=Q, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def flashguard_field(chunks_or_reply) -> dict:
    """The ``flashguard`` field (the rails' verdicts) of a reply, or of a stream's chunk that has finish_reason."""
    if isinstance(chunks_or_reply, list):
        last = [c for c in chunks_or_reply if c.choices and c.choices[0].finish_reason]
        assert len(last) == 1 and all(getattr(c, "flashguard", None) is None for c in chunks_or_reply
                                      if c is not last[0])
        return last[0].flashguard
    return chunks_or_reply.flashguard


def test_an_allowed_reply_carries_both_rails_verdicts_and_their_tokens(client):
    """Beside OpenAI's fields: every verdict of the turn (the input rail's, the output rail's), none blocking."""
    r = client.chat.completions.create(model="flashguard", messages=Q)
    chunks, _ = _stream(client)
    for field in (flashguard_field(r), flashguard_field(chunks)):
        assert field["blocked_by"] is None
        rails = [v["rail"] for v in field["rails"]]
        assert rails[0] == "input" and "output" in rails and not any(v["blocked"] for v in field["rails"])
        for v in field["rails"]:
            assert 0 <= v["p_unsafe"] < v["threshold"] and v["method"] and v["reason"]
            assert v["prefilled_tokens"] >= 0 and v["reused_tokens"] >= 0
        out = next(v for v in field["rails"] if v["rail"] == "output")
        assert out["reused_tokens"] > 0   # the reply's check reads the generation's pages


def test_models_list_names_the_configured_model(client):
    assert [m.id for m in client.models.list()] == ["flashguard"]
    assert client.models.retrieve("flashguard").id == "flashguard"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_plain_reply_has_usage_and_stop(client):
    r = client.chat.completions.create(model="my-label", messages=Q)
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and r.model == "my-label"
    u = r.usage
    assert u.prompt_tokens > 10 and u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_stream_has_role_first_finish_reason_last_and_a_usage_chunk(client):
    plain = client.chat.completions.create(model="flashguard", messages=Q)
    chunks, text = _stream(client, stream_options={"include_usage": True})
    assert text == plain.choices[0].message.content  # greedy: the same reply in both modes
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in with_choices] == [None] * (len(with_choices) - 1) + ["stop"]
    assert all(c.usage is None for c in with_choices)
    last = chunks[-1]
    assert last.choices == [] and last.usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == \
        plain.usage.model_dump(include={"prompt_tokens", "completion_tokens"})
    assert len({c.id for c in chunks}) == 1


def test_stream_without_include_usage_sends_no_usage_chunk(client):
    chunks, text = _stream(client)
    assert "Paris" in text and all(c.choices and c.usage is None for c in chunks)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_reply_cut_by_the_token_limit_says_length(client, field):
    r = client.chat.completions.create(model="flashguard", messages=Q, **{field: 3})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    chunks, _ = _stream(client, stream_options={"include_usage": True}, **{field: 3})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 3


def test_content_as_text_parts(client):
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    r = client.chat.completions.create(model="flashguard", messages=[{"role": "user", "content": parts}])
    assert "Paris" in r.choices[0].message.content


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True}, "logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[1]"),
])
def test_unsupported_fields_are_a_400_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{"model": "flashguard", "messages": Q, **kwargs})
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_prompt_over_the_context_is_a_400_in_both_modes(client):
    long = [{"role": "user", "content": "hello " * 9000}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="context"):
            r = client.chat.completions.create(model="flashguard", messages=long, stream=stream)
            list(r) if stream else r


def test_request_log_has_one_line_per_request_and_no_text(client, server):
    client.chat.completions.create(model="flashguard", messages=[{"role": "user", "content": "Name a big zebra."}],
                                   max_tokens=4)
    log = server.log()
    assert "POST /v1/chat/completions 200 prompt_tokens=" in log and "GET /v1/models 200" in log
    assert "zebra" not in log and "capital of France" not in log and "Paris" not in log


def test_a_blocked_reply_is_the_same_refusal_in_both_modes(blocking_server):
    client = _client(blocking_server)
    r = client.chat.completions.create(model="flashguard", messages=Q)
    refusal = r.choices[0].message.content
    assert refusal == "I'm sorry, I can't respond to that." and r.choices[0].finish_reason == "content_filter"
    assert r.usage.completion_tokens > 0
    chunks, text = _stream(client, stream_options={"include_usage": True})
    assert text == refusal
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "content_filter"
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    for field in (flashguard_field(r), flashguard_field(chunks[:-1])):   # which rail blocked, and why
        verdict = field["blocked_by"]
        assert verdict["rail"] == "output" and verdict["blocked"] and verdict["p_unsafe"] >= verdict["threshold"]
        assert verdict["method"] == "question" and verdict["threshold"] == 0.001
    # --verbose: the log shows the conversation (and the rail's verdict)
    log = blocking_server.log()
    assert "capital of France" in log and "flashguard moderation: BLOCK" in log


def test_a_question_the_input_rail_blocks_counts_its_prompt_and_the_refusal(input_blocking_server, client):
    """The model read the prompt (the rail judged it) and the reply is the refusal: usage counts both, in both
    modes, with finish_reason content_filter (NeMo streams an input rail's refusal as plain text)."""
    blocked = _client(input_blocking_server)
    r = blocked.chat.completions.create(model="flashguard", messages=Q)
    assert r.choices[0].message.content == "I'm sorry, I can't respond to that."
    assert r.choices[0].finish_reason == "content_filter"
    allowed = client.chat.completions.create(model="flashguard", messages=Q, max_tokens=1)
    u = r.usage
    assert u.prompt_tokens == allowed.usage.prompt_tokens > 10   # the same prompt, as the generation counts it
    assert 5 <= u.completion_tokens <= 20 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks, text = _stream(blocked, stream_options={"include_usage": True})
    assert text == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "content_filter"
    assert chunks[-1].choices == [] and chunks[-1].usage == u
    for field in (flashguard_field(r), flashguard_field(chunks[:-1])):   # which rail blocked, and why
        verdict = field["blocked_by"]
        assert verdict["rail"] == "input" and verdict["p_unsafe"] >= verdict["threshold"] == 0.001
        assert verdict["method"] == "question" and field["rails"] == [verdict]
    assert "POST /v1/chat/completions 200 prompt_tokens=%d completion_tokens=%d" % (
        u.prompt_tokens, u.completion_tokens) in input_blocking_server.log()
