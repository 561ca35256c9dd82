"""Page codecs: how a page's K and V are stored off L1.

A page's K and V arrive as ``[layers, kv_heads, page_size, head_dim]`` tensors.

- ``int8`` (L2): keys quantized per channel (scale and zero point per layer/head/channel over the page's
  tokens), values per token in groups of 32 channels, as KIVI found works best. Asymmetric round-to-nearest; vectorised torch, runs on the device the tensors are on.
- ``int4`` (L3): the same axes at 4 bits, two values packed per byte, then zstd over the bytes.
- ``fp16``: lossless (the KV dtype as it is: fp16/bf16 on GPU), for tests and for users who trade memory
  for exactness.

``encode`` returns a dict of tensors (an ``Encoded`` page); ``decode`` returns ``(k, v)`` in ``dtype``;
``transcode`` re-encodes a page (int4 -> int8 exactly, by unpacking: an L3 page coming back to L2).
``to_bytes``/``from_bytes`` serialise an encoded page for disk, with zstd.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import torch
import zstandard

Encoded = dict  # name -> tensor


GROUP = 32  # value channels per scale group


def _quant(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest along ``dim``: ``x ~ q * scale + zero`` with q in [0, 2^bits - 1]."""
    levels = 2 ** bits - 1
    lo = x.amin(dim=dim, keepdim=True).float()
    hi = x.amax(dim=dim, keepdim=True).float()
    scale = (hi - lo) / levels
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    # one float temporary, worked in place (a copy even when x is float32: x is the caller's); the expression form
    # held two at once, 28 MiB each for a 16-page batch of the 1.5B shape's keys, the size of the allocation that
    # ran out of memory in a 128K turn's crop under a 4 GiB budget
    y = x.to(torch.float32, copy=True)
    q = y.sub_(lo).div_(scale).round_().clamp_(0, levels).to(torch.uint8)
    return q, scale.to(torch.float16), lo.to(torch.float16)


