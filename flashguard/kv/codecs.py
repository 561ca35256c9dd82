"""Page codecs: how a page's K and V are stored off L1.

A page's K and V arrive as ``[layers, kv_heads, page_size, head_dim]`` tensors.

- ``int8`` (L2): keys quantized per channel (one scale per layer/head/channel over the page's tokens),
  values per token (one scale per layer/head/token over channels), as KIVI found works best.
  Symmetric, round-to-nearest; vectorised torch, runs on the device the tensors are on.
- ``int4`` (L3): the same axes at 4 bits, two values packed per byte, then zstd over the bytes.
- ``fp16``: lossless (the value is stored as is), for tests and for users who trade memory for exactness.

``encode`` returns a dict of tensors (an ``Encoded`` page); ``decode`` returns ``(k, v)`` in ``dtype``.
``to_bytes``/``from_bytes`` serialise an encoded page for disk, with zstd.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import torch
import zstandard

Encoded = dict  # name -> tensor


def _quant(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().amax(dim=dim, keepdim=True).float() / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(x.float() / scale), -qmax, qmax).to(torch.int8)
    return q, scale.to(torch.float16)


def encode(k: torch.Tensor, v: torch.Tensor, codec: str) -> Encoded:
    if codec == "fp16" or codec == "fp16-zstd":
        return {"k": k.to(torch.float16), "v": v.to(torch.float16)}
    bits = 8 if codec in ("int8", "int8-zstd") else 4
    kq, ks = _quant(k, dim=-2, bits=bits)  # per channel: reduce over tokens
    vq, vs = _quant(v, dim=-1, bits=bits)  # per token: reduce over channels
    if bits == 4:
        kq, vq = _pack4(kq), _pack4(vq)
    return {"kq": kq, "ks": ks, "vq": vq, "vs": vs}


def decode(e: Encoded, dtype: torch.dtype, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if "k" in e:
        return e["k"].to(device=device, dtype=dtype, non_blocking=True), e["v"].to(device=device, dtype=dtype,
                                                                                   non_blocking=True)
    kq, vq = e["kq"].to(device, non_blocking=True), e["vq"].to(device, non_blocking=True)
    if kq.dtype == torch.uint8:
        kq, vq = _unpack4(kq), _unpack4(vq)
    ks, vs = e["ks"].to(device, non_blocking=True), e["vs"].to(device, non_blocking=True)
    return (kq.to(dtype) * ks.to(dtype)), (vq.to(dtype) * vs.to(dtype))


def _pack4(q: torch.Tensor) -> torch.Tensor:
    u = (q + 8).to(torch.uint8)  # [-7, 7] -> [1, 15]
    return (u[..., 0::2] << 4) | u[..., 1::2]


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    hi = (p >> 4).to(torch.int8) - 8
    lo = (p & 0xF).to(torch.int8) - 8
    return torch.stack((hi, lo), dim=-1).flatten(-2)


def nbytes(e: Encoded) -> int:
    return sum(t.numel() * t.element_size() for t in e.values())


_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "float16": torch.float16}
_MAGIC = b"FGP1"


def to_bytes(e: Encoded, level: int = 3) -> bytes:
    """Serialise an encoded page (CPU tensors) and entropy-code it with zstd."""
    raw = io.BytesIO()
    raw.write(struct.pack("<I", len(e)))
    for name, t in e.items():
        arr = t.detach().cpu().contiguous().numpy()
        dt = str(t.dtype).replace("torch.", "").encode()
        nm = name.encode()
        raw.write(struct.pack("<BB", len(nm), len(dt)) + nm + dt + struct.pack("<B", arr.ndim))
        raw.write(struct.pack(f"<{arr.ndim}I", *arr.shape))
        raw.write(arr.tobytes())
    return _MAGIC + zstandard.ZstdCompressor(level=level).compress(raw.getvalue())


def from_bytes(blob: bytes) -> Encoded:
    if blob[:4] != _MAGIC:
        raise ValueError("not a flashguard page")
    buf = memoryview(zstandard.ZstdDecompressor().decompress(blob[4:]))
    (n,), off = struct.unpack_from("<I", buf, 0), 4
    out: Encoded = {}
    for _ in range(n):
        ln, ld = struct.unpack_from("<BB", buf, off)
        off += 2
        name = bytes(buf[off:off + ln]).decode()
        off += ln
        dt = _DTYPES[bytes(buf[off:off + ld]).decode()]
        off += ld
        (ndim,) = struct.unpack_from("<B", buf, off)
        off += 1
        shape = struct.unpack_from(f"<{ndim}I", buf, off)
        off += 4 * ndim
        count = int(np.prod(shape)) if ndim else 1
        size = count * torch.empty((), dtype=dt).element_size()
        out[name] = torch.frombuffer(bytearray(buf[off:off + size]), dtype=dt).reshape(shape)
        off += size
    return out
