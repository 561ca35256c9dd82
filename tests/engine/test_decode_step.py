"""DecodeStep (the engine's one-token step: CUDA graphs on a GPU, the same segments eagerly here) against the
model's own forward, with a DynamicCache and with a TieredCache whose three tiers are in use."""

import pydoc_data.topics as topics
import pytest
import torch
from transformers import DynamicCache

from flashguard import CacheConfig
from flashguard.engine.decode_step import DecodeStep
from flashguard.kv.cache import TieredCache
from tests.tiny import forwarding

TIERS = dict(page_size=32, l1_tokens=128, sink_tokens=32, l2_tokens=256, l1_max_tokens=256, budget_tokens=256)


@pytest.fixture(scope="module")
def engine(float_engine):
    """The float model: the steps are compared with its forward at 2e-4."""
    return float_engine


def prefill(model, cache, ids):
    for a in range(0, len(ids), 200):
        with torch.inference_mode(), forwarding(cache, ids[a:a + 200]):
            logits = model(input_ids=torch.tensor([ids[a:a + 200]]), past_key_values=cache).logits[0, -1]
    return logits


def steps_both_ways(model, make_cache, ids, steps):
    """Greedy steps from the same prefix: DecodeStep on one cache, model(...) on another; their logits."""
    ours, theirs = make_cache(), make_cache()
    step = DecodeStep(model, graphs=False)
    token = int(prefill(model, ours, ids).argmax())
    assert token == int(prefill(model, theirs, ids).argmax())
    a, b = [], []
    for _ in range(steps):
        with forwarding(ours, [token]):
            a.append(step.step(token, ours).float())
        with torch.inference_mode(), forwarding(theirs, [token]):
            b.append(model(input_ids=torch.tensor([[token]]), past_key_values=theirs).logits[0, -1].float())
        token = int(b[-1].argmax())
    return torch.stack(a), torch.stack(b), ours


@pytest.mark.slow
def test_supports_plain_causal_llama_and_qwen2_only(engine):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    assert DecodeStep.supports(engine.model)  # SmolLM2: Llama
    gemma = Gemma3TextConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, vocab_size=128)
    assert not DecodeStep.supports(Gemma3ForCausalLM(gemma))  # sliding-window layers keep the model's forward


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dynamic", "tiered-exact", "tiered-sparse"])
def test_smollm2_steps_match_the_models_forward(engine, kind):
    text = "".join(topics.topics[k] for k in sorted(topics.topics)[:8])
    ids = engine.tokenizer(text)["input_ids"][:700]
    model = engine.model
    if kind == "dynamic":
        def make():
            return DynamicCache(config=model.config)
    else:
        policy = kind.split("-")[1]

        def make():
            return TieredCache(model.config, CacheConfig(**TIERS, policy=policy)).attach(model)
    ours, theirs, cache = steps_both_ways(model, make, ids, 40)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    if kind != "dynamic":
        assert cache.length == len(ids) + 40 and cache.layers[0].win_start > 32  # pages left L1
        cache.check_integrity()


