"""The AWQ "gemm" checkpoint format, as written by AutoAWQ / llm-awq and read by vLLM and gptqmodel.

For a linear layer with ``in_features`` = K, ``out_features`` = N and group size G (over K):

- ``qweight`` int32 [K, N/8]: eight 4-bit codes per int32 along N, nibble ``i`` (bits 4i..4i+3) holding
  column ``8*j + AWQ_ORDER[i]`` of word ``j``.
- ``qzeros``  int32 [K/G, N/8]: the integer zero points, packed the same way (absent = symmetric, zero 8).
- ``scales``  fp16  [K/G, N].

Dequantized weight (nn.Linear layout [N, K]): ``W[n, k] = (q[k, n] - z[k//G, n]) * s[k//G, n]``.

Contract: ``pack(codes, zeros) -> (qweight, qzeros)`` and ``unpack(qweight, qzeros) -> (codes, zeros)`` are exact
inverses; codes/zeros here are in nn.Linear orientation ([N, K] and [N, K/G]), uint8 in 0..15.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
BITS = 4
PACK = 32 // BITS


def _pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints 0..15 -> int32 [R, C/8] in AWQ nibble order."""
    r, c = values.shape
    v = values.to(torch.int64).view(r, c // PACK, PACK)[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64, device=values.device)
    words = (v << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement into int32


def _unpack_cols(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> uint8 [R, C]."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=words.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8] in stored order
    inverse = [AWQ_ORDER.index(i) for i in range(PACK)]
    return nibbles[:, :, inverse].reshape(words.shape[0], -1).to(torch.uint8)


def pack(codes: torch.Tensor, zeros: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """codes uint8 [N, K], zeros uint8 [N, K/G] -> qweight int32 [K, N/8], qzeros int32 [K/G, N/8]."""
    qweight = _pack_cols(codes.t().contiguous())
    qzeros = None if zeros is None else _pack_cols(zeros.t().contiguous())
    return qweight, qzeros


def unpack(qweight: torch.Tensor, qzeros: torch.Tensor | None, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack``; a missing ``qzeros`` means symmetric codes with zero point 8."""
    codes = _unpack_cols(qweight).t().contiguous()
    if qzeros is None:
        zeros = torch.full((codes.shape[0], codes.shape[1] // group_size), 1 << (BITS - 1), dtype=torch.uint8,
                           device=codes.device)
    else:
        zeros = _unpack_cols(qzeros).t().contiguous()
    return codes, zeros


def dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [N, K], zeros [N, K/G], scales [N, K/G] -> weight [N, K] in ``dtype``."""
    n, k = codes.shape
    q = codes.to(dtype).view(n, k // group_size, group_size)
    w = (q - zeros.to(dtype).unsqueeze(-1)) * scales.to(dtype).unsqueeze(-1)
    return w.view(n, k)


def quantize_rtn(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest per group: weight [N, K] -> (codes uint8, zeros uint8, scales fp16).

    The scale is stored in fp16 (the format's dtype) before the codes are rounded, so that
    ``dequantize`` of the result is exactly what a loader of the checkpoint computes.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    w = weight.float().view(n, k // group_size, group_size)
    wmax, wmin = w.amax(-1), w.amin(-1)
    scales = ((wmax - wmin).clamp(min=1e-5) / 15).half().float()
    zeros = torch.round(-wmin / scales).clamp(0, 15)
    codes = torch.clamp(torch.round(w / scales.unsqueeze(-1)) + zeros.unsqueeze(-1), 0, 15)
    return codes.view(n, k).to(torch.uint8), zeros.to(torch.uint8), scales.half()


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``dequantize(quantize_rtn(weight))`` in the weight's dtype: what the int4 checkpoint will compute."""
    codes, zeros, scales = quantize_rtn(weight, group_size)
    return dequantize(codes, zeros, scales, group_size, weight.dtype)
