"""The pool in int8: how the GPU holds twice the tokens when the 16-bit pool cannot hold the context.

When ``kv.l1_codec`` is ``int8`` (``auto`` picks it on a GPU whose budget leaves a 16-bit pool shorter than the
context), every token of L1 is kept as int8 codes ``[kv_heads, capacity, head_dim]`` plus one fp16 scale per
``GROUP`` channels ``[kv_heads, capacity, head_dim / GROUP]``: symmetric round-to-nearest per token, head and group
of 32 channels, the layout of llama.cpp's ``q8_0`` KV cache (34 bytes per 32 values). 1.06 bytes a value instead
of 2.

- ``quantize`` / ``dequantize``: vectorised torch, any device, no host sync (they run inside CUDA graphs).
- ``decode_attention``: one query token's heads over the first ``used`` positions (``used`` an int32 device tensor,
  so a whole decode step stays one CUDA graph). On CUDA with Triton, a split-K flash-decoding kernel reads the
  int8 codes and scales directly (half the bytes of the 16-bit pool; the output is merged over splits by their
  log-sum-exp); elsewhere the pool is dequantized and attended by ``attention.prefix_attention``.

Prefill chunks (many queries) dequantize the layer's pool and use the 16-bit kernels: prefill is bound by
compute, and the 16-bit copy of one layer lives only while that layer attends. A decode step that is not one graph
(an int8 pool shorter than the context: the one-graph sparse step takes 16-bit pools only) dequantizes the pool in
every layer too, which is slow: ``auto`` never picks int8 there, and the engine warns when a config does.
"""

from __future__ import annotations

import torch

from . import attention

GROUP = 32          # channels per scale
QMAX = 127.0

try:  # Triton ships with PyTorch's CUDA wheels on Linux (triton-windows on Windows); without it, the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU wheels
    triton = tl = None


def bytes_per_value() -> float:
    """Bytes one K or V value takes in the int8 pool (codes + its share of a scale)."""
    return 1 + 2 / GROUP


def scale_shape(kv_heads: int, capacity: int, head_dim: int) -> tuple[int, int, int]:
    return kv_heads, capacity, head_dim // GROUP


def supported(head_dim: int) -> bool:
    return head_dim % GROUP == 0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (int8 codes ``[..., D]``, fp16 scales ``[..., D / GROUP]``); ``x ~ codes * scale``."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP).float()
    scale = (g.abs().amax(dim=-1) / QMAX).to(torch.float16)   # cast first: a tiny scale underflows to 0 in fp16
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(g / scale.float().unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes.reshape(x.shape), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize``, in ``dtype``."""
    g = codes.reshape(*codes.shape[:-1], codes.shape[-1] // GROUP, GROUP)
    return g.to(dtype).mul_(scales.to(dtype).unsqueeze(-1)).reshape(codes.shape)   # one 16-bit temporary


def available(device: torch.device) -> bool:
    """The Triton kernel runs here (a CUDA device and an importable Triton)."""
    return triton is not None and device.type == "cuda"


if triton is not None:
    @triton.jit
    def _split_kernel(Q, KC, KS, VC, VS, USED, O, L, scale,
                      s_qh, s_kh, s_kn, s_ksh, s_ksn, s_vh, s_vn, s_vsh, s_vsn, s_oh, s_os, s_og, s_lh, s_ls,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, GRP: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
        h = tl.program_id(0)
        s = tl.program_id(1)
        used = tl.load(USED)
        start = s * SPLIT
        end = tl.minimum(start + SPLIT, used)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        q = tl.load(Q + (h * G + offs_g)[:, None] * s_qh + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n
            valid = n < end
            kc = tl.load(KC + h * s_kh + n[:, None] * s_kn + offs_d[None, :], mask=valid[:, None], other=0)
            ks = tl.load(KS + h * s_ksh + n[:, None] * s_ksn + (offs_d // GRP)[None, :], mask=valid[:, None],
                         other=0.0)
            k = (kc.to(tl.float32) * ks.to(tl.float32)).to(q.dtype)
            sc = tl.dot(q, tl.trans(k)) * scale
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(sc - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            vc = tl.load(VC + h * s_vh + n[:, None] * s_vn + offs_d[None, :], mask=valid[:, None], other=0)
            vs = tl.load(VS + h * s_vsh + n[:, None] * s_vsn + (offs_d // GRP)[None, :], mask=valid[:, None],
                         other=0.0)
            v = (vc.to(tl.float32) * vs.to(tl.float32)).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m = m_new
        has = l > 0
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        o = acc / tl.where(has, l, 1.0)[:, None]
        tl.store(O + h * s_oh + s * s_os + offs_g[:, None] * s_og + offs_d[None, :], o)
        tl.store(L + h * s_lh + s * s_ls + offs_g, lse)


SPLITS = 64          # key ranges per KV head: enough programs to fill a large GPU at 2 KV heads
BLOCK_N = 64


def _split_len(capacity: int) -> int:
    """Keys per split for a pool view of ``capacity``: a power of two, at least one block, ~``SPLITS`` splits."""
    per = -(-capacity // SPLITS)
    return max(BLOCK_N, 1 << (per - 1).bit_length())


def decode_attention(q: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor, vc: torch.Tensor, vs: torch.Tensor,
                     used: torch.Tensor, scale: float) -> torch.Tensor:
    """One token's query heads ``q [Hq, D]`` over the first ``used`` positions of the int8 pool (codes
    ``[kvh, capacity, D]``, scales ``[kvh, capacity, D / GROUP]``); ``used`` an int32 device tensor ``[1]``, at
    least 1. Returns ``[Hq, D]`` in q's dtype. No host sync, fixed shapes: capturable in a CUDA graph."""
    kvh, cap, d = kc.shape
    if not available(q.device) or q.dtype not in (torch.float16, torch.bfloat16) or d & (d - 1):
        # (the kernel's tl.arange needs a power-of-two head size)
        k, v = dequantize(kc, ks, q.dtype), dequantize(vc, vs, q.dtype)
        return attention.prefix_attention(q, k, v, used, scale)
    return _triton_decode(q, kc, ks, vc, vs, used, scale)


def _triton_decode(q, kc, ks, vc, vs, used, scale):
    kvh, cap, d = kc.shape
    hq = q.shape[0]
    g = hq // kvh
    block_g = max(16, 1 << (g - 1).bit_length())
    split = _split_len(cap)
    n_splits = -(-cap // split)
    o = torch.empty((kvh, n_splits, block_g, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((kvh, n_splits, block_g), dtype=torch.float32, device=q.device)
    q = q.contiguous()
    _split_kernel[(kvh, n_splits)](
        q, kc, ks, vc, vs, used, o, lse, scale,
        q.stride(0), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1),
        vc.stride(0), vc.stride(1), vs.stride(0), vs.stride(1),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        G=g, BLOCK_G=block_g, D=d, GRP=GROUP, SPLIT=split, BLOCK_N=BLOCK_N)
    # merge the splits by log-sum-exp (split 0 always holds key 0, so the max is finite)
    m = lse.amax(dim=1, keepdim=True)
    w = torch.exp(lse - m)                                           # [kvh, S, BG]; empty splits weigh 0
    out = (o * w.unsqueeze(-1)).sum(dim=1) / w.sum(dim=1).unsqueeze(-1)
    return out[:, :g].reshape(hq, d).to(q.dtype)
