"""The int8 pool (``kv.l1_codec: int8``) and the host embedding table, on a tiny random Qwen2 (fast).

The int8 pool must stay close to the 16-bit one: every token of L1 as codes + a scale per 32 channels, decoded
in attention; the whole-step path (the CUDA graph's kernels, run eagerly here) must equal the layer-by-layer
path; sizes must follow the codec; pages stored from an int8 pool must not mix with a 16-bit pool's."""

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from flashguard import CacheConfig
from flashguard.engine.decode_step import DecodeStep
from flashguard.engine.host_embedding import HostEmbedding, install
from flashguard.errors import ConfigError
from flashguard.kv import int8_pool
from flashguard.kv.cache import TieredCache
from flashguard.kv.store import namespace_for
from flashguard.vram import plan as planner
from tests.tiny import forwarding, qwen2_head64


@pytest.fixture(scope="module")
def model():
    return qwen2_head64()


def _greedy(model, cache, ids, steps, step=None):
    """Prefill ``ids`` in chunks of 100, then ``steps`` greedy tokens; returns (tokens, last logits)."""
    with torch.inference_mode():
        for a in range(0, len(ids), 100):
            with forwarding(cache, ids[a:a + 100]):
                logits = model(input_ids=torch.tensor([ids[a:a + 100]]), past_key_values=cache).logits[0, -1]
        out = []
        for _ in range(steps):
            token = int(logits.argmax())
            out.append(token)
            with forwarding(cache, [token]):
                if step is not None:
                    logits = step.step(token, cache)
                else:
                    logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache).logits[0, -1]
    return out, logits.float()


def _tiered(model, codec, **sizes):
    kv = CacheConfig(page_size=16, sink_tokens=16, l1_codec=codec, **sizes)
    return TieredCache(model.config, kv).attach(model)


def test_quantize_round_trip_is_within_half_a_step_per_group():
    torch.manual_seed(1)
    x = torch.randn(2, 50, 64) * torch.linspace(0.1, 30, 64)    # channels of very different ranges
    codes, scales = int8_pool.quantize(x)
    assert codes.dtype == torch.int8 and scales.shape == (2, 50, 2)
    back = int8_pool.dequantize(codes, scales, torch.float32)
    step = scales.float().repeat_interleave(int8_pool.GROUP, dim=-1)
    assert ((back - x).abs() <= step * 0.5 + 1e-3).all()
    zero_codes, zero_scales = int8_pool.quantize(torch.zeros(1, 3, 64))
    assert not int8_pool.dequantize(zero_codes, zero_scales, torch.float32).isnan().any()


def test_decode_attention_torch_path_equals_attention_over_the_dequantized_pool():
    torch.manual_seed(2)
    k, v = torch.randn(2, 300, 64), torch.randn(2, 300, 64)
    kc, ks = int8_pool.quantize(k)
    vc, vs = int8_pool.quantize(v)
    q = torch.randn(4, 64)
    used = torch.tensor([123], dtype=torch.int32)
    out = int8_pool.decode_attention(q, kc, ks, vc, vs, used, 0.125)
    kd, vd = int8_pool.dequantize(kc, ks, torch.float32)[:, :123], int8_pool.dequantize(vc, vs, torch.float32)[:, :123]
    ref = torch.softmax(torch.einsum("hgd,hnd->hgn", q.view(2, 2, 64), kd) * 0.125, -1)
    ref = torch.einsum("hgn,hnd->hgd", ref, vd).reshape(4, 64)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_an_int8_pool_generates_like_the_16_bit_pool(model):
    ids = [int(t) for t in torch.randint(0, 300, (250,), generator=torch.Generator().manual_seed(3))]
    ref_tokens, ref_logits = _greedy(model, DynamicCache(config=model.config), ids, 12)
    cache = _tiered(model, "int8")
    tokens, logits = _greedy(model, cache, ids, 12)
    assert cache.layers[0].l1_k.dtype == torch.int8 and cache.layers[0].l1_ks is not None
    assert tokens[:6] == ref_tokens[:6]
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                                    reduction="sum")
    assert float(kl) < 0.05   # a random model amplifies rounding; the real model's bound is below
    cache.check_integrity()


@pytest.mark.slow
def test_the_embedded_model_on_an_int8_pool_is_greedy_identical_and_close(engine):
    """SmolLM2 (float), 1200 tokens of prose, 16 greedy steps: the same tokens as DynamicCache, KL <= 0.01 nats."""
    import pydoc_data.topics as topics

    text = "".join(topics.topics[k] for k in sorted(topics.topics)[:8])
    ids = engine.tokenizer(text)["input_ids"][:1200]
    m = engine.model
    ref_tokens, ref_logits = _greedy(m, DynamicCache(config=m.config), ids, 16)
    cache = _tiered(m, "int8")
    tokens, logits = _greedy(m, cache, ids, 16)
    cache.release()
    assert tokens == ref_tokens
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                                    reduction="sum")
    assert float(kl) < 0.01


def test_the_whole_step_over_an_int8_pool_equals_the_layer_by_layer_step(model):
    ids = [int(t) for t in torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(4))]
    a = _greedy(model, _tiered(model, "int8"), ids, 10, DecodeStep(model, graphs=False, whole_step=True))
    b = _greedy(model, _tiered(model, "int8"), ids, 10, DecodeStep(model, graphs=False, whole_step=False))
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1], atol=2e-3, rtol=2e-3)


