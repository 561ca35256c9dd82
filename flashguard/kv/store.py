"""PageStore: content-addressed pages in L2 (host RAM) and L3 (disk), shared by every TieredCache.

A *page* is ``page_size`` consecutive tokens of K and V for all layers. Its key chains
``hash(parent_key, token ids of the page, namespace)``, so two sequences with the same token prefix
produce the same keys and share the pages. The namespace covers model identity (a LoRA adapter's content
included), KV dtype, page size, codecs (an int8 pool's too) and an isolation salt: pages never cross models,
adapters or tenants.

Contract:
- ``put_many(keys, k, v, summary)`` (``put`` for one) stores full pages (``[layers, kv_heads, n, page_size,
  head_dim]``) in L2, encoded with the L2 codec in one go; a key that exists only takes a reference. The caller
  holds one reference per page in its page table and gives it back with ``release``.
- ``get(key, layer=None)`` returns the encoded tensors of a page (all layers, or one), promoting it from L3 to
  L2 (a page fault) when needed; ``None`` when the key is unknown. The hot paths instead ask ``slots(keys)``
  once and read many pages of a layer from the L2 arena (one pinned buffer): ``arena.gather`` on the host, or
  straight from the GPU (``uva.gather_rows``: sparse decoding, the one-graph sparse step, prefill past the pool).
- The store only stores; ``policy.TierPolicy`` decides placement. When L2 holds more than ``l2_tokens`` the
  policy's coldest pages are demoted to L3 (int4 + zstd files; a page that already has its file leaves L2
  for free). When L3 is full the policy's coldest unreferenced page gives its file up; with no such page (or
  L3 disabled) an unreferenced page is forgotten and a referenced one stays in L2 over budget: nothing a live
  sequence needs is ever dropped. A page read from L3 is promoted to L2 and stays there while it is read.
- The one-graph sparse step reads L2 without asking the store: ``peek_slots(keys)`` gives its slot table (-1 for a
  page only in L3, nothing promoted; valid until ``moves`` changes), ``warm(keys)`` reports what it read (a page a
  live sequence's decoding read in the last ``TierPolicy.hot_steps`` forwards stays in L2 over budget; ``clock``
  counts the forwards of the sequences on this store, ``tick``, so what stays does not depend on how fast a machine
  decodes), and its misses go
  to ``prefetch(keys)``: read, verified and transcoded (int4 -> int8, ``codecs.transcode``) on worker threads,
  put in L2 by ``install_prefetched()`` on the caller's thread between steps (or promoted at once with ``slots``
  when a step missed many). A synchronous read of a page in flight waits for the worker's read. ``deferred()`` (a
  prefill): pages over budget stay in L2 and their L3 files are written on a worker; L2 is trimmed at the end, for
  free (unreferenced pages first). ``spill()`` moves every unreferenced page to L3.
- ``check_integrity()`` raises AssertionError if the bookkeeping is inconsistent (tests call it).
- Why L3 is off or failing (a missing package, an unusable folder) is ``l3_error``, warned once.
- L2's storage is ``L2Arena`` (``kv/arena.py``); the L3 reads and writes off the hot paths (``prefetch``,
  ``deferred``) are ``L3Traffic`` (``kv/store_l3.py``), a part of this class kept in its own file.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..config import CacheConfig
from . import OUT_OF_MEMORY, codecs
from .arena import L2Arena
from .disk import L3Folder, PageLost
from .policy import TierPolicy
from .store_l3 import L3Traffic

log = logging.getLogger("flashguard")


def page_key(parent: bytes, token_ids, namespace: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(namespace)
    h.update(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
    return h.digest()


def namespace_for(model_id: str, dtype: torch.dtype, config: CacheConfig) -> bytes:
    # an int8 pool's pages were rounded once more before the L2 codec: not the same page as a 16-bit pool's
    text = f"{model_id}|{dtype}|{config.page_size}|{config.l2_codec}|{config.l3_codec}|{config.isolation_salt}"
    if config.l1_codec == "int8":
        text += "|l1-int8"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass
class _Page:
    refs: int = 0
    l2: int | None = None        # slot in the L2 arena
    l3: str | None = None        # file path
    summary: torch.Tensor | None = None  # [layers, kv_heads, 2, head_dim] key min/max, CPU
    heat: float = 0.0
    read_at: int = -(1 << 62)    # the store's ``clock`` at the last decoding read (``warm``): hot pages stay in L2


@dataclass
class TierStats:
    hits: dict = field(default_factory=lambda: {"l2": 0, "l3": 0})
    misses: int = 0
    page_faults: int = 0          # L3 reads
    bytes_to_l2: int = 0
    bytes_to_l3: int = 0
    bytes_from_l3: int = 0
    pages_shared: int = 0         # puts that found the page already stored
    codec_seconds: float = 0.0
    disk_seconds: float = 0.0
    disk_errors: int = 0          # L3 writes that failed (missing, read-only or full folder)
    corrupt_pages: int = 0        # L3 reads that failed verification: dropped, recomputed by the caller
    l3_evictions: int = 0         # L3 files removed to make room (unreferenced pages only)
    prefetched: int = 0           # L3 reads queued on the prefetch worker (off the decode path)


class PageStore(L3Traffic):
    def __init__(self, config: CacheConfig, pin_memory: bool = False, policy: TierPolicy | None = None):
        if config.l2_tokens is None:   # a store made outside an engine: L2 holds everything
            config = config.replace(l2_tokens=1 << 40)
        self.config = config
        self.policy = policy or TierPolicy()
        self.pin = pin_memory
        self.arena = L2Arena(pin_memory)
        self.epoch = 0  # bumped whenever a page leaves its L2 slot (callers may cache key -> slot until then)
        self.moves = 0  # bumped whenever a page enters or leaves an L2 slot (``peek_slots`` tables are valid until)
        # every change of a page's L2 slot since ``slot_log_base`` entries were dropped: (key, new slot; -1 gone from
        # L2, -2 gone from the store), so a slot table can be brought up to date without asking for every page
        self.slot_log: list[tuple[bytes, int]] = []
        self.slot_log_base = 0
        self._deferred = 0                 # > 0 inside ``deferred()``: pages over budget stay in L2
        self._writer = None                # the thread that writes L3 files inside ``deferred()``
        self._pending: dict = {}           # key -> Future of an L3 write in flight
        self._readers: dict = {}           # "decode" / "bulk" -> the threads that read L3 files (``prefetch``)
        self._fetching: dict = {}          # key -> (its L3 file, Future of its read) in flight
        self.pages: "OrderedDict[bytes, _Page]" = OrderedDict()  # LRU order: oldest first
        self.lock = threading.RLock()
        self.clock = 0                     # forwards of the sequences on this store (``tick``): "read lately"
        self.stats = TierStats()
        self.l3_enabled = config.l3_tokens > 0
        self.disk = None
        self.l3_error: str | None = None   # why L3 is off or failing (engine_info's tiers.l3.error), None while fine
        self._warned: set = set()
        if self.l3_enabled:
            try:
                self.disk = L3Folder(config.l3_dir, encrypt=config.l3_encrypt)
            except OSError as exc:
                self._disk_warning(f"cannot create the L3 folder {config.l3_dir!r}: {exc.strerror}")
            except ImportError as exc:   # a dependency missing from this Python (cryptography, psutil)
                self._disk_warning(f"L3 needs the `{exc.name or exc}` package, which this Python lacks "
                                   f"(pip install {exc.name or 'cryptography'}"
                                   + ("; or kv.l3_encrypt: false, checksummed unencrypted pages"
                                      if exc.name and exc.name.startswith("cryptography") else "") + ")")
        self.l3_dir = self.disk.path if self.disk else None
        self.l3_pages = 0  # pages with a file in L3 (kept, not recounted on every demotion)
        self.l2_pages_max = max(1, config.l2_tokens // config.page_size)
        self.l3_pages_max = config.l3_tokens // config.page_size

    # ---- writes ---------------------------------------------------------------------------
    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, summary: torch.Tensor) -> None:
        """One page: k/v ``[layers, kv_heads, page_size, head_dim]``, summary ``[layers, kv_heads, 2, head_dim]``."""
        self.put_many([key], k.unsqueeze(2), v.unsqueeze(2), summary.unsqueeze(0))

    def put_many(self, keys: list[bytes], k: torch.Tensor, v: torch.Tensor, summary: torch.Tensor) -> None:
        """Several pages at once: k/v ``[layers, kv_heads, n, page_size, head_dim]``, summary ``[n, layers, ...]``.
        Pages already stored take a reference; the new ones are encoded together (``_encode_to_host``) and copied
        to the host. An error raised by the encode (a CUDA out-of-memory on a single page) leaves the store as it
        was: no reference is taken before it."""
        with self.lock:
            new = [i for i, key in enumerate(keys) if key not in self.pages]
            if new:
                t0 = time.perf_counter()
                enc = self._encode_to_host(k, v, new)
                summary = summary[new].to("cpu")
            fresh = set(new)
            for i, key in enumerate(keys):
                if i not in fresh:
                    self.pages[key].refs += 1
                    self.stats.pages_shared += 1
                    self.pages.move_to_end(key)
            if not new:
                return
            for j, i in enumerate(new):
                slot = self.arena.write({n: (t if n == "bits" else t[:, :, j]) for n, t in enc.items()})
                self.pages[keys[i]] = _Page(refs=1, l2=slot, summary=summary[j].clone())
                self._moved(keys[i], slot)
            self.moves += 1
            self.stats.codec_seconds += time.perf_counter() - t0
            self.stats.bytes_to_l2 += len(new) * self.arena.page_bytes()
            self._enforce_budgets()

    def _encode_to_host(self, k: torch.Tensor, v: torch.Tensor, pages: list[int]) -> dict:
        """``codecs.encode`` of the pages ``pages`` of ``k``/``v`` (``[layers, kv_heads, n, page_size, head_dim]``)
        on their device, every field (``[layers, kv_heads, len(pages), ...]``) copied to the host. Where the
        encode's temporaries do not fit the GPU (a crop at 128K under a 4 GiB budget ran out of memory here, with
        the allocator at its cap), the pages are encoded in halves, down to one page, whose error is
        raised (the engine's prefill recovers from it); the codes are the same (each page is quantized alone)."""
        try:
            if pages == list(range(k.shape[2])):
                enc = codecs.encode(k, v, self.config.l2_codec)
            else:
                pick = torch.tensor(pages, device=k.device)
                enc = codecs.encode(k.index_select(2, pick), v.index_select(2, pick), self.config.l2_codec)
            return {n: t.to("cpu") for n, t in enc.items()}
        except OUT_OF_MEMORY:
            if len(pages) == 1:
                raise
        # past the except block: its traceback (and the failed attempt's GPU temporaries) is released first
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        log.info("flashguard: out of GPU memory encoding %d pages for L2; encoding them in halves", len(pages))
        half = len(pages) // 2
        a = self._encode_to_host(k, v, pages[:half])
        b = self._encode_to_host(k, v, pages[half:])
        return {f: a[f] if f == "bits" else torch.cat([a[f], b[f]], dim=2) for f in a}

    def _touch(self, key: bytes) -> _Page | None:
        """The page, marked most recently used; None (and a miss) if unknown. Call with the lock held."""
        page = self.pages.get(key)
        if page is None:
            self.stats.misses += 1
            return None
        self.pages.move_to_end(key)
        return page

    def acquire(self, key: bytes) -> bool:
        """Take a reference to an existing page (prefix sharing); False if unknown."""
        with self.lock:
            page = self._touch(key)
            if page is not None:
                page.refs += 1
            return page is not None

    def release(self, key: bytes) -> None:
        with self.lock:
            page = self.pages.get(key)
            if page is not None and page.refs > 0:
                page.refs -= 1

    # ---- reads ----------------------------------------------------------------------------
    def summary(self, key: bytes) -> torch.Tensor:
        return self.pages[key].summary

    def read_ahead(self, keys) -> None:
        """``keys`` are about to be read one by one (``get``): those only on disk start coming back in parallel."""
        with self.lock:
            self._read_ahead(keys)

    def get(self, key: bytes, layer: int | None = None) -> dict | None:
        """Encoded tensors of a page (one layer, or all with ``layer=None``); promotes from L3."""
        with self.lock:
            slot = self._in_l2(key, protect={key})
            # copies: a view would change under the caller when a later call reuses this slot
            return None if slot is None else {n: t.clone() for n, t in self.arena.read(slot, layer).items()}

    def slots(self, keys: list[bytes]) -> list[int] | None:
        """L2 slots of ``keys`` (promoting pages from L3, none of these demoted meanwhile); None when one is
        unknown or failed verification. Valid until ``epoch`` changes; read them with ``arena.gather``."""
        with self.lock:
            out, protect = [], set(keys)
            self._read_ahead(keys)
            moves = self.moves
            try:
                for key in keys:
                    slot = self._in_l2(key, protect, enforce=False)
                    if slot is None:
                        return None
                    out.append(slot)
                return out
            finally:   # the budget, once for every page this call promoted (none of them leaves L2)
                if self.moves != moves:
                    self._enforce_budgets(protect=protect, written=True)

    def peek_slots(self, keys: list[bytes]) -> list[int] | None:
        """L2 slots of ``keys``, -1 for a page whose only copy is in L3: nothing is promoted, touched or counted
        (the one-graph sparse step's slot table: a picked page at -1 is promoted by the host, and the step runs
        again). None when a key is unknown. Valid until ``moves`` changes."""
        with self.lock:
            out = []
            for key in keys:
                page = self.pages.get(key)
                if page is None:
                    return None
                out.append(-1 if page.l2 is None else page.l2)
            return out

    SLOT_LOG_MAX = 1 << 14

    def _moved(self, key: bytes, slot: int) -> None:
        """``key``'s L2 slot is now ``slot`` (-1: gone from L2, -2: from the store). Call with the lock held."""
        self.slot_log.append((key, slot))
        if len(self.slot_log) > self.SLOT_LOG_MAX:   # readers this far behind rebuild their table
            drop = len(self.slot_log) // 2
            del self.slot_log[:drop]
            self.slot_log_base += drop

    def slot_changes(self, since: int) -> list[tuple[bytes, int]] | None:
        """The slot changes after the first ``since`` ever logged (``slot_log_base + len(slot_log)`` is the
        count now); None when some were dropped since (ask ``peek_slots`` again)."""
        with self.lock:
            start = since - self.slot_log_base
            return None if start < 0 else self.slot_log[start:]

    def slot_log_end(self) -> int:
        return self.slot_log_base + len(self.slot_log)

    def tick(self) -> None:
        """One forward of a sequence on this store (a decode step or a prefill chunk; ``TieredCache`` calls it):
        the policy's clock. Counted in forwards, not seconds, so what stays hot does not depend on the machine."""
        self.clock += 1

    def warm(self, keys) -> None:
        """Pages attention read without asking the store (zero-copy reads in the one-graph step): they count as
        read now (at ``clock``) for the policy (heat, recency), so what decoding keeps reading is not what leaves
        L2."""
        with self.lock:
            for key in keys:
                page = self.pages.get(key)
                if page is not None:
                    page.heat += 1.0
                    page.read_at = self.clock
                    self.pages.move_to_end(key)

    def count_hits(self, n: int) -> None:
        """L2 reads a caller served from its own copy of the slot table (``slots`` while ``epoch`` held)."""
        self.stats.hits["l2"] += n

    def _in_l2(self, key: bytes, protect: set, enforce: bool = True) -> int | None:
        """The L2 slot of ``key``, read now: touched, warmed, promoted from L3 if needed (``protect`` is not
        demoted meanwhile); None when unknown or its L3 file failed verification. Call with the lock held."""
        page = self._touch(key)
        if page is None:
            return None
        page.heat += 1.0
        if page.l2 is not None:
            self.stats.hits["l2"] += 1
            return page.l2
        try:
            self._promote(key, page, protect, enforce)
        except PageLost as exc:
            self._drop_corrupt(key, page, exc)
            return None
        return page.l2

    def _drop_corrupt(self, key: bytes, page: _Page, exc: Exception) -> None:
        self.stats.corrupt_pages += 1
        self._warn_once("corrupt", f"flashguard: dropped an L3 page that failed verification ({exc}); "
                        "its tokens will be recomputed")
        self.disk.remove(page.l3)
        self.l3_pages -= 1
        del self.pages[key]
        self._moved(key, -2)

    def _promote(self, key: bytes, page: _Page, protect: set, enforce: bool = True) -> None:
        fetch = self._fetching.pop(key, None)
        if fetch is not None and fetch[0] == page.l3:   # already being read on the prefetch worker: its result
            enc, size, disk_s, codec_s = fetch[1].result()   # (the worker takes no lock; PageLost as below)
        else:
            t0 = time.perf_counter()
            blob = self.disk.read(key, page.l3)
            disk_s, size = time.perf_counter() - t0, len(blob)
            t0 = time.perf_counter()
            enc = self._l2_encoding(blob)
            codec_s = time.perf_counter() - t0
        self.stats.disk_seconds += disk_s
        self.stats.codec_seconds += codec_s
        self.stats.page_faults += 1
        self.stats.hits["l3"] += 1
        self.stats.bytes_from_l3 += size
        page.l2 = self.arena.write(enc)
        self._moved(key, page.l2)
        self.moves += 1
        if enforce:
            self._enforce_budgets(protect=protect | {key}, written=True)

    def _l2_encoding(self, blob: bytes) -> dict | torch.Tensor:
        """An L3 file's payload as an L2 page: the arena's rows where an int4 file unpacks straight into the int8
        layout (``codecs.int4_as_int8_rows``: numpy, no torch call, the GIL left to the decoding thread), else the
        encoded dict (``codecs.transcode``); PageLost when it does not decode."""
        try:
            if self.config.l2_codec == "int8" and self.arena.layout:
                rows = codecs.int4_as_int8_rows(blob, self.arena.layout, self.arena.row_bytes)
                if rows is not None:
                    return rows
            return codecs.transcode(codecs.from_bytes(blob), self.config.l2_codec)
        except (ValueError, KeyError, RuntimeError, IndexError) as exc:
            raise PageLost(f"undecodable page: {exc}") from exc

    # ---- budgets --------------------------------------------------------------------------
    def expect_tokens(self, tokens: int) -> None:
        """``tokens`` new tokens are coming (a prompt being prefilled, inside ``deferred``): L2 makes room for their
        pages (and the one they may complete) at once (``L2Arena.expect``)."""
        with self.lock:
            self.arena.expect(self.arena.used() + -(-tokens // self.config.page_size) + 1)

    def _enforce_budgets(self, protect: set = frozenset(), written: bool = False) -> None:
        """L2 back to its budget (the policy's victims leave; see the module docstring). Inside ``deferred()``
        nothing leaves: the victims' L3 files are written on the worker meanwhile, a scan skipped when the pages
        that took L2 are ``written`` already (promoted from L3: they brought no page without a file)."""
        excess = self.arena.used() - self.l2_pages_max
        if excess <= 0:
            return
        if self._deferred:
            if self.disk is not None and not written:
                for key in self.policy.l2_victims(self.pages, excess, protect, self.clock):
                    page = self.pages[key]
                    if page.l3 is None:
                        self._write_later(key, page)
            return
        victims = self.policy.l2_victims(self.pages, excess, protect, self.clock)
        for key in victims:
            self._demote(key, self.pages[key], protect)
        if victims:
            self.policy.cool(self.pages)

    def _demote(self, key: bytes, page: _Page, protect: set = frozenset()) -> None:
        if page.l3 is None and self.disk is not None and self.l3_pages >= self.l3_pages_max:
            self._evict_l3(protect | {key})
        if page.l3 is None and self.disk is not None and self.l3_pages < self.l3_pages_max:
            try:
                t0 = time.perf_counter()
                k, v = codecs.decode(self.arena.read(page.l2), torch.float32)
                blob = codecs.to_bytes(codecs.encode(k, v, self.config.l3_codec))
                self.stats.codec_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                page.l3 = self.disk.write(key, blob)
                self.l3_pages += 1
                self.stats.disk_seconds += time.perf_counter() - t0
                self.stats.bytes_to_l3 += len(blob)
            except OSError as exc:
                self.stats.disk_errors += 1
                self._disk_warning(f"cannot write to the L3 folder {self.l3_dir}: {exc.strerror or exc}")
        if page.l3 is not None or page.refs == 0:
            self.arena.release(page.l2)
            page.l2 = None
            self._moved(key, -1)
            self.epoch += 1
            self.moves += 1
        if page.l3 is None and page.refs == 0:
            del self.pages[key]  # unreferenced and no room on disk: forget it (a later miss recomputes)
            self._moved(key, -2)
        # else: referenced and L3 unavailable -> stays in L2 over budget; nothing a sequence needs is lost

    def spill(self) -> int:
        """Every page no sequence references leaves L2 for L3 (written where it has no file yet); returns how many.
        What a long idle time does to a stored conversation: the benchmark's new session "every page in L3"."""
        with self.lock:
            keys = [k for k, p in self.pages.items() if p.l2 is not None and p.refs == 0]
            for key in keys:
                self._demote(key, self.pages[key])
            return sum(1 for k in keys if k in self.pages and self.pages[k].l2 is None)

    def _evict_l3(self, protect: set) -> None:
        """L3 is full: the policy's victim gives its file up (forgotten when it has no L2 copy either)."""
        key = self.policy.l3_victim(self.pages, protect)
        if key is None:
            return
        page = self.pages[key]
        self.disk.remove(page.l3)
        page.l3 = None
        self.l3_pages -= 1
        self.stats.l3_evictions += 1
        if page.l2 is None:
            del self.pages[key]
            self._moved(key, -2)

    def _disk_warning(self, text: str) -> None:
        self.l3_error = text
        self._warn_once("disk", text + "; continuing with host RAM (L2) only")

    def _warn_once(self, kind: str, text: str) -> None:
        warned = self.__dict__.setdefault("_warned", set())
        if kind not in warned:
            warned.add(kind)
            log.warning(text)


    # ---- introspection --------------------------------------------------------------------
    def tier_counts(self) -> dict:
        with self.lock:
            l2 = sum(p.l2 is not None for p in self.pages.values())
            return {"l2_pages": l2, "l3_pages": self.l3_pages, "pages": len(self.pages),
                    "l2_bytes": l2 * self.arena.page_bytes(), "l2_arena_slots": self.arena.capacity}

    def stats_dict(self) -> dict:
        s = self.stats
        with self.lock:
            return {**self.tier_counts(), "hits": dict(s.hits), "misses": s.misses, "page_faults": s.page_faults,
                    "bytes_to_l2": s.bytes_to_l2, "bytes_to_l3": s.bytes_to_l3, "bytes_from_l3": s.bytes_from_l3,
                    "pages_shared": s.pages_shared, "codec_seconds": s.codec_seconds,
                    "disk_seconds": s.disk_seconds, "disk_errors": s.disk_errors, "corrupt_pages": s.corrupt_pages,
                    "l3_evictions": s.l3_evictions, "prefetched": s.prefetched}

    def check_integrity(self) -> None:
        for fut in list(self._pending.values()):
            fut.result()
        with self.lock:
            for key, p in self.pages.items():
                assert p.refs >= 0, f"negative refcount on {key.hex()}"
                assert p.l2 is not None or p.l3 is not None, f"page {key.hex()} is in no tier"
            assert self.l3_pages == sum(p.l3 is not None for p in self.pages.values()), "L3 page count drifted"
            slots = [p.l2 for p in self.pages.values() if p.l2 is not None]
            assert len(set(slots)) == len(slots), "two pages share an L2 slot"
            free = set(self.arena.free) | set(self.arena.recycled)
            assert not set(slots) & free, "a page's L2 slot is also free"
            assert len(slots) == self.arena.used(), "an L2 slot leaked"
            for key, p in self.pages.items():
                if p.l3 is not None:
                    assert p.l3.startswith(self.l3_dir), f"L3 file of {key.hex()} is outside the L3 folder"
                assert p.summary is not None and p.summary.dim() == 4

    def close(self) -> None:
        if "arena" in self.__dict__:
            self.arena.drop_ahead()
        for pool in self.__dict__.get("_readers", {}).values():
            pool.shutdown(wait=True, cancel_futures=True)
        self._fetching.clear()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
