"""One sparse decode step off the pool as fixed-shape kernels with no host decisions: so ``DecodeStep`` records the
whole step, attention included, as one CUDA graph when the context is longer than the pool.

The layer-by-layer sparse path (``TieredLayer._sparse``) decides on the host, per layer, which pages to read; its
~30 small launches a layer bound a step by the host (28 tok/s at 128K on a GPU where the resident step runs ~290,
docs/benchmarks/e2e.md). Here every decision is a device tensor: the new token's K/V go to L1 at ``l1_pos``; L1
(sinks + window) is attended up to ``used`` keys (flash's variable-length kernel, with its log-sum-exp); the
off-window pages [``first``, ``last``) are ranked by their Quest bound against the whole ``bounds`` buffer with the
others masked, each KV head's top ``budget`` pages plus the best of the rest make a fixed ``kv_heads x budget``
selection (``kv/quest.py``, as ``TieredLayer._pick``), their L2 slots come from a device slot table, their rows are
read straight from pinned host RAM (``uva.gather_rows``; a host ``index_select`` on a CPU), decoded and attended,
and the two parts merged. The host fills five scalars before each replay (``TieredCache.sparse_view``) and does the
page bookkeeping after it (``TieredCache.advance``), as for a resident step.

A picked page whose only copy is on disk (L3) has slot -1: the step attends the others (the page kernel skips it,
the torch kernels mask it) and notes it in ``missed``, with the ``ahead`` pages ranked just after the selection
that are on disk too; after the step the host hands them to the store's prefetch worker, so L3 reads stay off the
decode path (``TieredCache.promote_missed``, which runs the step again only when it missed a large share).

Contract: a view of ``kv/static.py``'s interface (``key``, ``slot``, ``attend``).
``SparseKV.attend(i, q [Hq, D], k [kvh, 1, D], v, scale) -> [Hq, D]`` for layer ``i`` (k and v None: the
step kernels (``kv/step_kernels.py``) wrote them and attend L1), with the same
result as ``TieredLayer.attend`` on the sparse zero-copy path (the same pages; attention over a set of pages does
not depend on their order). ``key`` names every buffer a recorded graph reads: a new key means record again.
"""

from __future__ import annotations

import torch

from . import attention, codecs, quest, step_kernels, uva


class SparseState:
    """The device scalars and the slot table one cache's sparse steps read, and ``reach`` (per layer: the picked
    pages just behind L1, what the window adapts to) they write; allocated once per cache, so a recorded graph
    keeps reading and writing the same tensors."""

    def __init__(self, device: torch.device, layers: int):
        def scalar(dtype):
            return torch.zeros(1, dtype=dtype, device=device)

        self.l1_pos, self.first, self.last, self.edge = (scalar(torch.long) for _ in range(4))
        self.used = scalar(torch.int32)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)   # L2 slot of page i, i < len
        self.slots_key = None
        self.reach = torch.zeros(layers, dtype=torch.long, device=device)
        # L3 pages (TieredCache.step_slots): the step number, the last step that picked page i (-1: none), and per
        # layer the picked pages, then those ranked just after them, whose slot was -1 (only on disk; -1 elsewhere)
        self.tick = scalar(torch.long)
        self.seen = torch.full((0,), -1, dtype=torch.long, device=device)
        self.missed = torch.full((layers, 0), -1, dtype=torch.long, device=device)
        self.picked = 0   # pages a step picks a layer (the first columns of ``missed``)


    def forget_slots(self) -> None:
        """After a crop or a release (page i may be another page now): the slot table is refilled at the next step
        and the steps' picks are forgotten. The tensors were made inside a step, under inference mode: updating
        them outside it (a crop, a release) needs it too."""
        self.slots_key = None
        with torch.inference_mode():
            self.seen.fill_(-1)