def test_an_int8_pool_off_its_window_stores_and_reads_pages(model):
    """A window smaller than the sequence: pages leave the int8 pool for L2 and come back for attention."""
    ids = [int(t) for t in torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(5))]
    cache = _tiered(model, "int8", l1_tokens=64, l1_max_tokens=64, l2_tokens=1024, policy="exact")
    tokens, logits = _greedy(model, cache, ids, 8)
    ref_tokens, ref_logits = _greedy(model, DynamicCache(config=model.config), ids, 8)
    assert cache.page_reads > 0 and not cache.layers[0].resident
    assert tokens[:4] == ref_tokens[:4]
    cache.check_integrity()
    cache.release()


def test_int8_pages_have_their_own_namespace():
    fp16, int8 = CacheConfig(l1_codec="fp16"), CacheConfig(l1_codec="int8")
    assert namespace_for("m", torch.float16, fp16) != namespace_for("m", torch.float16, int8)


def test_an_unknown_codec_and_an_odd_head_size_name_the_key():
    with pytest.raises(ConfigError, match="kv.l1_codec"):
        CacheConfig(l1_codec="int4")
    odd = Qwen2Config(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=48, num_hidden_layers=1,
                      intermediate_size=64, vocab_size=50)
    with pytest.raises(ConfigError, match="kv.l1_codec"):
        TieredCache(odd, CacheConfig(l1_codec="int8"))


def test_the_planner_picks_int8_only_when_it_makes_the_whole_context_resident():
    shape = planner.Shape.from_config(planner.deepseek_1_5b_config(), "ds")
    kv = CacheConfig()
    # 4 GiB: a 16-bit pool holds ~47K of 135K tokens, an int8 one ~90K: neither holds it, auto stays 16-bit
    four = planner.sized_kv(shape, budget=4 * 2**30, context=135168, weights="int4", prefill_chunk=2048, kv=kv)
    assert four.l1_codec == "fp16" and four.l1_max_tokens < 135168
    forced = planner.sized_kv(shape, budget=4 * 2**30, context=135168, weights="int4", prefill_chunk=2048,
                              kv=kv.replace(l1_codec="int8"))
    assert forced.l1_max_tokens > 1.6 * four.l1_max_tokens   # codes + scales, and one layer's 16-bit copy
    # 6 GiB: int8 makes every token resident, 16-bit would not
    six = planner.sized_kv(shape, budget=6 * 2**30, context=135168, weights="int4", prefill_chunk=2048, kv=kv)
    assert six.l1_codec == "int8" and six.l1_max_tokens >= 135168
    roomy = planner.sized_kv(shape, budget=4 * 2**30, context=8192, weights="int4", prefill_chunk=2048, kv=kv)
    assert roomy.l1_codec == "fp16" and roomy.l1_max_tokens >= 8192


def test_prefill_chunk_defaults_to_auto_and_accepts_auto_in_yaml():
    from flashguard.config import EngineConfig

    assert EngineConfig().prefill_chunk is None
    assert EngineConfig.from_parameters({"prefill_chunk": "auto"}).prefill_chunk is None
    assert EngineConfig.from_parameters({"prefill_chunk": 1024}).prefill_chunk == 1024
    with pytest.raises(ConfigError, match="prefill_chunk"):
        EngineConfig.from_parameters({"prefill_chunk": "big"})


def test_the_host_embedding_gives_the_same_rows_and_frees_the_table(model):
    import copy

    m = copy.deepcopy(model)
    ids = torch.tensor([[1, 5, 299, 0]])
    before = m.get_input_embeddings()(ids)
    freed = install(m, torch.device("cpu"))
    assert freed == 300 * 128 * 4
    emb = m.get_input_embeddings()
    assert isinstance(emb, HostEmbedding) and not list(emb.parameters())
    torch.testing.assert_close(emb(ids), before)
    with torch.inference_mode():
        a = m(input_ids=ids).logits
        b = model(input_ids=ids).logits
    torch.testing.assert_close(a, b)
    step_tokens = _greedy(m, DynamicCache(config=m.config), [1, 2, 3], 5, DecodeStep(m, graphs=False))[0]
    assert step_tokens == _greedy(model, DynamicCache(config=model.config), [1, 2, 3], 5)[0]


def test_a_tied_table_stays(model):
    cfg = Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, vocab_size=50, tie_word_embeddings=True)
    tied = Qwen2ForCausalLM(cfg)
    assert install(tied, torch.device("cpu")) == 0
    assert isinstance(tied.get_input_embeddings(), torch.nn.Embedding)


def test_a_tied_table_moves_when_lm_head_holds_its_own_int4_codes():
    """A GGUF's int4 lm_head (its own codes, no float weight) no longer ties the table: it moves to host RAM and the
    model computes the same."""
    from flashguard.quant.int4_linear import quantize_linears_rtn

    cfg = Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, vocab_size=50, tie_word_embeddings=True)
    torch.manual_seed(8)
    m = Qwen2ForCausalLM(cfg).eval()
    quantize_linears_rtn(m, 32, backend="dequant", prefix="lm_head")
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        before = m(input_ids=ids).logits
    assert install(m, torch.device("cpu")) > 0 and isinstance(m.get_input_embeddings(), HostEmbedding)
    with torch.inference_mode():
        torch.testing.assert_close(m(input_ids=ids).logits, before)
