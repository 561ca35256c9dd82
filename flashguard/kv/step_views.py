"""The decode step's side of a TieredCache (``kv/static.py``'s interface): what one step attends over as one graph.

``StepViews`` is a part of ``TieredCache`` (a base class of it, kept in its own file); it reads and writes the
cache's state like the cache's other methods do.

Contract:
- ``decode_view(graphs, sparse)``: the pool as a ``StaticKV`` while the whole sequence is resident in it
  (``static_view``), else, with ``sparse``, a ``SparseKV`` off it (``sparse_view``: the sparse step as fixed-shape
  kernels over the pool, its page bounds and the L2 arena read zero-copy); None: the step runs layer by layer
  (``attend_layer``: ``update``, then the layer's own ``attend``).
- After a one-graph step: ``promote_missed()`` (pages it picked were only on disk: queued on the store's prefetch
  worker, or promoted at once and True: run the step again) and ``advance(n)`` (the tokens it wrote, counted; pages
  it filled settle as after ``update``).
- ``step_slots(i, ranked, n)``: the L2 slot of each page the sparse step ranked (-1: only on disk), its misses noted
  for ``promote_missed``; the device slot table follows the store's moves (``_update_slots``).
"""

from __future__ import annotations

import torch

from .disk import PageLost
from .layer import index_tensor
from .static import GraphKey, StaticKV


