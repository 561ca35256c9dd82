"""The engine on the real embedded SmolLM2-135M-Instruct (CPU)."""

import pytest
import torch

from flashguard import PromptError
from flashguard.engine import SamplingParams

pytestmark = pytest.mark.slow

Q = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def engine(float_engine):
    """The float model: its tokens are compared with transformers' generate."""
    return float_engine


def hf_greedy(engine, ids, n):
    inp = torch.tensor([ids])
    out = engine.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False,
                                eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def run_ids(engine, ids, params):
    engine.generate(ids, params)
    return list(engine.turns[-1].output_ids)


def test_greedy_answer_and_reference(engine):
    ids = engine.encode_messages(Q)
    res = engine.generate(ids, SamplingParams(max_tokens=32))
    assert "Paris" in res.text and res.finish_reason == "stop"
    ids = engine.encode_messages(STORY)
    mine = run_ids(engine, ids, SamplingParams(max_tokens=64))
    ref = [t for t in hf_greedy(engine, ids, 64) if t not in engine.eos_ids]
    assert mine == ref[:len(mine)] and len(mine) == 64


def test_prefix_reuse_gives_the_same_tokens(engine):
    ids = engine.encode_messages(STORY)
    engine.reset_session()
    fresh = run_ids(engine, ids, SamplingParams(max_tokens=24))
    before = engine.stats.as_dict()["generation"]["reused_tokens"]
    again = run_ids(engine, ids, SamplingParams(max_tokens=24))  # the session already holds the prompt
    assert again == fresh
    assert engine.stats.as_dict()["generation"]["reused_tokens"] - before == len(ids) - 1


def test_stop_strings_cut_the_text(engine):
    ids = engine.encode_messages(Q)
    res = engine.generate(ids, SamplingParams(max_tokens=32, stop=("Paris",)))
    assert res.finish_reason == "stop" and "Paris" not in res.text and res.text.startswith("The capital")


def test_stream_equals_generate(engine):
    ids = engine.encode_messages(STORY)
    params = SamplingParams(max_tokens=48, stop=("keeper's",))
    whole = engine.generate(ids, params)
    parts = list(engine.stream(ids, params))
    assert "".join(p.text for p in parts) == whole.text
    assert parts[-1].finish_reason == whole.finish_reason and all(p.finish_reason is None for p in parts[:-1])
    assert not any("keeper's" in p.text for p in parts)


def test_seeded_sampling_is_reproducible(engine):
    ids = engine.encode_messages(STORY)
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)
    assert engine.generate(ids, p).text == engine.generate(ids, p).text


def test_max_tokens_gives_length(engine):
    res = engine.generate(engine.encode_messages(STORY), SamplingParams(max_tokens=5))
    assert res.finish_reason == "length" and res.completion_tokens == 5


def test_bad_prompts_say_what_to_change(engine):
    with pytest.raises(PromptError, match="empty"):
        engine.encode_messages([])
    with pytest.raises(PromptError, match=r"messages\[0\]\.role"):
        engine.encode_messages([{"role": "wizard", "content": "hi"}])
    long_ids = [1] * (engine.context_length + 5)
    with pytest.raises(PromptError, match="context is 8192 tokens.*max_context"):
        engine.generate(long_ids, SamplingParams(max_tokens=4))
    with pytest.raises(PromptError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_a_conversation_encoded_again_is_not_tokenized_again(engine, monkeypatch):
    """The input rail and the generation encode the same conversation in one turn (at 128K tokens ~0.5 s each):
    the engine keeps its last few encodings; a changed message is encoded afresh, and callers get their own list."""
    calls = []
    real = engine.tokenizer.apply_chat_template
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or real(*a, **k))
    msgs = [{"role": "user", "content": "Tell me about the sea, once."}]
    first = engine.encode_messages(msgs)
    again = engine.encode_messages([dict(m) for m in msgs])
    assert again == first and len(calls) == 1
    again.append(7)                                     # the caller's list: the kept ids do not change
    assert engine.encode_messages(msgs) == first and len(calls) == 1
    other = engine.encode_messages([{"role": "user", "content": "Tell me about the sea, twice."}])
    assert other != first and len(calls) == 2
    for i in range(engine.ENCODED_KEPT):                # older conversations leave: encoded again when they return
        engine.encode_messages([{"role": "user", "content": f"filler {i}"}])
    assert engine.encode_messages(msgs) == first and len(calls) == 3 + engine.ENCODED_KEPT


def test_int4_greedy_replies_do_not_depend_on_what_the_session_held():
    """int4 (the CPU's default) rounds a token's activations to bf16 differently in a chunk than alone: the prompt's
    last token runs alone after its prefill, as a held prompt's does, so a question asked again (after its own
    answer, after another question) gets the same greedy reply (before, the reply parted ~35 tokens in, and the load
    test counted it as cross-talk)."""
    from flashguard import EngineConfig, get_engine

    int4 = get_engine(EngineConfig(weights="int4"))
    ids, other = int4.encode_messages(STORY), int4.encode_messages(Q)
    params = SamplingParams(max_tokens=48)
    int4.reset_session()
    fresh = int4.generate(ids, params).text
    assert "".join(p.text for p in int4.stream(ids, params)) == fresh
    int4.generate(other, params)
    assert int4.generate(ids, params).text == fresh
