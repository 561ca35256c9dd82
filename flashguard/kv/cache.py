"""TieredCache: a transformers ``Cache`` whose pages live in L1 (device), L2 (host RAM) and L3 (disk).

Contract:
- One sequence (batch size 1) per cache; the ``PageStore`` (L2, L3) may be shared by many caches, which then reuse
  each other's pages of a common prefix (``adopt_prefix``, ``kv/prefix.py``).
- Forward protocol: ``begin(token_ids, start)`` before a forward and ``end()`` after it. The ids make page keys
  content hashes; ``end`` is the one point where a forward's pages settle (keyed, bounded, stored as they leave
  the window). Without it (plain ``generate``) pages are private to this cache and settle at the next forward's
  first layer. ``attach(model)`` switches the model to the ``tiered_kv`` attention, which the forward gives this
  cache explicitly (``attention.forward_kwargs`` / ``pass_cache``); any number of caches may share a model.
- Nothing is ever dropped from the sequence: every full page is in L1, in the store, or both (``stored``);
  ``release`` gives every reference back (``kv/prefix.py``); ``check_integrity()`` raises where the bookkeeping
  disagrees (tests call it).
- The decode step's interface (``kv/static.py``) is ``StepViews`` (``kv/step_views.py``); a layer's buffers and
  attention are ``TieredLayer`` (``kv/layer.py``), which calls this cache only through the public methods under
  "the layers' interface" below.

Per layer, L1 holds the attention sinks (the first ``sink_tokens``) and the recent window (``l1_tokens``, growing up
to ``l1_max_tokens`` when queries keep reaching just behind it) in one buffer (the pool), in the model's 16-bit
dtype or as int8 codes and scales (``kv.l1_codec``, ``int8_pool.py``). Pages are keyed as they fill; a page is
written to the shared ``PageStore`` (L2 int8, spilling to L3 int4 + zstd) only when it leaves the window (sink
pages at once), or when the cache is released with ``keep_pages``. So while the sequence fits the window
(``resident``) nothing is encoded or copied, attention is one fused call over the buffer, and ``static_view``
offers the buffers to ``DecodeStep``'s one-graph step.

Attention (``attention.py``) covers: sinks + window (causal inside the current chunk) and the pages between
them: all of them (``exact``, fetched in blocks), or, when decoding one token with the ``sparse`` policy, the
top pages by their Quest upper bound ``sum_d max(q_d min_d, q_d max_d)`` within ``budget_tokens`` per KV head.
Pages fetched for sparse decoding on the host path stay on the device in a small hot set, evicted by heat.

Use::

    cache = TieredCache(model.config, CacheConfig(...)).attach(model)
    cache.begin(ids, start=cache.length); model(input_ids=ids, past_key_values=cache); cache.end()
    # (kv/session.py's ``TieredSession.forward`` does exactly that, with undo on a failure)
    model.generate(input_ids, past_key_values=cache, ...)            # plain transformers: pages private
"""

from __future__ import annotations

import logging
import os

import torch
from transformers.cache_utils import Cache

from ..config import CacheConfig
from . import FETCH_BLOCK_TOKENS, FETCH_BLOCK_TOKENS_CPU, attention, codecs, int8_pool, uva
from .disk import PageLost  # the engine catches it from here
from .layer import TieredLayer, index_tensor
from .peer import PeerLostError
from .prefix import PrefixAndCrop
from .step_views import StepViews
from .store import PageStore, namespace_for, page_key

log = logging.getLogger("flashguard")


class TieredCache(StepViews, PrefixAndCrop, Cache):
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
            self._dev_slots, self._dev_slots_key = index_tensor(slots, device), key
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
