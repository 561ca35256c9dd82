"""Tier policy: how big each tier is, and which page leaves a tier when it is full.

The L2 arena and the L3 folder (``store.py``) only store; every placement decision is made here, from one heat
signal: a page's ``heat`` rises by one each time attention reads it from the store and halves at every demotion
round, so it means "read lately".

- ``size_tiers`` turns the ``auto`` sizes of a ``CacheConfig`` into numbers at engine start: the pool (L1, on the
  compute device) from what the VRAM budget leaves, L2 from the host RAM available.
- ``TierPolicy.l2_victims`` picks the pages that leave L2 when it is over budget: pages no live sequence references
  first (a released conversation's, kept only for a later session with the same prefix), then the coldest, never
  a page being read right now (``protect``) or one a live sequence's decoding read lately (``hot_steps``), and
  among equally cold ones the least recently used. A page that already has an L3 file leaves L2 for free
  (nothing is written again).
- ``TierPolicy.l3_victim`` picks the page whose L3 file is removed when L3 is full: a page no live sequence
  references, preferring one that still has its L2 copy, coldest first. Referenced pages are never dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..config import CacheConfig

log = logging.getLogger("flashguard")

L2_RAM_SHARE = 0.5          # auto L2: at most this share of the host RAM available at start


def round_pages(tokens: int, page: int) -> int:
    return -(-max(tokens, page) // page) * page


def size_tiers(kv: CacheConfig, *, context: int, pool_tokens: int, l2_bytes_per_token: int,
               host_available: int | None, kv_heads: int) -> CacheConfig:
    """``kv`` with ``l1_tokens``, ``l1_max_tokens`` and ``l2_tokens`` set (the ones given stay as given).

    pool_tokens        tokens of fp16/bf16 KV the device can hold beside the weights and activations
    l2_bytes_per_token host bytes one token takes in L2 (all layers, K and V, the L2 codec)
    host_available     bytes of host RAM available now (None: unknown, L2 holds the whole context)

    When the pool holds the whole context, L1 is the whole context: every page stays resident and no page is
    ever read from the store. Otherwise the pool is the recent window plus a hot set of pages that sparse
    decoding brings back (``kv_heads`` x ``budget_tokens``, at most a quarter of the pool)."""
    p = kv.page_size
    full = round_pages(context, p)
    pool = max(p, (pool_tokens // p) * p)
    l1, l1_max = kv.l1_tokens, kv.l1_max_tokens
    if l1 is None:
        if pool >= full:
            l1 = full
        else:
            hot = min(pool // 4, kv_heads * kv.budget_tokens)
            l1 = max(p, ((pool - hot) // p) * p)
    if l1_max is None:
        l1_max = max(l1, full if l1 >= full else max(l1, pool))
    l2 = kv.l2_tokens
    if l2 is None:
        # room for the whole context: the pages off the pool, and a released session's pages kept for the next
        # session with the same prefix (a resident session is written to L2 when it ends)
        off = max(0, full - l1)
        if host_available is None:
            l2 = full
        else:
            l2 = int(host_available * L2_RAM_SHARE) // max(1, l2_bytes_per_token)
            l2 = max(p, (min(l2, full) // p) * p)
            if l2 < off:
                log.warning("flashguard: host RAM holds %d of the %d off-pool tokens in L2; the rest go to disk "
                            "(L3). Set models[main].parameters.kv.l2_tokens to change it", l2, off)
    return kv.replace(l1_tokens=l1, l1_max_tokens=l1_max, l2_tokens=l2,
                      l1_codec="fp16" if kv.l1_codec == "auto" else kv.l1_codec)


def host_available() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or unsupported platform: size L2 for the whole context
        return None


@dataclass
class TierPolicy:
    """Placement decisions over the store's pages (``PageStore.pages``: key -> page with ``refs``, ``l2``, ``l3``,
    ``heat``; insertion order is least recently used first)."""

    decay: float = 0.5
    # a referenced page decoding read (``PageStore.warm``) in the last ``hot_steps`` forwards of the sequences on its
    # store (``PageStore.clock``: decode steps and prefill chunks) stays in L2. Counted in forwards, not seconds: a
    # wall-clock window let a slow machine (a loaded 2-core CPU) demote and read again from disk pages a fast one
    # kept. 256 are ~2 s of the 1.5B model's decoding on a fast GPU, ~10-25 s on a laptop CPU: the pages over budget are
    # those decoding read in that many steps (sparse selections drift slowly: a few selections' worth).
    hot_steps: int = 256

    def l2_victims(self, pages: dict, n: int, protect: set, clock: int) -> list:
        """Up to ``n`` keys of pages in L2 to demote: unreferenced pages first (no live sequence reads them: a
        released conversation's pages go to disk before a live one's, whatever heat they gathered while they were
        read), then coldest first; LRU order breaks ties (sorted is stable). A page of a live sequence that its
        decoding read in the last ``hot_steps`` forwards (``clock``: the store's count of them) is not one:
        L2 holds what decoding reads (the budget bounds the cold pages), so a page promoted from L3 is not read
        from disk again while it stays hot. Once no sequence references it, that protection ends
        (``reset_session`` hands a conversation's pages back to the budget)."""
        if n <= 0:
            return []
        hot = clock - self.hot_steps
        in_l2 = [k for k, p in pages.items()
                 if p.l2 is not None and k not in protect and (p.refs == 0 or p.read_at < hot)]
        return sorted(in_l2, key=lambda k: (pages[k].refs > 0, pages[k].heat))[:n]

    def cool(self, pages: dict) -> None:
        """One demotion round has passed: halve every page's heat."""
        for p in pages.values():
            p.heat *= self.decay

    def l3_victim(self, pages: dict, protect: set):
        """The key of a page whose L3 file may be removed to make room, or None: an unreferenced page (no live
        sequence needs it), coldest first, preferring one whose copy in L2 survives it."""
        best = None
        for k, p in pages.items():
            if p.l3 is None or p.refs > 0 or k in protect:
                continue
            rank = (p.l2 is None, p.heat)
            if best is None or rank < best[0]:
                best = (rank, k)
        return None if best is None else best[1]
