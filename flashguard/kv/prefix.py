"""Prefix sharing, cropping and release of a TieredCache: where a sequence's pages come from and where they go.

``PrefixAndCrop`` is a part of ``TieredCache`` (a base class of it, kept in its own file); it reads and writes the
cache's state like the cache's other methods do.

Contract:
- ``adopt_prefix(ids, dtype, device) -> tokens``: a new sequence takes the stored pages of the longest page-aligned
  prefix of ``ids`` (a reference each) and refills L1 from them (``_rebuild_l1``); the rest is prefilled.
- ``crop_to(length)`` / ``crop(max_length)`` (transformers' name) / ``undo_to(length)``: the sequence ends at
  ``length``; pages past it are given back, L1 rebuilt where the window moved.
- ``release(keep_pages=True)``: every reference goes back to the store (resident full pages written to it first
  with ``keep_pages``, so the next sequence with the same prefix adopts them); the pool's buffers go back to
  ``pool``. ``reset()``: release without keeping.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import codecs
from .disk import PageLost
from .store import namespace_for, page_key


class PrefixAndCrop:
    # ---- prefix sharing and cropping -----------------------------------------------------------
    def adopt_prefix(self, token_ids, model_dtype: torch.dtype, device) -> int:
        """Reuse stored pages for the longest page-aligned prefix of ``token_ids``; returns tokens reused.

        Must be called on an empty cache with a store. The L1 sinks and window are filled from the pages.
        """
        if self.length or self.store is None:
            return 0
        if not self.namespace:
            self.namespace = namespace_for(self.model_id, model_dtype, self.config)
        ids = [int(t) for t in token_ids]
        p, parent, keys = self.page_size, b"root", []
        for a in range(0, len(ids) - p + 1, p):
            key = page_key(parent, ids[a:a + p], self.namespace)
            if not self.store.acquire(key):
                break
            keys.append(key)
            parent = key
        if not keys:
            return 0
        self.page_keys = keys
        self.stored = [True] * len(keys)
        self.token_ids = ids[:len(keys) * p]
        self._rebuild_l1(len(keys) * p, model_dtype, torch.device(device))
        return self.length

    @torch.inference_mode()
    def _rebuild_l1(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        """Set every layer to ``length`` tokens, refilling sinks and window from stored pages: runs of up to
        ``REBUILD_PAGES`` consecutive pages, gathered from L2 in one copy (pages only on disk read ahead in
        parallel), decoded on the device and written into every layer's L1 buffer (the peak is the buffer plus
        one run)."""
        p, n_pages = self.page_size, len(self.page_keys)
        win_start = max(self.sink_tokens, (max(0, length - self.window) // p) * p)
        sink_end = min(length, self.sink_tokens)
        summaries = torch.stack([self.store.summary(k) for k in self.page_keys]).to(device, dtype) if n_pages else None
        for li, layer in enumerate(self.layers):
            if not layer.is_initialized:
                kvh, d = self._kv_shape()
                z = torch.zeros((1, kvh, 0, d), dtype=dtype, device=device)
                layer.lazy_initialization(z, z)
            layer.length, layer.win_start = 0, self.sink_tokens   # nothing of the old content is kept
            layer.reserve(sink_end + max(0, length - win_start))
            layer.win_start, layer.length = win_start, length
            layer.n_pages = 0
            if summaries is not None:
                layer.add_bounds(summaries[:, li])
            layer.heat = [0.0] * n_pages
            layer.hot.clear()
        spans = [(0, sink_end, 0), (win_start, length, self.sink_tokens - win_start)]   # (first, end, shift)
        wanted = sorted({i for a, b, _ in spans if b > a for i in range(a // p, -(-b // p))})
        runs: list[list[int]] = []   # consecutive pages, REBUILD_PAGES at a time: one write per layer and run
        for idx in wanted:
            if runs and runs[-1][-1] == idx - 1 and len(runs[-1]) < self.REBUILD_PAGES:
                runs[-1].append(idx)
            else:
                runs.append([idx])
        self.store.read_ahead([self.page_keys[i] for i in wanted])   # pages only on disk: read in parallel
        for run in runs:
            slots = self.store.slots([self.page_keys[i] for i in run])   # (promoted from L3 where needed)
            if slots is None:
                raise PageLost(f"a page of pages {run[0]}-{run[-1]} of this sequence is gone from the store")
            k, v = self._pages_kv(slots, dtype, device)   # [layers, kvh, len(run) * page_size, D]
            first = run[0] * p
            for a, b, shift in spans:
                lo, hi = max(a, first), min(b, (run[-1] + 1) * p)
                if lo >= hi:
                    continue
                for li, layer in enumerate(self.layers):
                    layer.write(lo + shift, k[li][:, lo - first:hi - first], v[li][:, lo - first:hi - first])
        self.length = length

    REBUILD_PAGES = 16   # pages decoded together when L1 is refilled (an int8 pool quantizes once per run)

    def _pages_kv(self, slots: list[int], dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[layers, kv_heads, len(slots) * page_size, D]`` of L2 pages: gathered (every layer at once),
        copied to ``device`` and decoded there."""
        k, v = codecs.decode(self.store.arena.gather(None, slots, device), dtype)   # [layers, n, kvh, p, D]
        return k.transpose(1, 2).flatten(2, 3), v.transpose(1, 2).flatten(2, 3)

    def _kv_shape(self) -> tuple[int, int]:
        c = self.model_config.get_text_config() if hasattr(self.model_config, "get_text_config") else self.model_config
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_key_value_heads, d

    def crop(self, max_length: int) -> None:
        """transformers' convention: ``max_length`` < 0 drops that many tokens, else keeps ``max_length``. Once for
        the whole cache (``Cache.crop`` would crop every layer, and each would cut the shared length again)."""
        self.crop_to(self.length + max_length if max_length < 0 else max_length)

    def crop_to(self, length: int) -> None:
        """Keep the first ``length`` tokens."""
        self._crop_to(length)

    def _crop_to(self, length: int) -> None:
        if length >= self.length:
            return
        self._adapted_at = -1
        if self.sparse_state is not None:   # page i may be another page after the crop: refill the slot table
            self.sparse_state.forget_slots()
        self._warmed_at = -1
        if self.layers[0].is_initialized:
            self.settle_pages()
        length = max(0, length)
        keep = length // self.page_size
        # the full pages the crop drops that are only in L1 (the window) go to the store first, as ``release`` does:
        # a later sequence with the same prefix adopts them (a crop to a few tokens, e.g. the output rail judging a
        # reply in windows, otherwise lost the whole window: 41K tokens re-prefilled at 128K)
        keyed = min(self.public_pages(), len(self.token_ids) // self.page_size)   # pages keyed by their token ids
        if self.store is not None and self.layers[0].is_initialized and keyed > keep:
            self._store_pages(keep, keyed, to_peers=False)
        if self.private_from is not None and length <= self.private_from:
            self.private_from = None
        dropped = [k for k, kept in zip(self.page_keys[keep:], self.stored[keep:]) if kept]
        l0 = self.layers[0]
        if length >= l0.win_start or length <= self.sink_tokens:
            # still inside L1 (the window, or the sinks): just cut (L1 is a prefix of its buffer)
            for layer in self.layers:
                layer.length = length
                if length <= self.sink_tokens:
                    layer.win_start = self.sink_tokens
            self.length = length
        else:  # below the window: refill L1 from the stored pages (the partial last page included)
            n = -(-length // self.page_size)
            # references past the partial page go back now: the refill can raise PageLost, and release() then
            # gives back exactly what page_keys / stored still list
            for key, kept in zip(self.page_keys[n:], self.stored[n:]):
                if kept:
                    self.store.release(key)
            dropped = [k for k, kept in zip(self.page_keys[keep:n], self.stored[keep:n]) if kept]
            self.page_keys, self.stored = self.page_keys[:n], self.stored[:n]
            self._rebuild_l1(length, l0.dtype, l0.device)
        for layer in self.layers:
            layer.n_pages, layer.heat = min(layer.n_pages, keep), layer.heat[:keep]
            layer.hot = OrderedDict((p, slot) for p, slot in layer.hot.items() if p < keep)
        self.page_keys, self.stored = self.page_keys[:keep], self.stored[:keep]
        # page indices from ``keep`` on will name other pages: their remembered L2 slots are stale
        self._slot_table = {i: slot for i, slot in self._slot_table.items() if i < keep}
        if self.peers is not None:
            self.peers.forget_from(keep)    # those page indices will name other pages on the peers too
        self._dev_slots = None
        for key in dropped:
            self.store.release(key)
        self.token_ids = self.token_ids[:length]

    def undo_to(self, length: int) -> None:
        """After a forward that failed part-way (some layers appended the new tokens, others not): every layer
        back to ``length`` tokens. Pages are completed only between forwards, so only L1 lengths changed."""
        for layer in self.layers:
            if layer.is_initialized and layer.length > length:
                layer.length = length
        self.length = min(self.length, length)
        if self.private_from is not None and length <= self.private_from:
            self.private_from = None

    def public_pages(self) -> int:
        """Full pages keyed by content (before any private forward's positions: ``private_from``)."""
        if self.private_from is None:
            return len(self.page_keys)
        return min(len(self.page_keys), self.private_from // self.page_size)

    def release(self, keep_pages: bool = True) -> None:
        """The end of this cache: with ``keep_pages`` its full pages still only in L1 are written to the store
        first (a later sequence with the same prefix adopts them), then every reference it holds is given back.
        Idempotent; the cache is empty afterwards."""
        self.peers = None            # the next session resets the peers: nothing to send them now
        if self.sparse_state is not None:
            self.sparse_state.forget_slots()
        self._warmed_at, self._on_disk = -1, False
        if keep_pages and self.store is not None and self.layers[0].is_initialized and self.page_keys:
            try:
                self.settle_pages()
                self._store_pages(0, self.public_pages())
            except Exception:  # noqa: BLE001 - keeping pages is an optimisation; the references must go back
                pass
        if self.store is not None:
            for key, kept in zip(self.page_keys, self.stored):
                if kept:
                    self.store.release(key)
        self.page_keys, self.stored, self.token_ids, self.length = [], [], [], 0
        self.private_from = None
        if self.pool is not None:   # the next session takes them (kv/pool.py)
            from .pool import LayerBuffers

            for layer in self.layers:
                if layer.is_initialized and layer.l1_k is not None:
                    self.pool.give(layer.index, LayerBuffers(layer.l1_k, layer.l1_v, layer.l1_ks, layer.l1_vs,
                                                             layer.bounds))
            if self.sparse_state is not None:
                self.pool.give_state(self.sparse_state)
        self.sparse_state = None
        for layer in self.layers:
            layer.is_initialized = False
            layer.length = 0
            layer.hot.clear()
            layer.l1_k = layer.l1_v = layer.l1_ks = layer.l1_vs = layer.hot_k = layer.hot_v = layer.bounds = None

    def reset(self) -> None:
        """transformers' Cache.reset: forget the sequence, keep nothing."""
        self.release(keep_pages=False)
