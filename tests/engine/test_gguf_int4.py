"""GGUF Q4_0 / Q4_1 / Q4_K tensors straight into Int4Linear: the weights are gguf-py's own dequantization (files written
with gguf-py, and the embedded SmolLM2 Q4_1 GGUF); other types and truncated files are errors naming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from flashguard.quant import awq_format  # noqa: E402
from flashguard.quant.gguf_int4 import (  # noqa: E402
    Int4PairLinear, UnsupportedQuantization, file_key, int4_codes, int4_tensors, q8_0_codes)
from flashguard.quant.int4_linear import Int4Linear  # noqa: E402


def _weights(n=64, k=128, seed=0):
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_codes_are_gguf_pys_dequantization(qtype):
    w = _weights()
    blocks = quants.quantize(w, T[qtype])
    codes, zeros, scales = int4_codes(blocks, qtype, w.shape)
    ours = awq_format.dequantize(codes, zeros, scales, 32)
    theirs = torch.from_numpy(quants.dequantize(blocks, T[qtype]))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("backend,tol", [("dequant", 1e-4), ("cpu", 2e-2)])
def test_int4_linear_computes_the_gguf_weights(qtype, backend, tol):
    if backend == "cpu" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("torch has no CPU int4 kernel")
    w = _weights()
    blocks = quants.quantize(w, T[qtype])
    layer = Int4Linear.from_codes(*int4_codes(blocks, qtype, w.shape), 32, None, torch.device("cpu"), backend)
    assert layer.backend == backend
    x = torch.from_numpy(_weights(3, 128, seed=1))
    expected = x @ torch.from_numpy(quants.dequantize(blocks, T[qtype])).T
    torch.testing.assert_close(layer(x), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_a_flat_q4_1_block_keeps_its_value():
    w = _weights()
    w[0, :32] = 0.125   # one block of equal weights: d == 0, every weight is m
    blocks = quants.quantize(w, T.Q4_1)
    ours = awq_format.dequantize(*int4_codes(blocks, "Q4_1", w.shape), 32)
    torch.testing.assert_close(ours[0, :32], torch.full((32,), 0.125), rtol=1e-3, atol=1e-4)


def _q4_k_blocks(n, k, seed=0):
    """Random Q4_K super-blocks (gguf-py cannot quantize Q4_K): every code and 6-bit scale/min pattern, fp16 d and
    dmin in [1e-5, 1e-4], one sub-block scale of 0 (all its weights equal -dmin * m)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = rng.uniform(1e-5, 1e-4, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    raw[0, 0, 4] &= 0xC0   # sub-block 0's 6-bit scale is the low bits of the first scale byte: now 0
    return raw.reshape(n, -1)


def test_q4_k_codes_are_gguf_pys_dequantization():
    blocks = _q4_k_blocks(48, 512)
    codes, zeros, scales = int4_codes(blocks, "Q4_K", (48, 512))
    assert codes.shape == (48, 512) and zeros.shape == scales.shape == (48, 16) and int(codes.max()) == 15
    theirs = torch.from_numpy(quants.dequantize(blocks, T.Q4_K))
    ours = awq_format.dequantize(codes, zeros, scales, 32)
    # the sub-block scale d * sc is kept in fp16: weights within fp16 rounding of gguf-py's
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3 * theirs.abs().max().item())
    assert float(scales[0, 0]) < 1e-6   # the flat sub-block kept its value through a tiny scale
    torch.testing.assert_close(ours[0, :32], theirs[0, :32], rtol=1e-3, atol=1e-7)


