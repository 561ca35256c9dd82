"""TieredCache: a transformers ``Cache`` whose pages live in L1 (device), L2 (host RAM) and L3 (disk).

Per layer (``TieredLayer``), L1 holds the attention sinks (the first ``sink_tokens``) and the recent window
(``l1_tokens``, growing up to ``l1_max_tokens`` when queries keep reaching just behind it) in the model's dtype.
Every full page is also written to the shared ``PageStore`` (L2 int8, spilling to L3 int4 + zstd) when it
fills, so leaving the window only drops the device copy. Nothing is ever dropped from the sequence.

Attention (``attention.py``) covers: sinks + window (causal inside the current chunk) and the pages between
them: all of them (``exact``, fetched in blocks), or, when decoding one token with the ``sparse`` policy, the
top pages by their Quest upper bound ``sum_d max(q_d min_d, q_d max_d)`` within ``budget_tokens`` per KV head.
Pages fetched for sparse decoding stay on the device in a small hot set, evicted by access heat.

Use::

    cache = TieredCache(model.config, CacheConfig(...)).attach(model)
    model.generate(input_ids, past_key_values=cache, ...)            # or the engine's own loop

``attach`` switches the model to the ``flashguard`` attention and lets it find this cache. Token ids
(``feed``) make page keys content hashes, so another cache on the same store reuses the pages of a common
prefix (``adopt_prefix``); without them (plain ``generate``) pages are private to this cache.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..config import CacheConfig
from . import attention, codecs
from .store import PageStore, namespace_for, page_key

FETCH_BLOCK_PAGES = 64


class PageLost(RuntimeError):
    """A page this cache needs is gone from the store (it failed verification, or could not be kept).

    The cache is no longer usable; the caller recomputes the sequence (the engine does so by prefill)."""


class TieredLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner: "TieredCache", index: int):
        super().__init__()
        self.owner = owner
        self.index = index
        self.length = 0
        self.sink_k = self.sink_v = None        # [kvh, <=S, D]
        self.win_k = self.win_v = None          # [kvh, length - win_start, D]
        self.win_start = 0
        self.summaries = None                   # [n_full_pages, kvh, 2, D] on device
        self.hot: "OrderedDict[int, int]" = OrderedDict()   # hot page -> slot of the hot arena
        self.hot_k = self.hot_v = None          # [slots, kvh, P, D] preallocated at the first sparse fetch
        self.returned = None
        self.last_reach = 0                     # pages selected at the last sparse step that sit just behind L1

    # ---- transformers CacheLayerMixin ---------------------------------------------------------
    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        kvh, d = key_states.shape[1], key_states.shape[-1]
        empty = key_states.new_zeros((kvh, 0, d))
        self.sink_k, self.sink_v, self.win_k, self.win_v = empty, empty, empty, empty
        self.summaries = key_states.new_zeros((0, kvh, 2, d))
        self.heat: list[float] = []             # per full page, on the host (no device syncs)
        self.win_start = self.owner.sink_tokens
        self.is_initialized = True
        self.owner._on_first_layer_init(key_states)
        # the hot set must hold one sparse selection: budget pages for each KV head (their union)
        self.owner.hot_pages = max(self.owner.hot_pages, kvh * (self.owner.config.budget_tokens // self.owner.page_size))

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.index == 0:
            self.owner._settle()  # the previous forward is complete in every layer: store pages, trim L1
        k, v = key_states[0], value_states[0]
        s = self.owner.sink_tokens
        if self.length < s:
            take = min(s - self.length, k.shape[1])
            self.sink_k = torch.cat([self.sink_k, k[:, :take]], dim=1)
            self.sink_v = torch.cat([self.sink_v, v[:, :take]], dim=1)
            k, v = k[:, take:], v[:, take:]
        if k.shape[1]:
            self.win_k = torch.cat([self.win_k, k], dim=1)
            self.win_v = torch.cat([self.win_v, v], dim=1)
        self.length += key_states.shape[2]
        self.returned = self.win_k.unsqueeze(0)  # the attention function checks it got *this* cache's keys
        if self.index == self.owner.num_layers - 1:
            self.owner.length = self.length
        return self.returned, self.win_v.unsqueeze(0)

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
        self.owner._crop_to(self.owner.length + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove)

    def reset(self) -> None:
        self.owner.reset()

    # ---- tokens and pages --------------------------------------------------------------------
    def tokens(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of tokens [start, end) that are in L1 (sinks or window)."""
        s = self.owner.sink_tokens
        parts_k, parts_v = [], []
        if start < s:
            parts_k.append(self.sink_k[:, start:min(end, s)])
            parts_v.append(self.sink_v[:, start:min(end, s)])
        if end > self.win_start:
            a = max(start, self.win_start) - self.win_start
            parts_k.append(self.win_k[:, a:end - self.win_start])
            parts_v.append(self.win_v[:, a:end - self.win_start])
        return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)

    def fetch(self, pages: list[int], keep_hot: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Device K/V ``[kvh, len(pages) * page_size, D]`` of off-window pages (hot set, else the store), in no
        particular page order (attention over a set of pages does not depend on it).

        Pages missing from the hot set are stacked on the host, moved in one copy and decoded in one op; hot
        pages are gathered from a preallocated arena in one ``index_select``, and ``keep_hot`` copies the newly
        fetched pages into the arena in one ``index_copy_`` (a view of the fetched block would keep the whole
        block alive: measured ~1 GB at 128K).
        """
        hot = [p for p in pages if p in self.hot]
        missing = [p for p in pages if p not in self.hot]
        parts_k, parts_v = [], []
        if hot:
            slots = torch.tensor([self.hot[p] for p in hot], device=self.device)
            for p in hot:
                self.hot.move_to_end(p)
            parts_k.append(self.hot_k.index_select(0, slots))
            parts_v.append(self.hot_v.index_select(0, slots))
        if missing:
            encs = [self.owner.store.get(self.owner.page_keys[p], self.index) for p in missing]
            if any(e is None for e in encs):
                raise PageLost(f"layer {self.index}: a page of this sequence is gone from the store")
            batch = {n: torch.stack([e[n] for e in encs]) for n in encs[0] if n != "bits"}
            if "bits" in encs[0]:
                batch["bits"] = encs[0]["bits"]
            k, v = codecs.decode(batch, self.dtype, self.device)       # [n, kvh, P, D]
            parts_k.append(k)
            parts_v.append(v)
            if keep_hot:
                self._keep(missing, k, v)
        k = parts_k[0] if len(parts_k) == 1 else torch.cat(parts_k)
        v = parts_v[0] if len(parts_v) == 1 else torch.cat(parts_v)
        n, kvh, p, d = k.shape
        return k.transpose(0, 1).reshape(kvh, n * p, d), v.transpose(0, 1).reshape(kvh, n * p, d)

    def _keep(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
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
        index = torch.tensor(slots, device=k.device)
        pick = torch.tensor(rows, device=k.device)
        self.hot_k.index_copy_(0, index, k.index_select(0, pick))
        self.hot_v.index_copy_(0, index, v.index_select(0, pick))

    def hot_bytes(self) -> int:
        if self.hot_k is None:
            return 0
        return (self.hot_k.numel() + self.hot_v.numel()) * self.hot_k.element_size()

    # ---- attention -----------------------------------------------------------------------
    def attend(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q ``[Hq, Lq, D]`` for the last Lq tokens -> output ``[Hq, Lq, D]``."""
        kvh = self.win_k.shape[0]
        hq, lq, d = q.shape
        qg = q.reshape(kvh, hq // kvh, lq, d)
        first_page = self.owner.sink_tokens // self.owner.page_size
        last_page = self.win_start // self.owner.page_size       # off-window pages: [first_page, last_page)
        # L1: sinks + window, causal for the current chunk
        l1_k = torch.cat([self.sink_k, self.win_k], dim=1)
        l1_v = torch.cat([self.sink_v, self.win_v], dim=1)
        mask = None
        if lq > 1:
            kpos = torch.cat([torch.arange(self.sink_k.shape[1], device=q.device),
                              torch.arange(self.win_start, self.length, device=q.device)])
            qpos = torch.arange(self.length - lq, self.length, device=q.device)
            mask = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
        acc = attention.partial_attention(qg, l1_k, l1_v, scale, mask)
        if last_page > first_page:
            pages = list(range(first_page, last_page))
            sparse = self.owner.config.policy == "sparse" and lq == 1
            if sparse:
                pages = self._select(qg, pages)
            self.owner._count_reads(len(pages))
            for a in range(0, len(pages), FETCH_BLOCK_PAGES):
                k, v = self.fetch(pages[a:a + FETCH_BLOCK_PAGES], keep_hot=sparse)
                acc = attention.merge_into(acc, attention.partial_attention(qg, k, v, scale))
        return acc[0].reshape(hq, lq, d)

    def _select(self, qg: torch.Tensor, pages: list[int]) -> list[int]:
        """Quest: top pages per KV head by upper bound, union over heads, within the token budget."""
        budget = max(1, self.owner.config.budget_tokens // self.owner.page_size)
        if len(pages) <= budget:
            chosen = pages
        else:
            summ = self.summaries[pages[0]:pages[-1] + 1].float()    # pages is a contiguous range: [n, kvh, 2, D]
            qf = qg[:, :, 0].float()                                   # [kvh, g, D]
            bound = torch.einsum("hgd,nhd->hgn", qf.clamp(min=0), summ[:, :, 1]) + \
                torch.einsum("hgd,nhd->hgn", qf.clamp(max=0), summ[:, :, 0])
            per_head = bound.amax(dim=1)                               # [kvh, n]
            top = per_head.topk(budget, dim=-1).indices.flatten().unique()
            chosen = sorted(pages[i] for i in top.tolist())
        if len(chosen):
            for p in self.hot:
                self.heat[p] *= 0.9
            for p in chosen:
                self.heat[p] += 1.0
            reach_edge = (self.win_start // self.owner.page_size) - self.owner.adapt_pages
            self.last_reach = sum(1 for p in chosen if p >= reach_edge)
        return chosen


class TieredCache(Cache):
    """See the module docstring. One sequence (batch size 1) per cache; the store may be shared."""

    def __init__(self, model_config, cache_config: CacheConfig | None = None, store: PageStore | None = None,
                 model_id: str | None = None):
        self.config = cache_config or CacheConfig()
        self.model_config = model_config
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.num_layers = text_config.num_hidden_layers
        p = self.config.page_size
        self.page_size = p
        self.sink_tokens = -(-self.config.sink_tokens // p) * p if self.config.sink_tokens else 0
        self.window = self.config.l1_tokens
        self.hot_pages = max(0, (self.config.l1_max_tokens - self.config.l1_tokens) // p)
        self.adapt_pages = max(1, self.config.budget_tokens // p // 4)
        self.model_id = model_id or getattr(text_config, "_name_or_path", "") or text_config.model_type
        self.store = store
        self._own_store = store is None
        self.namespace = b""
        self.page_keys: list[bytes] = []
        self.token_ids: list[int] = []
        self.length = 0
        self.page_reads = 0
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.num_layers)])

    # ---- wiring ----------------------------------------------------------------------------
    def attach(self, model) -> "TieredCache":
        """Switch ``model`` to the tiered attention and point its attention modules at this cache."""
        attention.register()
        if getattr(model.config, "_attn_implementation", None) != attention.NAME:
            model.set_attn_implementation(attention.NAME)
        ref = weakref.ref(self)
        for module in model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
                module._flashguard_cache = ref
        return self

    def feed(self, token_ids) -> None:
        """Token ids of the next forward pass (makes page keys content hashes)."""
        self.token_ids.extend(int(t) for t in token_ids)

    def _on_first_layer_init(self, key_states: torch.Tensor) -> None:
        if self.store is None:
            self.store = PageStore(self.config, pin_memory=key_states.device.type == "cuda")
        if not self.namespace:
            self.namespace = namespace_for(self.model_id, key_states.dtype, self.config)

    # ---- page bookkeeping (runs before the next forward, when every layer has the last one) -----
    def _settle(self) -> None:
        p = self.page_size
        while (len(self.page_keys) + 1) * p <= self.length:
            self._complete_page(len(self.page_keys))
        self._evict_window()

    def _complete_page(self, idx: int) -> None:
        p = self.page_size
        a, b = idx * p, (idx + 1) * p
        parent = self.page_keys[-1] if self.page_keys else b"root"
        if len(self.token_ids) >= b:
            key = page_key(parent, self.token_ids[a:b], self.namespace)
        else:
            key = os.urandom(16)  # no token ids: a private page
        ks, vs, summ = [], [], []
        for layer in self.layers:
            k, v = layer.tokens(a, b)
            ks.append(k)
            vs.append(v)
            s = torch.stack([k.amin(dim=1), k.amax(dim=1)], dim=1)   # [kvh, 2, D]
            summ.append(s)
            layer.summaries = torch.cat([layer.summaries, s.unsqueeze(0)])
            layer.heat.append(0.0)
        self.store.put(key, torch.stack(ks), torch.stack(vs), torch.stack(summ))
        self.page_keys.append(key)

    def _evict_window(self) -> None:
        p = self.page_size
        self._adapt_window()
        for layer in self.layers:
            full_end = len(self.page_keys) * p
            while layer.length - layer.win_start > self.window + p and layer.win_start + p <= full_end:
                layer.win_k, layer.win_v = layer.win_k[:, p:], layer.win_v[:, p:]
                layer.win_start += p

    def _adapt_window(self) -> None:
        """Grow L1 while sparse queries keep reaching just behind it; shrink back when they stop."""
        if self.config.policy != "sparse" or not self.config.adaptive_l1:
            return
        reach = sum(layer.last_reach for layer in self.layers) / max(1, self.num_layers)
        if reach >= self.adapt_pages / 2 and self.window + self.page_size <= self.config.l1_max_tokens:
            self.window += self.page_size
        elif reach < 1 and self.window - self.page_size >= self.config.l1_tokens:
            self.window -= self.page_size

    def _count_reads(self, n: int) -> None:
        self.page_reads += n

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
        self.token_ids = ids[:len(keys) * p]
        self._rebuild_l1(len(keys) * p, model_dtype, torch.device(device))
        return self.length

    def _rebuild_l1(self, length: int, dtype: torch.dtype, device: torch.device) -> None:
        """Set every layer to ``length`` tokens, refilling sinks and window from stored pages."""
        p = self.page_size
        n_pages = len(self.page_keys)
        win_start = max(self.sink_tokens, (max(0, length - self.window) // p) * p)
        decoded = {}
        for idx in list(range(min(n_pages, self.sink_tokens // p))) + list(range(win_start // p, -(-length // p))):
            enc = self.store.get(self.page_keys[idx])
            if enc is None:
                raise PageLost(f"page {idx} of this sequence is gone from the store")
            decoded[idx] = codecs.decode(enc, dtype, device)
        summaries = torch.stack([self.store.summary(k) for k in self.page_keys]).to(device, dtype) if n_pages else None
        for li, layer in enumerate(self.layers):
            if not layer.is_initialized:
                kvh, d = self._kv_shape()
                z = torch.zeros((1, kvh, 0, d), dtype=dtype, device=device)
                layer.lazy_initialization(z, z)

            def span(a, b):
                ks = [decoded[i][0][li][:, max(a, i * p) - i * p:min(b, (i + 1) * p) - i * p] for i in
                      range(a // p, -(-b // p))]
                vs = [decoded[i][1][li][:, max(a, i * p) - i * p:min(b, (i + 1) * p) - i * p] for i in
                      range(a // p, -(-b // p))]
                return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

            sink_end = min(length, self.sink_tokens)
            layer.sink_k, layer.sink_v = span(0, sink_end) if sink_end else (layer.sink_k[:, :0], layer.sink_v[:, :0])
            layer.win_start = win_start
            layer.win_k, layer.win_v = span(win_start, length) if length > win_start else (
                layer.win_k[:, :0], layer.win_v[:, :0])
            layer.length = length
            layer.summaries = summaries[:, li] if summaries is not None else layer.summaries[:0]
            layer.heat = [0.0] * n_pages
            layer.hot.clear()
        self.length = length

    def _kv_shape(self) -> tuple[int, int]:
        c = self.model_config.get_text_config() if hasattr(self.model_config, "get_text_config") else self.model_config
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return c.num_key_value_heads, d

    def _crop_to(self, length: int) -> None:
        if length >= self.length:
            return
        if self.layers[0].is_initialized:
            self._settle()
        length = max(0, length)
        keep = length // self.page_size
        dropped = self.page_keys[keep:]
        l0 = self.layers[0]
        if length >= l0.win_start:  # still inside the window: just cut
            for layer in self.layers:
                layer.win_k = layer.win_k[:, :length - layer.win_start]
                layer.win_v = layer.win_v[:, :length - layer.win_start]
                layer.sink_k, layer.sink_v = layer.sink_k[:, :length], layer.sink_v[:, :length]
                layer.length = length
            self.length = length
        else:  # below the window: refill L1 from the stored pages (the partial last page included)
            self.page_keys = self.page_keys[:-(-length // self.page_size)]
            self._rebuild_l1(length, l0.dtype, l0.device)
        for layer in self.layers:
            layer.summaries, layer.heat = layer.summaries[:keep], layer.heat[:keep]
            layer.hot = OrderedDict((p, slot) for p, slot in layer.hot.items() if p < keep)
        self.page_keys = self.page_keys[:keep]
        for key in dropped:
            self.store.release(key)
        self.token_ids = self.token_ids[:length]

    def reset(self) -> None:
        for key in self.page_keys:
            self.store.release(key)
        self.page_keys, self.token_ids, self.length = [], [], 0
        for layer in self.layers:
            layer.is_initialized = False
            layer.length = 0
            layer.hot.clear()

    # ---- introspection ---------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def l1_bytes(self) -> int:
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                for t in (layer.sink_k, layer.sink_v, layer.win_k, layer.win_v, layer.summaries):
                    total += t.numel() * t.element_size()
                total += layer.hot_bytes()
        return total

    def stats(self) -> dict:
        if self.layers[0].is_initialized:
            self._settle()
        out = {"length": self.length, "pages": len(self.page_keys), "l1_window_tokens": self.window,
               "l1_bytes": self.l1_bytes(), "page_reads": self.page_reads}
        if self.store is not None:
            out["store"] = self.store.stats_dict()
        return out

    def check_integrity(self) -> None:
        """Settles pending pages, then checks the page table, every layer's L1 and the store."""
        if self.layers[0].is_initialized:
            self._settle()
        p = self.page_size
        assert len(self.page_keys) == self.length // p, "page table does not match the length"
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            assert layer.length == self.length
            assert layer.sink_k.shape[1] == min(self.length, self.sink_tokens)
            assert layer.win_k.shape[1] == self.length - layer.win_start
            assert layer.win_start % p == 0 and layer.win_start >= self.sink_tokens
            assert layer.summaries.shape[0] == len(self.page_keys)
        for key in self.page_keys:
            assert key in self.store.pages, "a page of this cache is missing from the store"
        self.store.check_integrity()
