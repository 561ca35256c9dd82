"""The server's sampling fields beside temperature, top_p and seed: OpenAI's frequency_penalty and presence_penalty,
and repetition_penalty (vLLM's name) checked before any work and handed to the engine; unset, the config's
defaults apply."""

import json

import pytest

from flashguard.guardrails.server import RequestBounds

Q = [{"role": "user", "content": "Who wrote Romeo and Juliet?"}]


def problem(**fields):
    return RequestBounds(app=None).check(json.dumps({"messages": Q, **fields}).encode())


@pytest.mark.parametrize("fields, param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"presence_penalty": "0.5"}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
])
def test_bad_penalties_are_a_400_naming_the_field(fields, param):
    message, named = problem(**fields)
    assert named == param and param in message


def test_good_penalties_pass():
    assert problem(frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.1) is None


@pytest.mark.slow
def test_the_penalty_fields_reach_the_engine(server):
    import httpx

    def reply(**fields):
        body = {"model": "flashguard", "messages": Q, "max_tokens": 48, **fields}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    plain = reply(repetition_penalty=1.0)
    assert reply(repetition_penalty=1.0)["message"]["content"] == plain["message"]["content"]   # deterministic
    assert reply(repetition_penalty=1.5)["message"]["content"] != plain["message"]["content"]
    assert reply(repetition_penalty=1.0, frequency_penalty=2.0)["message"]["content"] != plain["message"]["content"]
