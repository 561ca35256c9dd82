"""A causal LM built straight from a GGUF file, its 4-bit matrices as ``Int4Linear`` (``weights: int4``).

No float round trip and no AWQ search: every Q4_0 / Q4_1 / Q4_K matrix becomes an ``Int4Linear`` with group size
32 (``gguf_int4``), so starting takes seconds. A Q8_0 matrix (and a tied ``lm_head`` whose embeddings are Q8_0,
as in SmolLM2's GGUF) becomes an ``Int4PairLinear``: the same int4 kernel over ``[x, x]``, exact, about half the
bytes a step reads of a 16-bit matrix. Other tensors (the Q5_K / Q6_K matrices a Q4_K_M file keeps, embeddings,
norms, biases) are dequantized by gguf-py and stay in the model's float dtype: the kernels have no 5- or 6-bit
group format (Q6_K's scales cover 16 weights, the kernels' groups at least 32), and re-quantizing them to 4 bits
would change the model. One log line says what went where.

llama.cpp's converter permutes the rows of a ``llama`` GGUF's ``attn_q`` / ``attn_k`` for its rotary layout; the
permutation is undone here on the codes, zeros and scales (it moves whole rows, so it is exact), as transformers'
GGUF loader does on the float weights.

Contract:
- ``read_tensors(path) -> (architecture, [GgufTensor])``: the tensor table, data memory-mapped, in ~0.1 s;
  ``read_gguf(path)`` also returns the metadata's numbers and strings.
- ``int4_arch(path)`` is the file's ``general.architecture`` when it is one of ``ARCHS`` and the file holds at least
  one 4-bit matrix, else None (the caller then loads it as a float model).
- ``load_int4(path, config, device, dtype, backend, label)`` returns the model in eval mode on ``device``: every
  parameter comes from the file (an error names the first that does not); without an ``output.weight``,
  ``lm_head`` uses the embeddings (their codes when they are Q4 / Q8_0, else tied to the float table). Logits equal those of gguf-py's dequantization of the file up to the
  int4 kernel's rounding (bf16 activations on the CPU). A truncated or unreadable file is a ``ValueError`` naming it.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import Counter

import numpy as np
import torch
from torch import nn

from . import gguf_int4
from .int4_linear import Int4Linear, set_module

log = logging.getLogger("flashguard")

ARCHS = ("llama", "qwen2")   # plain decoders whose GGUF names gguf-py maps onto the transformers model


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufTensor:
    """One tensor of the file: its GGUF name, ``shape`` (rows first, as torch), type name and raw bytes ``data``
    (uint8 ``[rows, bytes per row]``, memory-mapped at first use: a look at the table maps nothing)."""

    def __init__(self, name: str, shape: tuple[int, ...], qtype, data):
        self.name, self.shape, self.qtype = name, shape, qtype
        self._data = data   # an array, or (path, offset, shape) to map

    @property
    def data(self) -> np.ndarray:
        if isinstance(self._data, tuple):
            path, offset, shape = self._data
            self._data = np.memmap(path, np.uint8, "r", offset=offset, shape=shape)
        return self._data


def read_tensors(path: str) -> tuple[str, list[GgufTensor]]:
    """``(general.architecture, tensors)`` of a GGUF file: ``read_gguf`` without the metadata."""
    meta, tensors = read_gguf(path)
    return str(meta.get("general.architecture") or ""), tensors


def read_gguf(path: str, arrays: bool = False, tensors: bool = True) -> tuple[dict, list[GgufTensor]]:
    """``(metadata, tensors)`` of a GGUF file (versions 2 and 3): metadata numbers and strings; arrays (the token
    list, its types, the merges) are read as None, or with ``arrays`` as lists (gguf-py's ``field.contents()``:
    strings as ``str``, numbers as Python numbers). Reads the header with ``struct`` from a read-only map of the file
    (gguf-py's reader builds numpy views of every token string, which takes seconds on a 49K vocabulary; this, with
    the token strings skipped, about 20 ms); tensor data stays memory-mapped; ``tensors=False``: the metadata alone
    (``[]`` for the tensors, their data unchecked, as for a file of which only the first part is present). A
    truncated or malformed file is a ``ValueError`` naming it."""
    import mmap

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":   # (also an empty file, which cannot be mapped)
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:   # (mmap: POSIX and Windows alike)
            meta, infos, start = _parse_header(buf, path, size, arrays, tensors)
    if not tensors:
        return meta, []
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has GGUF type number {kind}, which gguf-py does not know; "
                             "the file may be damaged or newer than the installed gguf package") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, cols = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
        row_bytes = cols // block * block_bytes
        if start + offset + rows * row_bytes > size:
            raise ValueError(f"{path}: tensor {name} ends past the end of the file ({size} bytes); it is truncated")
        tensors.append(GgufTensor(name, shape, qtype, (path, start + offset, (rows, row_bytes))))
    return meta, tensors


_STRUCTS = {kind: struct.Struct(fmt) for kind, fmt in _SCALAR.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def _parse_header(buf, path: str, size: int, arrays: bool, tensors: bool):
    """``(metadata, [(name, shape, type number, offset)], start of the tensor data)`` of the mapped file ``buf``
    (``read_gguf``): offsets are tracked in a local, every read checked against the file's size."""
    from gguf import GGUF_DEFAULT_ALIGNMENT

    pos = 4

    def truncated() -> ValueError:
        return ValueError(f"{path}: the file ends inside its GGUF header; it is truncated")

    def take(st: struct.Struct):
        nonlocal pos
        if pos + st.size > size:
            raise truncated()
        value = st.unpack_from(buf, pos)[0]
        pos += st.size
        return value

    def text() -> str:
        nonlocal pos
        n = take(_U64)
        if n > size:
            raise ValueError(f"{path}: a GGUF string of {n} bytes in a {size}-byte file; the file is damaged")
        if pos + n > size:
            raise truncated()
        pos += n
        return buf[pos - n:pos].decode("utf-8", "replace")

    def value(kind: int):
        nonlocal pos
        if kind == _STRING:
            return text()
        if kind == _ARRAY:
            inner, count = take(_U32), take(_U64)
            if inner in _SCALAR:   # numbers: skipped in one step, or read in one
                width = _STRUCTS[inner].size
                if pos + count * width > size:
                    raise truncated()
                pos += count * width
                if not arrays:
                    return None
                return np.frombuffer(buf[pos - count * width:pos], dtype=np.dtype(_SCALAR[inner])).tolist()
            if inner == _STRING and not arrays:   # a token list: each string's length read, its bytes skipped
                unpack = _U64.unpack_from
                for _ in range(count):
                    if pos + 8 > size:
                        raise truncated()
                    n = unpack(buf, pos)[0]
                    if n > size:
                        raise ValueError(f"{path}: a GGUF string of {n} bytes in a {size}-byte file; the file is "
                                         "damaged")
                    pos += 8 + n
                if pos > size:
                    raise truncated()
                return None
            items = [value(inner) for _ in range(count)]
            return items if arrays else None
        if kind not in _SCALAR:
            raise ValueError(f"{path}: unknown GGUF value type {kind}; the file is damaged")
        return take(_STRUCTS[kind])

    version = take(_U32)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_kv = take(_U64), take(_U64)
    meta = {}
    for _ in range(n_kv):
        key = text()
        meta[key] = value(take(_U32))
    if not tensors:
        return meta, [], 0
    infos = []
    for _ in range(n_tensors):
        name = text()
        dims = [take(_U64) for _ in range(take(_U32))]
        infos.append((name, tuple(reversed(dims)), take(_U32), take(_U64)))   # GGUF lists innermost first
    align = int(meta.get("general.alignment") or GGUF_DEFAULT_ALIGNMENT)
    return meta, infos, -(-pos // align) * align


def int4_arch(path: str) -> str | None:
    arch, tensors = read_tensors(path)
    has_int4 = any(t.qtype.name in gguf_int4.SUPPORTED and len(t.shape) == 2 for t in tensors)
    return arch if arch in ARCHS and has_int4 else None


def _unpermute(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a llama ``attn_q`` / ``attn_k`` back in transformers' order (the inverse of llama.cpp's permute)."""
    rest = x.shape[1:]
    return x.reshape(heads, x.shape[0] // heads // 2, 2, *rest).transpose(1, 2).reshape(x.shape)


def load_int4(path: str, config, device: torch.device, dtype: torch.dtype, backend: str = "auto",
              label: str | None = None) -> nn.Module:
    import gguf
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM

    from .awq_load import rebuild_meta_buffers

    arch, tensors = read_tensors(path)
    if arch not in ARCHS:
        raise ValueError(f"{path}: general.architecture is {arch!r}; int4 straight from GGUF supports "
                         f"{', '.join(ARCHS)}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    to_hf = {}
    for hf in model.state_dict():
        g = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if g is not None:
            to_hf[g] = hf
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads} if arch == "llama" else {}

    def linear(module_name: str, t: GgufTensor, permute: int | None) -> None:
        if t.qtype.name == "Q8_0":
            codes, zeros, scales = gguf_int4.q8_0_codes(t.data, t.shape)
        else:
            codes, zeros, scales = gguf_int4.int4_codes(t.data, t.qtype.name, t.shape)
        if permute:
            codes, zeros, scales = (_unpermute(x, permute) for x in (codes, zeros, scales))
        layer = Int4Linear.from_codes(codes, zeros, scales, gguf_int4.GROUP_SIZE, None, device, backend)
        set_module(model, module_name, gguf_int4.Int4PairLinear(layer) if t.qtype.name == "Q8_0" else layer)
        int4_types[t.qtype.name] += 1

    direct = (*gguf_int4.SUPPORTED, "Q8_0")
    floats: dict[str, torch.Tensor] = {}
    int4_types: Counter = Counter()
    kept: Counter = Counter()   # (gguf type, role) of 2-D tensors kept in float
    embeddings = None
    for t in tensors:
        hf = to_hf.get(t.name)
        if hf is None:
            continue   # e.g. rope_freqs: recomputed by the model
        shape = t.shape
        role = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.rsplit(".", 1)[0]
        permute = heads.get(role)
        module_name = hf.rsplit(".", 1)[0]
        qtype = t.qtype.name
        if t.name == "token_embd.weight":
            embeddings = t
        if qtype in direct and len(shape) == 2 and hf.endswith(".weight") and \
                isinstance(model.get_submodule(module_name), nn.Linear):
            linear(module_name, t, permute)
            continue
        try:
            w = torch.from_numpy(np.array(dequantize(t.data, t.qtype), dtype=np.float32)).reshape(shape)
        except NotImplementedError:
            raise ValueError(f"{path}: tensor {t.name} is {qtype}, which has no int4 form and which gguf-py cannot "
                             f"dequantize; int4 straight from GGUF takes {', '.join(gguf_int4.SUPPORTED)} matrices "
                             "and F32 / F16 / BF16 / Q8_0 / Q5_K / Q6_K / other gguf-py types for the rest") from None
        if permute:
            w = _unpermute(w, permute)
        floats[hf] = w.to(device=device, dtype=dtype)
        if len(shape) == 2:
            kept[(qtype, role)] += 1
    tied = "lm_head.weight" not in floats and not isinstance(model.lm_head, (Int4Linear, gguf_int4.Int4PairLinear))
    from_table = tied and embeddings is not None and embeddings.qtype.name in direct
    if from_table:
        linear("lm_head", embeddings, None)   # no output.weight: lm_head computes with the embeddings' own codes
        tied = False
    if not int4_types:
        raise ValueError(f"{path} holds no {'/'.join(gguf_int4.SUPPORTED)} matrix to load as int4")
    for hf in [k for k in floats if k.endswith(".bias")]:   # biases of the Int4Linear layers (Qwen2's q/k/v)
        module = model.get_submodule(hf.rsplit(".", 1)[0])
        if isinstance(module, Int4Linear):
            module.bias = floats.pop(hf)
    model.load_state_dict(floats, strict=False, assign=True)
    if from_table and isinstance(model.lm_head, gguf_int4.Int4PairLinear):
        model.lm_head.table = model.get_input_embeddings().weight   # the head's matrix in float (lm_head: int4)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight   # no output.weight: tied
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]   # buffers: rebuilt below
    if missing:
        raise ValueError(f"{path} has no tensor for {missing[0]} (and {len(missing) - 1} more); is it a complete "
                         f"{arch} model?")
    rebuild_meta_buffers(model, device)
    model.eval()
    model.requires_grad_(False)
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    stayed = ", ".join(f"{n} {role} ({q})" for (q, role), n in sorted(kept.items())) or "none"
    pairs = int4_types.pop("Q8_0", 0)
    summary = "flashguard: %s: %d matrices int4 straight from %s%s (group %d, %s kernel); kept in %s (no int4 " \
              "form without re-quantizing): %s" % (
                  label or path, sum(int4_types.values()), "/".join(sorted(int4_types)),
                  f", {pairs} Q8_0 matrices as exact int4 pairs" if pairs else "", gguf_int4.GROUP_SIZE,
                  layer.backend, str(dtype).replace("torch.", ""), stayed)
    log.info("%s", summary)
    model.flashguard_load_summary = summary   # (gguf_cache keeps it: a start from the cache logs the same line)
    return model
