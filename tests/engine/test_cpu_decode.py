"""The CPU decode path's pieces against their references: the CPU flash kernel in ``attention.segment`` gives the
einsum path's output and log-sum-exp."""

from __future__ import annotations

import pytest
import torch

from flashguard.kv import attention
from tests.tiny import forwarding


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lq,keys,causal", [(1, 7, False), (1, 300, False), (5, 300, False), (40, 40, True)])
def test_segment_on_the_cpu_is_the_einsum_reference(dtype, tol, lq, keys, causal):
    g = torch.Generator().manual_seed(lq + keys)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in ((3, 3, lq, 64), (3, keys, 64), (3, keys, 64)))
    o, lse = attention.segment(q, k, v, 0.125, causal=causal)
    mask = torch.ones(lq, keys, dtype=torch.bool).tril_(keys - lq) if causal else None
    o_ref, lse_ref = attention._partial(q.float(), k.float(), v.float(), 0.125, mask)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.float(), lse_ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])   # qwen2: q/k/v biases
def test_the_fused_int4_decode_step_is_the_models_forward(tmp_path, arch):
    """On the CPU an int4 model's q/k/v and gate/up run as one kernel call each (``concat_rows``): the step's logits
    are the model's own forward over the same cache, and the layers keep one copy of their codes."""
    from transformers import AutoConfig, DynamicCache

    from flashguard.engine.decode_step import DecodeStep
    from flashguard.engine.engine import cache_kwarg
    from flashguard.quant import gguf_load
    from tests.engine.test_gguf_load import VOCAB, T, write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", arch, v_type=T.Q4_1)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    model = gguf_load.load_int4(str(tmp_path / "tiny.gguf"), config, torch.device("cpu"), torch.float32, "cpu")
    step = DecodeStep(model)
    assert all(f is not None for f in step.fused)
    assert step.cpu is not None   # the CPU's kernels (step_ops.CpuOps) run it
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.packed.data_ptr() == step.fused[0][0].packed.data_ptr()   # a view, not a copy
    assert DecodeStep(model).fused[0] is step.fused[0]
    ids = torch.randint(0, len(VOCAB), (1, 12), generator=torch.Generator().manual_seed(3))
    kwarg = cache_kwarg(model)
    with torch.inference_mode():
        ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
        model(input_ids=ids[:, :8], **{kwarg: ours})
        model(input_ids=ids[:, :8], **{kwarg: theirs})
        for t in range(8, 12):
            got = step.step(int(ids[0, t]), ours)
            expected = model(input_ids=ids[:, t:t + 1], **{kwarg: theirs}).logits[0, -1]
            torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def test_the_cpu_step_over_a_tiered_cache_is_the_models_forward(tmp_path):
    """``CpuOps`` writes a resident TieredCache's L1 itself and attends the keys in use (``static_view`` /
    ``advance``), and goes through the cache's own update and attention once pages leave the window: the logits
    are the model's forward's all along, and the cache stays whole."""
    from transformers import AutoConfig, DynamicCache

    from flashguard import CacheConfig
    from flashguard.engine.decode_step import DecodeStep
    from flashguard.kv.cache import TieredCache
    from flashguard.quant import gguf_load
    from tests.engine.test_gguf_load import VOCAB, T, write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", v_type=T.Q4_1)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    model = gguf_load.load_int4(str(tmp_path / "tiny.gguf"), config, torch.device("cpu"), torch.float32, "cpu")
    step = DecodeStep(model)
    assert step.cpu is not None
    ids = torch.randint(0, len(VOCAB), (90,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = TieredCache(config, CacheConfig(page_size=16, sink_tokens=16, l1_tokens=96, l1_max_tokens=96,
                                           l2_tokens=512, policy="exact", l2_codec="fp16")).attach(model)
    theirs = DynamicCache(config=config)
    with torch.inference_mode():
        with forwarding(ours, ids):
            model(input_ids=torch.tensor([ids]), past_key_values=ours)
        token = int(model(input_ids=torch.tensor([ids]), past_key_values=theirs).logits[0, -1].argmax())
    statics = 0
    for _ in range(60):
        with forwarding(ours, [token]):
            statics += ours.static_view() is not None
            got = step.step(token, ours)
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([[token]]), past_key_values=theirs).logits[0, -1]
        # the int4 lm_head writes bf16 logits: an fp32 rounding that differs upstream (RMSNorm as a dot product,
        # rotary as a matmul, attention) may flip one bf16 rounding of an activation, one bf16 step of a logit
        torch.testing.assert_close(got, want, rtol=0, atol=want.abs().max().item() / 128)
        assert int(got.argmax()) == int(want.argmax())
        token = int(want.argmax())
    assert 0 < statics < 60 and ours.length == 150 and ours.layers[0].win_start > 16
    ours.check_integrity()


@pytest.mark.parametrize("arch,down,way", [("llama", "Q4_1", "script"), ("qwen2", "Q4_1", "script"),
                                            ("llama", "Q4_1", "python"), ("qwen2", "Q4_1", "python"),
                                            ("llama", "Q8_0", "script")])
def test_the_cpu_resident_step_is_the_generic_layer_bit_for_bit(tmp_path, monkeypatch, arch, down, way):
    """``DecodeStep.step`` over a resident cache runs ``CpuOps.resident_step`` (one loop over ``layer_args``, as
    TorchScript by default, engine/cpu_loop.py, or in Python where TorchScript is not there), which computes what the
    generic layer (``DecodeStep._run`` with ``CpuOps``, ``layer_args`` None) computes, call for call: the same logits
    and the same K/V written, exactly, step after step at moving positions (rotary). qwen2: q/k/v biases; a Q8_0
    ffn_down (an int4 pair) has no ``layer_args`` and runs the generic layer."""
    from transformers import AutoConfig

    from flashguard import CacheConfig
    from flashguard.engine.decode_step import DecodeStep
    from flashguard.kv.cache import TieredCache
    from flashguard.quant import gguf_load
    from tests.engine.test_gguf_load import VOCAB, T, write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", arch, v_type=T.Q4_1, down_type=getattr(T, down))
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    model = gguf_load.load_int4(str(tmp_path / "tiny.gguf"), config, torch.device("cpu"), torch.float32, "cpu")
    step = DecodeStep(model)
    layer_args = step.cpu.layer_args
    assert (layer_args is None) == (down == "Q8_0")
    from flashguard.engine import cpu_loop

    assert step.cpu.use_script == (down != "Q8_0")
    assert cpu_loop.scripted() is not None   # this torch has TorchScript: once made, the steps run the script
    if way == "python":
        step.cpu.use_script = False   # what runs where TorchScript cannot make the loop
    scripted_steps = []   # the steps that ran the script
    ready = cpu_loop.ready
    monkeypatch.setattr(cpu_loop, "ready", lambda: scripted_steps.append(1) or ready())
    ids = torch.randint(0, len(VOCAB), (20,), generator=torch.Generator().manual_seed(7)).tolist()
    caches = [TieredCache(config, CacheConfig(page_size=16, sink_tokens=16, l1_tokens=96, l1_max_tokens=96,
                                              l2_tokens=512, policy="exact", l2_codec="fp16")).attach(model)
              for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            with forwarding(cache, ids):
                model(input_ids=torch.tensor([ids]), past_key_values=cache)
    calls = []   # which path each step took
    loop, generic = step.cpu.resident_step, step._run
    step.cpu.resident_step = lambda view: calls.append("loop") or loop(view)
    step._run = lambda ops, attend: calls.append("generic") or generic(ops, attend)
    token = 3
    for _ in range(8):
        got = []
        for cache, args in zip(caches, (layer_args, None)):
            step.cpu.layer_args = args
            with forwarding(cache, [token]):
                assert step.cpu.resident(cache) is not None
                got.append(step.step(token, cache))
        assert torch.equal(got[0], got[1])
        token = int(got[0].argmax())
    assert calls == ["loop" if layer_args is not None else "generic", "generic"] * 8
    assert len(scripted_steps) == (8 if way == "script" and layer_args is not None else 0)
    assert caches[0].length == caches[1].length == 28
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.l1_k[:, :a.length], b.l1_k[:, :b.length])
        assert torch.equal(a.l1_v[:, :a.length], b.l1_v[:, :b.length])


def test_the_loop_falls_back_to_python_where_torchscript_cannot_make_it(monkeypatch, caplog):
    """Where TorchScript is gone or cannot script the loop (no source files, as in a frozen app), ``ready()`` is
    None and the log says why once: ``resident_step`` then runs its Python loop (the same calls)."""
    import logging

    from flashguard.engine import cpu_loop

    def fails(fn):
        raise OSError("Can't get source for <function layers>")

    cpu_loop.scripted()   # (a scripting thread an earlier test started has ended)
    monkeypatch.setattr(torch.jit, "script", fails)
    monkeypatch.setattr(cpu_loop, "_made", [])
    monkeypatch.setattr(cpu_loop, "_thread", [])
    with caplog.at_level(logging.INFO, logger="flashguard"):
        assert cpu_loop.scripted() is None
    assert cpu_loop.ready() is None
    assert "run as Python (TorchScript: OSError: Can't get source" in caplog.text
