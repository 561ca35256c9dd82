"""GGUF 4-bit tensors straight into ``Int4Linear``: no float round trip, no AWQ search.

A GGUF ``Q4_0`` or ``Q4_1`` tensor is already group-quantized with groups of 32 along the input dimension, the
format ``Int4Linear.from_codes`` takes (codes 0..15, a zero point and a scale per group):

- ``Q4_0`` block (18 bytes): ``d`` fp16, 16 bytes of codes; ``w = (q - 8) * d``           -> zero 8, scale d
- ``Q4_1`` block (20 bytes): ``d`` fp16, ``m`` fp16, 16 bytes; ``w = q * d + m``           -> zero -m/d, scale d

In each block byte ``j`` holds element ``j`` in its low nibble and element ``j + 16`` in its high nibble. A ``Q4_1``
zero point is fractional; the kernels take it as a float (``(q - 8) * s + z_float``), so the weights are exactly
gguf-py's dequantization up to the kernels' rounding (bf16 on the CPU). Any other type is an error naming it.

Contract:
- ``int4_codes(blocks, qtype, shape) -> (codes, zeros, scales)``: ``blocks`` the tensor's raw bytes (uint8, one row
  of blocks per output row), ``shape`` ``(out_features, in_features)``; ``awq_format.dequantize(codes, zeros, scales,
  32)`` equals ``gguf.quants.dequantize(blocks, qtype)``.
- ``int4_tensors(path)`` yields ``(name, codes, zeros, scales)`` for every Q4_0 / Q4_1 matrix of a GGUF file.
- ``file_key(path)``: a key of a file's content (size, a hash of its head and of samples spread over it), for a
  cache of converted models that survives moving the file or reinstalling the package that holds it.

The loader (``engine/loader.py``) does not use this yet: the embedded model still loads through transformers'
float conversion, and ``weights: int4`` still runs AWQ.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterator

import numpy as np
import torch

GROUP_SIZE = 32
SUPPORTED = ("Q4_0", "Q4_1")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


class UnsupportedQuantization(ValueError):
    """A GGUF tensor type that has no direct int4 form here."""


def int4_codes(blocks: np.ndarray, qtype: str, shape: tuple[int, int]):
    """Codes uint8 [N, K], zeros float32 [N, K/32], scales float16 [N, K/32] of one Q4_0 / Q4_1 matrix."""
    if qtype not in SUPPORTED:
        raise UnsupportedQuantization(f"GGUF type {qtype} has no direct int4 form; supported: {', '.join(SUPPORTED)}"
                                      " (other types load through the float conversion)")
    n, k = shape
    if k % GROUP_SIZE:
        raise ValueError(f"in_features {k} is not a multiple of the GGUF block size {GROUP_SIZE}")
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
        d = np.where(flat, np.float16(2 ** -24), d)
        zeros = -m / np.where(flat, np.float32(2 ** -24), d32)
    return torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(zeros), torch.from_numpy(d.astype(np.float16))


def int4_tensors(path: str) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(name, codes, zeros, scales)`` for each Q4_0 / Q4_1 matrix of the GGUF file at ``path`` (GGUF names)."""
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
