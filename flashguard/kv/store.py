"""PageStore: content-addressed pages in L2 (host RAM) and L3 (disk), shared by every TieredCache.

A *page* is ``page_size`` consecutive tokens of K and V for all layers. Its key chains
``hash(parent_key, token ids of the page, namespace)``, so two sequences with the same token prefix
produce the same keys and share the pages. The namespace covers model identity, KV dtype, codecs and
an isolation salt: pages never cross models or tenants.

Contract:
- ``put(key, k, v, summary)`` stores a full page (``[layers, kv_heads, page_size, head_dim]``) in L2,
  encoded with the L2 codec; if the key exists it only takes a reference. The caller holds one reference
  per page in its page table and gives it back with ``release``.
- ``get(key, layer)`` returns the encoded tensors of one layer of a page, promoting it from L3 to L2
  (a page fault) when needed; ``None`` when the key is unknown.
- When L2 holds more than ``l2_tokens`` the coldest pages are demoted to L3 (int4 + zstd files); when L3 is
  over ``l3_tokens`` (or disabled) the coldest unreferenced pages are dropped, and referenced ones stay in
  L2 over budget rather than being lost: nothing a live sequence needs is ever dropped.
- ``check_integrity()`` raises AssertionError if the bookkeeping is inconsistent (tests call it).
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
from . import codecs
from .disk import L3Folder, PageCorrupt

log = logging.getLogger("flashguard")


def page_key(parent: bytes, token_ids, namespace: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(namespace)
    h.update(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes())
    return h.digest()


def namespace_for(model_id: str, dtype: torch.dtype, config: CacheConfig) -> bytes:
    text = f"{model_id}|{dtype}|{config.page_size}|{config.l2_codec}|{config.l3_codec}|{config.isolation_salt}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass
class _Page:
    refs: int = 0
    l2: dict | None = None       # encoded tensors, layers first (CPU, pinned when CUDA is used)
    l3: str | None = None        # file path
    summary: torch.Tensor | None = None  # [layers, kv_heads, 2, head_dim] key min/max, CPU
    heat: float = 0.0


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


class PageStore:
    def __init__(self, config: CacheConfig, pin_memory: bool = False):
        self.config = config
        self.pin = pin_memory
        self.pages: "OrderedDict[bytes, _Page]" = OrderedDict()  # LRU order: oldest first
        self.lock = threading.RLock()
        self.stats = TierStats()
        self.l3_enabled = config.l3_tokens > 0
        self.disk = None
        if self.l3_enabled:
            try:
                self.disk = L3Folder(config.l3_dir, encrypt=config.l3_encrypt)
            except OSError as exc:
                self._disk_warning(f"cannot create the L3 folder {config.l3_dir!r}: {exc.strerror}")
        self.l3_dir = self.disk.path if self.disk else None
        self.l3_pages = 0  # pages with a file in L3 (kept, not recounted on every demotion)
        self._warned: set = set()
        self.l2_pages_max = max(1, config.l2_tokens // config.page_size)
        self.l3_pages_max = config.l3_tokens // config.page_size

    # ---- writes ---------------------------------------------------------------------------
    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, summary: torch.Tensor) -> None:
        with self.lock:
            page = self.pages.get(key)
            if page is not None:
                page.refs += 1
                self.stats.pages_shared += 1
                self.pages.move_to_end(key)
                return
            t0 = time.perf_counter()
            enc = codecs.encode(k, v, self.config.l2_codec)
            enc = {n: self._host(t) for n, t in enc.items()}
            self.stats.codec_seconds += time.perf_counter() - t0
            self.stats.bytes_to_l2 += codecs.nbytes(enc)
            self.pages[key] = _Page(refs=1, l2=enc, summary=summary.to("cpu"))
            self._enforce_budgets()

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to("cpu", non_blocking=False).contiguous()
        return t.pin_memory() if self.pin else t

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

    def get(self, key: bytes, layer: int | None = None) -> dict | None:
        """Encoded tensors of a page (one layer, or all with ``layer=None``); promotes from L3."""
        with self.lock:
            page = self._touch(key)
            if page is None:
                return None
            page.heat += 1.0
            if page.l2 is None:
                try:
                    self._promote(key, page)
                except PageCorrupt as exc:
                    self.stats.corrupt_pages += 1
                    self._warn_once("corrupt", f"flashguard: dropped an L3 page that failed verification ({exc}); "
                                    "its tokens will be recomputed")
                    self.disk.remove(page.l3)
                    self.l3_pages -= 1
                    del self.pages[key]
                    return None
            else:
                self.stats.hits["l2"] += 1
            enc = page.l2
        return enc if layer is None else {n: (t if n == "bits" else t[layer]) for n, t in enc.items()}

    def _promote(self, key: bytes, page: _Page) -> None:
        t0 = time.perf_counter()
        blob = self.disk.read(key, page.l3)
        self.stats.disk_seconds += time.perf_counter() - t0
        self.stats.page_faults += 1
        self.stats.hits["l3"] += 1
        self.stats.bytes_from_l3 += len(blob)
        t0 = time.perf_counter()
        try:
            k, v = codecs.decode(codecs.from_bytes(blob), torch.float32)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise PageCorrupt(f"undecodable page: {exc}") from exc
        enc = codecs.encode(k, v, self.config.l2_codec)
        self.stats.codec_seconds += time.perf_counter() - t0
        page.l2 = {n: self._host(t) for n, t in enc.items()}
        self._enforce_budgets(protect=key)

    # ---- budgets --------------------------------------------------------------------------
    def _enforce_budgets(self, protect: bytes | None = None) -> None:
        in_l2 = [k for k, p in self.pages.items() if p.l2 is not None]
        excess = len(in_l2) - self.l2_pages_max
        if excess <= 0:
            return
        victims = sorted((k for k in in_l2 if k != protect), key=lambda k: self.pages[k].heat)
        for key in victims[:excess]:
            self._demote(key, self.pages[key])
        for p in self.pages.values():
            p.heat *= 0.5  # decay, so heat means "used lately"

    def _demote(self, key: bytes, page: _Page) -> None:
        if page.l3 is None and self.disk is not None and self.l3_pages < self.l3_pages_max:
            try:
                t0 = time.perf_counter()
                k, v = codecs.decode(page.l2, torch.float32)
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
        if page.l3 is not None:
            page.l2 = None
        elif page.refs == 0:
            del self.pages[key]  # unreferenced and no room on disk: forget it (a later miss recomputes)
        # else: referenced and L3 unavailable -> stays in L2 over budget; nothing a sequence needs is lost

    def _disk_warning(self, text: str) -> None:
        self._warn_once("disk", text + "; continuing with host RAM (L2) only")

    def _warn_once(self, kind: str, text: str) -> None:
        warned = self.__dict__.setdefault("_warned", set())
        if kind not in warned:
            warned.add(kind)
            log.warning(text)


    # ---- introspection --------------------------------------------------------------------
    def tier_counts(self) -> dict:
        with self.lock:
            return {"l2_pages": sum(p.l2 is not None for p in self.pages.values()),
                    "l3_pages": self.l3_pages, "pages": len(self.pages),
                    "l2_bytes": sum(codecs.nbytes(p.l2) for p in self.pages.values() if p.l2 is not None)}

    def stats_dict(self) -> dict:
        s = self.stats
        with self.lock:
            return {**self.tier_counts(), "hits": dict(s.hits), "misses": s.misses, "page_faults": s.page_faults,
                    "bytes_to_l2": s.bytes_to_l2, "bytes_to_l3": s.bytes_to_l3, "bytes_from_l3": s.bytes_from_l3,
                    "pages_shared": s.pages_shared, "codec_seconds": s.codec_seconds,
                    "disk_seconds": s.disk_seconds, "disk_errors": s.disk_errors, "corrupt_pages": s.corrupt_pages}

    def check_integrity(self) -> None:
        with self.lock:
            for key, p in self.pages.items():
                assert p.refs >= 0, f"negative refcount on {key.hex()}"
                assert p.l2 is not None or p.l3 is not None, f"page {key.hex()} is in no tier"
            assert self.l3_pages == sum(p.l3 is not None for p in self.pages.values()), "L3 page count drifted"
            for key, p in self.pages.items():
                if p.l3 is not None:
                    assert p.l3.startswith(self.l3_dir), f"L3 file of {key.hex()} is outside the L3 folder"
                assert p.summary is not None and p.summary.dim() == 4

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
