"""The default cache (tiered, sized at start) on the real SmolLM2: short prompts, page ownership, L3 promotion."""

import pydoc_data.topics as topics
import pytest
import torch
from transformers import DynamicCache

from flashguard import CacheConfig, EngineConfig
from flashguard.engine import SamplingParams
from flashguard.engine.engine import OUT_OF_MEMORY, Engine
from flashguard.kv.cache import TieredCache

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def dynamic(engine):
    return Engine(EngineConfig(kv_cache="dynamic"), source=engine.source)


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
    e = Engine(EngineConfig(kv_cache="tiered", kv=PAGED), source=engine.source)
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
    e = Engine(EngineConfig(kv_cache="tiered", kv=PAGED, prefill_chunk=512), source=engine.source)
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
    e = Engine(EngineConfig(kv_cache="tiered", kv=kv), source=engine.source)
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
    """Half the pages on disk, sparse decoding: a page read from L3 is promoted to L2 and stays there while it is
    selected, so no page is read from disk twice."""
    kv = CacheConfig(page_size=32, l1_tokens=256, sink_tokens=32, l1_max_tokens=512, l2_tokens=1216,
                     budget_tokens=128, policy="sparse", l3_dir=str(tmp_path / "l3"))
    e = Engine(EngineConfig(kv_cache="tiered", kv=kv), source=engine.source)
    reads: dict = {}
    disk = e.store.disk if e.store is not None else None
    e.generate(long_ids, SamplingParams(max_tokens=1))
    disk = e.store.disk
    real_read = disk.read

    def counted(key, path):
        reads[key] = reads.get(key, 0) + 1
        return real_read(key, path)

    disk.read = counted
    pages = len(e.session.cache.page_keys)
    assert e.store.tier_counts()["l3_pages"] >= pages // 2            # at least half the pages on disk
    out = e.generate(long_ids, SamplingParams(max_tokens=24))
    assert out.completion_tokens == 24 or out.finish_reason == "stop"
    assert reads, "sparse decoding selected no page from disk: the test does not test anything"
    assert max(reads.values()) == 1, f"pages read from disk more than once: {sorted(reads.values())[-5:]}"


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
