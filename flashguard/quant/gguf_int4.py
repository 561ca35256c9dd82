"""GGUF 4-bit tensors straight into ``Int4Linear``: no float round trip, no AWQ search.

A GGUF ``Q4_0``, ``Q4_1`` or ``Q4_K`` tensor is already group-quantized with groups of 32 along the input
dimension, the format ``Int4Linear.from_codes`` takes (codes 0..15, a zero point and a scale per group):

- ``Q4_0`` block (18 bytes): ``d`` fp16, 16 bytes of codes; ``w = (q - 8) * d``           -> zero 8, scale d
- ``Q4_1`` block (20 bytes): ``d`` fp16, ``m`` fp16, 16 bytes; ``w = q * d + m``           -> zero -m/d, scale d
- ``Q4_K`` super-block of 256 (144 bytes): ``d``, ``dmin`` fp16, 12 bytes of 6-bit scales ``sc`` and mins ``m`` for
  its eight sub-blocks of 32, 128 bytes of codes; ``w = d*sc * q - dmin*m``  -> scale d*sc (fp16), zero dmin*m/scale

In a Q4_0 / Q4_1 block byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high nibble;
in a Q4_K super-block each 32 bytes hold 64 elements (low nibbles the first 32, high nibbles the next 32). The zero
points are fractional; the kernels take them as floats (``(q - 8) * s + z_float``), so the weights are gguf-py's
dequantization up to the scale's fp16 rounding (Q4_K) and the kernels' rounding (bf16 on the CPU). Any other type
is an error naming it.

Contract:
- ``int4_codes(blocks, qtype, shape) -> (codes, zeros, scales)``: ``blocks`` the tensor's raw bytes (uint8, one row
  of blocks per output row), ``shape`` ``(out_features, in_features)``; ``awq_format.dequantize(codes, zeros, scales,
  32)`` equals ``gguf.quants.dequantize(blocks, qtype)``.
- ``q8_0_codes(blocks, shape) -> (codes, zeros, scales)`` of shape ``[N, 2K]``: a Q8_0 matrix exactly as one int4
  matrix over the doubled input ``[x, x]`` (``Int4PairLinear``): with ``q + 128 = 16 hi + lo``,
  ``d q = 16d (hi - 8) + d lo``, so the first K columns hold ``hi`` (zero 8, scale 16d), the next K ``lo`` (zero 0,
  scale d). One int4 kernel call reading 1.25 bytes a weight (codes, fp16 scales and zeros) instead of a float
  matrix's 2 or 4.
- ``q8_0_quantize(weight) -> (codes, zeros, scales)``: the same for a float matrix quantized as Q8_0 (``lm_head:
  int8``, quant/lm_head.py).
- ``int4_tensors(path)`` yields ``(name, codes, zeros, scales)`` for every Q4_0 / Q4_1 / Q4_K matrix of a GGUF file.
- ``file_key(path)``: a key of a file's content (size, a hash of its head and of samples spread over it), for a
  cache of converted models that survives moving the file or reinstalling the package that holds it.

``gguf_load`` builds a whole model from these (``weights: int4`` on a GGUF file).
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterator

import numpy as np
import torch

GROUP_SIZE = 32
SUPPORTED = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
_BLOCK_ELEMENTS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}
_TINY = 2 ** -24   # the scale of a group whose weights are all equal (scale 0): q * tiny + w keeps them


class UnsupportedQuantization(ValueError):
    """A GGUF tensor type that has no direct int4 form here."""


def int4_codes(blocks: np.ndarray, qtype: str, shape: tuple[int, int]):
    """Codes uint8 [N, K], zeros float32 [N, K/32], scales float16 [N, K/32] of one Q4_0 / Q4_1 / Q4_K matrix."""
    if qtype not in SUPPORTED:
        raise UnsupportedQuantization(f"GGUF type {qtype} has no direct int4 form; supported: {', '.join(SUPPORTED)}"
                                      " (other types load through the float conversion)")
    n, k = shape
    if k % _BLOCK_ELEMENTS[qtype]:
        raise ValueError(f"in_features {k} is not a multiple of the {qtype} block size {_BLOCK_ELEMENTS[qtype]}")
    if qtype == "Q4_K":
        return _q4_k_codes(blocks, n, k)
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, k // GROUP_SIZE, _BLOCK_BYTES[qtype])
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    qs = b[..., -16:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)   # elements 0..15, then 16..31
    if qtype == "Q4_0":
        zeros = np.full(d.shape, 8.0, dtype=np.float32)
    else:
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        d32 = d.astype(np.float32)
        flat = d32 == 0   # all 32 weights equal m: a tiny scale keeps them (q * tiny + m)
        d = np.where(flat, np.float16(_TINY), d)
        zeros = -m / np.where(flat, np.float32(_TINY), d32)
    return torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(zeros), torch.from_numpy(d.astype(np.float16))


def _q4_k_codes(blocks: np.ndarray, n: int, k: int):
    from gguf.quants import Q4_K

    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n * (k // 256), 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)          # [B, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())                      # [B, 8] 6-bit each, gguf-py's own unpacking
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0xF).reshape(n, k)                                   # sub-block 2j: low nibbles of chunk j
    scales = (d * sc.astype(np.float32)).astype(np.float16)            # the zero is taken against the rounded scale
    mins = dmin * m.astype(np.float32)
    flat = scales == 0
    scales = np.where(flat, np.float16(_TINY), scales)
    zeros = mins / scales.astype(np.float32)
    return (torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(zeros.reshape(n, k // 32).astype(np.float32)),
            torch.from_numpy(scales.reshape(n, k // 32)))


def q8_0_codes(blocks: np.ndarray, shape: tuple[int, int]):
    """Codes uint8 [N, 2K], zeros float16 [N, 2K/32], scales float16 [N, 2K/32] of a Q8_0 matrix over ``[x, x]``."""
    n, k = shape
    if k % GROUP_SIZE:
        raise ValueError(f"in_features {k} is not a multiple of the Q8_0 block size {GROUP_SIZE}")
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, k // GROUP_SIZE, 34)
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0])
    q = torch.from_numpy(b[..., 2:].copy().view(np.int8).reshape(n, k))
    return _pair_codes(q, d)


def q8_0_quantize(weight: torch.Tensor, rows: int = 4096):
    """``q8_0_codes`` of a float matrix ``weight`` [N, K] quantized as llama.cpp's Q8_0 (``gguf.quants.quantize``):
    a block of 32 weights along K keeps ``d = max|w| / 127`` (fp16) and ``round(w / d)`` in int8. Runs ``rows`` rows
    at a time on the weight's device and returns host tensors, so a 16-bit lm_head of 150K rows needs a few MB
    beside itself, not a float32 copy."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"in_features {k} is not a multiple of the Q8_0 block size {GROUP_SIZE}")
    qs, ds = [], []
    for r0 in range(0, n, rows):
        w = weight[r0:r0 + rows].float().view(-1, k // GROUP_SIZE, GROUP_SIZE)
        d = w.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        x = w * inv[..., None]
        x = torch.sign(x) * torch.floor(x.abs() + 0.5)   # ggml's roundf (halves away from zero), as gguf-py
        qs.append(x.to(torch.int8).view(-1, k).cpu())
        ds.append(d.to(torch.float16).cpu())
    return _pair_codes(torch.cat(qs), torch.cat(ds))


def _pair_codes(q: torch.Tensor, d: torch.Tensor):
    """int8 codes ``q`` [N, K] and fp16 block scales ``d`` [N, K/32] as one int4 matrix over ``[x, x]``: with
    ``q + 128 = 16 hi + lo``, ``d q = 16 d (hi - 8) + d lo``. Zeros 8 and 0 are exact in fp16 (half the bytes of
    float32 zeros a step reads)."""
    u = q.to(torch.int16) + 128   # 0..255
    codes = torch.cat([u >> 4, u & 0xF], dim=1).to(torch.uint8)
    zeros = torch.cat([torch.full(d.shape, 8.0, dtype=torch.float16), torch.zeros(d.shape, dtype=torch.float16)], 1)
    scales = torch.cat([d * 16, d], dim=1).to(torch.float16)
    return codes, zeros, scales


class Int4PairLinear(torch.nn.Module):
    """``x @ W.T`` for an 8-bit matrix held as one ``Int4Linear`` over ``[x, x]`` (``q8_0_codes``). ``table``: ``W``
    in float where the model holds it anyway (a GGUF's lm_head made of its embeddings' codes: the input table),
    else None; not a buffer (``lm_head: int4`` reads it)."""

    def __init__(self, inner, table: torch.Tensor | None = None):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = inner.in_features // 2, inner.out_features
        self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.cat([x, x], dim=-1))


def int4_tensors(path: str) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(name, codes, zeros, scales)`` for each Q4_0 / Q4_1 / Q4_K matrix of the GGUF file at ``path`` (GGUF names)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: cannot read it as GGUF ({exc}); the file may be truncated") from exc
    for t in reader.tensors:
        if t.tensor_type.name in SUPPORTED and len(t.shape) == 2:
            k, n = (int(v) for v in t.shape)   # GGUF lists dimensions innermost first
            yield (t.name, *int4_codes(t.data, t.tensor_type.name, (n, k)))


def file_key(path: str, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A hex key of the file's content: its size, its first MiB (a GGUF header and metadata) and ``samples``
    evenly spread ``sample_bytes`` reads. Equal for copies of the file; different when any of those bytes differ."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
        for i in range(samples):
            fh.seek(size * i // samples)
            h.update(fh.read(sample_bytes))
    return h.hexdigest()
