"""TieredCache fidelity against DynamicCache on the real SmolLM2 (CPU), all three tiers in use."""

import pydoc_data.topics as topics
import pytest
import torch
from transformers import DynamicCache

from flashguard import CacheConfig, EngineConfig
from flashguard.engine import SamplingParams
from flashguard.kv.cache import TieredCache
from tests.tiny import forwarding


@pytest.fixture(scope="module")
def engine(float_engine):
    """The float model: the cache's logits and tokens are compared with DynamicCache's at tight tolerances."""
    return float_engine


pytestmark = pytest.mark.slow

SMALL = dict(page_size=32, l1_tokens=256, sink_tokens=32, l2_tokens=512, l1_max_tokens=512, budget_tokens=512)
LOSSLESS = CacheConfig(**SMALL, policy="exact", l2_codec="fp16", l3_codec="fp16-zstd")
EXACT = CacheConfig(**SMALL, policy="exact")
SPARSE = CacheConfig(**SMALL, policy="sparse")


@pytest.fixture(scope="module")
def text_ids(engine):
    text = "".join(topics.topics[k] for k in sorted(topics.topics)[:40])
    return engine.tokenizer(text)["input_ids"]


def run(model, cache, ids, chunk=256):
    out = []
    for a in range(0, len(ids), chunk):
        with torch.inference_mode(), forwarding(cache, ids[a:a + chunk]):
            out.append(model(input_ids=torch.tensor([ids[a:a + chunk]]), past_key_values=cache).logits[0])
    return torch.cat(out)


def test_lossless_exact_logits_match_dynamic_cache(engine, text_ids):
    ids, m = text_ids[:1500], engine.model
    ref = run(m, DynamicCache(config=m.config), ids)
    cache = TieredCache(m.config, LOSSLESS).attach(m)
    out = run(m, cache, ids)
    cache.check_integrity()  # settles the last forward's pages
    counts = cache.store.tier_counts()
    assert counts["l2_pages"] > 0 and counts["l3_pages"] > 0 and cache.layers[0].win_start > 32  # all tiers used
    full_kv = 30 * 2 * 3 * 1500 * 64 * 4  # layers * (K, V) * kv heads * tokens * head_dim * fp32
    assert cache.l1_bytes() < 0.3 * full_kv
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-3)
    cache.check_integrity()


def test_plain_generate_accepts_the_cache(engine, text_ids):
    m = engine.model
    inp = torch.tensor([text_ids[:700]])
    ref = m.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=16, do_sample=False,
                     past_key_values=DynamicCache(config=m.config), pad_token_id=2)
    cache = TieredCache(m.config, LOSSLESS).attach(m)
    out = m.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=16, do_sample=False,
                     past_key_values=cache, pad_token_id=2)
    assert out.tolist() == ref.tolist() and cache.get_seq_length() == 700 + 15


PREFIX, STEPS = 3000, 200   # the sparse tests: a 3000-token text, then 200 positions after it


@pytest.fixture(scope="module")
def dynamic_after_prefix(engine, text_ids):
    """The model's logits on a DynamicCache at positions ``PREFIX`` .. ``PREFIX + STEPS`` of the text (prefilled
    in 256-token chunks: what single-token teacher-forced steps compute), the reference of both sparse tests."""
    m = engine.model
    return run(m, DynamicCache(config=m.config), text_ids[:PREFIX + STEPS])[PREFIX:]


def teacher_forced(model, cache, ids, prefix, steps):
    """Logits of ``steps`` single-token decode steps after a chunked prefill of ``prefix`` tokens."""
    if prefix:
        run(model, cache, ids[:prefix])
    rows = []
    for t in range(prefix, prefix + steps):
        rows.append(run(model, cache, ids[t:t + 1])[-1])
    return torch.stack(rows)


