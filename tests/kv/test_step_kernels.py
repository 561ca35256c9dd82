"""The one-graph decode step's Triton kernels (kv/step_kernels.py, the folds of quant/int4_triton.gemv) against
torch references, on the CPU through Triton's interpreter; then DecodeStep's kernel path against its torch path and
the model's forward on tiny random Qwen2 models (the resident pool, an int8 pool, the sparse step off the pool).
tests/engine/test_gpu.py runs the kernel path on a real GPU."""

import pytest
import torch

pytest.importorskip("triton")

from flashguard import CacheConfig  # noqa: E402
from flashguard.engine.decode_step import DecodeStep, StaticKV  # noqa: E402
from flashguard.kv import attention, int8_pool, step_kernels  # noqa: E402
from flashguard.quant import awq_format, int4_triton  # noqa: E402
from tests.tiny import forwarding  # noqa: E402


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter runs the kernels on CPU tensors (it is read when a kernel is first launched)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(int4_triton, "_kernels", {})
    monkeypatch.setattr(step_kernels, "_kernels", {})


def _rope_reference(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_write_rotates_q_and_k_and_writes_the_pool_at_pos(interpreted, dtype):
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, cap = 6, 2, 64, 40
    q, k, v = (torch.randn(h * d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    angle = torch.rand(d // 2, generator=gen).repeat(2) * 3
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    pool = torch.zeros(2, hkv, cap + 8, d, dtype=dtype)
    keys, values = pool[0, :, :cap], pool[1, :, :cap]   # views with the capacity of a larger buffer
    got = step_kernels.rope_write(q, k, v, cos, sin, torch.tensor([17]), keys, values)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got.float(), _rope_reference(q.view(hq, d).float(), cos.float(), sin.float()), **tol)
    torch.testing.assert_close(keys[:, 17].float(), _rope_reference(k.view(hkv, d).float(), cos.float(),
                                                                    sin.float()), **tol)
    assert torch.equal(values[:, 17], v.view(hkv, d))
    assert pool[:, :, :17].abs().sum() == 0 and pool[:, :, 18:].abs().sum() == 0   # nothing else written


def test_rope_write_into_an_int8_pool_quantizes_as_int8_pool_does(interpreted):
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, cap = 4, 2, 64, 24
    q, k, v = (torch.randn(h * d, generator=gen).half() for h in (hq, hkv, hkv))
    angle = torch.rand(d // 2, generator=gen).repeat(2)
    cos, sin = angle.cos().half(), angle.sin().half()
    codes = torch.zeros(hkv, cap, d, dtype=torch.int8)
    vcodes = torch.zeros_like(codes)
    scales = torch.zeros(int8_pool.scale_shape(hkv, cap, d), dtype=torch.float16)
    vscales = torch.zeros_like(scales)
    step_kernels.rope_write(q, k, v, cos, sin, torch.tensor([5]), codes, vcodes, scales, vscales)
    want_k = _rope_reference(k.view(hkv, d).float(), cos.float(), sin.float()).half()
    for got_c, got_s, x in ((codes, scales, want_k), (vcodes, vscales, v.view(hkv, d))):
        c, s = int8_pool.quantize(x)
        assert torch.equal(got_s[:, 5], s)
        assert (got_c[:, 5].int() - c.int()).abs().max() <= 1   # rounding of exact halves may differ
        torch.testing.assert_close(int8_pool.dequantize(got_c[:, 5], got_s[:, 5], torch.float32), x.float(),
                                   atol=float(s.float().max()), rtol=0)


@pytest.mark.parametrize("used,dtype", [(1, torch.float32), (70, torch.float32), (300, torch.float16),
                                        pytest.param(2200, torch.float32, marks=pytest.mark.slow)])
def test_decode_attention_equals_attention_over_the_used_keys(interpreted, used, dtype):
    """Splits follow ``used``: one key, fewer keys than splits x blocks, more; 16-bit; GQA of 3 per KV head."""
    gen = torch.Generator().manual_seed(used)
    hq, hkv, d, cap = 6, 2, 32, 2240
    q = torch.randn(hq, d, generator=gen).to(dtype)
    keys, values = (torch.randn(hkv, cap, d, generator=gen).to(dtype) for _ in range(2))
    n = torch.tensor([used], dtype=torch.int32)
    got, lse = step_kernels.decode_attention(q, keys, values, n, d ** -0.5, lse=True)
    qg = q.float().reshape(hkv, hq // hkv, 1, d)
    want, want_lse = attention.partial_attention(qg, keys[:, :used].float(), values[:, :used].float(), d ** -0.5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(got.float(), want.reshape(hq, d), **tol)
    torch.testing.assert_close(lse, want_lse.reshape(hq), **tol)


def test_decode_attention_over_an_int8_pool(interpreted):
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, cap = 4, 2, 64, 300
    q = torch.randn(hq, d, generator=gen)
    keys, values = (torch.randn(hkv, cap, d, generator=gen) for _ in range(2))
    (kc, ks), (vc, vs) = int8_pool.quantize(keys), int8_pool.quantize(values)
    n = torch.tensor([257], dtype=torch.int32)
    got = step_kernels.decode_attention(q, kc, vc, n, d ** -0.5, ks, vs)
    k, v = int8_pool.dequantize(kc, ks, torch.float32), int8_pool.dequantize(vc, vs, torch.float32)
    want = attention.prefix_attention(q, k, v, n, d ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _int4(n, k, group, seed):
    gen = torch.Generator().manual_seed(seed)
    codes, zeros, scales = awq_format.quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, group)
    return ((codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(), scales, zeros,
            awq_format.dequantize(codes, zeros, scales, group))


def test_gemv_folds_the_norm_the_gating_and_the_residual(interpreted):
    gen = torch.Generator().manual_seed(2)
    n, k, group = 48, 256, 64
    packed, scales, zeros, w = _int4(n, k, group, 4)
    x = torch.randn(1, k, generator=gen)
    weight, eps = torch.rand(k, generator=gen) + 0.5, 1e-6
    res = torch.randn(n, generator=gen)
    got = int4_triton.gemv(x, packed, scales, zeros, group, norm=(weight, eps), residual=res)
    normed = torch.nn.functional.rms_norm(x, (k,), weight, eps)
    torch.testing.assert_close(got, normed @ w.t() + res, atol=1e-4, rtol=1e-4)
    gate_up = torch.randn(1, 2 * k, generator=gen)
    got = int4_triton.gemv(gate_up, packed, scales, zeros, group, gated=True)
    act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    torch.testing.assert_close(got, act @ w.t(), atol=1e-4, rtol=1e-4)


def _qwen2(layers=2, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=300, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    return m


def _prefill(model, cache, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0, -1]


@pytest.mark.slow
def test_the_kernel_step_equals_the_models_forward_on_a_static_pool(interpreted):
    from transformers import DynamicCache

    model = _qwen2()
    ids = torch.randint(0, 300, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    theirs = DynamicCache(config=model.config)
    token = int(_prefill(model, theirs, ids).argmax())
    ours = StaticKV.from_cache(theirs, capacity=160)
    step = DecodeStep(model, graphs=False, kernels=True)
    assert step.kernels
    step.warm_up(page_size=16, pages=4)   # (what the engine does at start on a GPU: it must leave nothing behind)
    for _ in range(4):
        got = step.step(token, ours)
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[token]]), past_key_values=theirs).logits[0, -1]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        token = int(want.argmax())
    torch.testing.assert_close(ours.keys[1, :, :94], theirs.layers[1].keys[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_kernel_step_of_an_int4_model_equals_its_torch_step(interpreted):
    """Triton-backend Int4Linear layers (their packed layout is the CPU ``dequant`` one): qkv and gate_up fused,
    norm / gating / residual folded into the gemv calls."""
    from flashguard.quant.int4_linear import Int4Linear, quantize_linears_rtn
    from transformers import DynamicCache

    model = _qwen2(layers=1, seed=3)   # (one layer: the interpreter's gemv is slow)
    quantize_linears_rtn(model, group_size=64, backend="dequant")
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = DynamicCache(config=model.config)
    token = int(_prefill(model, cache, ids).argmax())   # (the prompt on the torch dequantization: fast here)
    for m in model.modules():
        if isinstance(m, Int4Linear):
            m.backend = "triton"
    a, b = StaticKV.from_cache(cache, 96), StaticKV.from_cache(cache, 96)
    fast, plain = DecodeStep(model, graphs=False, kernels=True), DecodeStep(model, graphs=False, kernels=False)
    assert fast.fused[0] is not None
    for _ in range(2):   # (two steps: the second reads the first one's K/V written by the kernel)
        got, want = fast.step(token, a), plain.step(token, b)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        token = int(want.argmax())


@pytest.mark.slow
def test_the_kernel_step_over_an_int8_pool_and_off_the_pool(interpreted):
    """A resident int8 pool, then the sparse step off a 16-bit pool: the same tokens as the torch kernels'
    whole step (the int8 write's rounding of exact halves aside: logits within the codes' precision)."""
    from flashguard.kv.cache import TieredCache

    model = _qwen2(seed=5)
    ids = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    setups = {"int8": dict(page_size=32, sink_tokens=32, l1_tokens=512, l1_max_tokens=512, l2_tokens=1024,
                           policy="exact", l1_codec="int8"),
              "sparse": dict(page_size=16, sink_tokens=16, l1_tokens=64, l1_max_tokens=128, l2_tokens=4096,
                             budget_tokens=32, policy="sparse", l1_codec="fp16")}
    for name, tiers in setups.items():
        runs = []
        for kernels in (True, False):
            cache = TieredCache(model.config, CacheConfig(**tiers)).attach(model)
            with forwarding(cache, ids):
                token = int(_prefill(model, cache, ids).argmax())
            step = DecodeStep(model, graphs=False, whole_step=True, kernels=kernels)
            out, views = [], 0
            for _ in range(5):
                with forwarding(cache, [token]):
                    views += (cache.sparse_view() if name == "sparse" else cache.static_view()) is not None
                    logits = step.step(token, cache)
                out.append(logits)
                token = int(logits.argmax())
            runs.append((torch.stack(out), views))
            cache.check_integrity()
        (a, views), (b, _) = runs
        assert views >= 4, name   # (sparse: one step may find L1 full just before a page leaves it)
        tol = 5e-2 if name == "int8" else 2e-4
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist(), name


@pytest.mark.slow   # (Triton interpreter: seconds)
def test_a_page_at_slot_minus_one_is_left_out_of_the_attention(interpreted):
    """The sparse step's pages only on disk (slot -1): the page kernel attends the others, as if not picked."""
    from flashguard.kv import codecs
    from flashguard.kv.store import L2Arena

    gen = torch.Generator().manual_seed(11)
    hkv, g, d, p = 2, 3, 64, 16
    q = torch.randn(hkv * g, d, generator=gen).half()
    keys, values = (torch.randn(hkv, 40, d, generator=gen).half() for _ in range(2))
    arena = L2Arena(pin=False)
    slots = [arena.write(codecs.encode(*(torch.randn(1, hkv, p, d, generator=gen).half() for _ in range(2)),
                                       "int8")) for _ in range(4)]
    used = torch.tensor([40], dtype=torch.int32)

    def attend(picked):
        read = step_kernels.PageRead(torch.tensor(picked), arena.data[0], arena.layout, p)
        return step_kernels.decode_attention(q, keys, values, used, 0.125, pages=read)

    full = attend([slots[0], -1, slots[2], -1])
    torch.testing.assert_close(full, attend([slots[0], slots[2]]), atol=2e-3, rtol=2e-3)
    assert not torch.allclose(full, attend(slots), atol=2e-3, rtol=2e-3)


def test_page_bounds_takes_bounds_in_another_16_bit_type(interpreted):
    """Quest's ranking with fp16 queries against bf16 bounds (the H200's 128K rows mixed them): = the torch
    bound, pages outside [first, last) at -inf."""
    gen = torch.Generator().manual_seed(9)
    hkv, g, d, cols = 2, 6, 64, 100
    q = torch.randn(hkv * g, d, generator=gen).half()
    kmax = torch.randn(hkv, d, cols, generator=gen)
    bounds = torch.cat([kmax, kmax - torch.rand(hkv, d, cols, generator=gen)], 1).bfloat16()
    got = step_kernels.page_bounds(q, bounds, torch.tensor([3]), torch.tensor([90]))
    qq = q.float().view(hkv, g, d)
    want = torch.bmm(torch.cat([qq.clamp(min=0), qq.clamp(max=0)], -1), bounds.float()).amax(1)
    torch.testing.assert_close(got[:, 3:90], want[:, 3:90], atol=1e-3, rtol=1e-3)
    assert torch.isinf(got[:, :3]).all() and torch.isinf(got[:, 90:]).all()


def test_a_failing_step_kernel_falls_back_to_the_torch_kernels(interpreted, monkeypatch):
    """A step kernel that fails to build or run (Triton's errors are not RuntimeErrors) turns the kernels off,
    once, and the step runs on torch's kernels: the same logits as a step that never had them. An int8 pool
    whose head does not split into whole scale groups never takes them."""
    from transformers import DynamicCache

    model = _qwen2(layers=1, seed=4)
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = DynamicCache(config=model.config)
    token = int(_prefill(model, cache, ids).argmax())
    want = DecodeStep(model, graphs=False, kernels=False).step(token, StaticKV.from_cache(cache, 64))

    def broken(*args, **kwargs):
        raise ValueError("a kernel that does not build here")

    monkeypatch.setattr(step_kernels, "rope_write", broken)
    step = DecodeStep(model, graphs=False, kernels=True)
    step.warm_up()                      # the gate: the failure turns them off at start
    assert not step.kernels
    step = DecodeStep(model, graphs=False, kernels=True)
    got = step.step(token, StaticKV.from_cache(cache, 64))   # or at the first step
    assert not step.kernels
    torch.testing.assert_close(got, want)
    assert not step_kernels.supported(32, int8=True) and step_kernels.supported(64, int8=True)