class StepViews:
    # ---- the decode step's interface (kv/static.py) ---------------------------------------------
    def decode_view(self, graphs: bool, sparse: bool):
        """The pool as a StaticKV while the sequence is resident (``static_view``), else, with ``sparse``, a
        SparseKV off it (``sparse_view``); None: layer by layer. Only with ``graphs``."""
        if not graphs:
            return None
        view = self.static_view()
        return self.sparse_view() if view is None and sparse else view

    def attend_layer(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Layer ``i``'s new ``k``, ``v`` appended (``update``) and ``q`` ``[1, Hq, 1, D]`` attended over its
        tiers: ``[Hq, 1, D]``."""
        self.update(k, v, i)
        return self.layers[i].attend(q[0], scale)

    def static_view(self):
        """The L1 buffers as a ``StaticKV`` when the whole sequence is resident in them, in order, with room for
        one more token (``DecodeStep`` then runs the whole step, attention included, as one CUDA graph); None
        otherwise. Page bookkeeping after such a step is ``advance``."""
        layers = self.layers
        l0 = layers[0]
        if not l0.is_initialized or not l0.resident or l0.l1_k.shape[1] <= self.length + 1:
            return None

        # the attention kernel is sized by the capacity it is shown: show a power of two above the length (a few
        # graphs per conversation), not the whole pool (a 128K pool would cost a 4K conversation 15% of its step)
        view = min(l0.l1_k.shape[1], max(self.STATIC_MIN, 1 << (self.length + 1).bit_length()))
        scales = None
        if l0.l1_ks is not None:
            scales = ([layer.l1_ks[:, :view] for layer in layers], [layer.l1_vs[:, :view] for layer in layers])
        return StaticKV([layer.l1_k[:, :view] for layer in layers], [layer.l1_v[:, :view] for layer in layers],
                        self.length, owner=self, scales=scales)

    STATIC_MIN = 4096   # the smallest capacity a whole-step graph attends over

    def sparse_view(self):
        """A ``SparseKV`` (``sparse_step.py``) when a decode step off the pool can run as one CUDA graph: sparse
        policy, a 16-bit pool with room for one more token, more off-window pages than one selection takes, and
        every page readable by a kernel (zero-copy from pinned L2 on a GPU; the host arena on a CPU, where no
        page is in L3). Fills the step's device scalars; ``advance`` does the bookkeeping after it. None
        otherwise (the layer-by-layer path)."""
        l0 = self.layers[0]
        if self.config.policy != "sparse" or not l0.is_initialized or l0.resident or self.int8 or self.store is None:
            return None
        self.settle_pages()   # what the first layer's ``update`` does before a step: pages keyed, the window adapted
        if l0.l1_k.shape[1] <= l0.l1_len:
            return None
        p, kvh = self.page_size, l0.l1_k.shape[0]
        first, last = self.sink_tokens // p, l0.win_start // p
        budget = max(1, self.config.budget_tokens // p)
        if last - first <= kvh * budget:
            return None
        dev = l0.device
        if dev.type == "cuda" and not self._zero_copy_base(dev):
            return None
        from .sparse_step import SparseKV, SparseState

        if self.sparse_state is None:
            kept = self.pool.take_state() if self.pool is not None else None
            fits = kept is not None and kept.reach.device == dev and kept.reach.shape[0] == self.num_layers
            self.sparse_state = kept if fits else SparseState(dev, self.num_layers)
        st = self.sparse_state
        for i, layer in enumerate(self.layers):   # the window adapts to what the replayed graphs write
            layer.last_reach = st.reach[i]
        if self._on_disk:   # pages the prefetch worker has read since the last step go to L2 (the table below)
            self.store.install_prefetched()
        if st.slots_key != (self.store.moves, last) and not self._update_slots(st, last):
            # L2 slot of every page, -1 for a page only in L3: a step that picks one attends without it and
            # records it in ``missed``; the host has it read on the prefetch worker (``promote_missed``)
            log_end = self.store.slot_log_end()
            slots = self.store.peek_slots(self.page_keys[:last])
            if slots is None:
                raise PageLost("a page of this sequence is gone from the store")
            if st.slots.shape[0] < last:   # grown by doubling: a new buffer (and graph) only now and then
                cap = max(last, 2 * st.slots.shape[0], 256)
                st.slots = torch.zeros(cap, dtype=torch.long, device=dev)
                seen = torch.full((cap,), -1, dtype=torch.long, device=dev)
                seen[:st.seen.shape[0]] = st.seen
                st.seen = seen
            st.slots[:last].copy_(index_tensor(slots, dev))
            st.slots_key = (self.store.moves, last)
            self._on_disk = -1 in slots
            self._host_slots, self._slots_log_at = slots, log_end
            self._slot_of_key = {key: i for i, key in enumerate(self.page_keys[:last])}
        ahead = max(1, kvh * budget // self.AHEAD_SHARE)
        ahead = min(ahead, last - first - kvh * budget)
        if st.missed.shape != (self.num_layers, kvh * budget + ahead):
            st.missed = torch.full((self.num_layers, kvh * budget + ahead), -1, dtype=torch.long, device=dev)
        st.picked = kvh * budget   # (the first columns of ``missed``; the rest: the pages ranked after them)
        if self.length - self._warmed_at >= self.WARM_EVERY:
            self._warm_picked()
        for t, value in ((st.l1_pos, l0.l1_len), (st.used, l0.l1_len + 1), (st.first, first), (st.last, last),
                         (st.edge, last - self.adapt_pages), (st.tick, self.length)):
            t.fill_(value)
        self.page_reads += kvh * budget * self.num_layers
        key = GraphKey("sparse", tuple((layer.l1_k.data_ptr(), layer.l1_v.data_ptr(), layer.bounds.data_ptr(),
                                        layer.bounds.shape[2]) for layer in self.layers),
                       tables=(self.store.arena.data.data_ptr(), st.l1_pos.data_ptr(), st.slots.data_ptr(),
                               st.seen.data_ptr(), st.missed.data_ptr()),
                       variant=(budget, l0.l1_k.shape[1], ahead, self._on_disk))
        return SparseKV(self, key, self.length, budget, ahead=ahead, masked=self._on_disk)

    SLOT_UPDATE_MAX = 256   # slot changes applied one by one; more: the whole table is asked for again

    def _update_slots(self, st, last: int) -> bool:
        """Bring the sparse step's slot table up to date from the store's log of slot changes (a few pages a
        step come and go while pages are on disk; asking for all 2,048 slots at 128K cost ~1.2 ms a step).
        False when it cannot (a new table, pages added, a page gone, too many changes): ask for all."""
        if st.slots_key is None or st.slots_key[1] != last or self._host_slots is None:
            return False
        changes = self.store.slot_changes(self._slots_log_at)
        if changes is None or len(changes) > self.SLOT_UPDATE_MAX:
            return False
        table, host, moved = self._slot_of_key, self._host_slots, {}
        for key, slot in changes:
            i = table.get(key)
            if i is None:
                continue
            if slot < -1:   # gone from the store: the full table says so (PageLost)
                return False
            moved[i] = slot
        if moved:
            for i, slot in moved.items():
                host[i] = slot
            where = index_tensor([list(moved), list(moved.values())], st.slots.device)   # one copy for both
            st.slots.index_copy_(0, where[0], where[1])
            self._on_disk = -1 in host
        self._slots_log_at += len(changes)
        st.slots_key = (self.store.moves, last)
        return True

    WARM_EVERY = 8   # decode steps between two reports of the pages the one-graph steps read (store heat)
    AHEAD_SHARE = 8  # the sparse step looks 1/8 of its selection past it for pages to fetch from L3 early

    def step_slots(self, i: int, ranked: torch.Tensor, n: int) -> torch.Tensor:
        """Inside the one-graph sparse step (layer ``i``): the L2 slots of the ``n`` pages it picked, the first
        ``n`` of ``ranked`` (a device index; -1 for a page whose only copy is in L3, which the step attends
        without), noting them as read at this step (``seen``: the store's heat, ``_warm_picked``), and in
        ``missed`` those of all ``ranked`` (the picked ones and the next best) that are only in L3: after the
        step the host has them fetched (``promote_missed``). Fixed shapes, no host decision."""
        st = self.sparse_state
        slots = st.slots[ranked]
        st.missed[i].copy_(torch.where(slots < 0, ranked, -1))
        st.seen.index_copy_(0, ranked[:n], st.tick.expand(n))
        return slots[:n]

    def _warm_picked(self) -> None:
        """Tell the store which pages the one-graph steps read since the last report (zero-copy reads bypass it),
        so its policy keeps them in L2 and demotes what decoding no longer reads."""
        st = self.sparse_state
        n = min(st.seen.shape[0], len(self.page_keys))
        seen = st.seen[:n].cpu()
        picked = torch.nonzero(seen >= self._warmed_at).flatten().tolist() if self._warmed_at >= 0 else \
            torch.nonzero(seen >= 0).flatten().tolist()
        self._warmed_at = self.length
        if picked:
            self.store.warm([self.page_keys[p] for p in picked])

    MAX_RETRIES = 4
    REPLAY_SHARE = 1 / 32   # a step that found more than this share of its picked pages only on disk runs again

    def promote_missed(self) -> bool:
        """After a one-graph sparse step, its pages whose only copy was in L3. In the steady state a few of the
        picked pages are (the selection drifts onto a page that went to disk): the step attended the others, the
        missing ones and those ranked just after the selection are queued on the store's prefetch worker, and are
        in L2 for the next steps (``install_prefetched`` in ``sparse_view``): no disk read on the decode path,
        False. When the step missed more than ``REPLAY_SHARE`` of what it picked (a new session whose pages all
        went to disk), they are promoted now (one disk read each) and True says: run the step again, exactly
        (``sparse_view`` then replay: it writes the same new token over what the first one wrote). False at no
        cost while no page of this sequence is in L3."""
        st = self.sparse_state
        if st is None or not self._on_disk or st.missed.numel() == 0:
            return False
        # while the step runs on the GPU: what the readers finished goes to L2 now (a page written to a slot the
        # running step may still read is waited for by the arena; the step's slot table changes in stream order)
        self.store.install_prefetched()
        missed = st.missed.to("cpu", copy=True)   # [layers, picked + ahead] (a copy: filled below)
        st.missed.fill_(-1)
        picked = missed[:, :st.picked]
        lost = int((picked >= 0).sum())
        if lost == 0 and int(missed.max()) < 0:
            return False
        if lost > self.REPLAY_SHARE * picked.numel() and self._retried_at != (self.length, self.MAX_RETRIES):
            tries = self._retried_at[1] + 1 if self._retried_at[0] == self.length else 1
            self._retried_at = (self.length, tries)
            # every page the step picked, in one call: the missed ones are promoted (one disk read each) and none
            # of them is demoted meanwhile (L2 goes over budget rather than drop a page this step reads)
            seen = st.seen[:min(st.seen.shape[0], len(self.page_keys))].cpu()
            keys = [self.page_keys[p] for p in torch.nonzero(seen == self.length).flatten().tolist()]
            self.store.warm(keys)
            if self.store.slots(keys) is None:
                raise PageLost("a page of this sequence is gone from the store")
            return True
        self.pages_missed += lost
        wanted = torch.unique(missed[missed >= 0]).tolist()
        self.store.prefetch([self.page_keys[p] for p in wanted if p < len(self.page_keys)])
        return False

    def advance(self, n: int = 1) -> None:
        """``n`` tokens were written into every layer's L1 buffer outside ``update`` (a whole-step graph): count
        them; while resident, complete the pages they filled (off the pool the next ``sparse_view`` or ``update``
        settles, once per step as after ``update``)."""
        for layer in self.layers:
            layer.length += n
        self.length += n
        if self.store is not None:
            self.store.tick()   # one forward (the graph's step), as ``update`` counts one
        # off the pool (a sparse step), the next step's ``sparse_view`` or ``update`` settles, as after ``update``
        if self.length // self.page_size > len(self.page_keys) and self.layers[0].resident:
            self.settle_pages()
