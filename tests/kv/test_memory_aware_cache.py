"""The default cache (tiered, sized at start) on the real SmolLM2: short prompts, page ownership, L3 promotion."""

import pydoc_data.topics as topics
import pytest
import torch
from transformers import DynamicCache

from flashguard import CacheConfig, EngineConfig
from flashguard.engine import SamplingParams
from flashguard.engine.engine import OUT_OF_MEMORY, Engine
from flashguard.kv.cache import TieredCache


@pytest.fixture(scope="module")
def engine(float_engine):
    """The float model: the cache's logits and tokens are compared with DynamicCache's at tight tolerances."""
    return float_engine


pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def dynamic(engine):
    return Engine(EngineConfig(weights="float", kv_cache="dynamic"), source=engine.source)


@pytest.fixture(scope="module")
def long_ids(engine):
    text = "".join(topics.topics[k] for k in sorted(topics.topics)[:30])
    return engine.tokenizer(text)["input_ids"][:2400]


def refs(engine) -> int:
    return sum(p.refs for p in engine.store.pages.values()) if engine.store is not None else 0


def test_the_default_engine_is_tiered_and_resident_on_the_cpu(engine):
    assert engine.config.kv_cache == "tiered" and engine.kv.sized
    assert engine.kv.l1_tokens >= engine.context_length   # the pool holds the whole context: nothing pages out
    info = engine.info()
    assert info["cache"] == "tiered" and info["tiers"]["pool"]["tokens"] >= engine.context_length


@pytest.mark.parametrize("ids", [[1], [1, 2], list(range(5, 25)), list(range(5, 70))])
def test_short_prompts_match_dynamic_cache(engine, dynamic, ids):
    """1 token, 2, shorter than the 64 sinks, just past them: the same greedy tokens as DynamicCache."""
    engine.reset_session()
    dynamic.reset_session()
    assert engine.generate(ids, GREEDY).text == dynamic.generate(ids, GREEDY).text
    engine.session.cache.check_integrity()


def test_crop_to_zero_and_a_zero_token_reply(engine, dynamic):
    ids = engine.encode_messages([{"role": "user", "content": "hi"}])
    engine.generate(ids, GREEDY)
    engine.session.crop(0)
    engine.session.cache.check_integrity()
    assert engine.generate(ids, GREEDY).text == dynamic.generate(ids, GREEDY).text
    eos = next(iter(engine.eos_ids))
    forced = engine.teacher_force(ids, [eos])       # a reply that is only the end of turn
    assert forced.text == ""


def test_plain_generate_with_a_prompt_shorter_than_the_sinks(engine):
    m = engine.model
    inp = torch.tensor([[1, 2, 3]])
    ref = m.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=5, do_sample=False,
                     past_key_values=DynamicCache(config=m.config), pad_token_id=2)
    cache = TieredCache(m.config, CacheConfig(page_size=32, sink_tokens=64)).attach(m)
    out = m.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=5, do_sample=False,
                     past_key_values=cache, pad_token_id=2)
    assert out.tolist() == ref.tolist()


PAGED = CacheConfig(page_size=32, l1_tokens=256, sink_tokens=32, l1_max_tokens=512, l2_tokens=4096, policy="exact",
                    l2_codec="fp16", l3_codec="fp16-zstd")


def test_references_go_back_to_zero_on_reset(engine, long_ids):
    e = Engine(EngineConfig(weights="float", kv_cache="tiered", kv=PAGED), source=engine.source)
    e.generate(long_ids, GREEDY)
    assert refs(e) == e.session.references() > 0
    e.reset_session()
    assert refs(e) == 0 and e.session is None
    assert len(e.store.pages) >= len(long_ids) // 32 - 1        # the pages stay stored, for a later session
    e.generate(long_ids[:1200], GREEDY)                          # a new conversation: the old one's pages released
    assert e.stats.last["generation"]["reused"] >= 1024 and refs(e) == e.session.references()


def test_references_go_back_to_zero_after_an_out_of_memory_recovery(engine, long_ids):
    """A forward that runs out of memory half-way through the layers: every layer back to the tokens before it,
    the chunk run again in halves, the same answer, and no reference kept by the failed attempt."""
    e = Engine(EngineConfig(weights="float", kv_cache="tiered", kv=PAGED, prefill_chunk=512), source=engine.source)
    want = e.generate(long_ids[:900], GREEDY).text
    e.reset_session()
    e.store.pages.clear()
    e.store.arena = type(e.store.arena)(False)
    layer = e.model.model.layers[15]
    fired = []

    def out_of_memory(module, args):
        if not fired and args[0].shape[1] > 100:
            fired.append(1)
            raise OUT_OF_MEMORY("injected: CUDA out of memory")

    handle = layer.register_forward_pre_hook(out_of_memory)
    try:
        assert e.generate(long_ids[:900], GREEDY).text == want
    finally:
        handle.remove()
    assert fired and e.oom_retries == 1 and e.prefill_chunk < 512
    e.session.cache.check_integrity()
    assert refs(e) == e.session.references()
    e.reset_session()
    assert refs(e) == 0


