"""TieredLayer: one layer of a TieredCache (``kv/cache.py``): its L1 buffer, its pages' key bounds and hot set, and its
attention over the tiers.

Contract:
- Its cache drives it through public methods (``reserve``, ``write``, ``tokens``, ``add_bounds``,
  ``add_key_bounds``, ``page_bounds``, ``drop_window_pages``, ``trim``, ``fetch``), and transformers through
  ``CacheLayerMixin`` (``update`` appends a forward's K/V; the first one sizes the buffer, from the cache's pool when
  it keeps one).
- ``attend(q [Hq, Lq, D], scale) -> [Hq, Lq, D]``: the layer's queries over every token it holds: sinks + window
  (causal inside the current chunk) and the pages between them, exactly (``exact``, fetched in blocks; a peer tier
  attends its own) or, for a decode step or a short chunk under ``sparse``, the top pages by their Quest bound.
- It reads its cache's settings (``config``, ``page_size``, ``sink_tokens``, the store, the page keys) and calls it
  only through the cache's public methods (``layer_initialized``, ``settle_pages``, ``l2_slots``,
  ``pages_to_peers``, ``fetch_block_pages``, ``zero_copy``, ``device_slots``, ``copy_stream``): no private method
  of the cache is called from here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from . import attention, codecs, int8_pool, quest, uva
from .peer import PeerLostError

if TYPE_CHECKING:
    from .cache import TieredCache

log = logging.getLogger("flashguard")

SPARSE_CHUNK_TOKENS = 64   # a prompt chunk this short attends the pages Quest selects (sparse policy, past the pool)


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
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
            slots = index_tensor([self.hot[p] for p in hot], self.device)
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
        index, pick = index_tensor(slots, k.device), index_tensor(rows, k.device)
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
                slots = slots[index_tensor(pages, self.device)]
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