def test_q4_k_int4_linear_on_the_cpu_kernel():
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("torch has no CPU int4 kernel")
    blocks = _q4_k_blocks(64, 256, seed=5)
    layer = Int4Linear.from_codes(*int4_codes(blocks, "Q4_K", (64, 256)), 32, None, torch.device("cpu"), "cpu")
    x = torch.from_numpy(_weights(3, 256, seed=1))
    expected = x @ torch.from_numpy(quants.dequantize(blocks, T.Q4_K)).T
    torch.testing.assert_close(layer(x), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("backend,tol", [("dequant", 1e-5), ("cpu", 2e-2)])
def test_q8_0_as_an_int4_pair_is_exact(backend, tol):
    """Q8_0 as one int4 matrix over [x, x]: the dequantized pair is gguf-py's weight; the layer computes x @ W.T."""
    w = _weights(64, 128, seed=6)
    w[0, :32] = 0.0   # a zero block (d == 0)
    blocks = quants.quantize(w, T.Q8_0)
    theirs = torch.from_numpy(quants.dequantize(blocks, T.Q8_0))
    codes, zeros, scales = q8_0_codes(blocks, w.shape)
    pair = awq_format.dequantize(codes, zeros, scales, 32)
    torch.testing.assert_close(pair[:, :128] + pair[:, 128:], theirs, rtol=0, atol=1e-7)
    layer = Int4PairLinear(Int4Linear.from_codes(codes, zeros, scales, 32, None, torch.device("cpu"), backend))
    x = torch.from_numpy(_weights(3, 128, seed=7))
    expected = x @ theirs.T
    torch.testing.assert_close(layer(x), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_other_types_are_an_error_naming_them():
    with pytest.raises(UnsupportedQuantization, match="GGUF type Q5_K has no direct int4 form; supported: Q4_0, Q4_1, Q4_K"):
        int4_codes(np.zeros((4, 176), np.uint8), "Q5_K", (4, 256))


def _write_gguf(path, tensors):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_written_by_gguf_py(tmp_path):
    w0, w1 = _weights(seed=2), _weights(32, 64, seed=3)
    b0, b1 = quants.quantize(w0, T.Q4_0), quants.quantize(w1, T.Q4_1)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": (b0, T.Q4_0), "blk.0.ffn_up.weight": (b1, T.Q4_1),
                       "output_norm.weight": (np.ones(128, np.float32), T.F32)})
    found = {name: (codes, zeros, scales) for name, codes, zeros, scales in int4_tensors(str(path))}
    assert sorted(found) == ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"]   # the F32 norm is not int4
    for name, blocks, qtype in (("blk.0.attn_q.weight", b0, T.Q4_0), ("blk.0.ffn_up.weight", b1, T.Q4_1)):
        torch.testing.assert_close(awq_format.dequantize(*found[name], 32),
                                   torch.from_numpy(quants.dequantize(blocks, qtype)), rtol=1e-5, atol=1e-6)


def test_a_truncated_gguf_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "cut.gguf"
    _write_gguf(path, {"w": (quants.quantize(_weights(), T.Q4_0), T.Q4_0)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.gguf"):
        list(int4_tensors(str(path)))


@pytest.mark.slow
def test_the_embedded_q4_1_gguf_loads_as_int4():
    from flashguard.engine import loader

    source = loader.resolve_model(None)
    path = f"{source.folder}/{source.gguf_file}"
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    seen = 0
    for name, codes, zeros, scales in int4_tensors(path):
        t = by_name[name]
        assert t.tensor_type.name in ("Q4_0", "Q4_1") and codes.shape == (int(t.shape[1]), int(t.shape[0]))
        if seen < 3:
            torch.testing.assert_close(awq_format.dequantize(codes, zeros, scales, 32),
                                       torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(codes.shape),
                                       rtol=1e-5, atol=1e-6)
        seen += 1
    assert seen >= 100   # the attention and MLP matrices of 30 layers


def test_file_key_follows_the_content_not_the_path(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "sub" / "b.gguf"
    b.parent.mkdir()
    data = np.random.default_rng(4).integers(0, 255, 3 << 20, dtype=np.uint8).tobytes()
    a.write_bytes(data)
    b.write_bytes(data)
    assert file_key(str(a)) == file_key(str(b))
    b.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])   # one byte of the header
    assert file_key(str(a)) != file_key(str(b))
    b.write_bytes(data + b"x")
    assert file_key(str(a)) != file_key(str(b))
