"""L2Arena: the host-RAM tier's storage, every L2 page of a PageStore in one host byte tensor.

Contract:
- ``write(enc) -> slot`` stores one page (its encoded fields, or its rows as they lie in the arena) in a free slot,
  growing the tensor when none is left (``expect(slots)`` announces a growth: one allocation, pinned on a thread);
  ``release(slot)`` gives the slot back; ``read(slot, layer)`` / ``gather(layer, slots, device)`` return a page's
  fields (views of its rows; many pages of a layer in one host gather and one copy).
- ``rows(enc)`` lays out a page as the arena's rows (a reader thread does it off the decoding thread);
  ``fields_of(rows)`` makes them fields again. ``layout``: per codec field its dtype, shape and byte range in a row.
- The tensor is pinned when the store serves a GPU (``pinned``: the GPU reads it directly, ``kv/uva.py``); a slot
  released while a step may still read it is handed out only after the device's pending work is waited for.
- Storage only: which pages live here is the store's and its policy's decision (``kv/store.py``, ``kv/policy.py``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import torch


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
