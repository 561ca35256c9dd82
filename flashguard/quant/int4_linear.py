"""``Int4Linear``: a 4-bit group-quantized ``nn.Linear`` on torch's own int4 kernels (no extra package).

Backends, chosen per device when the layer is built (``choose_backend``):

- ``triton``  flashguard's Triton kernels (``int4_triton``): a matrix-vector kernel for one token, a dequantization
  to the activation dtype + cuBLAS for prompts. CUDA with Triton (PyTorch's Linux wheels ship it; Windows needs
  ``triton-windows``); fp16 or bf16 activations. ``auto``'s first choice on CUDA (measured, see ``choose_backend``).
- ``cuda``    ``aten._weight_int4pack_mm`` (tinygemm; NVIDIA compute capability >= 8.0, bf16 activations).
- ``cpu``     ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations: measured 25-40x faster than its fp32 path).
- ``dequant`` the fallback everywhere else (other accelerators, GPUs without Triton or tinygemm): the packed codes stay
  in memory and are dequantized to the activation dtype for each call, so memory stays int4 while speed is
  that of a dense matmul plus the unpacking.

Contract: ``Int4Linear.from_codes(codes, zeros, scales, group_size, bias, device, backend)`` computes
``x @ dequantize(codes, zeros, scales).T + bias`` up to the rounding of its activation dtype; the weights live only
in their packed form. Kernel formats are device-specific, so a layer is built on its device and never moved
(``.to()`` to another device type raises).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import INT4_KERNELS
from . import awq_format, int4_triton

BACKENDS = INT4_KERNELS[1:]   # without "auto"
_NIBBLES = ("triton", "dequant")   # backends that keep the codes as packed bytes [N, K/2] + scales + zeros


def choose_backend(device: torch.device, requested: str = "auto") -> str:
    """``requested`` is ``auto`` or one of BACKENDS; ``auto`` picks by measurement (docs/benchmarks/int4.md,
    DeepSeek-R1-Distill-Qwen-1.5B shape): on CUDA the Triton kernels where they pass their self-check (one
    token as fast as tinygemm, 1.22x vs 1.20x fp16 a decode step; prompts 5.9x tinygemm), else tinygemm (compute
    capability >= 8.0), else ``dequant``."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        if int4_triton.available(device):
            return "triton"
        major, _ = torch.cuda.get_device_capability(device)
        return "cuda" if major >= 8 and hasattr(torch.ops.aten, "_weight_int4pack_mm") else "dequant"
    if device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "cpu"
    return "dequant"


