"""TieredCache: a transformers ``Cache`` whose pages live in L1 (device), L2 (host RAM) and L3 (disk).

Per layer (``TieredLayer``), L1 holds the attention sinks (the first ``sink_tokens``) and the recent window
(``l1_tokens``, growing up to ``l1_max_tokens`` when queries keep reaching just behind it) in one buffer (the
pool), in the model's 16-bit dtype or as int8 codes and scales (``kv.l1_codec``, ``int8_pool.py``). Pages are keyed as they fill; a page is written to the shared ``PageStore`` (L2 int8,
spilling to L3 int4 + zstd) only when it leaves the window (sink pages at once), or when the cache is released
with ``keep_pages``. So while the sequence fits the window (``resident``) nothing is encoded or copied, attention
is one fused call over the buffer, and ``static_view`` offers the buffers to ``DecodeStep``'s one-graph step.
Nothing is ever dropped from the sequence: every full page is in L1, in the store, or both (``stored``).

Attention (``attention.py``) covers: sinks + window (causal inside the current chunk) and the pages between
them: all of them (``exact``, fetched in blocks), or, when decoding one token with the ``sparse`` policy, the
top pages by their Quest upper bound ``sum_d max(q_d min_d, q_d max_d)`` within ``budget_tokens`` per KV head.
Pages fetched for sparse decoding on the host path stay on the device in a small hot set, evicted by heat.

Use::

    cache = TieredCache(model.config, CacheConfig(...)).attach(model)
    cache.begin(ids, start=cache.length); model(input_ids=ids, past_key_values=cache); cache.end()
    # (kv/session.py's ``TieredSession.forward`` does exactly that, with undo on a failure)
    model.generate(input_ids, past_key_values=cache, ...)            # plain transformers: pages private

``attach`` switches the model to the ``tiered_kv`` attention (any number of caches may share a model). The
forward protocol is ``begin(token_ids, start)`` before a forward and ``end()`` after it: the ids make page keys
content hashes, so another cache on the same store reuses the pages of a common prefix (``adopt_prefix``), and
``end`` is the one point where a forward's pages settle (keyed, bounded, stored as they leave the window). Without
it (plain ``generate``) pages are private to this cache and settle at the next forward's first layer.

A ``TieredLayer`` reads its cache's settings and calls it only through public methods: ``layer_initialized``,
``settle_pages``, ``l2_slots`` and ``pages_to_peers`` are the layers' interface (no private method of the cache
is called from outside it).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..config import CacheConfig
from . import FETCH_BLOCK_TOKENS, FETCH_BLOCK_TOKENS_CPU, attention, codecs, int8_pool, quest, uva
from .disk import PageLost  # the engine catches it from here
from .peer import PeerLostError
from .static import GraphKey, StaticKV

log = logging.getLogger("flashguard")
from .store import PageStore, namespace_for, page_key


SPARSE_CHUNK_TOKENS = 64   # a prompt chunk this short attends the pages Quest selects (sparse policy, past the pool)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """An index tensor on ``device``; on a GPU copied from pinned memory without waiting (a copy from pageable
    memory synchronises the stream first)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class TieredLayer(CacheLayerMixin):
    """One layer's L1 buffer (sinks + window), its pages' key bounds and hot set, and its attention. Its cache
    drives it through public methods (``reserve``, ``write``, ``tokens``, ``add_bounds``, ``add_key_bounds``,
    ``page_bounds``, ``drop_window_pages``, ``trim``); it calls its cache only through the cache's public ones."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner: "TieredCache", index: int):
        super().__init__()
        self.owner = owner
        self.index = index
        self.length = 0
        self.l1_k = self.l1_v = None            # [kvh, capacity, D]: sinks at [0, S), the window right after
        self.l1_ks = self.l1_vs = None          # int8 pool only: the codes' scales [kvh, capacity, D / GROUP]
        self.win_start = 0
        self.bounds = None                      # [kvh, 2D, capacity]: per full page key max (rows :D), min (D:)
        self.n_pages = 0                        # full pages with bounds (columns of ``bounds`` in use)
        self.hot: "OrderedDict[int, int]" = OrderedDict()   # hot page -> slot of the hot arena
        self.hot_k = self.hot_v = None          # [slots, kvh, P, D] preallocated at the first sparse fetch
        self.last_reach = 0                     # pages selected at the last sparse step that sit just behind L1
        self.heat: list[float] = []             # per full page: reads lately, on the host (no device syncs)
        self.dtype = self.device = None         # the model's K/V dtype and device, from the first update

    # ---- transformers CacheLayerMixin ---------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        kvh, d = key_states.shape[1], key_states.shape[-1]
        kept = self.owner.pool.take(self.index) if self.owner.pool is not None else None
        if kept is not None and kept.fits((kvh, self._full(), d), torch.int8 if self.owner.int8 else self.dtype,
                                          self.device, self.owner.int8):
            # the last session's buffers (kv/pool.py): the step graphs recorded over them stay valid
            kept = kept.zeroed()
            self.l1_k, self.l1_v, self.l1_ks, self.l1_vs, self.bounds = kept.k, kept.v, kept.ks, kept.vs, kept.bounds
        elif self.owner.int8:
            self.l1_k = key_states.new_zeros((kvh, 0, d), dtype=torch.int8)
            self.l1_v = key_states.new_zeros((kvh, 0, d), dtype=torch.int8)
            self.l1_ks = key_states.new_zeros(int8_pool.scale_shape(kvh, 0, d), dtype=torch.float16)
            self.l1_vs = key_states.new_zeros(int8_pool.scale_shape(kvh, 0, d), dtype=torch.float16)
        else:
            self.l1_k = key_states.new_zeros((kvh, 0, d))
            self.l1_v = value_states.new_zeros((kvh, 0, d))
        if kept is None or self.l1_k is not kept.k:
            self.bounds = key_states.new_zeros((kvh, 2 * d, 64))
        self.n_pages = 0
        self.heat = []
        self.win_start = self.owner.sink_tokens
        self.is_initialized = True
        self.owner.layer_initialized(key_states)
        # the hot set must hold one sparse selection: budget pages for each KV head (their union)
        self.owner.hot_pages = max(self.owner.hot_pages, kvh * (self.owner.config.budget_tokens // self.owner.page_size))

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.index == 0:
            if not self.owner.driven:   # plain ``generate``: the previous forward is complete in every layer now
                self.owner.settle_pages()
            if self.owner.store is not None:
                self.owner.store.tick()   # one forward: the tier policy's clock ("read lately")
        self._append(key_states[0], value_states[0])
        if self.index == self.owner.num_layers - 1:
            self.owner.length = self.length
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.length + q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """A layer cannot be cropped alone (the sequence's pages are shared by every layer): ``TieredCache.crop``."""
        raise NotImplementedError("crop a TieredCache as a whole: TieredCache.crop or crop_to")

    def reset(self) -> None:
        self.owner.reset()

    # ---- L1: sinks and window in one buffer ---------------------------------------------------
    @property
    def l1_len(self) -> int:
        """Tokens in L1: the sinks, then (once they are full) the window [win_start, length)."""
        return min(self.length, self.owner.sink_tokens) + max(0, self.length - self.win_start)

    @property
    def resident(self) -> bool:
        """Every token of the sequence is in L1, in order (no page has left the window)."""
        return self.win_start == self.owner.sink_tokens or self.length <= self.owner.sink_tokens

    @property
    def win_k(self) -> torch.Tensor:
        s = self.owner.sink_tokens
        return self.l1_k[:, s:s + max(0, self.length - self.win_start)]

    def reserve(self, tokens: int) -> None:
        """Make the L1 buffer hold ``tokens``. Its full size is the window it serves (sinks + window + two pages;
        with the owner preallocating, the largest window: ``l1_max_tokens``): taken at once when the owner
        preallocates (the engine on a GPU: the pool is planned memory, and growing in steps would need old + new
        at once), else grown by doubling. A long prefill chunk may grow it further;
        ``trim`` shrinks it back."""
        cap = self.l1_k.shape[1]
        if tokens <= cap:
            return
        full = self._full()
        self._resize(max(tokens, full if self.owner.preallocate else min(full, max(2 * cap, 1024))))

    def _full(self) -> int:
        """The buffer's size for the window it serves: sinks + window + two pages; preallocated, for the largest
        window (``l1_max_tokens``), so that the adaptive window grows without a resize (which copied the layer's
        pool and, past the pool, made a step fall back to the layer-by-layer path and record its graph again:
        once a page of window growth at 128K)."""
        owner = self.owner
        full = owner.sink_tokens + owner.window + 2 * owner.page_size
        if owner.preallocate:
            full = max(full, owner.sink_tokens + (owner.config.l1_max_tokens or 0) + 2 * owner.page_size)
        return full

    @torch.inference_mode()  # the buffers may be inference tensors (made by the engine) in a plain generate()
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n, new = self.l1_len, k.shape[1]
        self.reserve(n + new)
        self.write(n, k, v)
        self.length += new

    def write(self, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V ``[kvh, T, D]`` into L1 positions [at, at + T) (quantized in an int8 pool)."""
        b = at + k.shape[1]
        if self.l1_ks is None:
            self.l1_k[:, at:b] = k
            self.l1_v[:, at:b] = v
            return
        self.l1_k[:, at:b], self.l1_ks[:, at:b] = int8_pool.quantize(k)
        self.l1_v[:, at:b], self.l1_vs[:, at:b] = int8_pool.quantize(v)

    def _read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of L1 positions [a, b) in the model's dtype: views of a 16-bit pool, dequantized copies of an int8
        one."""
        if self.l1_ks is None:
            return self.l1_k[:, a:b], self.l1_v[:, a:b]
        return (int8_pool.dequantize(self.l1_k[:, a:b], self.l1_ks[:, a:b], self.dtype),
                int8_pool.dequantize(self.l1_v[:, a:b], self.l1_vs[:, a:b], self.dtype))

    @torch.inference_mode()
    def _resize(self, capacity: int) -> None:
        n = self.l1_len
        # zeros, not empty: the whole-step graph's attention reads the unused tail under a mask where flash's
        # variable-length kernel is missing (CPU, pre-Ampere GPUs), and 0 x NaN of stale memory is NaN
        k = self.l1_k.new_zeros((self.l1_k.shape[0], capacity, self.l1_k.shape[2]))
        v = self.l1_v.new_zeros(k.shape)
        k[:, :n], v[:, :n] = self.l1_k[:, :n], self.l1_v[:, :n]
        self.l1_k, self.l1_v = k, v
        if self.l1_ks is not None:
            ks = self.l1_ks.new_zeros((k.shape[0], capacity, self.l1_ks.shape[2]))
            vs = self.l1_vs.new_zeros(ks.shape)
            ks[:, :n], vs[:, :n] = self.l1_ks[:, :n], self.l1_vs[:, :n]
            self.l1_ks, self.l1_vs = ks, vs

    @torch.inference_mode()
    def drop_window_pages(self, n: int) -> None:
        """The oldest ``n`` window pages leave L1 (they are in the store already): the window shifts left once by
        ``n`` pages (a prefill chunk's 32 pages shifted a 32K window 32 times: 2.8 s of a 98K-token prefill on a
        GPU)."""
        s, shift, nw = self.owner.sink_tokens, n * self.owner.page_size, self.length - self.win_start
        for t in (self.l1_k, self.l1_v, self.l1_ks, self.l1_vs):
            if t is not None:
                t[:, s:s + nw - shift] = t[:, s + shift:s + nw].clone()
        self.win_start += shift

    def trim(self) -> None:
        """After a long prefill chunk, give the device back the buffer's extra room."""
        want = self._full()
        if self.l1_k.shape[1] > want + self.owner.page_size and self.l1_len <= want:
            self._resize(want)

    def tokens(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of tokens [start, end) that are in L1 (sinks or window): views when they are in one of them."""
        s = self.owner.sink_tokens
        if end <= s or start >= self.win_start:
            a, b = (start, end) if end <= s else (start - self.win_start + s, end - self.win_start + s)
            return self._read(a, b)
        (k1, v1), (k2, v2) = self._read(start, s), self._read(s, end - self.win_start + s)
        return torch.cat([k1, k2], dim=1), torch.cat([v1, v2], dim=1)

    # ---- pages off L1 ---------------------------------------------------------------------
    def fetch(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device K/V ``[kvh, len(pages) * page_size, D]`` of the pages one query picked, through the hot set
        (the sparse host path), in no particular page order (attention over a set of pages does not depend on it).

        Hot pages come from a preallocated device arena in one ``index_select``; the others from the store's L2
        arena (one host gather and one copy), decoded in one op and copied into the hot arena in one
        ``index_copy_`` (a view of the fetched block would keep the whole block alive: measured ~1 GB at 128K).
        """
        hot = [p for p in pages if p in self.hot]
        missing = [p for p in pages if p not in self.hot] if hot else pages
        parts_k, parts_v = [], []
        if hot:
            slots = _index([self.hot[p] for p in hot], self.device)
            for p in hot:
                self.hot.move_to_end(p)
            parts_k.append(self.hot_k.index_select(0, slots))
            parts_v.append(self.hot_v.index_select(0, slots))
        if missing:
            store = self.owner.store
            slots = self.owner.l2_slots(missing)
            if store.l3_pages:   # decoding reads them: the policy keeps them in L2 while they stay hot
                store.warm([self.owner.page_keys[p] for p in missing])
            k, v = codecs.decode(store.arena.gather(self.index, slots, self.device), self.dtype)
            parts_k.append(k)
            parts_v.append(v)
            self._keep_hot(missing, k, v)
        k = parts_k[0] if len(parts_k) == 1 else torch.cat(parts_k)
        v = parts_v[0] if len(parts_v) == 1 else torch.cat(parts_v)
        return self.as_kv(k, v)

    @staticmethod
    def as_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages ``[n, kvh, P, D]`` -> one segment ``[kvh, n * P, D]``."""
        n, kvh, p, d = k.shape
        return k.transpose(0, 1).reshape(kvh, n * p, d), v.transpose(0, 1).reshape(kvh, n * p, d)

    @torch.inference_mode()
    def _keep_hot(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy ``pages`` (rows of k/v) into the hot arena, evicting the coldest hot pages to make room."""
        cap = self.owner.hot_pages
        if cap <= 0:
            return
        if self.hot_k is None or self.hot_k.shape[0] < cap:
            old_k, old_v = self.hot_k, self.hot_v
            self.hot_k = k.new_empty((cap,) + tuple(k.shape[1:]))
            self.hot_v = v.new_empty((cap,) + tuple(v.shape[1:]))
            if old_k is not None:
                self.hot_k[:old_k.shape[0]] = old_k
                self.hot_v[:old_v.shape[0]] = old_v
        rows = list(range(len(pages)))[-cap:]              # more new pages than slots: keep the last ones
        used = set(self.hot.values())
        free = [s for s in range(cap) if s not in used]
        while len(free) < len(rows):
            coldest = min(self.hot, key=lambda q: self.heat[q])
            free.append(self.hot.pop(coldest))
        slots = free[:len(rows)]
        for r, s in zip(rows, slots):
            self.hot[pages[r]] = s
        index, pick = _index(slots, k.device), _index(rows, k.device)
        self.hot_k.index_copy_(0, index, k.index_select(0, pick))
        self.hot_v.index_copy_(0, index, v.index_select(0, pick))

    def _bounds_room(self, n: int) -> torch.Tensor:
        """The ``bounds`` columns of the next ``n`` pages ``[kvh, 2D, n]`` (the buffer grown by doubling first)."""
        if self.n_pages + n > self.bounds.shape[2]:
            grown = self.bounds.new_zeros(self.bounds.shape[:2] + (max(2 * self.bounds.shape[2], self.n_pages + n),))
            grown[:, :, :self.n_pages] = self.bounds[:, :, :self.n_pages]
            self.bounds = grown
        return self.bounds[:, :, self.n_pages:self.n_pages + n]

    @torch.inference_mode()
    def add_bounds(self, page_bounds: torch.Tensor) -> None:
        """Append the key bounds of pages ``[n, kvh, 2 (min, max), D]`` as columns ``[max; min]``."""
        n = page_bounds.shape[0]
        cols = torch.cat([page_bounds[:, :, 1], page_bounds[:, :, 0]], dim=-1).permute(1, 2, 0)   # [kvh, 2D, n]
        self._bounds_room(n).copy_(cols)
        self.n_pages += n

    @torch.inference_mode()
    def add_key_bounds(self, k: torch.Tensor) -> None:
        """Append the bounds of the full pages whose keys are ``k`` ``[kvh, n * page_size, D]``: four kernels for
        any number of pages (a 2,048-token prefill chunk's 32 pages took ~20 launches a layer as stacked pieces)."""
        kvh, t, d = k.shape
        n = t // self.owner.page_size
        k = k.reshape(kvh, n, self.owner.page_size, d)
        cols = self._bounds_room(n)
        cols[:, :d].copy_(k.amax(dim=2).transpose(1, 2))
        cols[:, d:].copy_(k.amin(dim=2).transpose(1, 2))
        self.n_pages += n

    def page_bounds(self, first: int, end: int) -> torch.Tensor:
        """The key bounds of pages [first, end) as ``add_bounds`` took them: ``[n, kvh, 2 (min, max), D]``."""
        cols = self.bounds[:, :, first:end]                          # [kvh, 2D (max; min), n]
        kvh, two_d, n = cols.shape
        return cols.permute(2, 0, 1).reshape(n, kvh, 2, two_d // 2).flip(2)

    def hot_bytes(self) -> int:
        if self.hot_k is None:
            return 0
        return (self.hot_k.numel() + self.hot_v.numel()) * self.hot_k.element_size()

    # ---- attention -----------------------------------------------------------------------
    def attend(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[Hq, Lq, D]`` for the last Lq tokens -> output ``[Hq, Lq, D]``."""
        kvh = self.l1_k.shape[0]
        hq, lq, d = q.shape
        qg = q.reshape(kvh, hq // kvh, lq, d)
        p = self.owner.page_size
        first_page = self.owner.sink_tokens // p
        last_page = self.win_start // p       # off-window pages: [first_page, last_page)
        n = self.l1_len
        l1_k, l1_v = self._read(0, n)   # an int8 pool: this layer's 16-bit copy, alive while it attends
        if self.resident:
            # every token is in L1, in order: fused kernels over one buffer, as a plain resident cache
            if lq == 1:
                return attention.segment(qg, l1_k, l1_v, scale)[0].reshape(hq, lq, d)
            # on a GPU: one flash call, causal bottom-right with GQA in the kernel (the first chunk too: SDPA's
            # dispatch took cuDNN there, 2.2 ms of host time a layer in a profiled 128K prompt)
            one = attention.chunk_attention(q, l1_k, l1_v, scale)
            if one is not None:
                return one
            if not q.is_cuda or n == lq:   # SDPA with a lower-right causal bias (the CPU's fastest form)
                return attention.causal_sdpa(q.unsqueeze(0), l1_k.unsqueeze(0), l1_v.unsqueeze(0),
                                             scale)[0].transpose(0, 1)
            # else the chunk over itself (causal) and over what precedes it, merged
            acc = attention.segment(qg, l1_k[:, n - lq:], l1_v[:, n - lq:], scale, causal=True)
            acc = attention.merge_into(acc, attention.segment(qg, l1_k[:, :n - lq], l1_v[:, :n - lq], scale))
            return acc[0].reshape(hq, lq, d)
        sparse = self.owner.config.policy == "sparse" and lq == 1
        if sparse and last_page > first_page:
            # one token: its selected pages and L1 as one segment (one kernel call), or two merged
            k, v = self._sparse(qg, first_page, last_page)
            if n > 4 * k.shape[1]:   # a large pool: attend it in place and merge, rather than copy it each step
                acc = attention.merge_into(attention.segment(qg, l1_k, l1_v, scale), attention.segment(qg, k, v, scale))
                return acc[0].reshape(hq, lq, d)
            out = attention.segment(qg, torch.cat([l1_k, k], dim=1), torch.cat([l1_v, v], dim=1), scale)
            return out[0].reshape(hq, lq, d)
        pending = self._ask_peers(qg, scale, first_page, last_page)   # they attend their pages meanwhile
        if lq == 1:
            acc = attention.segment(qg, l1_k, l1_v, scale)
        elif self.length - lq >= self.win_start:
            # the chunk is the end of the window: everything before it is visible, the chunk itself is causal
            acc = attention.segment(qg, l1_k[:, n - lq:], l1_v[:, n - lq:], scale, causal=True)
            if n > lq:
                acc = attention.merge_into(acc, attention.segment(qg, l1_k[:, :n - lq], l1_v[:, :n - lq], scale))
        else:  # the chunk reaches into the sinks (the first chunk): one masked segment
            kpos = torch.cat([torch.arange(min(self.length, self.owner.sink_tokens), device=q.device),
                              torch.arange(self.win_start, max(self.win_start, self.length), device=q.device)])
            qpos = torch.arange(self.length - lq, self.length, device=q.device)
            acc = attention.partial_attention(qg, l1_k, l1_v, scale, kpos.unsqueeze(0) <= qpos.unsqueeze(1))
        if pending is not None:
            try:   # the peer GPUs attended the pages they hold; the store keeps them too (the fallback below)
                acc = attention.merge_into(acc, pending.wait())
                return acc[0].reshape(hq, lq, d)
            except PeerLostError as err:
                log.warning("flashguard: %s; attending the pages from the store instead", err)
        if last_page > first_page:  # every page (exact policy, prefill chunks), streamed in blocks
            pages = list(range(first_page, last_page))
            if self.owner.config.policy == "sparse" and lq <= SPARSE_CHUNK_TOKENS:
                # a short chunk (a question after a long paste, a rail's suffix, a new session's last tokens)
                # reads what its queries select, as a decoding step does: the pages it does not read stay where
                # they are (a new session whose pages are on disk read them all for a 12-token question)
                pick = self._pick(qg, first_page, last_page)
                if pick is not None:
                    pages = sorted(first_page + i for i in pick.tolist())
            self.owner.page_reads += len(pages)
            for k, v in self._stream_pages(pages, self.owner.fetch_block_pages(q)):
                acc = attention.merge_into(acc, attention.segment(qg, k, v, scale))
        return acc[0].reshape(hq, lq, d)

    def _ask_peers(self, qg: torch.Tensor, scale: float, first: int, last: int):
        """The peers' pending partial over the pages [first, last) (``kv.peer.Pending``), after putting on them the
        pages they lack; None without peers, without pages, or once the peers are lost (then the store serves)."""
        peers = self.owner.peers
        if last <= first or peers is None or peers.lost is not None:
            return None
        try:
            if not peers.covers(first, last):
                self.owner.pages_to_peers(first, last)   # pages adopted from the store: put once
            return peers.ask(self.index, qg, scale, first, last)
        except PeerLostError as err:
            log.warning("flashguard: %s; attending the pages from the store instead", err)
            return None

    def _stream_pages(self, pages: list[int], block: int):
        """K/V of ``pages`` from the store, ``block`` pages at a time. The next block's host rows are gathered
        before the current one is decoded and attended; on a GPU their copy runs on a side stream meanwhile
        (double buffering). With zero-copy reads (every page in pinned L2), the GPU reads each block's rows
        straight from host RAM instead: no host gather, no staging copy (the prefill of a prompt longer than the
        pool streams every page that left it for every chunk)."""
        arena, stream = self.owner.store.arena, self.owner.copy_stream(self.device)
        if self.owner.zero_copy(self.device, pages[-1] + 1):
            slots = self.owner.device_slots(self.device, pages[-1] + 1)
            if pages == list(range(pages[0], pages[-1] + 1)):
                slots = slots[pages[0]:pages[-1] + 1]
            else:   # the pages a short chunk selected (``SPARSE_CHUNK_TOKENS``)
                slots = slots[_index(pages, self.device)]
            for a in range(0, len(pages), block):
                rows = uva.gather_rows(arena.data[self.index], slots[a:a + block], self.device)
                yield self.as_kv(*codecs.decode(arena.fields_of(rows), self.dtype))
            return
        main = torch.cuda.current_stream(self.device) if stream is not None else None
        if self.index == 0:   # pages only on disk: all start coming back now on the readers, not a block at a
            # time (the first layer's promotions serve the others: a prefill keeps them in L2, ``deferred``)
            self.owner.store.read_ahead([self.owner.page_keys[i] for i in pages])

        def issue(b):
            slots = self.owner.l2_slots(b)
            if stream is None:
                return arena.gather(self.index, slots, self.device), None
            stream.wait_stream(main)  # device memory the main stream freed may be reused by this copy
            with torch.cuda.stream(stream):
                enc = arena.gather(self.index, slots, self.device)
                done = torch.cuda.Event()
                done.record(stream)
            return enc, done

        blocks = [pages[a:a + block] for a in range(0, len(pages), block)]
        nxt = issue(blocks[0])
        for i in range(len(blocks)):
            enc, done = nxt
            if i + 1 < len(blocks):
                nxt = issue(blocks[i + 1])
            if done is not None:
                main.wait_event(done)
                for t in enc.values():
                    if t.is_cuda:
                        t.record_stream(main)
            yield self.as_kv(*codecs.decode(enc, self.dtype))

    def _pick(self, qg: torch.Tensor, first: int, last: int) -> torch.Tensor | None:
        """Quest over the off-window pages [first, last) (``kv/quest.py``): a device index (relative to ``first``)
        of the ``kv_heads * budget`` pages one query attends (for a short chunk, the highest bound any of its
        queries gives a page), or None for all of them."""
        n, kvh = last - first, qg.shape[0]
        budget = max(1, self.owner.config.budget_tokens // self.owner.page_size)
        if n <= kvh * budget:
            return None
        q = qg.reshape(kvh, -1, qg.shape[-1])                        # [kvh, g * Lq, D]: every query of a chunk
        return quest.select(quest.bound(q, self.bounds[:, :, first:last]), budget)

    def _sparse(self, qg: torch.Tensor, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the pages one decoding query attends (``_pick``): read straight from pinned host RAM on the
        GPU when zero-copy works (no host round trip), else through the hot set and a host gather."""
        pick = self._pick(qg, first, last)
        edge = self.win_start // self.owner.page_size - self.owner.adapt_pages - first
        owner = self.owner
        if owner.zero_copy(self.device, last):
            slots = owner.device_slots(self.device, last)[first:last]
            slots = slots if pick is None else slots[pick]
            arena = owner.store.arena
            rows = uva.gather_rows(arena.data[self.index], slots, self.device)
            owner.page_reads += slots.shape[0]
            self.last_reach = (pick >= edge).sum() if pick is not None else max(0, last - first - max(0, edge))
            return self.as_kv(*codecs.decode(arena.fields_of(rows), self.dtype))
        chosen = list(range(first, last)) if pick is None else sorted(first + i for i in pick.tolist())
        for p in self.hot:
            self.heat[p] *= 0.9
        for p in chosen:
            self.heat[p] += 1.0
        self.last_reach = sum(1 for p in chosen if p - first >= edge)
        owner.page_reads += len(chosen)
        return self.fetch(chosen)


class TieredCache(Cache):
    """See the module docstring. One sequence (batch size 1) per cache; the store may be shared."""

    serves_attention = True   # the tiered_kv attention asks this cache's layers (``attention.forward_kwargs``)

    def __init__(self, model_config, cache_config: CacheConfig | None = None, store: PageStore | None = None,
                 model_id: str | None = None, preallocate: bool = False, pool=None):
        """``preallocate``: take the whole L1 buffer (the pool) at the first token instead of growing it.
        ``pool``: a ``kv.pool.PoolBuffers`` the buffers are taken from at the first token and given back to at
        ``release`` (the engine's, so that the next session runs on the same device memory)."""
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        cache_config = cache_config or CacheConfig()
        if not cache_config.sized:   # made outside an engine: everything resident up to the model's context
            from .policy import size_tiers

            context = getattr(text_config, "max_position_embeddings", None) or 8192
            cache_config = size_tiers(cache_config, context=context, pool_tokens=context, l2_bytes_per_token=1,
                                      host_available=None, kv_heads=text_config.num_key_value_heads or 1)
        self.config = cache_config
        self.preallocate = preallocate
        self.pool = pool
        text_heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_heads
        if cache_config.l1_codec == "int8" and not int8_pool.supported(head_dim):
            from ..errors import ConfigError

            raise ConfigError(f"an int8 pool needs a head_dim that is a multiple of {int8_pool.GROUP}, this model's "
                              f"is {head_dim}; set fp16", key="kv.l1_codec")
        self.int8 = cache_config.l1_codec == "int8"
        self.model_config = model_config
        self.num_layers = text_config.num_hidden_layers
        p = self.config.page_size
        self.page_size = p
        self.sink_tokens = -(-self.config.sink_tokens // p) * p if self.config.sink_tokens else 0
        self.window = self.config.l1_tokens
        self.hot_pages = max(0, (self.config.l1_max_tokens - self.config.l1_tokens) // p)
        self.adapt_pages = max(1, self.config.budget_tokens // p // 4)
        self.model_id = model_id or getattr(text_config, "_name_or_path", "") or text_config.model_type
        self.store = store
        self.namespace = b""
        self.page_keys: list[bytes] = []
        self.stored: list[bool] = []            # per full page: the store holds it (and a reference for us)
        self.token_ids: list[int] = []
        self.length = 0
        # positions from here on were run by a private forward (an activated adapter's suffix, engine/alora.py):
        # their K/V are not the base model's, so the pages holding them are never keyed by content nor stored
        # for another sequence to adopt; None while the cache holds no such position
        self.private_from: int | None = None
        self.driven = False                     # forwards come with ``begin`` / ``end`` (the engine's sessions)
        self.page_reads = 0
        self._slot_table: dict[int, int] = {}   # page index -> L2 slot, valid for the store epoch below
        self._slot_epoch = -1
        self._copy_stream = None
        self._dev_slots, self._dev_slots_key = None, None
        self.peers = None                       # kv/peer.PeerTier holding off-window pages on other GPUs, if any
        self.sparse_state = None                # sparse_step.SparseState, made at the first one-graph sparse step
        self._adapted_at = -1                   # the length at which the window last adapted
        self._on_disk = False                   # the sparse step's slot table has a page only in L3
        self._in_l2, self._in_l2_key = True, None   # zero_copy: every page below a bound is in L2 (cached)
        self._warmed_at = -1                    # the length at which the picked pages were last reported
        self._retried_at = (-1, 0)              # promote_missed: (length, steps run again at that length)
        self.pages_missed = 0                   # picked pages a sparse step attended without (only in L3 then)
        self._host_slots = None                 # the sparse step's slot table on the host, its page index by key,
        self._slot_of_key: dict = {}            # and how far into the store's slot log it is (_update_slots)
        self._slots_log_at = 0
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.num_layers)])

    # ---- wiring ----------------------------------------------------------------------------
    def use_peers(self, tier) -> "TieredCache":
        """Put this sequence's off-window pages on ``tier`` (a ``kv.peer.PeerTier``) as they leave L1 (the store
        keeps them too) and attend them there under the exact policy and for prefill chunks. The tier serves one
        sequence: it forgets what it held."""
        tier.reset()
        self.peers = tier
        return self

    def attach(self, model) -> "TieredCache":
        """Switch ``model`` to the tiered attention, and have its forward hand a TieredCache given as its cache
        argument on to that attention (``attention.pass_cache``: plain ``model.generate`` works as is)."""
        attention.register()
        if getattr(model.config, "_attn_implementation", None) != attention.NAME:
            model.set_attn_implementation(attention.NAME)
        attention.pass_cache(model)
        return self

    # ---- the forward protocol -------------------------------------------------------------
    def begin(self, token_ids, start: int, private: bool = False) -> None:
        """A forward over ``token_ids`` at positions ``start``, ``start + 1``, ... is about to run. ``start`` must
        be the tokens this cache holds (a ``ValueError`` otherwise: K/V at the wrong positions would be attended
        silently). The ids key the pages they fill by content (``page_key``); a ``private`` forward's pages are
        keyed at random and never stored for adoption (``private_from``)."""
        if start != self.length or len(self.token_ids) != start:
            raise ValueError(f"a forward from position {start} on a cache holding {self.length} tokens "
                             f"({len(self.token_ids)} ids)")
        if private and self.private_from is None:
            self.private_from = start
        self.driven = True
        self.token_ids.extend(int(t) for t in token_ids)

    def end(self) -> None:
        """The forward begun last ran in every layer: its full pages are keyed and bounded (sink pages stored),
        pages leaving the window are stored and dropped from L1, the window adapts. The one point where a
        forward's pages settle."""
        self.settle_pages()

    # ---- the layers' interface: besides its settings and public methods, what a TieredLayer calls on its cache ----
    def layer_initialized(self, key_states: torch.Tensor) -> None:
        """A layer made its buffers at its first update: the store (a cache made without one) and the pages'
        namespace, which need the K/V dtype and device, are made now if they are not yet."""
        if self.store is None:
            self.store = PageStore(self.config, pin_memory=key_states.device.type == "cuda")
        if not self.namespace:
            self.namespace = namespace_for(self.model_id, key_states.dtype, self.config)

    # ---- page bookkeeping (runs before the next forward, when every layer has the last one) -----
    SETTLE_PAGES = 16  # pages encoded together when a prefill chunk stores many (bounds the temporaries)

    def settle_pages(self) -> None:
        """Pages the last forward filled are keyed and bounded, and pages past the window stored and dropped from
        L1 (``end``; layer 0's ``update`` calls it before a forward nobody ``begin``-ed: plain ``generate``)."""
        full = self.length // self.page_size
        if len(self.page_keys) < full:   # (their bounds in one pass a layer; stores go SETTLE_PAGES at a time)
            self._complete_pages(len(self.page_keys), full)
        self._evict_window()

    def tokens_leaving(self, new_tokens: int) -> int:
        """Window tokens that will have left L1 for the store once ``new_tokens`` more are in, counted from the
        sequence's start (``_leaving``: the window keeps at most ``window`` + a page; whole pages leave), at the
        window's smallest size (``l1_tokens``: an adaptive window may shrink while a prompt is prefilled). 0 exactly
        when no window page leaves (sink pages go to the store in any case)."""
        over = self.length + new_tokens - self.sink_tokens - self.config.l1_tokens - self.page_size
        return -(-over // self.page_size) * self.page_size if over > 0 else 0

    def _complete_pages(self, first: int, end: int) -> None:
        """Pages [first, end) are full: key them and bound their keys per layer. Sink pages go to the store now;
        window pages only when they leave L1 (``_store_pages``), so a context that fits the pool never pays
        for encoding and copying its pages to the host."""
        p, n = self.page_size, end - first
        keys, parent = [], self.page_keys[-1] if self.page_keys else b"root"
        for i in range(first, end):
            if len(self.token_ids) >= (i + 1) * p and (self.private_from is None or (i + 1) * p <= self.private_from):
                parent = page_key(parent, self.token_ids[i * p:(i + 1) * p], self.namespace)
            else:
                parent = os.urandom(16)  # no token ids, or a private forward's positions: a private page
            keys.append(parent)
        for layer in self.layers:
            layer.add_key_bounds(layer.tokens(first * p, end * p)[0])
            layer.heat.extend([0.0] * n)
        self.page_keys.extend(keys)
        self.stored.extend([False] * n)
        sinks = min(end, self.sink_tokens // p)
        if sinks > first:
            self._store_pages(first, sinks)

    def _store_pages(self, first: int, end: int, to_peers: bool = True) -> None:
        """Write the pages in [first, end) that are not in the store yet from L1 to the store (one encode and one
        host copy per ``SETTLE_PAGES``); the store takes one reference per page for this cache. ``to_peers``
        False: not on the peer GPUs (pages a crop is about to drop from this sequence)."""
        p = self.page_size
        runs: list[list[int]] = []
        for i in range(first, end):
            if self.stored[i]:
                continue
            if runs and runs[-1][-1] == i - 1 and len(runs[-1]) < self.SETTLE_PAGES:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:                  # runs of consecutive unstored pages
            lo, hi = run[0], run[-1] + 1
            n = hi - lo
            ks, vs, page_bounds = [], [], []
            for layer in self.layers:
                k, v = layer.tokens(lo * p, hi * p)
                kvh, _, d = k.shape
                k, v = k.reshape(kvh, n, p, d), v.reshape(kvh, n, p, d)
                ks.append(k)
                vs.append(v)
                page_bounds.append(layer.page_bounds(lo, hi))   # kept since the pages filled: not computed again
            self.store.put_many(self.page_keys[lo:hi], torch.stack(ks), torch.stack(vs), torch.stack(page_bounds, dim=1))
            sinks = self.sink_tokens // p
            if to_peers and self.peers is not None and hi > sinks and self.peers.lost is None:   # off-window pages: on the peers too
                at = max(lo, sinks) - lo
                try:
                    self.peers.put(lo + at, torch.stack(ks)[:, :, at:], torch.stack(vs)[:, :, at:])
                except PeerLostError as err:
                    log.warning("flashguard: %s; its pages stay in the store", err)
            for i in range(lo, hi):
                self.stored[i] = True

    @torch.inference_mode()
    def pages_to_peers(self, first: int, last: int) -> None:
        """Put the pages of [first, last) that the peers lack (pages adopted from the store never left this L1)
        on them, read back from the store, every layer at once, ``SETTLE_PAGES`` at a time."""
        missing = [i for i in range(first, last) if i not in self.peers.put_pages]
        l0 = self.layers[0]
        for a in range(0, len(missing), self.SETTLE_PAGES):
            run = missing[a:a + self.SETTLE_PAGES]
            parts = []
            for idx in run:
                enc = self.store.get(self.page_keys[idx])
                if enc is None:
                    raise PageLost(f"page {idx} of this sequence is gone from the store")
                parts.append(codecs.decode(enc, l0.dtype, l0.device))   # [layers, kvh, page_size, D] each
            for i, idx in enumerate(run):   # consecutive pages go in one put
                if i and run[i - 1] == idx - 1:
                    continue
                j = i
                while j + 1 < len(run) and run[j + 1] == run[j] + 1:
                    j += 1
                self.peers.put(idx, torch.stack([k for k, _ in parts[i:j + 1]], dim=2),
                               torch.stack([v for _, v in parts[i:j + 1]], dim=2))

    def _evict_window(self) -> None:
        """Pages leave the window when it is longer than ``window`` + a page: stored first, then dropped from L1."""
        self._adapt_window()
        l0 = self.layers[0]
        if l0.is_initialized and (leave := self._leaving(l0)):
            first = l0.win_start // self.page_size
            self._store_pages(first, first + leave)
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            if leave := self._leaving(layer):
                layer.drop_window_pages(leave)
            layer.trim()

    def _leaving(self, layer: "TieredLayer") -> int:
        """How many full pages leave ``layer``'s window: it may hold ``window`` + a page."""
        p, full_end, leave = self.page_size, len(self.page_keys) * self.page_size, 0
        while layer.length - (layer.win_start + leave * p) > self.window + p and \
                layer.win_start + (leave + 1) * p <= full_end:
            leave += 1
        return leave

    def _adapt_window(self) -> None:
        """Grow L1 while sparse queries keep reaching just behind it; shrink back when they stop. Once per step
        (a step may settle twice: ``sparse_view`` settles, and when it declines, the layers' ``update`` again)."""
        if self.config.policy != "sparse" or not self.config.adaptive_l1 or self._adapted_at == self.length:
            return
        self._adapted_at = self.length
        reaches = [layer.last_reach for layer in self.layers]
        if all(isinstance(r, torch.Tensor) for r in reaches):   # one-graph steps: one sum and one sync, not 28
            reaches = [torch.stack(reaches).sum()]
        reach = float(sum(reaches)) / max(1, self.num_layers)
        if reach >= self.adapt_pages / 2 and self.window + self.page_size <= self.config.l1_max_tokens:
            self.window += self.page_size
        elif reach < 1 and self.window - self.page_size >= self.config.l1_tokens:
            self.window -= self.page_size

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
            st.slots[:last].copy_(_index(slots, dev))
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
            where = _index([list(moved), list(moved.values())], st.slots.device)   # one copy for both
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

    def _zero_copy_base(self, device: torch.device) -> bool:
        return (self.config.zero_copy and device.type == "cuda" and self.store.arena.pinned
                and uva.available(device))

    def zero_copy(self, device: torch.device, upto: int | None = None) -> bool:
        """The layer-by-layer paths read pages on the GPU straight from the pinned L2 arena (``uva.py``): when the
        config allows it, the arena is pinned, and every page of this sequence below ``upto`` (default: all
        stored) is in L2 (a page only in L3 needs the host; other sequences' L3 pages do not matter). The
        one-graph sparse step serves L3 pages itself (``promote_missed``)."""
        if not self._zero_copy_base(device):
            return False
        if self.store.l3_pages == 0:
            return True
        upto = len(self.page_keys) if upto is None else upto
        key = (self.store.moves, upto)
        if self._in_l2_key != key:
            slots = self.store.peek_slots(self.page_keys[:upto])
            self._in_l2, self._in_l2_key = slots is not None and -1 not in slots, key
        return self._in_l2

    def device_slots(self, device: torch.device, upto: int) -> torch.Tensor:
        """L2 slot of pages [0, upto) (pages that left the window: all stored), as a device tensor (rebuilt when
        pages are added or moved)."""
        key = (self.store.epoch, upto)
        if self._dev_slots is None or self._dev_slots_key != key:
            slots = self.l2_slots(list(range(upto)))
            self._dev_slots, self._dev_slots_key = _index(slots, device), key
        return self._dev_slots

    def copy_stream(self, device: torch.device):
        """The side stream that brings pages to ``device`` (None off CUDA): one per cache, made on first use."""
        if device.type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        return self._copy_stream

    def fetch_block_pages(self, q: torch.Tensor) -> int:
        fused = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        return max(1, (FETCH_BLOCK_TOKENS if fused else FETCH_BLOCK_TOKENS_CPU) // self.page_size)

    def l2_slots(self, pages: list[int]) -> list[int]:
        """L2 arena slots of page indices: from this cache's slot table while the store's ``epoch`` says no page
        moved, else asked of the store (which promotes pages from L3 as needed)."""
        store = self.store
        if self._slot_epoch != store.epoch:
            self._slot_table, self._slot_epoch = {}, store.epoch
        table = self._slot_table
        try:
            slots = [table[p] for p in pages]
            store.count_hits(len(pages))
            return slots
        except KeyError:
            pass
        slots = store.slots([self.page_keys[p] for p in pages])
        if slots is None:
            raise PageLost("a page of this sequence is gone from the store")
        if self._slot_epoch != store.epoch:   # a promotion moved other pages: start the table again
            self._slot_table, self._slot_epoch = {}, store.epoch
        self._slot_table.update(zip(pages, slots))
        return slots

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

    # ---- introspection ---------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def l1_bytes(self) -> int:
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                for t in (layer.l1_k, layer.l1_v, layer.l1_ks, layer.l1_vs, layer.bounds):
                    if t is not None:
                        total += t.numel() * t.element_size()
                total += layer.hot_bytes()
        return total

    def stats(self) -> dict:
        """Read-only: what the cache holds now."""
        out = {"length": self.length, "pages": len(self.page_keys), "l1_window_tokens": self.window,
               "l1_bytes": self.l1_bytes(), "page_reads": self.page_reads}
        if self.store is not None:
            out["store"] = self.store.stats_dict()
        return out

    def check_integrity(self) -> None:
        """Checks the page table, every layer's L1 and the store, between forwards (a cache driven by plain
        ``generate`` settles its last forward first)."""
        if self.layers[0].is_initialized and not self.driven:
            self.settle_pages()
        p = self.page_size
        assert len(self.page_keys) == self.length // p, "page table does not match the length"
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            assert layer.length == self.length
            assert layer.l1_k.shape[1] >= layer.l1_len and layer.l1_v.shape == layer.l1_k.shape
            assert layer.length <= self.sink_tokens or layer.win_start <= layer.length
            assert layer.win_start % p == 0 and layer.win_start >= self.sink_tokens
            assert layer.n_pages == len(self.page_keys) <= layer.bounds.shape[2]
        assert len(self.stored) == len(self.page_keys), "stored flags do not match the page table"
        for key, kept in zip(self.page_keys, self.stored):
            assert not kept or key in self.store.pages, "a page of this cache is missing from the store"
        for i in range(min(len(self.page_keys), self.layers[0].win_start // p)):
            assert self.stored[i], f"page {i} left L1 without being stored"
        self.store.check_integrity()