def test_references_go_back_to_zero_after_a_page_lost_recovery(engine, long_ids, tmp_path):
    kv = PAGED.replace(l2_tokens=256, l3_dir=str(tmp_path / "l3"))
    e = Engine(EngineConfig(weights="float", kv_cache="tiered", kv=kv), source=engine.source)
    want = e.generate(long_ids, GREEDY).text
    e.reset_session()
    assert e.store.tier_counts()["l3_pages"] > 0
    for name in sorted(p for p in __import__("os").listdir(e.store.l3_dir) if p.endswith(".page"))[:3]:
        with open(__import__("os").path.join(e.store.l3_dir, name), "r+b") as f:
            f.seek(40)
            f.write(b"\xff" * 16)
    assert e.generate(long_ids, GREEDY).text == want          # corrupt pages dropped and recomputed
    assert e.store.stats.corrupt_pages >= 1
    e.session.cache.check_integrity()
    assert refs(e) == e.session.references()
    e.reset_session()
    assert refs(e) == 0


def test_a_page_promoted_from_l3_is_not_read_from_disk_again_while_selected(engine, long_ids, tmp_path):
    """Conversation A's pages are pushed to disk by conversation B; back on A (a new session), sparse decoding
    reads each of A's pages from L3 at most once: a promoted page stays in L2 (B's cold pages leave instead)."""
    kv = CacheConfig(page_size=32, l1_tokens=256, sink_tokens=32, l1_max_tokens=256, l2_tokens=2560,
                     budget_tokens=128, policy="sparse", l3_dir=str(tmp_path / "l3"))
    e = Engine(EngineConfig(weights="float", kv_cache="tiered", kv=kv), source=engine.source)
    text_b = "".join(topics.topics[k] for k in sorted(topics.topics)[60:90])
    b_ids = engine.tokenizer(text_b)["input_ids"][:len(long_ids)]
    e.generate(long_ids, SamplingParams(max_tokens=1))
    a_keys = list(e.session.cache.page_keys)
    e.reset_session()                                  # A's pages stay in the store, unreferenced
    e.generate(b_ids, SamplingParams(max_tokens=1))    # B's pages take L2: A's go to disk
    e.reset_session()
    in_l3 = [k for k in a_keys if e.store.pages[k].l2 is None and e.store.pages[k].l3 is not None]
    assert len(in_l3) >= len(a_keys) // 2, (len(in_l3), len(a_keys))   # at least half of A's pages on disk
    reads: dict = {}
    real_read = e.store.disk.read

    def counted(key, path):
        reads[key] = reads.get(key, 0) + 1
        return real_read(key, path)

    e.store.disk.read = counted
    out = e.generate(long_ids, SamplingParams(max_tokens=24))
    assert out.completion_tokens == 24 or out.finish_reason == "stop"
    assert reads, "nothing was read from disk: the test does not test anything"
    assert max(reads.values()) == 1, f"pages read from disk more than once: {sorted(reads.values())[-5:]}"
    e.session.cache.check_integrity()


def test_the_same_prompt_again_and_a_cropped_suffix_match_dynamic_cache(engine, dynamic):
    """The prefix reuse crops the cache (a repeated prompt keeps all but its last token; the moderation suffix is
    cropped away by the next turn): the same answers as DynamicCache, and as the first time."""
    params = SamplingParams(max_tokens=12)
    ids = engine.encode_messages([{"role": "user", "content": "What is the capital of France?"}])
    answers = {}
    for e in (engine, dynamic):
        e.reset_session()
        first = [e.generate(ids, params).text for _ in range(3)]
        assert len(set(first)) == 1, first
        turn = e.turns[-1]
        e.next_token_logprobs(list(turn.prompt_ids) + list(turn.output_ids) + [2, 3, 4, 5, 6])
        nxt = list(turn.prompt_ids) + list(turn.output_ids) + \
            e.encode_messages([{"role": "user", "content": "And of Spain?"}])[1:]
        answers[e.config.kv_cache] = (first[0], e.generate(nxt, params).text)
    assert answers["tiered"] == answers["dynamic"]
    engine.session.cache.check_integrity()