def test_sparse_default_codecs_kl_and_top1(engine, text_ids, dynamic_after_prefix, capsys):
    m, prefix, steps = engine.model, PREFIX, STEPS
    ref = dynamic_after_prefix
    cache = TieredCache(m.config, SPARSE).attach(m)
    run(m, cache, text_ids[:prefix])
    reads = cache.page_reads
    out = teacher_forced(m, cache, text_ids[prefix:], 0, steps)
    per_step = (cache.page_reads - reads) / steps / m.config.num_hidden_layers
    off_window = prefix // SPARSE.page_size - (SPARSE.l1_max_tokens + SPARSE.sink_tokens) // SPARSE.page_size
    lp_ref, lp = torch.log_softmax(ref.float(), -1), torch.log_softmax(out.float(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(f"\nsparse (int8 L2, int4+zstd L3), {steps} decode steps after {prefix} tokens, {per_step:.0f} of "
              f">={off_window} off-window pages read per step and layer: KL={kl:.5f} nats, top-1={top1:.1%}, "
              f"stats={cache.stats()['store']['page_faults']} page faults")
    assert per_step == 3 * SPARSE.budget_tokens // SPARSE.page_size < off_window  # 3 KV heads x budget: sparse
    # The targets: KL <= 0.01 and top-1 >= 99% (measured 0.0023 and 99.0% here). On this teacher-forced
    # text many positions are near-ties for a 135M model that int8/int4 pages can flip, so the bound below
    # leaves a point of margin for other CPUs' rounding; docs/benchmarks/kv_fidelity.md reports the numbers.
    assert kl <= 0.01 and top1 >= 0.98
    assert cache.store.tier_counts()["l3_pages"] > 0


def test_short_chunks_past_the_pool_read_only_the_selected_pages(engine, text_ids, dynamic_after_prefix, capsys):
    """A short prompt chunk (a question after a long text, a rail's suffix) under the sparse policy attends the
    pages Quest selects for its queries, as a decoding step does, not every page: within the sparse targets of
    every position it prefills (KL <= 0.01 nats, top-1 >= 98% teacher-forced, as above)."""
    from flashguard.kv.layer import SPARSE_CHUNK_TOKENS

    m, prefix, chunk, chunks = engine.model, PREFIX, 12, 16
    assert chunk <= SPARSE_CHUNK_TOKENS and chunk * chunks <= STEPS
    tail = text_ids[prefix:prefix + chunk * chunks]
    ref = dynamic_after_prefix[:chunk * chunks]
    cache = TieredCache(m.config, SPARSE).attach(m)
    run(m, cache, text_ids[:prefix])
    reads = cache.page_reads
    out = run(m, cache, tail, chunk=chunk)
    per_chunk = (cache.page_reads - reads) / chunks / m.config.num_hidden_layers
    lp_ref, lp = torch.log_softmax(ref.float(), -1), torch.log_softmax(out.float(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(f"\nsparse, {chunks} chunks of {chunk} tokens after {prefix}: {per_chunk:.0f} pages read per chunk and "
              f"layer, KL={kl:.5f} nats, top-1={top1:.1%}")
    assert per_chunk == 3 * SPARSE.budget_tokens // SPARSE.page_size   # 3 KV heads x budget: not every page
    assert kl <= 0.01 and top1 >= 0.98
    cache.check_integrity()


def test_exact_default_codecs_greedy_256_tokens_equal_dynamic(engine, text_ids):
    from flashguard.engine.engine import Engine

    tiered = Engine(EngineConfig(weights="float", kv_cache="tiered", kv=EXACT), source=engine.source)
    prompt = tiered.encode_messages([{"role": "user", "content": "Summarise this text.\n" +
                                      engine.tokenizer.decode(text_ids[:900])}])
    params = SamplingParams(max_tokens=256)
    engine.reset_session()
    engine.generate(prompt, params)
    ref = engine.turns[-1].output_ids
    tiered.generate(prompt, params)
    assert tiered.turns[-1].output_ids == ref
    counts = tiered.store.tier_counts()   # ~1150 tokens: 28 pages left the 256-token window, 16 fit L2
    assert counts["l3_pages"] > 0 and counts["l2_pages"] > 0
    tiered.session.cache.check_integrity()


def test_common_prefix_shares_pages_and_output(engine, text_ids):
    from flashguard.engine.engine import Engine

    tiered = Engine(EngineConfig(weights="float", kv_cache="tiered", kv=LOSSLESS), source=engine.source)
    doc = engine.tokenizer.decode(text_ids[:600])
    a = tiered.encode_messages([{"role": "user", "content": doc + "\nWhat is this about?"}])
    b = tiered.encode_messages([{"role": "user", "content": doc + "\nList three keywords."}])
    params = SamplingParams(max_tokens=24)
    tiered.generate(a, params)
    tiered.reset_session()                      # a new session: only the store remembers the pages
    before = tiered.stats.as_dict()["generation"]["reused_tokens"]
    shared = tiered.generate(b, params).text
    reused = tiered.stats.as_dict()["generation"]["reused_tokens"] - before
    assert reused >= 512 and tiered.store.stats.misses >= 1
    fresh_engine = Engine(EngineConfig(weights="float", kv_cache="tiered", kv=LOSSLESS), source=engine.source)
    assert fresh_engine.generate(b, params).text == shared
    tiered.session.cache.check_integrity()


def test_deepseek_shape_random_weights(text_ids):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                      num_hidden_layers=28, intermediate_size=256, vocab_size=512, max_position_embeddings=4096)
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg).double().eval()  # float64: random 28-layer nets amplify rounding differences
    ids = [t % 512 for t in text_ids[:600]]
    ref = run(m, DynamicCache(config=cfg), ids, chunk=200)
    cache = TieredCache(cfg, CacheConfig(page_size=32, l1_tokens=128, sink_tokens=32, l2_tokens=256, l1_max_tokens=128,
                                         policy="exact", l2_codec="fp16", l3_codec="fp16-zstd")).attach(m)
    out = run(m, cache, ids, chunk=200)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].win_k.shape == (2, cache.length - cache.layers[0].win_start, 128)
    cache.check_integrity()


@pytest.fixture(scope="module")
def sparse_engine(engine):
    """An engine on the sparse tiered cache (SMALL tiers), loaded once for the passkey grid."""
    from flashguard.engine.engine import Engine

    return Engine(EngineConfig(weights="float", kv_cache="tiered", kv=SPARSE), source=engine.source)


@pytest.mark.parametrize("filler_sentences,depths", [(60, (0.1, 0.5, 0.9)), (160, (0.1,))])
def test_passkey_grid_matches_dynamic_cache(engine, sparse_engine, filler_sentences, depths, capsys):
    """Needle retrieval: wherever DynamicCache finds the key, the sparse tiered cache does too; at three depths of a
    1.5K-token prompt, and near the start of a 3.9K one (the needle furthest behind the window: the depth where the
    sparse selection has the most pages to pass over; the other depths at 3.9K cost a minute of CI and add none)."""
    tiered = sparse_engine
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    for depth in depths:
        before = int(filler_sentences * depth)
        text = (filler * before + "The pass key is 68213. Remember it. 68213 is the pass key. " +
                filler * (filler_sentences - before) + "\nWhat is the pass key?")
        ids = engine.encode_messages([{"role": "user", "content": text}])
        params = SamplingParams(max_tokens=12)
        engine.reset_session()
        want = engine.generate(ids, params).text
        tiered.reset_session()
        got = tiered.generate(ids, params).text
        with capsys.disabled():
            print(f"\npasskey depth={depth} tokens={len(ids)}: dynamic={'68213' in want} tiered={'68213' in got}")
        assert ("68213" in got) >= ("68213" in want), (depth, len(ids), want, got)
        if "68213" in want:
            assert got == want
    assert len(tiered.store.pages) > 0 and tiered.session.cache.layers[0].win_start > SPARSE.sink_tokens


def test_two_caches_take_turns_on_one_model(engine, text_ids):
    """Attention finds the cache whose update ran, not the last one attached: chunks of two sequences
    interleaved on one model give what each gives alone."""
    m, ids = engine.model, text_ids[:600]
    alone = run(m, TieredCache(m.config, LOSSLESS).attach(m), ids, chunk=150)
    alone_b = run(m, TieredCache(m.config, LOSSLESS).attach(m), ids[::-1], chunk=150)
    a, b = TieredCache(m.config, LOSSLESS).attach(m), TieredCache(m.config, LOSSLESS).attach(m)
    out_a, out_b = [], []
    for s in range(0, len(ids), 150):
        out_a.append(run(m, a, ids[s:s + 150], chunk=150))
        out_b.append(run(m, b, ids[::-1][s:s + 150], chunk=150))
    torch.testing.assert_close(torch.cat(out_a), alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(out_b), alone_b, atol=1e-5, rtol=1e-5)
