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
  when a step missed many). A synchronous read of a page in flight waits for the worker's read. ``deferred()`` (a prefill): pages over budget stay in L2 and their L3 files are written
  on a worker; L2 is trimmed at the end, for free (unreferenced pages first). ``spill()`` moves every unreferenced
  page to L3.
- ``check_integrity()`` raises AssertionError if the bookkeeping is inconsistent (tests call it).
- Why L3 is off or failing (a missing package, an unusable folder) is ``l3_error``, warned once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import CacheConfig
from . import OUT_OF_MEMORY, codecs
from .disk import L3Folder, PageLost
from .policy import TierPolicy

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


class L2Arena:
    """L2 pages in one host byte tensor ``[layers, slots, bytes]``: a page is a slot, and one layer of a page is
    one row holding every codec field (``layout``: name, dtype, shape, byte offset, byte length).

    Reading many pages of a layer is one host gather (or, for consecutive slots, a view: a sequence's pages sit
    in consecutive slots as they are written) and one copy to the device, however many codec fields there are;
    the fields are then views of the copied rows. The tensor is pinned when the store serves a GPU, so those
    copies run asynchronously. A slot freed since the last wait (``recycled``) may still be read by a step running
    on the device: slots no step can read (``free``) are handed out first, and only when none is left does a write
    wait for the device's pending work, once, making every recycled slot free.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.data: torch.Tensor | None = None
        self.host: np.ndarray | None = None   # ``data`` as a numpy array (the same memory)
        self.layout: list[tuple[str, torch.dtype, tuple, int, int]] = []
        self.row_bytes = 0
        self.bits = None                      # the codec's "bits" marker, shared by every page
        self.free: list[int] = []             # slots no device work can still be reading
        self.recycled: list[int] = []         # slots released since the device was last waited for
        self.capacity = 0
        self.wanted = 0                       # slots announced by ``expect``: the next growth goes there at once
        self.pinned = False                   # the GPU may read it directly (uva.py)
        self.ahead: tuple | None = None       # (slots, Future of the allocation) of a growth made on a thread

    def _plan(self, enc: dict) -> None:
        off, layout = 0, []
        for name, t in enc.items():
            if name == "bits":
                continue
            nbytes = t[0].numel() * t.element_size()
            layout.append((name, t.dtype, tuple(t.shape[1:]), off, nbytes))
            off += -(-nbytes // 16) * 16      # 16-byte aligned fields
        self.row_bytes = off
        self.layout = layout                  # set last, at once: reader threads ask for ``rows`` meanwhile

    def _grow(self, enc: dict | torch.Tensor) -> None:
        """Room for more slots: the announced allocation (``ahead``) when one is on its way, else one allocation
        for the announced pages (``wanted``), else twice the capacity. The arena's pages are copied over, and
        ``wanted`` is cleared once the new capacity holds it."""
        layers = enc.shape[0] if isinstance(enc, torch.Tensor) else \
            next(t for n, t in enc.items() if n != "bits").shape[0]
        if not self.layout:
            self._plan(enc)
            self._allocate_ahead(layers)  # a long first prompt: its allocation on a thread, 64 slots meanwhile
        new = None
        if self.ahead is not None and self.capacity == 0:
            cap = 64
        elif self.ahead is not None:      # the announced allocation, pinned while the prompt's first chunks ran
            (cap, fut), self.ahead = self.ahead, None
            new = fut.result()
        else:
            cap = max(64, self.capacity * 2)
            if self.wanted > self.capacity:   # announced (a long prompt): one allocation, an eighth to spare
                cap = self._room_for(self.wanted)
        if self.wanted <= cap:
            self.wanted = 0
        if new is None:
            new = _host_empty((layers, cap, self.row_bytes), torch.uint8, self.pin)
        if self.pin and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # kernels may still read the old allocation directly (zero-copy)
        if self.data is not None:
            np.copyto(new.numpy()[:, :self.capacity], self.host)
        self.data = new
        self.host = new.numpy()               # the same bytes, for host copies without torch's thread pool
        self.pinned = self.pin and new.is_pinned()
        self.free.extend(range(cap - 1, self.capacity - 1, -1))   # pop() hands out the lowest slot first
        self.capacity = cap

    def expect(self, slots: int) -> None:
        """``slots`` pages will be held at once soon (a prompt's pages, kept in L2 while it is prefilled): the next
        growth makes room for them in one allocation instead of doubling to them. Doubling a pinned arena to a
        128K prompt's 8.4K pages (2.1 GiB for the 1.5B shape) allocated 32K slots in all (8.3 GiB of pinned
        memory, 1.6 s of the prefill on a GPU server) and ended at 16K slots (4.2 GiB). A pinned allocation of at
        least ``AHEAD_BYTES`` is made on a thread from now (``_allocate_ahead``)."""
        self.wanted = max(self.wanted, slots)
        if self.data is not None:         # (else the first growth, which knows the layout, starts it)
            self._allocate_ahead(self.data.shape[0])

    AHEAD_BYTES = 64 * 2**20

    @staticmethod
    def _room_for(slots: int) -> int:
        return -(-(slots + slots // 8) // 64) * 64   # an eighth to spare, in whole multiples of 64 slots

    def _allocate_ahead(self, layers: int) -> None:
        """Make the announced growth's pinned allocation on a thread (``ahead``: its slots and a Future; ``_grow``
        takes it, ``drop_ahead`` discards it). Pinning host memory is slow (the 2.4 GiB of a 128K prompt took
        1.8 s of its time to the first token on a GPU server, on the prefilling thread), and it is not needed at once:
        no page of a prompt leaves the GPU's pool before the pool is full, so the memory is pinned while the
        prompt's first chunks run on the GPU, and ``_grow`` waits for it only if it is late. A larger
        announcement while one is on its way replaces it (the smaller one is freed when its thread ends).
        Pageable arenas (the CPU) and small growths (under ``AHEAD_BYTES``, or no more than the first 64 slots:
        so the allocation taken is always larger than the capacity) are allocated when needed, as before."""
        if not (self.pin and self.wanted > self.capacity):
            return
        cap = self._room_for(self.wanted)
        if (self.ahead is not None and self.ahead[0] >= cap) or cap <= 64 or \
                layers * cap * self.row_bytes < self.AHEAD_BYTES:
            return
        fut: Future = Future()
        shape = (layers, cap, self.row_bytes)

        def allocate():
            try:
                fut.set_result(_host_empty(shape, torch.uint8, True))
            except BaseException as exc:  # noqa: BLE001 - handed to the thread that takes the allocation
                fut.set_exception(exc)

        # not a daemon: the interpreter's exit waits for it rather than stopping it inside the CUDA driver's call
        threading.Thread(target=allocate, name="flashguard-l2-grow").start()
        self.ahead = (cap, fut)

    def drop_ahead(self) -> None:
        """Discard an announced allocation on its way (the store closes): wait for its thread, free the memory."""
        if self.ahead is not None:
            _, fut = self.ahead
            self.ahead = None
            fut.exception()   # waits; an allocation that failed has nothing to free

    def rows(self, enc: dict) -> torch.Tensor | None:
        """An encoded page as this arena's rows (``[layers, row_bytes]`` uint8, on the CPU), for ``write`` to copy
        in one go: the layout work done by the caller's thread (a reader thread's, for a page read from L3),
        not under the decoding thread's GIL. None until the first page has fixed the layout."""
        layout = self.layout
        if not layout:
            return None
        layers = enc[layout[0][0]].shape[0]
        out = np.empty((layers, self.row_bytes), dtype=np.uint8)
        with torch.inference_mode():
            for name, dtype, shape, off, nbytes in layout:
                t = enc[name].reshape(layers, -1).to(device="cpu", dtype=dtype)
                np.copyto(out[:, off:off + nbytes], t.contiguous().view(torch.uint8).numpy())
        return torch.from_numpy(out)

    def write(self, enc: dict | torch.Tensor) -> int:
        """Store an encoded page (tensors ``[layers, ...]``, any device; or its ``rows``); returns its slot.
        Rows are one copy: a page installed between two decode steps costs the decoding thread one call."""
        if isinstance(enc, torch.Tensor) and (not self.layout or enc.shape[-1] != self.row_bytes):
            raise ValueError("page rows for another layout")
        if not self.free and not self.recycled:
            self._grow(enc)
        if isinstance(enc, dict):   # (a page promoted from L3 may come back in float32: rows casts it)
            if "bits" in enc:
                self.bits = enc["bits"].cpu()
            enc = self.rows(enc)
        if not self.free:   # only slots a running step may still read: wait for it, once for all of them
            if self.pin and torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.current_stream().synchronize()
            self.free, self.recycled = self.recycled[::-1], []
        slot = self.free.pop()
        # a host copy with numpy: one thread, no OpenMP team (torch's copy_ of a page woke its thread pool, whose
        # threads wait on busy cores: ~8 ms a page on two busy cores against 0.05 ms)
        np.copyto(self.host[:, slot], enc.numpy())
        return slot

    def fields_of(self, rows: torch.Tensor) -> dict:
        """Views of the codec fields in byte rows ``[..., row_bytes]``."""
        out = {}
        lead = tuple(rows.shape[:-1])
        for name, dtype, shape, off, nbytes in self.layout:
            out[name] = rows[..., off:off + nbytes].view(dtype).view(lead + shape)
        if self.bits is not None:
            out["bits"] = self.bits
        return out

    def read(self, slot: int, layer: int | None = None) -> dict:
        """Views of one page (all layers, or one)."""
        return self.fields_of(self.data[:, slot] if layer is None else self.data[layer, slot])

    def release(self, slot: int) -> None:
        self.recycled.append(slot)

    def used(self) -> int:
        return self.capacity - len(self.free) - len(self.recycled)

    def page_bytes(self) -> int:
        return 0 if self.data is None else self.data.shape[0] * self.row_bytes

    def gather(self, layer: int | None, slots: list[int], device) -> dict:
        """One layer (or, with None, every layer) of several pages (fields ``[len(slots), ...]``, after the layers
        with None) on ``device``: one view or host gather (numpy: no thread pool woken on the host) and one copy
        for all fields."""
        a = slots[0]
        src, host = (self.data, self.host) if layer is None else (self.data[layer], self.host[layer])
        axis = 1 if layer is None else 0
        if slots == list(range(a, a + len(slots))):
            rows = src.narrow(axis, a, len(slots))
        else:
            rows = _host_empty(src.shape[:axis] + (len(slots), self.row_bytes), torch.uint8, self.pin)
            np.take(host, slots, axis=axis, out=rows.numpy())
        return self.fields_of(rows.to(device, non_blocking=True))


