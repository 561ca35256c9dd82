"""StaticKV: a fixed-capacity K/V view the whole-step decode graph runs over (``engine/decode_step.py``).

A resident TieredCache offers its pool as one (``TieredCache.static_view``); tests and benchmarks copy a
transformers Cache into one (``from_cache``).
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
