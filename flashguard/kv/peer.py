"""The peer tier: one conversation's off-window pages spread over the other GPUs of one host (``kv.peer_gpus``).

Rank 0 is the engine; ranks 1..N-1 are page servers (``serve``), one process per peer GPU. All traffic goes through
``torch.distributed`` (NCCL between GPUs, gloo on the CPU): no hand-written transport.

Why one file of ~600 lines: rank 0's side (``PeerTier``) and the page servers' (``serve``) are the two halves of one
message protocol that must match message by message; they are read and changed together, with the protocol's
description below.

Contract
--------
* Placement. Page ``p`` (an index into the sequence's pages) lives on rank ``1 + p % peers``: round robin, so any
  range of pages is split evenly, and on each rank the pages of a range are one contiguous run (local position
  ``p // peers``) of one K and one V buffer per layer, attended in place with one ``attention.segment`` call a
  layer. A buffer grows ``block_pages`` pages at a time, one layer at a time (the peak is the shard plus one
  layer's old buffers, never twice the shard).
* ``PeerTier.put(first, k, v)``: pages ``[first, first + n)`` of every layer, ``k``/``v`` ``[layers, kvh, n, P, D]``;
  each rank receives only its share. Putting a page again overwrites it (after a crop the new pages replace the
  old ones). ``covers(first, last)`` says whether every page of the range was put (rank 0 keeps the book).
* ``PeerTier.attend(layer, qg, scale, first, last)``: the partial ``(o [kvh, g, Lq, D], lse [kvh, g, Lq])``, fp32,
  of the queries ``qg`` over the pages ``[first, last)`` of ``layer``; each rank attends its own pages and the
  partials are merged exactly (``merge``). A range with no page on a rank gives ``lse = -inf`` and ``o = 0``
  (``merge`` and ``attention.merge_into`` accept that as long as some other segment shows every query a key).
  ``ask`` is the same split in two: it sends the query and returns a ``Pending`` at once, so the engine attends
  its own window while the peers attend their pages; ``wait()`` gives the merged partial.

Protocol (what crosses the process group)
-----------------------------------------
Commands are a ``HEADER`` of float64 words that rank 0 broadcasts; a peer waits for the next one (polling it on a
GPU). ``STOP``, ``RESET``; ``PUT`` (then rank 0 sends each peer its pages, K then V, point to point); and ``STEP``:

    STEP layer0 count first last Lq g kvh D dtype scale

opens an attention step: the queries of layers ``layer0 .. layer0 + count - 1`` (rank 0 asks ``count`` = the
layers from ``layer0`` to the last one put: a decode step is one header), all over the pages ``[first, last)``,
one shape. The peer knows the whole step from the header, so it enqueues it at once, for each layer:

    recv(q from rank 0) -> attend its pages of the layer -> send((o, lse) packed, fp32, to rank 0)

and rank 0, for each layer it asks, ``isend(q)`` then ``irecv(o, lse)`` to and from every peer (point to point:
the order on each pair is the same on both sides). On NCCL these are stream-ordered: no host waits for them,
neither the peer's (it runs ahead of rank 0, the whole step queued on its GPU) nor rank 0's (``Pending.wait``
only orders rank 0's stream after the receive), so a layer costs the GPUs the exchange and the attention, not a
host round trip. Rank 0's host waits twice a step: for the header (polled: a peer that died since the last step is
found there, before any layer used it) and for the step's last layer (polled: every exchange of the step
completed, before anything reads the step's result on the host). A step left open (a layer asked out of order,
another range, a ``put``, an exception between two layers) is closed first: its unasked layers get empty queries,
so both sides stay in step. On gloo the same messages are plain host waits: each layer is waited for as it comes.

Failure. A wait that fails or runs past ``timeout_s`` (a peer process died, or stopped) aborts the communicators
(their kernels end) and marks the tier ``lost``: later calls raise at once and ``covers`` is False, so a caller
that keeps the pages elsewhere (the L2 store) attends them there instead. Found at a step's header (or on gloo at
any layer: each was verified before it was used), it is a ``PeerLostError`` (503, naming ``kv.peer_gpus``) and the
cache attends that layer and the rest from the store: the same result. Found at a step's end on NCCL, layers of
the step already merged partials that were never verified: ``PeerStepLost``, a ``PageLost`` (503 if nothing
catches it), which the engine meets as it meets a lost page: it recomputes the sequence by prefill, from the
store. Never a hang: ``timeout_s`` bounds every host wait of rank 0. Rank 0 on NCCL runs without blocking waits
and without the watchdog's error handling (a wait only orders a stream; the tier polls instead; a timed-out
collective never ends the engine's process), with a group timeout that never fires before the tier's own.
* Idle. A peer waits for rank 0's next command without a bound (``IDLE_TIMEOUT``: an engine may sit idle for
  hours); what ends a peer is rank 0: its stop command, its closed sockets (gloo), or its death (the peer polls
  that its parent lives). Rank 0's own timeout is ``timeout_s``.
* Lifetime. ``close()`` stops the servers and destroys the process group; ``reset()`` forgets the pages (a new
  conversation). One PeerTier per process (it owns the default process group).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError, FlashguardError
from . import attention
from .disk import PageLost

KEY = "kv.peer_gpus"
OP_STOP, OP_PUT, OP_STEP, OP_RESET = 0, 1, 2, 3
HEADER = 12     # float64 words of a command: op, then PUT: layers, first, n, kvh, D, dtype; STEP: layer0, count,
                # first, last, Lq, g, kvh, D, dtype, scale (float64 holds page indices exactly up to 2**53)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEFAULT_TIMEOUT_S = 30.0
IDLE_TIMEOUT = timedelta(days=365)   # a peer's timeout (it waits for rank 0 as long as rank 0 lives); rank 0's on NCCL
JOIN_S = 120.0     # how long rank 0 waits for the spawned peers to join (each imports torch, makes its CUDA context)
SPIN_S = 0.02      # a peer polls the next command without sleeping this long after the last one (decode cadence)
BLOCK_PAGES = 256  # a peer's buffers grow this many pages at a time (16K tokens at 64-token pages)


class PeerLostError(FlashguardError):
    """A peer rank stopped answering (its process died, or its GPU failed): the request fails with a 503 unless the
    caller attends the pages from another tier."""

    status_code = 503


class PeerStepLost(PageLost):
    """A peer was found lost at the end of a decode step whose earlier layers already merged its (unverified)
    partials: the step's result is not to be used. A ``PageLost``: the engine recomputes the sequence from the
    store, as for a lost page; a 503 where nothing catches it."""

    status_code = 503


def resolve_devices(peer_gpus, engine_device: torch.device, device_count: int | None = None) -> list[int]:
    """The peer GPU indices of ``kv.peer_gpus`` (a list of indices, or a count: the next GPUs after the engine's),
    checked against this host: ConfigErrors naming ``kv.peer_gpus`` for a CPU engine, a host with one GPU, an index
    that does not exist, the engine's own GPU, or a repeated index. ``device_count`` defaults to this host's."""
    if peer_gpus is None:
        return []
    if engine_device.type != "cuda":
        raise ConfigError(f"peer GPUs need the engine on a GPU (device: cuda); it runs on {engine_device.type}",
                          key=KEY)
    n = torch.cuda.device_count() if device_count is None else device_count
    if n < 2:
        raise ConfigError(f"this host has {n} GPU{'s' if n != 1 else ''}; peer GPUs need at least two", key=KEY)
    own = engine_device.index if engine_device.index is not None else 0
    if isinstance(peer_gpus, int):
        others = [i for i in range(n) if i != own]
        if peer_gpus > len(others):
            raise ConfigError(f"asks for {peer_gpus} peer GPUs; this host has {len(others)} besides the engine's "
                              f"(cuda:{own})", key=KEY)
        return others[:peer_gpus]
    out = list(peer_gpus)
    for i in out:
        if i >= n:
            raise ConfigError(f"GPU {i} does not exist; this host has GPUs 0..{n - 1}", key=KEY)
        if i == own:
            raise ConfigError(f"GPU {i} is the engine's own device; list the other GPUs", key=KEY)
    if len(set(out)) != len(out):
        raise ConfigError(f"lists a GPU twice: {out}", key=KEY)
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int, backend: str, timeout_s: float | None) -> None:
    """Join the default process group through a TCP store on 127.0.0.1:``port`` (rank 0 serves it; the join may
    take ``JOIN_S``: a spawned peer imports torch first). Rank 0 (``timeout_s``): on gloo the timeout bounds every
    collective; on NCCL no blocking waits and no watchdog error handling (a wait orders a stream; the tier polls
    completion up to ``timeout_s`` and aborts: a dead peer never ends this process), with ``IDLE_TIMEOUT`` as the
    group's (the watchdog never times out first). A peer (``timeout_s`` None): ``IDLE_TIMEOUT``, no blocking
    waits (``serve`` polls)."""
    if backend == "nccl":
        os.environ.pop("TORCH_NCCL_BLOCKING_WAIT", None)
        if timeout_s is not None:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # no NVLink multicast (shared hosts; nothing here needs it)
    timeout = IDLE_TIMEOUT if timeout_s is None or backend == "nccl" else timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=JOIN_S) if rank == 0 else IDLE_TIMEOUT, wait_for_workers=False)
    # every rank checks in first, within JOIN_S: the group's own join waits only its timeout (seconds on gloo),
    # shorter than a spawned peer's torch import on a loaded machine
    if rank == 0:
        store.wait([f"flashguard/joined/{r}" for r in range(1, world)], timedelta(seconds=JOIN_S))
    else:
        store.set(f"flashguard/joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def finish(works: list, deadline: float | None) -> None:
    """Wait for ``works``: on a GPU, poll their completion until ``deadline`` (``time.monotonic()``), and past it
    abort the communicators (their kernels end) and raise a RuntimeError; then ``wait()`` each (it raises for a
    failed one; on NCCL it only orders the current stream after it; on gloo, ``deadline`` None, it blocks up to
    the group's timeout)."""
    if deadline is not None:
        pending = list(works)
        while pending and time.monotonic() < deadline:
            pending = [w for w in pending if not w.is_completed()]
        if pending:   # a peer stopped answering: abort the communicators rather than wait on them
            _abort()
            raise RuntimeError(f"{len(pending)} collective(s) did not complete within the group timeout")
    for w in works:
        w.wait()


def _abort() -> None:
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - the caller raises what it needs
        pass


def merge(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of stacked partials ``o [R, ...tail, D]``, ``lse [R, ...tail]`` (what folding
    ``attention.merge_into`` over R gives), where a partial may see no key (``lse = -inf``); a query that no
    partial shows a key gets ``o = 0``, ``lse = -inf``."""
    m = lse.amax(dim=0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m)                                   # exp(-inf) = 0: empty partials weigh nothing
    total = w.sum(dim=0)
    out = (w.unsqueeze(-1) * o).sum(dim=0) / total.clamp_min(1e-30).unsqueeze(-1)
    return out, torch.where(total > 0, m + torch.log(total.clamp_min(1e-30)), torch.full_like(m, float("-inf")))


def local_range(first: int, last: int, slot: int, peers: int) -> tuple[int, int]:
    """Local page positions ``[lo, hi)`` on peer ``slot`` (0-based: rank ``slot + 1``) of the pages
    ``[first, last)``: the pages ``p`` with ``p % peers == slot`` sit at ``p // peers``."""
    return (max(0, first - slot) + peers - 1) // peers, (max(0, last - slot) + peers - 1) // peers


class _Shard:
    """One rank's pages in local page order: per layer one K and one V buffer ``[kvh, capacity * P, D]``, the
    capacity a multiple of ``block_pages`` pages. Growing reallocates one layer's buffers at a time (the peak is
    the shard plus one layer's old buffers), so the pages of a range are one slice: one attention call a layer."""

    def __init__(self, block_pages: int):
        self.block_pages = block_pages
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.pages = 0   # capacity, in pages

    def put(self, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v`` ``[layers, kvh, m, P, D]`` at local positions ``[at, at + m)``."""
        layers, kvh, m, p, d = k.shape
        if self.k and (self.k[0].dtype != k.dtype or self.k[0].shape[0] != kvh or len(self.k) != layers):
            self.__init__(self.block_pages)   # another model's pages: start over
        if at + m > self.pages:
            cap = -(-(at + m) // self.block_pages) * self.block_pages
            for bufs, src in ((self.k, k), (self.v, v)):
                for layer in range(layers):
                    grown = src.new_zeros((kvh, cap * p, d))
                    if layer < len(bufs):
                        grown[:, :self.pages * p] = bufs[layer]
                        bufs[layer] = grown
                    else:
                        bufs.append(grown)
            self.pages = cap
        for layer in range(layers):
            self.k[layer][:, at * p:(at + m) * p] = k[layer].reshape(kvh, m * p, d)
            self.v[layer][:, at * p:(at + m) * p] = v[layer].reshape(kvh, m * p, d)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def attend(self, layer: int, qg: torch.Tensor, scale: float, lo: int, hi: int, page: int):
        """``(o, lse)`` fp32 of ``qg`` over local pages ``[lo, hi)`` of ``layer`` (o = 0, lse = -inf if none)."""
        kvh, g, lq, d = qg.shape
        if hi <= lo:
            return qg.new_zeros((kvh, g, lq, d), dtype=torch.float32), \
                torch.full((kvh, g, lq), float("-inf"), device=qg.device)
        o, lse = attention.segment(qg, self.k[layer][:, lo * page:hi * page], self.v[layer][:, lo * page:hi * page],
                                   scale)
        return o.float(), lse.float()


def _pack(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return torch.cat([o.float().flatten(), lse.float().flatten()])


class _Step:
    """Rank 0's side of an open ``STEP``: layers ``[next, end)`` still to ask, what its messages need alive."""

    def __init__(self, key: tuple, layer0: int, end: int):
        self.key, self.next, self.end = key, layer0, end
        self.works: list = []      # every isend / irecv of the step (waited for when it closes)
        self.keep: list = []       # their tensors, alive until then
        self.unverified = 0        # layers whose partials were used before the host saw them arrive (NCCL)


class Pending:
    """An attention query in flight (``PeerTier.ask``): ``wait()`` returns the merged ``(o, lse)`` or raises
    ``PeerLostError`` / ``PeerStepLost`` (within the tier's timeout)."""

    def __init__(self, tier: "PeerTier", step: _Step, recvs: list, parts: list, shape, device, final: bool):
        self.tier, self.step, self.recvs, self.parts = tier, step, recvs, parts
        self.shape, self.device, self.final = shape, device, final

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.tier.receive(self)
        kvh, g, lq, d = self.shape
        split = kvh * g * lq * d
        if len(self.parts) == 1:               # one peer: its partial is the merge
            part = self.parts[0].to(self.device)
            return part[:split].view(kvh, g, lq, d), part[split:].view(kvh, g, lq)
        stacked = torch.stack(self.parts).to(self.device)
        return merge(stacked[:, :split].reshape(-1, kvh, g, lq, d), stacked[:, split:].reshape(-1, kvh, g, lq))


class PeerTier:
    """Rank 0's side: see the module docstring. ``device`` is where the engine's tensors live (its GPU, or the CPU
    with gloo); ``comm`` the device collectives run on (the same GPU for NCCL, the CPU for gloo)."""

    def __init__(self, world: int, page_size: int, device: torch.device, devices: list | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if world < 2:
            raise ConfigError("the peer tier needs at least one peer rank", key=KEY)
        self.world, self.peers, self.page_size = world, world - 1, page_size
        self.device = torch.device(device)
        self.comm = torch.device("cpu") if dist.get_backend() == "gloo" else self.device
        self.timeout_s = timeout_s
        self._covered = None           # (first, last) that ``covers`` last found put (each layer asks the same)
        self.devices = devices or [f"rank {r}" for r in range(1, world)]   # what engine_info shows
        self.put_pages: set[int] = set()
        self.layers = 0                # layers of the pages put: a step runs from its first layer to the last
        self._step: _Step | None = None
        self._side = torch.cuda.Stream(self.device) if self.comm.type == "cuda" else None   # headers' stream
        self.lost: str | None = None   # why the tier stopped working, once it did
        self.bytes_sent = 0
        self.page_bytes = 0            # K and V of one page, every layer (as last put)
        self.steps = 0
        self.processes: list = []      # the peer processes ``start`` spawned (joined by ``close``)

    def owner(self, page: int) -> int:
        return 1 + page % self.peers

    def covers(self, first: int, last: int) -> bool:
        """Whether every page of [first, last) was put (remembered for the range asked last: every layer of a step
        asks it, and 2,048 set lookups a layer cost a 128K decode step milliseconds)."""
        if self.lost is not None:
            return False
        if self._covered == (first, last):
            return True
        if all(p in self.put_pages for p in range(first, last)):
            self._covered = (first, last)
            return True
        return False

    def _finish(self, works: list) -> None:
        """Wait for rank 0's messages: polled up to the timeout on NCCL (``finish``), plain waits on gloo."""
        finish(works, time.monotonic() + self.timeout_s if self.comm.type == "cuda" else None)

    def _send_header(self, op: int, *words: float) -> None:
        """Broadcast a command and wait for it (polled on a GPU). On a GPU on a side stream, copied from pinned
        memory: it waits for none of the work queued on the engine's stream."""
        h = torch.zeros(HEADER, dtype=torch.float64, pin_memory=self.comm.type == "cuda")
        h[0] = op
        for i, w in enumerate(words):
            h[1 + i] = float(w)
        with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
            h = h.to(self.comm, non_blocking=True)
            work = dist.broadcast(h, src=0, async_op=True)
        self._finish([work])

    @contextlib.contextmanager
    def _guard(self, what: str):
        """Around messages: a lost tier raises at once; a failed or timed-out one (torch.distributed raises a
        RuntimeError, DistBackendError included) marks the tier lost and becomes a PeerLostError; a
        ``PeerStepLost`` goes through as it is."""
        if self.lost is not None:
            raise PeerLostError(f"the peer tier is gone ({self.lost}); the request cannot use it", key=KEY)
        try:
            yield
        except (FlashguardError, PeerStepLost, torch.cuda.OutOfMemoryError):
            raise
        except RuntimeError as err:
            self.lost = f"{what} failed: {str(err).splitlines()[0][:200]}"
            self._step = None
            if self.comm.type == "cuda":
                _abort()
            raise PeerLostError(f"a peer rank stopped answering during {what} ({self.lost}); its pages are lost "
                                "on that GPU", key=KEY) from err

    def _exchange(self, step: _Step, q: torch.Tensor) -> tuple[list, list]:
        """One layer of ``step``: ``q`` to every peer, a buffer for each one's packed partial; the receives."""
        kvh, g, lq, d = q.shape
        parts = [torch.empty(kvh * g * lq * (d + 1), dtype=torch.float32, device=self.comm)
                 for _ in range(self.peers)]
        sends = [dist.isend(q, dst=r) for r in range(1, self.world)]
        recvs = [dist.irecv(b, src=r) for r, b in zip(range(1, self.world), parts)]
        step.works += sends + recvs
        step.keep += [q] + parts
        step.next += 1
        return recvs, parts

    def _end_step(self) -> None:
        """Close the open step, if any: the layers it did not ask get empty queries (the peers have them queued),
        then every message of the step is waited for (polled on a GPU). A failure after layers used unverified
        partials raises ``PeerStepLost`` (the tier is lost); any other failure a RuntimeError (``_guard``)."""
        step, self._step = self._step, None
        if step is None:
            return
        try:
            kvh, g, lq, d, dtype = step.key[2:7]
            while step.next < step.end:
                self._exchange(step, torch.zeros((kvh, g, lq, d), dtype=dtype, device=self.comm))
            self._finish(step.works)
        except RuntimeError as err:
            if not step.unverified:
                raise
            self.lost = f"attend failed: {str(err).splitlines()[0][:200]}"
            if self.comm.type == "cuda":
                _abort()
            raise PeerStepLost(f"{KEY}: a peer rank stopped answering during a decode step ({self.lost}); the "
                               "step used its partials before they could be checked: recompute it") from err

    @torch.inference_mode()
    def put(self, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Pages ``[first, first + n)``, ``k``/``v`` ``[layers, kvh, n, P, D]`` (every layer at once)."""
        n = k.shape[2]
        with self._guard("put"):
            self._end_step()
            layers, kvh, _, _, d = k.shape
            self._send_header(OP_PUT, layers, first, n, kvh, d, _DTYPES.index(k.dtype))
            works, parts = [], []
            for slot in range(self.peers):
                idx = [i for i in range(n) if (first + i) % self.peers == slot]
                if not idx:
                    continue
                if len(idx) == n:
                    picked = (k, v)
                else:
                    pick = torch.tensor(idx, device=k.device)
                    picked = (k.index_select(2, pick), v.index_select(2, pick))
                for t in picked:
                    part = t.to(self.comm).contiguous()
                    parts.append(part)   # alive until the send is done
                    works.append(dist.isend(part, dst=slot + 1))
                    self.bytes_sent += part.numel() * part.element_size()
            self._finish(works)
        self.put_pages.update(range(first, first + n))
        self.layers = layers
        self.page_bytes = 2 * k[:, :, :1].numel() * k.element_size()

    @torch.inference_mode()
    def ask(self, layer: int, qg: torch.Tensor, scale: float, first: int, last: int) -> "Pending":
        """Send the query ``qg [kvh, g, Lq, D]`` for pages ``[first, last)`` of ``layer`` and return at once: the
        caller attends its own segments meanwhile, then ``Pending.wait()``. The first layer asked (or one out of
        the open step's order, range or shape) opens a step up to the last layer put."""
        kvh, g, lq, d = qg.shape
        key = (first, last, kvh, g, lq, d, qg.dtype, float(scale))
        with self._guard("attend"):
            step = self._step
            if step is None or step.key != key or step.next != layer:
                self._end_step()
                end = max(layer + 1, self.layers)
                self._send_header(OP_STEP, layer, end - layer, first, last, lq, g, kvh, d, _DTYPES.index(qg.dtype),
                                  scale)
                step = self._step = _Step(key, layer, end)
                self.steps += 1
            recvs, parts = self._exchange(step, qg.to(self.comm).contiguous())
        return Pending(self, step, recvs, parts, qg.shape, qg.device, final=step.next == step.end)

    def receive(self, pending: Pending) -> None:
        """The messages of ``pending`` (a query ``ask`` sent) have arrived, as far as this device can tell: its
        step closed if it is the step's last layer (every message waited for, polled on a GPU), else on a GPU
        ordered on the stream (verified when the step closes), with gloo waited for on the host. Raises as ``ask``
        does (``PeerLostError``, ``PeerStepLost``)."""
        with self._guard("attend"):
            if pending.final:                  # the step's last layer: all of it, polled on a GPU
                self._end_step()
            elif self.comm.type == "cuda":     # ordered on the stream, no host wait (verified at the step's end)
                for w in pending.recvs:
                    w.wait()
                pending.step.unverified += 1
            else:                              # gloo: the host waits, each layer verified as it comes
                for w in pending.recvs:
                    w.wait()
                    pending.step.works.remove(w)   # (a gloo receive waited twice waits for another message)

    def attend(self, layer: int, qg: torch.Tensor, scale: float, first: int, last: int):
        """Merged partial of ``qg [kvh, g, Lq, D]`` over pages ``[first, last)`` of ``layer``: ``(o, lse)`` fp32 on
        ``qg``'s device (``ask`` then ``wait``)."""
        return self.ask(layer, qg, scale, first, last).wait()

    def forget_from(self, page: int) -> None:
        """Pages from ``page`` on no longer count as put (the sequence was cropped; they are put again when they
        leave L1 anew, overwriting the old ones)."""
        self.put_pages = {p for p in self.put_pages if p < page}
        self._covered = None

    def reset(self) -> None:
        """Forget every page (the next conversation puts its own)."""
        if self.lost is None:
            with self._guard("reset"):
                self._end_step()
                self._send_header(OP_RESET)
        self.put_pages.clear()
        self._covered = None

    def close(self) -> None:
        """Stop the servers and leave the process group (best effort once a peer is lost: the peers are killed
        first, and leaving the group may take at most ``CLOSE_S``)."""
        if self.lost is None:
            try:
                self._end_step()
                self._send_header(OP_STOP)
            except RuntimeError:   # PeerStepLost included
                self.lost = self.lost or "stop failed"
                if self.comm.type == "cuda":
                    _abort()
        if self.lost is not None:   # a lost peer answers nothing: end the processes before leaving the group
            for p in self.processes:
                if p.is_alive():
                    p.kill()
        if dist.is_initialized():
            def leave():
                try:
                    dist.destroy_process_group()
                except RuntimeError:
                    pass
            t = threading.Thread(target=leave, daemon=True)   # a communicator stuck on a dead peer: bounded
            t.start()
            t.join(self.CLOSE_S)
        self.lost = self.lost or "closed"
        for p in self.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    CLOSE_S = 10.0

    def info(self) -> dict:
        """What ``engine_info()`` shows under ``tiers.peers``."""
        return {"devices": self.devices, "ranks": self.world, "pages": len(self.put_pages),
                "bytes_held": len(self.put_pages) * self.page_bytes, "bytes_sent": self.bytes_sent,
                "steps": self.steps, "lost": self.lost}


def _next_command(h: torch.Tensor, parent: int | None) -> None:
    """Receive rank 0's next command into ``h``. On a GPU: poll the broadcast (without sleeping for ``SPIN_S``
    after the last command, then every half millisecond) and end this process once its parent, rank 0, is gone (a
    broadcast from a dead rank 0 never completes); gloo waits (rank 0's closed sockets end the wait)."""
    if h.device.type != "cuda":
        dist.broadcast(h, src=0)
        return
    work = dist.broadcast(h, src=0, async_op=True)
    t0 = checked = time.monotonic()
    while not work.is_completed():
        now = time.monotonic()
        if now - t0 > SPIN_S:
            time.sleep(0.0005)
        if now - checked > 1.0:
            checked = now
            if parent is not None and os.getppid() != parent:
                os._exit(0)
    work.wait()


@torch.inference_mode()
def serve(page_size: int, device: torch.device, block_pages: int = BLOCK_PAGES, parent: int | None = None) -> None:
    """A peer rank's loop (the process group is joined): store the pages it is sent, answer each ``STEP`` (module
    docstring: on a GPU the whole step is queued at once, no host wait), until rank 0 says stop. A failed message
    (rank 0 died) raises out of it: its pages are of no use alone. ``parent``: rank 0's process id (a peer on a
    GPU ends when it is gone)."""
    device = torch.device(device)
    comm = torch.device("cpu") if dist.get_backend() == "gloo" else device
    rank, world = dist.get_rank(), dist.get_world_size()
    slot, peers = rank - 1, world - 1
    shard = _Shard(block_pages)
    held: list = []   # the last step's tensors and sends: alive until the next command (rank 0 had them all)
    while True:
        h = torch.zeros(HEADER, dtype=torch.float64, device=comm)
        _next_command(h, parent)
        held = []
        words = h.tolist()
        op = int(words[0])
        if op == OP_STOP:
            return
        if op == OP_RESET:
            shard = _Shard(block_pages)
        elif op == OP_PUT:
            layers, first, n, kvh, d, dt = (int(w) for w in words[1:7])
            mine = [p for p in range(first, first + n) if p % peers == slot]
            if mine:
                kv = []
                for _ in range(2):
                    t = torch.empty((layers, kvh, len(mine), page_size, d), dtype=_DTYPES[dt], device=comm)
                    dist.recv(t, src=0)
                    kv.append(t.to(device))
                shard.put(mine[0] // peers, *kv)
        elif op == OP_STEP:
            layer0, count, first, last, lq, g, kvh, d, dt = (int(w) for w in words[1:10])
            lo, hi = local_range(first, last, slot, peers)
            for layer in range(layer0, layer0 + count):
                q = torch.empty((kvh, g, lq, d), dtype=_DTYPES[dt], device=comm)
                dist.recv(q, src=0)            # NCCL: orders this stream after it (no host wait); gloo: waits
                out = _pack(*shard.attend(layer, q.to(device), words[10], lo, hi, page_size)).to(comm)
                held.append((q, out, dist.isend(out, dst=0)))
            for _, _, work in held:             # NCCL: stream order only; gloo: the partials went out
                work.wait()


def _peer_main(rank: int, world: int, port: int, backend: str, page_size: int, device: str,
               block_pages: int, parent: int) -> None:
    """Entry point of a peer process (spawned by ``start``)."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(1)   # the CPU tests run beside other work
    init_group(rank, world, port, backend, None)
    try:
        serve(page_size, torch.device(device), block_pages, parent)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start(devices: list, engine_device, page_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
          block_pages: int = BLOCK_PAGES) -> PeerTier:
    """Spawn one page server per entry of ``devices`` (``"cuda:1"``, or ``"cpu"`` for a gloo test), join them as
    rank 0 and return the tier. NCCL when the engine is on a GPU, gloo otherwise; the rendezvous is a TCP store on
    127.0.0.1 at a free port (works on Linux and Windows). The peer processes are daemons: they end with this one
    and after ``close()``."""
    engine_device = torch.device(engine_device)
    backend = "nccl" if engine_device.type == "cuda" else "gloo"
    world = len(devices) + 1
    port = free_port()
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_peer_main, daemon=True,
                         args=(r, world, port, backend, page_size, str(dev), block_pages, os.getpid()))
             for r, dev in enumerate(devices, start=1)]
    for p in procs:
        p.start()
    try:
        init_group(0, world, port, backend, timeout_s)
    except Exception as err:
        for p in procs:
            p.kill()
        raise PeerLostError(f"the peer ranks did not join within {JOIN_S:.0f} s: {err}", key=KEY) from err
    tier = PeerTier(world, page_size, engine_device, [str(d) for d in devices], timeout_s)
    tier.processes = procs
    return tier
