"""The L3 traffic of a PageStore: disk reads off the decode path and disk writes off the prefill path.

``L3Traffic`` is a part of ``PageStore`` (a base class of it, kept in its own file); it reads and writes the store's
state under the store's lock like its other methods.

Contract:
- ``prefetch(keys, bulk=False) -> queued``: pages whose only copy is in L3 are read, verified and transcoded for L2
  on reader threads (no lock held, no GPU work); ``install_prefetched(wait=False)`` puts the finished ones in L2 on
  the caller's thread, between two steps (a page whose file failed verification is dropped: its sequence
  recomputes it). A synchronous read of a page in flight (``slots``, ``get``) takes the reader's result.
- ``deferred()`` (a prefill): pages over the L2 budget stay in L2 and their L3 files are written on a worker thread
  (``_write_later``); at the end the writes in flight are waited for and L2 goes back to its budget, for free.
- A file that cannot be written (a missing, read-only or full folder) is counted and warned about once; the page
  stays in L2.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from . import OUT_OF_MEMORY, codecs
from .disk import PageLost


class L3Traffic:
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

    # ---- writes off the prefill's path -------------------------------------------------------
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

    def _write_later(self, key: bytes, page) -> None:
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
