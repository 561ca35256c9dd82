"""The decode step's interface to a cache, and StaticKV: a fixed-capacity K/V view the whole-step graph runs over.

Contract (what ``engine/decode_step.py`` asks of what it decodes over, and nothing else; ``step_target(cache)``
gives it a TieredCache or a StaticKV as they are, any other transformers Cache through ``LayerwiseCache``):

- ``decode_view(graphs, sparse) -> view | None``: the fixed-shape buffers this step runs over, attention included,
  as one graph (a StaticKV over the pool, or, with ``sparse``, a SparseKV off it: ``kv/sparse_step.py``); None:
  the step runs layer by layer (``attend_layer``). ``graphs``: the step may run as one graph at all (a cache's own
  views are offered only then; a StaticKV is always its own view, and a full one is a ``ValueError``).
- ``attend_layer(i, q, k, v, scale) -> [Hq, 1, D]``: layer ``i``'s new ``k``, ``v`` (``[1, kvh, 1, D]``) appended
  as the model's forward would (``update``), and ``q`` (``[1, Hq, 1, D]``) attended over everything the layer holds.
- ``promote_missed() -> bool``: after a one-graph step: True when it must run again over a new ``decode_view``
  (pages it picked were only on disk and are in host RAM now).
- ``advance(n)``: ``n`` tokens a one-graph step wrote into the view's buffers, counted.
- ``get_seq_length()``: the tokens held (the next token's position).

A view (StaticKV, SparseKV) offers the step's attention per layer:

- ``key``: a ``GraphKey`` naming the buffers a recorded graph reads (``key.kind``: "static" or "sparse").
- ``slot(i, position) -> (pos, keys, values, key_scales, value_scales)``: where layer ``i``'s new token goes (the
  step kernels' ``rope_write`` writes it there).
- ``attend(i, q [Hq, D], k, v, scale, position=, used=, split=) -> [Hq, D]``: ``k``, ``v`` (``[kvh, 1, D]``) written
  at ``position`` first, or None when ``rope_write`` wrote them (then the step kernels' attention runs); ``used``:
  the device-side key count; ``split``: an int8 pool is read by the step kernels' split-K attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GraphKey:
    """Which device buffers a recorded whole-step graph reads, and the variant it was recorded for: a graph is
    replayed only under an equal key, recorded again under a new one.

    ``kind``: "static" (a StaticKV) or "sparse" (a SparseKV). ``layers``: per layer the data pointers of its K and V
    buffers (and, sparse, its page bounds and their capacity). ``tables``: a sparse step's other buffers (the L2
    arena, the step's position, slot, seen and missed tables). ``variant``: what else tells two graphs over the same
    buffers apart (capacity, scales' pointers; sparse: budget, pool capacity, read-ahead, pages on disk)."""

    kind: str
    layers: tuple
    tables: tuple = ()
    variant: tuple = ()

    def buffers(self) -> set[int]:
        """The layers' buffers (K, V and, sparse, page bounds): what a new session's pool must hold for the graph to
        stay valid (``DecodeStep.forget_steps``)."""
        return {ptr for layer in self.layers for ptr in layer[:3 if self.kind == "sparse" else 2]}

    def replaced_by(self, new: "GraphKey") -> bool:
        """A sparse step's graph whose buffers ``new``'s step no longer uses (its L1 buffers, the L2 arena or the
        step's tables were replaced: a grown arena, a new session): it will not be replayed again, and its pool
        holds device memory until it goes. Variants over the same buffers (the pool's capacity, pages on disk) stay;
        a change of budget or read-ahead replaces the step's ``missed`` table, so its old graph goes too."""
        return self.kind == new.kind == "sparse" and (self.layers, self.tables) != (new.layers, new.tables)


class StaticKV:
    """Keys and values of every layer, ``keys[i]`` / ``values[i]`` ``[kv_heads, capacity, head_dim]`` (two device
    tensors ``[layers, ...]``, or per-layer lists: a resident TieredCache's L1 buffers), written at the step's
    position by a kernel (the position is a device tensor) and attended up to a device-side count
    (``attention.prefix_attention``): shapes never change, so a whole decode step can be replayed as one CUDA
    graph. ``length`` is the number of tokens held (host side); ``owner`` (a TieredCache) is told of each step.
    ``scales``: an int8 pool (``kv/int8_pool.py``): keys/values are codes and ``scales`` is ``(key scales, value
    scales)``, per layer ``[kv_heads, capacity, head_dim / GROUP]``."""

    def __init__(self, keys, values, length: int, owner=None, scales=None):
        self.keys, self.values, self.length, self.owner = keys, values, length, owner
        self.scales = scales

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def key(self) -> GraphKey:
        """Where the buffers are: a graph recorded over them stays valid while this is unchanged."""
        if isinstance(self.keys, torch.Tensor):
            return GraphKey("static", ((self.keys.data_ptr(), self.values.data_ptr()),), variant=(self.capacity,))
        scales = () if self.scales is None else tuple(t.data_ptr() for part in self.scales for t in part)
        return GraphKey("static", tuple((k.data_ptr(), v.data_ptr()) for k, v in zip(self.keys, self.values)),
                        variant=(self.capacity, scales))

    def quantized(self) -> "StaticKV":
        """A copy of this 16-bit pool as an int8 pool (``int8_pool.quantize``'s codes and scales, per layer)."""
        from . import int8_pool

        keys = [int8_pool.quantize(self.keys[i]) for i in range(len(self.keys))]
        values = [int8_pool.quantize(self.values[i]) for i in range(len(self.values))]
        return StaticKV([c for c, _ in keys], [c for c, _ in values], self.length,
                        scales=([s for _, s in keys], [s for _, s in values]))

    @classmethod
    def from_cache(cls, cache, capacity: int) -> "StaticKV":
        """A copy of a transformers Cache's layers (``layers[i].keys`` ``[1, kvh, T, D]``), room for ``capacity``."""
        first = cache.layers[0].keys
        _, kvh, length, d = first.shape
        if capacity < length:
            raise ValueError(f"capacity {capacity} < the {length} tokens held")
        shape = (len(cache.layers), kvh, capacity, d)
        keys, values = (torch.zeros(shape, dtype=first.dtype, device=first.device) for _ in range(2))
        for i, layer in enumerate(cache.layers):
            keys[i, :, :length].copy_(layer.keys[0])
            values[i, :, :length].copy_(layer.values[0])
        return cls(keys, values, length)

    def get_seq_length(self) -> int:
        return self.length

    # ---- the decode step's interface (module docstring) -----------------------------------------
    def decode_view(self, graphs: bool, sparse: bool) -> "StaticKV":
        if self.length >= self.capacity:
            raise ValueError(f"the StaticKV is full ({self.length} tokens)")
        return self

    def attend_layer(self, i, q, k, v, scale):
        raise ValueError("a StaticKV is attended as a whole step (decode_view)")

    def promote_missed(self) -> bool:
        return False

    def advance(self, n: int = 1) -> None:
        self.length += n

    def slot(self, i: int, position: torch.Tensor) -> tuple:
        ks, vs = (None, None) if self.scales is None else (self.scales[0][i], self.scales[1][i])
        return position, self.keys[i], self.values[i], ks, vs

    def attend(self, i: int, q: torch.Tensor, k, v, scale: float, position: torch.Tensor | None = None,
               used: torch.Tensor | None = None, split: bool = False) -> torch.Tensor:
        from . import attention, int8_pool, step_kernels

        keys, values = self.keys[i], self.values[i]
        ks, vs = (None, None) if self.scales is None else (self.scales[0][i], self.scales[1][i])
        if k is None:   # written by the step kernels' rope_write: their attention
            return step_kernels.decode_attention(q, keys, values, used, scale, ks, vs)
        if self.scales is None:
            keys.index_copy_(1, position, k)          # [kvh, capacity, D] <- [kvh, 1, D]
            values.index_copy_(1, position, v)
            return attention.prefix_attention(q, keys, values, used, scale)
        for codes, scales, x in ((keys, ks, k), (values, vs, v)):   # an int8 pool: quantized on the way in
            c, sc = int8_pool.quantize(x)
            codes.index_copy_(1, position, c)
            scales.index_copy_(1, position, sc)
        if split:   # step_kernels' split-K attention reads the codes
            return step_kernels.decode_attention(q, keys, values, used, scale, ks, vs)
        return int8_pool.decode_attention(q, keys, ks, values, vs, used, scale)


class LayerwiseCache:
    """Any other transformers Cache as the decode step sees it: no view (layer by layer), one fused attention call
    over what its ``update`` returns."""

    def __init__(self, cache):
        self.cache = cache

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def decode_view(self, graphs: bool, sparse: bool) -> None:
        return None

    def attend_layer(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        from . import attention

        # a cache may keep the tensors it is given: not the caller's (a graph's outputs)
        k_all, v_all = self.cache.update(k.clone(), v.clone(), i)
        kvh, d = k_all.shape[1], q.shape[-1]
        qg = q[0].reshape(kvh, q.shape[1] // kvh, 1, d)   # a KV head's query heads: rows of one fused call
        return attention.segment(qg, k_all[0], v_all[0], scale)[0]

    def promote_missed(self) -> bool:
        return False

    def advance(self, n: int = 1) -> None:
        raise ValueError("a transformers Cache is not stepped as a whole (decode_view is None)")


def step_target(cache):
    """What the decode step runs over: ``cache`` itself where it speaks the interface above (a TieredCache, a
    StaticKV), else a ``LayerwiseCache`` around it."""
    return cache if hasattr(cache, "decode_view") else LayerwiseCache(cache)
