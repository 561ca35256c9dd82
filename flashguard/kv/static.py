"""StaticKV: a fixed-capacity K/V view the whole-step decode graph runs over (``engine/decode_step.py``).

A resident TieredCache offers its pool as one (``TieredCache.static_view``); tests and benchmarks copy a
transformers Cache into one (``from_cache``).
"""

from __future__ import annotations

import torch


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
    def key(self) -> tuple:
        """Where the buffers are: a graph recorded over them stays valid while this is unchanged."""
        if isinstance(self.keys, torch.Tensor):
            return (self.keys.data_ptr(), self.values.data_ptr(), self.capacity)
        scales = () if self.scales is None else tuple(t.data_ptr() for part in self.scales for t in part)
        return (tuple(t.data_ptr() for t in self.keys), tuple(t.data_ptr() for t in self.values), self.capacity,
                scales)

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
