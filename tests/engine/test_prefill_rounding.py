"""The input rail's guard leaves the session where the generation's prefill rounds the prompt as a whole prefill
does (``Engine.read(then=...)``, engine/session_runner.py ``ROW_BLOCK``).

The CPU int4 kernel rounds a row by the chunk it runs in (its block of 16 rows, and the chunk's length). Before, the
guard brought the session to the conversation without its answer header (a chunk a few tokens shorter than the
generation's own) and the generation resumed mid-block: configs/flash's greedy reply to "What is the capital of
France?" was another text from its first token."""

import pytest
import torch

from flashguard.engine.sampling import SamplingParams

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _kv(engine) -> tuple[list, int]:
    cache = engine.sessions.session.cache
    return [(layer.l1_k[:, :cache.length].clone(), layer.l1_v[:, :cache.length].clone())
            for layer in cache.layers], cache.length


def _same_kv_as_a_whole_prefill(engine, ids: list, before) -> None:
    """Every layer's K/V after ``before()`` then the prefill of ``ids`` equal, bit for bit, to ``ids`` prefilled from
    nothing (``before`` runs on the whole prefill's session)."""
    with engine.lock:
        engine.reset_session(keep_pages=False)
        engine.sessions.prefill(ids)
        whole, n = _kv(engine)
        before()
        engine.sessions.prefill(ids)
        other, m = _kv(engine)
        engine.reset_session(keep_pages=False)
    assert n == m == len(ids)
    for (k1, v1), (k2, v2) in zip(whole, other):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("first", [16, 32])
def test_a_prefill_resumed_at_a_row_block_writes_the_whole_prefills_kv(engine, first):
    """What the engine relies on: the session holding a whole number of ROW_BLOCKs of a prompt that a longer chunk
    ran, the prompt's prefill then writes every layer's K/V equal, bit for bit, to the prompt prefilled whole."""
    ids = engine.encode_messages(MESSAGES)
    assert len(ids) > 34
    _same_kv_as_a_whole_prefill(engine, ids, lambda: engine.sessions.bring_to(ids[:first]))   # (a crop)


def test_the_input_rails_guard_leaves_the_generation_the_whole_prefills_kv(engine):
    """The guard's read (``moderate_input``, configs/flash's default) then the generation's prefill: every layer's
    K/V equal, bit for bit, to the generation's prompt prefilled from nothing."""
    from flashguard.rails.input_rail import moderate_input
    from flashguard.rails.settings import ModerationSettings

    def guard():
        engine.reset_session(keep_pages=False)
        verdict = moderate_input(engine, MESSAGES, ModerationSettings.input_defaults())
        assert verdict.method == "adapter" and verdict.path == "branch"

    _same_kv_as_a_whole_prefill(engine, engine.encode_messages(MESSAGES), guard)


LONG = ("Here is a note about a library visit. " * 30) + "\nIn one sentence, what is this note about?"


@pytest.mark.parametrize("text", [MESSAGES[0]["content"], LONG], ids=["short", "long"])
def test_the_guarded_reply_is_the_models_own(engine, tmp_path, text):
    """configs/flash as shipped (the guard adapter decides the input rail): LLMRails' greedy reply to an everyday
    question, asked first in a fresh session, is the engine's own greedy reply to it without rails. The long one
    (~310 tokens) needs the input rail to bring the session to the generation's prompt as its prefill does
    (``Engine.read(then=...)``): a chunk of the conversation alone rounds its rows past ~130 otherwise."""
    from nemoguardrails import LLMRails, RailsConfig

    from tests.conftest import make_config

    messages = [{"role": "user", "content": text}]
    ids = engine.encode_messages(messages)
    engine.reset_session(keep_pages=False)
    plain = engine.generate(ids, SamplingParams(max_tokens=32, temperature=0)).text
    rails = LLMRails(RailsConfig.from_path(str(make_config(tmp_path))))
    engine.reset_session(keep_pages=False)
    res = rails.generate(messages=messages, options={"llm_params": {"max_tokens": 32, "temperature": 0},
                                                     "log": {"activated_rails": True}})
    assert any(r.type == "input" for r in res.log.activated_rails)
    assert res.response[-1]["content"] == plain