def test_qwen2_shape_with_biases_matches(text_ids=None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=4, intermediate_size=512, vocab_size=300, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).double().eval()
    assert DecodeStep.supports(model) and model.model.layers[0].self_attn.q_proj.bias is not None
    ids = torch.randint(0, 300, (500,), generator=torch.Generator().manual_seed(1)).tolist()

    def make():
        return TieredCache(cfg, CacheConfig(**TIERS, policy="exact", l2_codec="fp16",
                                            l3_codec="fp16-zstd")).attach(model)
    ours, theirs, _ = steps_both_ways(model, make, ids, 20)
    # float64 model: the 1e-7 left is transformers' RMSNorm, which computes in fp32 whatever the model's dtype
    # (DecodeStep's F.rms_norm stays in float64)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_static_kv_whole_step_matches_the_models_forward():
    """The one-graph step's attention (a fixed-capacity StaticKV, positions masked, not sliced) decodes what the
    model's forward decodes on a DynamicCache; the prefilled cache is copied in, the capacity is not filled."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flashguard.engine.decode_step import StaticKV

    cfg = Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=3, intermediate_size=512, vocab_size=300, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    theirs = DynamicCache(config=cfg)
    token = int(prefill(model, theirs, ids).argmax())
    ours = StaticKV.from_cache(theirs, capacity=384)
    step = DecodeStep(model, graphs=False)
    for _ in range(20):
        got = step.step(token, ours)
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[token]]), past_key_values=theirs).logits[0, -1]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)   # fp32 RMSNorm in transformers, see above
        token = int(want.argmax())
    assert ours.length == 320 and theirs.get_seq_length() == 320
    torch.testing.assert_close(ours.keys[2, :, :320], theirs.layers[2].keys[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="capacity"):
        StaticKV.from_cache(theirs, capacity=100)


@pytest.mark.slow   # (15 s: the fast loop stays under a minute)
def test_resident_tiered_cache_runs_the_whole_step_path():
    """A TieredCache whose every token is resident offers its L1 buffers as a StaticKV (what the one-graph step
    replays on a GPU); the same kernels run eagerly here: the same logits as the model's forward, the cache's
    pages completed by ``advance``, and the step leaves the static path once pages leave the window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=3, intermediate_size=512, vocab_size=300, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 300, (250,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = TieredCache(cfg, CacheConfig(page_size=32, sink_tokens=32, l1_tokens=224, l1_max_tokens=224,
                                        l2_tokens=1024, policy="exact", l2_codec="fp16")).attach(model)
    theirs = DynamicCache(config=cfg)
    token = int(prefill(model, ours, ids).argmax())
    assert token == int(prefill(model, theirs, ids).argmax())
    step = DecodeStep(model, graphs=False, whole_step=True)   # the whole-step graph's kernels, eagerly
    statics = 0
    for _ in range(80):
        with forwarding(ours, [token]):
            statics += ours.static_view() is not None
            got = step.step(token, ours)
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[token]]), past_key_values=theirs).logits[0, -1]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        token = int(want.argmax())
    assert 0 < statics < 80                          # resident first, then paged once past the 224-token window
    assert ours.length == 330 and ours.layers[0].win_start > 32
    ours.check_integrity()


def test_fused_norms_give_the_models_own_forward():
    """On a GPU the engine runs each RMSNorm of the prompt's forward as one ``F.rms_norm`` (``fuse_norms``), as the
    decode step does: the same logits as transformers' norms (to float rounding), every norm changed once."""
    import copy

    from flashguard.engine.decode_step import fuse_norms
    from tests import tiny

    for arch in ("llama", "qwen2"):
        model = tiny.model(arch, layers=2)
        fused = copy.deepcopy(model)
        assert fuse_norms(fused) == 2 * 2 + 1          # two a layer and the final one
        assert fuse_norms(fused) == 0                  # once
        ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            want, got = model(input_ids=ids).logits, fused(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_sparse_graph_over_replaced_buffers_is_stale():
    """A sparse step's graph recorded over buffers since replaced (a grown L2 arena, a new session's L1, regrown
    tables) goes when the next one is recorded (its pool held device memory: a 128K new session ran out of memory
    recording beside three such graphs); variants over the same buffers stay, and resident-step graphs are not
    touched."""
    from dataclasses import replace

    from flashguard.kv.static import GraphKey

    key = GraphKey("sparse", ((1, 2, 3, 64),), tables=(100, 150, 200, 300, 400), variant=(8, 4096, 2, False))
    tables = key.tables   # (arena, the step's scalars, slot table, seen, missed)
    assert not key.replaced_by(key)
    assert not key.replaced_by(replace(key, variant=(16, 4096, 4, True)))          # a variant: same buffers
    assert key.replaced_by(replace(key, tables=(101,) + tables[1:]))               # the arena grew
    assert key.replaced_by(replace(key, layers=((5, 6, 3, 64),)))                  # a new session's L1
    assert key.replaced_by(replace(key, tables=tables[:1] + (151,) + tables[2:]))  # another cache's scalars
    assert key.replaced_by(replace(key, tables=tables[:4] + (401,)))               # the step's table regrown
    static = GraphKey("static", ((1, 2),), variant=(64,))
    assert not static.replaced_by(key) and not key.replaced_by(static)
    assert key.buffers() == {1, 2, 3} and static.buffers() == {1, 2}
