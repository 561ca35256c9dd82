"""The pool in int8: how the GPU holds twice the tokens when the 16-bit pool cannot hold the context.

When ``kv.l1_codec`` is ``int8`` (``auto`` picks it on a GPU whose budget leaves a 16-bit pool shorter than the
context), every token of L1 is kept as int8 codes ``[kv_heads, capacity, head_dim]`` plus one fp16 scale per
``GROUP`` channels ``[kv_heads, capacity, head_dim / GROUP]``: symmetric round-to-nearest per token, head and group
of 32 channels, the layout of llama.cpp's ``q8_0`` KV cache (34 bytes per 32 values). 1.06 bytes a value instead
of 2.

- ``quantize`` / ``dequantize``: vectorised torch, any device, no host sync (they run inside CUDA graphs).
- ``decode_attention``: one query token's heads over the first ``used`` positions (``used`` an int32 device tensor,
  so a whole decode step stays one CUDA graph), the torch path: the pool dequantized and attended by
  ``attention.prefix_attention``. On a GPU with Triton the decode step reads the codes and scales directly with
  ``step_kernels.decode_attention`` instead (one split-K kernel for 16-bit and int8 pools: half the bytes).

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


def decode_attention(q: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor, vc: torch.Tensor, vs: torch.Tensor,
                     used: torch.Tensor, scale: float) -> torch.Tensor:
    """One token's query heads ``q [Hq, D]`` over the first ``used`` positions of the int8 pool (codes
    ``[kvh, capacity, D]``, scales ``[kvh, capacity, D / GROUP]``); ``used`` an int32 device tensor ``[1]``, at
    least 1. Returns ``[Hq, D]`` in q's dtype. The torch path: the pool dequantized, then
    ``attention.prefix_attention``; no host sync, fixed shapes (capturable in a CUDA graph)."""
    k, v = dequantize(kc, ks, q.dtype), dequantize(vc, vs, q.dtype)
    return attention.prefix_attention(q, k, v, used, scale)