def _grouped(v: torch.Tensor) -> torch.Tensor:
    d = v.shape[-1]
    g = GROUP if d % GROUP == 0 else d
    return v.reshape(*v.shape[:-1], d // g, g)


def encode(k: torch.Tensor, v: torch.Tensor, codec: str) -> Encoded:
    if codec == "fp16" or codec == "fp16-zstd":  # lossless: the KV dtype as it is (fp16/bf16 on GPU)
        return {"k": k, "v": v}
    bits = 8 if codec in ("int8", "int8-zstd") else 4
    kq, ks, kz = _quant(k, dim=-2, bits=bits)              # keys per channel: reduce over tokens
    vq, vs, vz = _quant(_grouped(v), dim=-1, bits=bits)    # values per token, in groups of channels
    if bits == 4:
        kq, vq = _pack4(kq), _pack4(vq)
    return {"kq": kq, "ks": ks, "kz": kz, "vq": vq, "vs": vs, "vz": vz, "bits": torch.tensor([bits], dtype=torch.uint8)}


def decode(e: Encoded, dtype: torch.dtype, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if "k" in e:
        return (e["k"].to(device=device, non_blocking=True).to(dtype),
                e["v"].to(device=device, non_blocking=True).to(dtype))
    t = {n: (x if device is None or x.device == torch.device(device) else x.to(device, non_blocking=True))
         for n, x in e.items() if n != "bits"}
    kq, vq = t["kq"], t["vq"]
    if int(e["bits"].reshape(-1)[0]) == 4:
        kq, vq = _unpack4(kq), _unpack4(vq)
    k = torch.addcmul(t["kz"].to(dtype), kq.to(dtype), t["ks"].to(dtype))   # q * scale + zero, one kernel
    v = torch.addcmul(t["vz"].to(dtype), vq.to(dtype), t["vs"].to(dtype))
    return k, v.flatten(-2)


def transcode(e: Encoded, codec: str) -> Encoded:
    """An encoded page in ``codec``. An int4 page into ``int8`` is exact and cheap: the two share their axes,
    scales and zeros (``_quant``), so the int4 codes are only unpacked into the int8 container (what an L3 page
    read back into L2 needs: no float round trip, no second rounding). Anything else is decoded and encoded."""
    bits = int(e["bits"].reshape(-1)[0]) if "bits" in e else None
    if codec == "int8" and bits == 8:
        return e
    if codec == "int8" and bits == 4:
        return {"kq": _unpack4(e["kq"]), "ks": e["ks"], "kz": e["kz"], "vq": _unpack4(e["vq"]), "vs": e["vs"],
                "vz": e["vz"], "bits": torch.tensor([8], dtype=torch.uint8)}
    k, v = decode(e, torch.float32)
    return encode(k, v, codec)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    return (q[..., 0::2] << 4) | q[..., 1::2]


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    return torch.stack((p >> 4, p & 0xF), dim=-1).flatten(-2)


_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float32": torch.float32, "float64": torch.float64}
_MAGIC = b"FGP1"


def to_bytes(e: Encoded, level: int = 3) -> bytes:
    """Serialise an encoded page (CPU tensors) and entropy-code it with zstd."""
    raw = io.BytesIO()
    raw.write(struct.pack("<I", len(e)))
    for name, t in e.items():
        t = t.detach().cpu().contiguous()
        arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
        dt = str(t.dtype).replace("torch.", "").encode()
        nm = name.encode()
        raw.write(struct.pack("<BB", len(nm), len(dt)) + nm + dt + struct.pack("<B", arr.ndim))
        raw.write(struct.pack(f"<{arr.ndim}I", *arr.shape))
        raw.write(arr.tobytes())
    return _MAGIC + zstandard.ZstdCompressor(level=level).compress(raw.getvalue())


def _fields(blob: bytes) -> tuple[bytes, dict]:
    """A page file's payload, unpacked by zstd, and where each field sits in it: name -> (dtype, shape, offset,
    size in bytes)."""
    if blob[:4] != _MAGIC:
        raise ValueError("not a flashguard page")
    raw = zstandard.ZstdDecompressor().decompress(blob[4:])
    try:
        return raw, _layout(raw)
    except struct.error as exc:
        raise ValueError(f"a truncated flashguard page ({exc})") from None


def _layout(raw: bytes) -> dict:
    buf = memoryview(raw)
    (n,), off = struct.unpack_from("<I", buf, 0), 4
    fields = {}
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
        if off + size > len(raw):
            raise ValueError("a truncated flashguard page")
        fields[name] = (dt, tuple(shape), off, size)
        off += size
    return fields


def from_bytes(blob: bytes) -> Encoded:
    raw, fields = _fields(blob)
    out: Encoded = {}
    for name, (dt, shape, off, size) in fields.items():
        raw_dt = torch.int16 if dt == torch.bfloat16 else dt
        out[name] = torch.frombuffer(bytearray(raw[off:off + size]), dtype=raw_dt).reshape(shape).view(dt)
    return out


def int4_as_int8_rows(blob: bytes, layout, row_bytes: int) -> torch.Tensor | None:
    """An int4 page file straight into int8 L2 arena rows ``[layers, row_bytes]`` (``layout`` as
    ``store.L2Arena`` has it): what ``transcode(from_bytes(blob), "int8")`` laid out as rows gives, without torch
    and with numpy's loops, which leave the GIL to other threads (a reader thread's work while the decoding thread
    runs). None when the file or the layout is not int4 -> int8 of the same shape (the caller takes the general
    path)."""
    raw, fields = _fields(blob)
    bits = fields.get("bits")
    if bits is None or raw[bits[2]] != 4 or not layout:
        return None
    layers = fields[layout[0][0]][1][0] if layout[0][0] in fields else 0
    out = np.empty((layers, row_bytes), dtype=np.uint8)
    for name, dtype, _, off, nbytes in layout:
        f = fields.get(name)
        if f is None or f[1][0] != layers:
            return None
        src = np.frombuffer(raw, dtype=np.uint8, count=f[3], offset=f[2]).reshape(layers, -1)
        dst = out[:, off:off + nbytes]
        if name in ("kq", "vq"):   # two codes a byte (``_pack4``): high nibble first
            if dtype != torch.uint8 or 2 * src.shape[1] != nbytes:
                return None
            pairs = dst.reshape(layers, nbytes // 2, 2)
            np.right_shift(src, 4, out=pairs[..., 0])
            np.bitwise_and(src, 0xF, out=pairs[..., 1])
        else:
            if f[0] != dtype or src.shape[1] != nbytes:
                return None
            np.copyto(dst, src)
    return torch.from_numpy(out)
