"""The Triton int4 kernels (``Int4Linear``'s ``triton`` backend) against the reference dequantization of
awq_format, on the CPU through Triton's interpreter: odd row counts, a row tail shorter than one load, every AWQ
group size, fp16 / bf16 / fp32 activations. The H200 run of tests/engine/test_gpu.py checks the same on real hardware."""

import pytest
import torch

from flashguard.quant import awq_format, int4_triton

pytest.importorskip("triton")


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter runs the kernels on CPU tensors (it is read when the kernels are built)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(int4_triton, "_kernels", {})


def _layer(n: int, k: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    codes, zeros, scales = awq_format.quantize_rtn(w, group)
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()
    return packed, scales, zeros, awq_format.dequantize(codes, zeros, scales, group)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_dequantize_is_the_reference_weight(interpreted, group):
    packed, scales, zeros, ref = _layer(37, 640 if group == 128 else 576, group, seed=group)
    got = int4_triton.dequantize(packed, scales, zeros, group, torch.float32)
    assert torch.equal(got, ref)   # (q - z) * s in fp32, the reference's arithmetic
    half = int4_triton.dequantize(packed, scales, zeros, group, torch.float16)
    torch.testing.assert_close(half, ref.half())


@pytest.mark.parametrize("group,dtype", [(32, torch.float16), (64, torch.bfloat16), (128, torch.float32)])
def test_gemv_matches_the_reference_product(interpreted, group, dtype):
    n, k = 37, 640 + 2 * group   # a load tail: K/2 is not a multiple of the bytes a program loads per step
    packed, scales, zeros, ref = _layer(n, k, group, seed=7)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(dtype) if group == 64 else None
    got = int4_triton.gemv(x, packed, scales, zeros, group, bias)
    assert got.shape == (1, n) and got.dtype == dtype
    want = x.float() @ ref.t() + (0 if bias is None else bias.float())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("config", [(1, 128, 4), (4, 512, 8), (16, 256, 4)])
def test_every_launch_shape_gives_the_same_product(interpreted, config):
    """The sweep's launch shapes (rows per program, bytes per iteration) cover the same sums, tails included."""
    packed, scales, zeros, ref = _layer(21, 1152, 64, seed=5)
    x = torch.randn(1, 1152, generator=torch.Generator().manual_seed(6))
    got = int4_triton.gemv(x, packed, scales, zeros, 64, config=config)
    torch.testing.assert_close(got, x @ ref.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow   # (Triton interpreter: seconds)
def test_a_wide_layer_uses_several_rows_per_program(interpreted):
    """520 outputs: the launch puts 16 rows in a program (the last one partly empty); each row gets its own sum."""
    packed, scales, zeros, ref = _layer(520, 256, 64, seed=3)
    assert int4_triton.gemv_config(520, 128, torch.device("cpu"))[0] == 16
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(int4_triton.gemv(x, packed, scales, zeros, 64), x @ ref.t(), rtol=1e-5, atol=1e-5)