def _inner_k_tiles(in_features: int) -> int:
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    return 0


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int, backend: str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.backend = group_size, backend
        self.register_buffer("bias", None)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None, device: torch.device, backend: str = "auto") -> "Int4Linear":
        n, k = codes.shape
        backend = choose_backend(device, backend)
        tinygemm = _inner_k_tiles(k) and n % 16 == 0 and group_size in (32, 64, 128, 256)   # its kernels' shapes
        if backend in ("cuda", "cpu") and not tinygemm:
            backend = "dequant"
        if backend == "triton" and (device.type != "cuda" or group_size not in (32, 64, 128, 256)):
            backend = "dequant"
        layer = cls(k, n, group_size, backend)
        if backend in _NIBBLES:   # packed where the codes are, then moved: half the bytes cross
            layer.register_buffer("packed", (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous().to(device))
            layer.register_buffer("scales", scales.to(device, torch.float16).contiguous())
            layer.register_buffer("zeros", zeros.to(device).contiguous())
        else:
            codes = codes.to(device)
            # The kernels compute (q - 8) * s + z_float; AWQ's (q - z) * s means z_float = (8 - z) * s.
            s = scales.float().to(device)
            zf = (8 - zeros.float().to(device)) * s
            layer.register_buffer("scale_zeros", torch.stack([s.t(), zf.t()], -1).to(torch.bfloat16).contiguous())
            tiles = _inner_k_tiles(k)
            if backend == "cpu":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), tiles)
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack(
                    (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous(), tiles)
            layer.register_buffer("packed", packed)
        if bias is not None:
            layer.bias = bias.to(device).contiguous()
        return layer

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] this layer computes with (packed-byte backends only; tests use ``forward``)."""
        if self.backend == "triton":
            return int4_triton.dequantize(self.packed, self.scales, self.zeros, self.group_size, dtype)
        codes = torch.stack([self.packed >> 4, self.packed & 0xF], -1).view(self.out_features, self.in_features)
        return awq_format.dequantize(codes, self.zeros, self.scales, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.backend == "triton" and x2.shape[0] == 1:   # bias inside the kernel
            return int4_triton.gemv(x2.contiguous(), self.packed, self.scales, self.zeros, self.group_size,
                                    self.bias).view(*shape[:-1], self.out_features)
        if self.backend in _NIBBLES:
            out = F.linear(x2, self.dequantized_weight(x.dtype))
        elif self.backend == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.packed,
                                                              self.group_size, self.scale_zeros).to(x.dtype)
        else:
            out = torch.ops.aten._weight_int4pack_mm(x2.to(torch.bfloat16).contiguous(), self.packed,
                                                     self.group_size, self.scale_zeros).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*shape[:-1], self.out_features)

    def fused_gemv(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                   norm: tuple[torch.Tensor, float] | None = None, gated: bool = False) -> torch.Tensor:
        """One token ``x`` [1, K] (``gated``: [1, 2K]) -> [1, N] with the decode step's folds (RMSNorm in, silu
        gating in, residual out: ``int4_triton.gemv``); ``triton`` backend only."""
        if self.backend != "triton":
            raise ValueError(f"fused_gemv runs the Triton backend's kernel; this layer's backend is {self.backend}")
        return int4_triton.gemv(x.reshape(1, -1), self.packed, self.scales, self.zeros, self.group_size, self.bias,
                                residual=residual, norm=norm, gated=gated)

    def _apply(self, fn, recurse=True):
        probe = fn(torch.empty(0, device=self.packed.device)) if hasattr(self, "packed") else None
        if probe is not None and probe.device.type != self.packed.device.type and self.backend != "dequant":
            raise RuntimeError("an Int4Linear's packed weights are laid out for one device; load the model on the "
                               "device it will run on (flashguard's loader does) instead of moving it")
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"backend={self.backend}, bias={self.bias is not None}")


def concat_rows(layers: list[Int4Linear]) -> Int4Linear | None:
    """One layer computing ``torch.cat([layer(x) for layer in layers], -1)`` (a decode step's q/k/v or gate/up in one
    kernel call), or None where the layers differ in input size, group size, backend or bias, or their backend's
    packing is not row by row (tinygemm's ``cuda`` tiles rows). The layers' codes, scales, zeros and biases become
    views of the new layer's (the ``cpu`` backend keeps its small scale_zeros), so the weights are not held twice."""
    first = layers[0]
    if first.backend not in ("cpu", *_NIBBLES) or any(
            (m.backend, m.in_features, m.group_size, m.bias is None) != (first.backend, first.in_features,
                                                                        first.group_size, first.bias is None)
            for m in layers):
        return None
    fused = Int4Linear(first.in_features, sum(m.out_features for m in layers), first.group_size, first.backend)
    fused.register_buffer("packed", _joined_rows([m.packed for m in layers]))
    if first.backend == "cpu":
        fused.register_buffer("scale_zeros", _joined_columns([m.scale_zeros for m in layers]))
    else:
        fused.register_buffer("scales", _joined_rows([m.scales for m in layers]))
        fused.register_buffer("zeros", _joined_rows([m.zeros for m in layers]))
    if first.bias is not None:
        fused.bias = _joined_rows([m.bias for m in layers])
    start = 0
    for m in layers:   # rows: contiguous views of the fused layer's tensors, nothing held twice
        rows = slice(start, start + m.out_features)
        m.packed = fused.packed[rows]
        if first.backend != "cpu":   # (the CPU kernel's scale_zeros [K/G, N, 2] would not slice contiguously)
            m.scales, m.zeros = fused.scales[rows], fused.zeros[rows]
        if m.bias is not None:
            m.bias = fused.bias[rows]
        start += m.out_features
    return fused


def _joined_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)``: a view where they already are consecutive row blocks of one storage (layers joined
    before, e.g. a model read from ``gguf_cache``, which keeps the joined layout), else a copy."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device or \
                t.shape[1:] != first.shape[1:] or t.untyped_storage().data_ptr() != storage or \
                t.storage_offset() != offset:
            return torch.cat(tensors)
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.as_strided(shape, torch.empty(shape, device="meta").stride(), first.storage_offset())


def _joined_columns(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors, dim=1)`` of ``[K/G, N_i, 2]`` tensors, one group row at a time: each copy stays below
    torch's parallel grain, so none waits for the thread pool (on a shared 2-core machine one large copy's wait
    is tens of ms: a whole second over a 30-layer model's joins at start)."""
    first = tensors[0]
    out = torch.empty((first.shape[0], sum(t.shape[1] for t in tensors), *first.shape[2:]), dtype=first.dtype,
                      device=first.device)
    if first.device.type != "cpu":
        return torch.cat(tensors, dim=1, out=out)
    start = 0
    for t in tensors:
        for g in range(t.shape[0]):
            out[g, start:start + t.shape[1]].copy_(t[g])
        start += t.shape[1]
    return out


def backend_of(model: nn.Module) -> str | None:
    """The backend of ``model``'s Int4Linear layers (None when it has none; one model uses one backend)."""
    return next((m.backend for m in model.modules() if isinstance(m, Int4Linear)), None)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted ``name``."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@torch.no_grad()
def quantize_linears_rtn(model: nn.Module, group_size: int = 128, backend: str = "auto",
                         prefix: str = "model.layers.", device: torch.device | None = None) -> int:
    """Replace every ``nn.Linear`` under ``prefix`` by a round-to-nearest ``Int4Linear`` on its own device, one
    layer at a time (peak extra memory: one float weight). With ``device``, a model built in host RAM is
    quantized onto that device layer by layer, so the float model never has to fit it. Used for random-weight speed/memory benchmarks, where
    an activation-aware search has nothing to find. Returns the number of layers replaced."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(prefix)]
    for name in names:
        old = model.get_submodule(name)
        target = device or old.weight.device
        codes, zeros, scales = awq_format.quantize_rtn(old.weight.data.to(target), group_size)
        bias = None if old.bias is None else old.bias.data.to(target)
        new = Int4Linear.from_codes(codes, zeros, scales, group_size, bias, target, backend)
        set_module(model, name, new)
        del old
    return len(names)