class SparseKV:
    def __init__(self, cache, key: tuple, length: int, budget_pages: int, ahead: int = 0, masked: bool = False):
        self.cache, self.owner, self.key, self.length = cache, cache, key, length
        self.budget_pages = budget_pages
        self.ahead = ahead     # pages ranked just below the selection, fetched from L3 before they are picked
        self.masked = masked   # some page is only in L3: the layer-by-layer kernels mask the missing ones

    @property
    def capacity(self) -> int:
        return self.cache.layers[0].l1_k.shape[1]

    def slot(self, i: int, position: torch.Tensor) -> tuple:
        """Where layer ``i``'s new token goes: L1 at the step's ``l1_pos`` (``position``, the sequence's, is not it)."""
        layer = self.cache.layers[i]
        return self.cache.sparse_state.l1_pos, layer.l1_k, layer.l1_v, None, None

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               position: torch.Tensor | None = None, used: torch.Tensor | None = None,
               split: bool = False) -> torch.Tensor:
        """(``kv/static.py``'s view interface; ``position`` and ``used`` are the step's own here: ``l1_pos`` and
        ``used`` of ``sparse_state``.)"""
        cache = self.cache
        layer, st = cache.layers[i], cache.sparse_state
        if k is not None:   # (None: the step kernels' rope_write has written them)
            layer.l1_k.index_copy_(1, st.l1_pos, k)
            layer.l1_v.index_copy_(1, st.l1_pos, v)
        kvh = layer.l1_k.shape[0]
        hq, d = q.shape
        qg = q.reshape(kvh, hq // kvh, 1, d)
        # Quest over every column of the bounds buffer, the pages outside [first, last) masked out
        if k is None:   # the step kernels (k, v written by them): one launch
            bound = step_kernels.page_bounds(q, layer.bounds, st.first, st.last)
        else:
            page = torch.arange(layer.bounds.shape[2], device=q.device)
            bound = quest.bound(qg[:, :, 0], layer.bounds).masked_fill((page < st.first) | (page >= st.last),
                                                                        float("-inf"))
        n = kvh * self.budget_pages
        ranked = quest.select(bound, self.budget_pages, self.ahead)   # the selection, then the next best
        # -1: a page only in L3, attended without (masked) and fetched for the next steps (TieredCache.step_slots)
        slots = cache.step_slots(i, ranked, n)
        pages = ranked[:n]
        arena = cache.store.arena
        st.reach[i].copy_((pages >= st.edge).sum())   # TieredCache.sparse_view points last_reach here
        if k is None:   # the step kernels: L1 and the pages in one attention, pages decoded as they are read
            if step_kernels.PageRead.takes(arena.layout, cache.page_size, d):
                read = step_kernels.PageRead(slots, arena.data[i], arena.layout, cache.page_size)
                return step_kernels.decode_attention(q, layer.l1_k, layer.l1_v, st.used, scale, pages=read)
            o, lse = step_kernels.decode_attention(q, layer.l1_k, layer.l1_v, st.used, scale, lse=True)
            acc = (o.reshape(kvh, hq // kvh, 1, d), lse.reshape(kvh, hq // kvh, 1))
        else:
            acc = attention.prefix_segment(qg, layer.l1_k, layer.l1_v, st.used, scale)
        at = slots.clamp(min=0)
        if q.is_cuda:
            rows = uva.gather_rows(arena.data[i], at, q.device)
        else:
            rows = arena.data[i].index_select(0, at)
        kp, vp = layer.as_kv(*codecs.decode(arena.fields_of(rows), layer.dtype))
        if self.masked:   # a page of this sequence is only on disk: what was not in L2 weighs nothing
            visible = (slots >= 0).repeat_interleave(cache.page_size).unsqueeze(0)
            part = attention.partial_attention(qg, kp, vp, scale, visible)
        else:
            part = attention.segment(qg, kp, vp, scale)
        acc = attention.merge_into(acc, part)
        return acc[0].reshape(hq, d).to(q.dtype)
