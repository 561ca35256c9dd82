"""The pool's device buffers, kept by the engine from one session to the next.

A session's ``TieredCache`` takes its layers' L1 buffers (the pool: sinks and window), their page key bounds and
the sparse step's device state (``SparseState``) from a ``PoolBuffers`` at its first token, and gives them back
when it is released. The next session then attends over the same device memory, so the decode steps' CUDA graphs
recorded over it stay valid (a new session on a 128K conversation recorded its sparse step again: 0.54 s of its
first token, docs/benchmarks/e2e.md), and the pool (1.2 GiB of a 4 GiB budget) is
not given back and taken again every session.

Contract:
- ``take(index)`` hands out layer ``index``'s buffers once (``LayerBuffers``), or None when none are kept; the
  caller checks they fit (``LayerBuffers.fits``) and zeroes them (``zeroed``: what a new buffer holds), or else
  makes its own.
- ``give(index, buffers)`` keeps them; ``take_state()`` / ``give_state(state)`` the same for the ``SparseState``.
- ``clear()`` drops everything (the engine planned a new pool); ``holds()``: whether anything is kept; ``ptrs()``:
  the device addresses of what is kept (a step graph recorded over other buffers is stale); ``nbytes()``: their
  size (the KV cache's share of the GPU memory while no session holds them).
One cache at a time takes from a pool; a second cache that finds it empty allocates its own buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerBuffers:
    k: torch.Tensor                 # [kvh, capacity, D] (int8 codes in an int8 pool)
    v: torch.Tensor
    ks: torch.Tensor | None         # an int8 pool's scales, else None
    vs: torch.Tensor | None
    bounds: torch.Tensor            # [kvh, 2D, pages]: the page key bounds (max rows, then min rows)

    def fits(self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, int8: bool) -> bool:
        return (tuple(self.k.shape) == shape and self.k.dtype == dtype and self.k.device == device
                and (self.ks is not None) == int8)

    @torch.inference_mode()
    def zeroed(self) -> "LayerBuffers":
        for t in (self.k, self.v, self.ks, self.vs, self.bounds):
            if t is not None:
                t.zero_()
        return self


class PoolBuffers:
    def __init__(self) -> None:
        self._layers: dict[int, LayerBuffers] = {}
        self._state = None

    def take(self, index: int) -> LayerBuffers | None:
        return self._layers.pop(index, None)

    def give(self, index: int, buffers: LayerBuffers) -> None:
        self._layers[index] = buffers

    def take_state(self):
        state, self._state = self._state, None
        return state

    def give_state(self, state) -> None:
        self._state = state

    def holds(self) -> bool:
        return bool(self._layers) or self._state is not None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self._layers.values()
                   for t in (b.k, b.v, b.ks, b.vs, b.bounds) if t is not None)

    def ptrs(self) -> set[int]:
        return {t.data_ptr() for b in self._layers.values() for t in (b.k, b.v, b.ks, b.vs, b.bounds)
                if t is not None}

    def clear(self) -> None:
        self._layers.clear()
        self._state = None
