"""Bytes of each part of a model, from its shape: what the planner adds up and what a decoded token reads.

Contract:
- ``weight_bytes(shape, kind)``: bytes per category (embeddings, lm_head, decoder linears, norms) for the
  ``weights`` key's ``kind``; ``head_bytes``, ``layer_bytes``, ``int4_bytes``, ``guard_bytes``: one part's;
  ``table_on_host``: whether the embedding table stays in host RAM.
- ``decode_bytes(shape, weights, context, kv)``: GPU bytes one decoded token reads with a sized cache (the linears,
  the lm_head as held, the K/V attended: ``kv_read_bytes``); ``llamacpp_decode_bytes``: the same for llama.cpp's
  Q4_K_M, an estimate from its quantization mix. ``LAPTOP_GB_S``: the bandwidth their ratio is a floor at.
"""

from __future__ import annotations

from ..quant import AWQ_GROUP_SIZE
from .shapes import Shape


def weight_bytes(s: Shape, kind: str, group: int = AWQ_GROUP_SIZE) -> dict:
    """Bytes per category for ``kind`` (the ``weights`` key: "int4", or "float" = 16-bit)."""
    kvd = s.kv_heads * s.head_dim
    linear = s.layers * (s.hidden * (s.heads * s.head_dim + 2 * kvd) + s.heads * s.head_dim * s.hidden
                         + 3 * s.hidden * s.intermediate)
    small = s.layers * (2 * s.hidden + ((s.heads * s.head_dim + 2 * kvd) if s.qkv_bias else 0)) + s.hidden
    if s.tied and s.lm_head == "float":   # one 16-bit tensor, table and head
        emb_bytes = s.vocab * s.hidden * 2
    else:
        emb_bytes = head_bytes(s, group) + (0 if table_on_host(s, kind) else s.vocab * s.hidden * 2)
    lin_bytes = int4_bytes(linear, group) if kind == "int4" else linear * 2
    return {"embeddings + lm_head": emb_bytes, "decoder linears": lin_bytes, "norms + biases": small * 2}


def table_on_host(s: Shape, kind: str) -> bool:
    """The embedding table in host RAM (``engine/host_embedding.py``): int4 weights, unless the table is the head."""
    return kind == "int4" and not (s.tied and s.lm_head == "float")


def head_bytes(s: Shape, group: int = AWQ_GROUP_SIZE) -> int:
    """The lm_head as held (``Shape.lm_head``): 16-bit; Q8_0 as an int4 pair over ``[x, x]`` (codes a byte a weight,
    a 16-bit scale and zero per 32 of the doubled input: 1.25 bytes a weight); int4 codes in groups of 32 (a GGUF's
    Q4 blocks, or ``lm_head: int4``'s codes, whose top rows a token reads from host RAM: counted here too)."""
    params = s.vocab * s.hidden
    if s.lm_head == "int8":
        return int4_bytes(2 * params, 32)
    if s.lm_head == "int4":
        from ..quant.lm_head import TOP

        return int4_bytes(params, 32) + TOP * s.hidden * 2
    return params * 2


def int4_bytes(params: int, group: int = AWQ_GROUP_SIZE) -> int:
    """Codes (half a byte each) plus a 16-bit scale and zero per group."""
    return params // 2 + (params // group) * 2 * 2


def layer_bytes(s: Shape, kind: str, group: int = AWQ_GROUP_SIZE) -> int:
    """One decoder layer's projections on the device (what a streamed layer copies: ``engine/layer_stream.py``)."""
    return weight_bytes(s, kind, group)["decoder linears"] // s.layers


def guard_bytes(shape: Shape, *, rank: int = 32, upper: float = 0.5, itemsize: int = 2) -> int:
    """The guard adapter's bytes (``guard_adapter``: an activated LoRA of ``rank`` on every linear of the upper
    ``upper`` share of the decoder layers, as the shipped guard is: rank 32 on the upper half), in the activations' dtype."""
    s = shape
    q, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_layer = rank * ((s.hidden + q) * 2 + (s.hidden + kvd) * 2 + (s.hidden + s.intermediate) * 3)
    return per_layer * max(1, round(s.layers * upper)) * itemsize


# A laptop GPU of the 4 GB class (RTX 3050 Laptop: GDDR6 on a 128-bit bus, 192 GB/s): decode there is bound by the
# bytes a token reads, not by launches, so bytes per token divided by this is the step's floor.
LAPTOP_GB_S = 192


def decode_bytes(shape: Shape, *, weights: str, context: int, kv, group: int = AWQ_GROUP_SIZE) -> dict:
    """GPU bytes one decoded token reads at ``context`` tokens with a sized ``kv`` (``sized_kv``): the decoder's
    linears, the lm_head as held (``head_bytes``), and the K/V attended: every token while the
    pool holds the conversation (``policy: exact`` or a resident context), else the sinks, the window and the pages
    the sparse policy selects (``budget_tokens`` per KV head) in the pool's codec. Norms and the one embedding row
    are left out (a few KB)."""
    w = weight_bytes(shape, weights, group)
    out = {"decoder linears": w["decoder linears"], "lm_head": head_bytes(shape, group),
           "kv attended": kv_read_bytes(shape, context=context, kv=kv)}
    out["total"] = sum(out.values())
    return out


def kv_read_bytes(shape: Shape, *, context: int, kv, value_bytes: int = 2) -> int:
    """K/V bytes one decoded token attends (``decode_bytes``): ``value_bytes`` a value in a 16-bit pool (4 for an
    fp32 model on the CPU), the int8 pool's codes and scales otherwise."""
    pool = kv.l1_tokens if kv.l1_tokens is not None else context
    if pool >= context or kv.policy == "exact":
        attended = context
    else:
        attended = min(context, kv.sink_tokens + pool + shape.kv_heads * kv.budget_tokens)
    per_value = float(value_bytes)
    if kv.l1_codec == "int8":
        from ..kv.int8_pool import bytes_per_value

        per_value = bytes_per_value()
    return int(attended * shape.layers * 2 * shape.kv_heads * shape.head_dim * per_value)


# llama.cpp's Q4_K_M, as `llama-quantize` writes it: Q4_K (4.5 bits a weight) for most matrices, Q6_K (6.5625) for
# half the layers' attn_v and ffn_down and for the output matrix; its KV cache q8_0 (34 bytes a 32 values) or f16.
Q4_K_BITS, Q6_K_BITS = 4.5, 6.5625


def llamacpp_decode_bytes(shape: Shape, *, context: int, kv_type: str = "q8_0") -> dict:
    """The same three parts for llama.cpp's Q4_K_M of ``shape`` with a ``kv_type`` cache attending every token (its
    decode reads the whole cache: no paging). An estimate from the quantization mix, not a file's tensor table."""
    kvd = shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    attn_qko = shape.hidden * (q + kvd) + q * shape.hidden
    attn_v = shape.hidden * kvd
    up_gate, down = 2 * shape.hidden * shape.intermediate, shape.hidden * shape.intermediate
    half = shape.layers // 2
    bits = shape.layers * (attn_qko + up_gate) * Q4_K_BITS + \
        (attn_v + down) * (half * Q6_K_BITS + (shape.layers - half) * Q4_K_BITS)
    per_value = 34 / 32 if kv_type == "q8_0" else 2.0
    out = {"decoder linears": int(bits / 8), "lm_head": int(shape.vocab * shape.hidden * Q6_K_BITS / 8),
           "kv attended": int(context * shape.layers * 2 * kvd * per_value)}
    out["total"] = sum(out.values())
    return out