def _host_empty(shape, dtype, pin: bool) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
        return _host_alloc(shape, dtype, pin)


def _host_alloc(shape, dtype, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:
            pass  # no pinnable memory left: pageable memory works, only slower to copy
    return torch.empty(shape, dtype=dtype)


class PageStore:
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

    # ---- prefetch: L3 reads off the decode path ----------------------------------------------
    def prefetch(self, keys, bulk: bool = False) -> int:
        """Read ``keys``' pages whose only copy is in L3 on worker threads (file read, verified, transcoded for
        L2: no lock held, no GPU work); ``install_prefetched`` puts them in L2 on the caller's thread, between
        two steps. Pages in L2, unknown or already on their way are skipped. Returns how many were queued.
        While decoding, ``READERS`` threads; ``bulk`` (many pages needed at once: a new session's), ``BULK_READERS``."""
        with self.lock:
            todo = []
            for key in keys:
                page = self.pages.get(key)
                if page is not None and page.l2 is None and page.l3 is not None and key not in self._fetching:
                    todo.append((key, page.l3))
            if not todo:
                return 0
            pool = self._pool("bulk" if bulk else "decode")
            for key, path in todo:
                self._fetching[key] = (path, pool.submit(self._read_file, key, path))
            self.stats.prefetched += len(todo)
            return len(todo)

    # Reader threads. A page read is a file read, a decryption, zstd and an unpacking (~3 ms of a laptop core,
    # mostly without the GIL): while decoding, two threads keep up with a few pages a step and leave the GIL to the
    # decoding thread (eight busy readers made a 2.3 ms host loop take 10.7 ms on two cores; two, 3.8 ms); a new
    # session's thousands of pages take more threads, as the host's cores allow.
    READERS = 2
    BULK_READERS = max(2, min(8, (os.cpu_count() or 2) // 2))

    def _pool(self, kind: str):
        from concurrent.futures import ThreadPoolExecutor

        if self._readers.get(kind) is None:
            n = self.BULK_READERS if kind == "bulk" else self.READERS
            self._readers[kind] = ThreadPoolExecutor(n, thread_name_prefix=f"flashguard-l3-read-{kind}")
        return self._readers[kind]

    def _read_ahead(self, keys) -> None:
        """Before pages are promoted one by one (``slots``, ``get`` in a loop): those of ``keys`` only in L3 are
        read on the prefetch threads meanwhile, in parallel; ``_promote`` takes each read's result."""
        if self.disk is not None and self.l3_pages and \
                sum(1 for k in keys if (p := self.pages.get(k)) is not None and p.l2 is None) > 1:
            self.prefetch(keys, bulk=True)

    def _read_file(self, key: bytes, path: str) -> tuple[dict | torch.Tensor, int, float, float]:
        """On a reader thread: the page as L2 will hold it (its arena rows when the layout is known, else the
        encoded dict), the file's size, the seconds of disk and of codec work."""
        t0 = time.perf_counter()
        blob = self.disk.read(key, path)
        t1 = time.perf_counter()
        enc = self._l2_encoding(blob)
        rows = enc if isinstance(enc, torch.Tensor) else self.arena.rows(enc)
        return enc if rows is None else rows, len(blob), t1 - t0, time.perf_counter() - t1

    def install_prefetched(self, wait: bool = False) -> list[bytes]:
        """The pages the prefetch worker has read go to L2 now, as read by decoding (heat, recency: the step that
        asked for them picked them); with ``wait``, those still in flight are waited for first. A page promoted
        meanwhile, released or evicted is skipped; one whose file failed verification is dropped (the sequence
        that needs it recomputes it, as for a synchronous read). Returns the keys installed."""
        with self.lock:
            if not self._fetching:
                return []
            if not wait:
                done = [k for k, (_, fut) in self._fetching.items() if fut.done()]
            else:
                done = list(self._fetching)
            work = [(k, *self._fetching.pop(k)) for k in done]
        installed = []
        for key, path, fut in work:
            try:
                result = fut.result()
            except PageLost as exc:
                result = exc
            with self.lock:
                page = self.pages.get(key)
                if page is None or page.l2 is not None or page.l3 != path:
                    continue
                if isinstance(result, PageLost):
                    self._drop_corrupt(key, page, result)
                    continue
                enc, size, disk_s, codec_s = result
                page.l2 = self.arena.write(enc)
                self._moved(key, page.l2)
                page.heat += 1.0
                page.read_at = self.clock
                self.pages.move_to_end(key)
                self.stats.page_faults += 1
                self.stats.hits["l3"] += 1
                self.stats.bytes_from_l3 += size
                self.stats.disk_seconds += disk_s
                self.stats.codec_seconds += codec_s
                installed.append(key)
        if installed:
            with self.lock:
                self.moves += 1
                self._enforce_budgets(protect=set(installed), written=True)
        return installed

    # ---- budgets --------------------------------------------------------------------------
    @contextlib.contextmanager
    def deferred(self):
        """A context (a prefill): pages over the L2 budget stay in L2 (the next chunk attends every page of the
        prompt: none is read back from disk), and their L3 files are written meanwhile on a worker thread, off
        the prefill's path. At the end, the writes still in flight are waited for and L2 is brought back to its
        budget: pages that have their file leave it for free. Nests; yields the store."""
        with self.lock:
            self._deferred += 1
        try:
            yield self
        finally:
            self._end_deferred()

    def expect_tokens(self, tokens: int) -> None:
        """``tokens`` new tokens are coming (a prompt being prefilled, inside ``deferred``): L2 makes room for their
        pages (and the one they may complete) at once (``L2Arena.expect``)."""
        with self.lock:
            self.arena.expect(self.arena.used() + -(-tokens // self.config.page_size) + 1)

    def _end_deferred(self) -> None:
        with self.lock:
            self._deferred -= 1
            if self._deferred:
                return
            pending = list(self._pending.values())
        for fut in pending:
            fut.result()
        with self.lock:
            self._enforce_budgets()

    def _write_later(self, key: bytes, page: _Page) -> None:
        """Write ``page``'s L3 file on the worker (inside ``deferred``): its L2 rows are copied now, under the lock."""
        if key in self._pending or self.l3_pages + len(self._pending) >= self.l3_pages_max:
            return
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(1, thread_name_prefix="flashguard-l3")
        rows = torch.from_numpy(self.arena.host[:, page.l2].copy())
        self._pending[key] = self._writer.submit(self._write_file, key, rows)

    @contextlib.contextmanager
    def _worker_device(self):
        if not (self.pin and torch.cuda.is_available() and torch.cuda.is_initialized()):
            yield torch.device("cpu")
            return
        if getattr(self, "_worker_stream", None) is None:
            self._worker_stream = torch.cuda.Stream()
        with torch.cuda.stream(self._worker_stream):
            yield torch.device("cuda", torch.cuda.current_device())

    def _l3_blob(self, rows: torch.Tensor, device: torch.device) -> bytes:
        """A page's L2 rows as its L3 file's bytes, the codec work on ``device``."""
        k, v = codecs.decode(self.arena.fields_of(rows.to(device)), torch.float32)
        return codecs.to_bytes({n: t.cpu() for n, t in codecs.encode(k, v, self.config.l3_codec).items()})

    def _write_file(self, key: bytes, rows: torch.Tensor) -> None:
        try:
            t0 = time.perf_counter()
            try:   # on a GPU (a store that serves one): the codec work there, on the worker's own stream
                with torch.inference_mode(), self._worker_device() as device:
                    blob = self._l3_blob(rows, device)
            except OUT_OF_MEMORY:   # its temporaries do not fit (a 128K output rail, the allocator at its cap)
                with torch.inference_mode():
                    blob = self._l3_blob(rows, torch.device("cpu"))
            t1 = time.perf_counter()
            path = self.disk.write(key, blob)
            t2 = time.perf_counter()
        except OSError as exc:
            with self.lock:
                self._pending.pop(key, None)
                self.stats.disk_errors += 1
                self._disk_warning(f"cannot write to the L3 folder {self.l3_dir}: {exc.strerror or exc}")
            return
        with self.lock:
            self._pending.pop(key, None)
            page = self.pages.get(key)
            if page is None or page.l3 is not None:
                self.disk.remove(path)
                return
            page.l3 = path
            self.l3_pages += 1
            self.stats.codec_seconds += t1 - t0
            self.stats.disk_seconds += t2 - t1
            self.stats.bytes_to_l3 += len(blob)

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
