"""The peer tier: one conversation's off-window pages spread over the other GPUs of one host (``kv.peer_gpus``).

Rank 0 is the engine; ranks 1..N-1 are page servers (``serve``), one process per peer GPU. All traffic goes through
``torch.distributed`` (NCCL between GPUs, gloo on the CPU): no hand-written transport.

Contract
--------
* Placement. Page ``p`` (an index into the sequence's pages) lives on rank ``1 + p % peers``: round robin, so any
  range of pages is split evenly, and on each rank the pages of a range are one contiguous run of its buffer
  (local position ``p // peers``), attended in place, one ``attention.segment`` call per block of ``block_pages``
  pages (the buffer grows a block at a time: no copy to grow, no 2x peak).
* ``PeerTier.put(first, k, v)``: pages ``[first, first + n)`` of every layer, ``k``/``v`` ``[layers, kvh, n, P, D]``;
  each rank receives only its share. Putting a page again overwrites it (after a crop the new pages replace the
  old ones). ``covers(first, last)`` says whether every page of the range was put (rank 0 keeps the book).
* ``PeerTier.attend(layer, qg, scale, first, last)``: the partial ``(o [kvh, g, Lq, D], lse [kvh, g, Lq])``, fp32,
  of the queries ``qg`` over the pages ``[first, last)`` of ``layer``; each rank attends its own pages with
  ``attention.segment`` and the partials (one ``gather`` of o and lse to rank 0 per layer and step) are merged
  exactly (``merge``).
  A range with no page gives ``lse = -inf`` and ``o = 0`` (``merge`` and ``attention.merge_into`` accept that as
  long as some other segment shows every query a key).
  ``ask`` is the same split in two: it sends the query and returns a ``Pending`` at once (the collectives run
  asynchronously), so the engine attends its own window while the peers attend their pages; ``wait()`` merges.
* Failure. A collective that fails or runs past the process group's timeout (a peer process died) raises
  ``PeerLostError`` (a 503 naming ``kv.peer_gpus``) and marks the tier ``lost``: later calls raise at once and
  ``covers`` is False, so a caller that keeps the pages elsewhere (the L2 store) attends them there instead.
  Never a hang: the timeout bounds every wait of rank 0. On NCCL rank 0 waits with ``TORCH_NCCL_BLOCKING_WAIT``
  (no watchdog that would end the process; a wait past the timeout raises), and polls a collective's completion
  before it waits (blocking waits sleep between checks: a millisecond or more a layer).
* Idle. A peer waits for rank 0's next command without a bound (``IDLE_TIMEOUT``: an engine may sit idle for
  hours); what ends a peer is rank 0: its stop command, its closed sockets (gloo), or its death (the peer polls
  that its parent lives). Rank 0's own timeout is ``timeout_s``: a group's timeout is each process's own.
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

KEY = "kv.peer_gpus"
OP_STOP, OP_PUT, OP_ATTEND, OP_RESET = 0, 1, 2, 3
HEADER = 12     # float64 words of a command: op, then PUT: layers, first, n, kvh, D, dtype; ATTEND: layer, first,
                # last, Lq, g, kvh, D, dtype, scale (float64 holds page indices exactly up to 2**53)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEFAULT_TIMEOUT_S = 30.0
IDLE_TIMEOUT = timedelta(days=365)   # a peer's timeout: it waits for rank 0's next command as long as rank 0 lives
JOIN_S = 120.0     # how long rank 0 waits for the spawned peers to join (each imports torch, makes its CUDA context)
SPIN_S = 0.02      # a peer polls the next command without sleeping this long after the last one (decode cadence)
BLOCK_PAGES = 256  # pages per block of a peer's buffer (16K tokens at 64-token pages)


class PeerLostError(FlashguardError):
    """A peer rank stopped answering (its process died, or its GPU failed): the request fails with a 503 unless the
    caller attends the pages from another tier."""

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
    take ``JOIN_S``: a spawned peer imports torch first). Rank 0 (``timeout_s``): the timeout bounds every collective
    on gloo, and on NCCL with blocking waits, which this turns on (no watchdog thread: a dead peer raises at the
    wait instead of ending the process). A peer (``timeout_s`` None): ``IDLE_TIMEOUT``, and on NCCL no blocking
    waits (a wait only orders its stream; ``serve`` polls)."""
    if backend == "nccl":
        if timeout_s is not None:
            os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
        else:
            os.environ.pop("TORCH_NCCL_BLOCKING_WAIT", None)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # no NVLink multicast (shared hosts; nothing here needs it)
    timeout = IDLE_TIMEOUT if timeout_s is None else timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=JOIN_S) if rank == 0 else IDLE_TIMEOUT, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def finish(works: list, deadline: float | None) -> None:
    """Wait for ``works``: on a GPU, poll their completion until ``deadline`` (``time.monotonic()``) first, so that
    a finished collective costs no blocking wait's sleep, and one past it aborts the communicators and raises
    (a RuntimeError) without a wait that would tie this stream to it; then ``wait()`` (it raises for a failed
    one; on gloo, ``deadline`` None, for one past the group's timeout)."""
    if deadline is not None:
        pending = list(works)
        while pending and time.monotonic() < deadline:
            pending = [w for w in pending if not w.is_completed()]
        if pending:   # a peer stopped answering: abort the communicators (their kernels end; this stream never
            try:      # waited on them) rather than wait() on a collective that never completes
                dist.distributed_c10d._abort_process_group()
            except Exception:  # noqa: BLE001 - the error below is what the caller needs
                pass
            raise RuntimeError(f"{len(pending)} collective(s) did not complete within the group timeout")
    for w in works:
        w.wait()


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
    """One rank's pages in local page order, in blocks of ``block_pages`` pages (``k``/``v`` ``[layers, kvh,
    block_pages * P, D]`` each, allocated as pages arrive: memory grows a block at a time and nothing is copied to
    grow). A range of pages is attended one block at a time with ``attention.segment``, merged by log-sum-exp."""

    def __init__(self, block_pages: int):
        self.block_pages = block_pages
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def put(self, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v`` ``[layers, kvh, m, P, D]`` at local positions ``[at, at + m)``."""
        layers, kvh, m, p, d = k.shape
        b = self.block_pages
        if self.blocks and (self.blocks[0][0].dtype != k.dtype or self.blocks[0][0].shape[1] != kvh):
            self.blocks = []              # another model's pages: start over
        while len(self.blocks) * b < at + m:
            self.blocks.append((k.new_zeros((layers, kvh, b * p, d)), v.new_zeros((layers, kvh, b * p, d))))
        for j in range(at, at + m):       # runs within one block are written in one copy
            if j != at and j % b:
                continue
            end = min(at + m, (j // b + 1) * b)
            bk, bv = self.blocks[j // b]
            lo = (j % b) * p
            bk[:, :, lo:lo + (end - j) * p] = k[:, :, j - at:end - at].reshape(layers, kvh, -1, d)
            bv[:, :, lo:lo + (end - j) * p] = v[:, :, j - at:end - at].reshape(layers, kvh, -1, d)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.blocks for t in kv)

    def attend(self, layer: int, qg: torch.Tensor, scale: float, lo: int, hi: int, page: int):
        """``(o, lse)`` fp32 of ``qg`` over local pages ``[lo, hi)`` of ``layer`` (o = 0, lse = -inf if none)."""
        kvh, g, lq, d = qg.shape
        acc = None
        b = self.block_pages
        for j in range(lo, hi):
            if j != lo and j % b:
                continue
            end = min(hi, (j // b + 1) * b)
            bk, bv = self.blocks[j // b]
            a, z = (j % b) * page, (end - (j // b) * b) * page
            part = attention.segment(qg, bk[layer, :, a:z], bv[layer, :, a:z], scale)
            acc = attention.merge_into(acc, (part[0].float(), part[1].float()))
        if acc is None:
            return qg.new_zeros((kvh, g, lq, d), dtype=torch.float32), \
                torch.full((kvh, g, lq), float("-inf"), device=qg.device)
        return acc


def _pack(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return torch.cat([o.float().flatten(), lse.float().flatten()])


class Pending:
    """An attention query in flight (``PeerTier.ask``): ``wait()`` returns the merged ``(o, lse)`` or raises
    ``PeerLostError`` (within the group's timeout). The tensors the collectives use stay referenced until then."""

    def __init__(self, tier: "PeerTier", works: list, keep: tuple, parts: list, shape, device):
        self.tier, self.works, self.keep, self.parts, self.shape, self.device = tier, works, keep, parts, shape, device

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        kvh, g, lq, d = self.shape
        with self.tier._guard("attend"):
            self.tier._finish(self.works)
        stacked = torch.stack(self.parts).to(self.device)
        split = kvh * g * lq * d
        o = stacked[:, :split].reshape(-1, kvh, g, lq, d)
        lse = stacked[:, split:].reshape(-1, kvh, g, lq)
        return merge(o, lse)


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
        self.lost: str | None = None   # why the tier stopped working, once it did
        self.bytes_sent = 0
        self.page_bytes = 0            # K and V of one page, every layer (as last put)
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
        """Wait for rank 0's collectives: polled up to the timeout on NCCL (``finish``), plain waits on gloo."""
        finish(works, time.monotonic() + self.timeout_s if self.comm.type == "cuda" else None)

    def _header(self, op: int, *words: float) -> torch.Tensor:
        """A command for the peers on the collectives' device; on a GPU copied from pinned memory without
        synchronizing (a pageable copy would wait for every kernel queued before it, once a layer)."""
        h = torch.zeros(HEADER, dtype=torch.float64, pin_memory=self.comm.type == "cuda")
        h[0] = op
        for i, w in enumerate(words):
            h[1 + i] = float(w)
        return h.to(self.comm, non_blocking=True)

    def _send_header(self, op: int, *words: float) -> None:
        self._finish([dist.broadcast(self._header(op, *words), src=0, async_op=True)])

    @contextlib.contextmanager
    def _guard(self, what: str):
        """Around collectives: a lost tier raises at once; a failed or timed-out collective (torch.distributed
        raises a RuntimeError, DistBackendError included) marks the tier lost and becomes a PeerLostError."""
        if self.lost is not None:
            raise PeerLostError(f"the peer tier is gone ({self.lost}); the request cannot use it", key=KEY)
        try:
            yield
        except FlashguardError:
            raise
        except RuntimeError as err:
            self.lost = f"{what} failed: {str(err).splitlines()[0][:200]}"
            raise PeerLostError(f"a peer rank stopped answering during {what} ({self.lost}); its pages are lost "
                                "on that GPU", key=KEY) from err

    @torch.inference_mode()
    def put(self, first: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Pages ``[first, first + n)``, ``k``/``v`` ``[layers, kvh, n, P, D]`` (every layer at once)."""
        n = k.shape[2]
        with self._guard("put"):
            layers, kvh, _, _, d = k.shape
            works = [dist.broadcast(self._header(OP_PUT, layers, first, n, kvh, d, _DTYPES.index(k.dtype)), src=0,
                                    async_op=True)]
            parts = []
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
        self.page_bytes = 2 * k[:, :, :1].numel() * k.element_size()

    @torch.inference_mode()
    def ask(self, layer: int, qg: torch.Tensor, scale: float, first: int, last: int) -> "Pending":
        """Send the query ``qg [kvh, g, Lq, D]`` for pages ``[first, last)`` of ``layer`` and return at once (the
        collectives run asynchronously): the caller attends its own segments meanwhile, then ``Pending.wait()``."""
        kvh, g, lq, d = qg.shape
        with self._guard("attend"):
            h = self._header(OP_ATTEND, layer, first, last, lq, g, kvh, d, _DTYPES.index(qg.dtype), scale)
            q = qg.to(self.comm).contiguous()
            own = _pack(torch.zeros((kvh, g, lq, d), device=self.comm),
                        torch.full((kvh, g, lq), float("-inf"), device=self.comm))   # rank 0 holds no page
            parts = [torch.empty_like(own) for _ in range(self.world)]
            works = [dist.broadcast(h, src=0, async_op=True), dist.broadcast(q, src=0, async_op=True),
                     dist.gather(own, parts, dst=0, async_op=True)]
        return Pending(self, works, (h, q, own), parts, qg.shape, qg.device)

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
                self._send_header(OP_RESET)
        self.put_pages.clear()
        self._covered = None

    def close(self) -> None:
        """Stop the servers and leave the process group (best effort once a peer is lost: the peers are killed
        first, and leaving the group may take at most ``CLOSE_S``)."""
        if self.lost is None:
            try:
                self._send_header(OP_STOP)
            except RuntimeError:
                self.lost = "stop failed"
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
                "bytes_held": len(self.put_pages) * self.page_bytes, "bytes_sent": self.bytes_sent, "lost": self.lost}


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
    """A peer rank's loop (the process group is joined): store the pages it is sent, answer attention queries with
    its partials, until rank 0 says stop. A failed collective (rank 0 died) raises out of it: its pages are of no
    use alone. ``parent``: rank 0's process id (a peer on a GPU ends when it is gone)."""
    device = torch.device(device)
    comm = torch.device("cpu") if dist.get_backend() == "gloo" else device
    rank, world = dist.get_rank(), dist.get_world_size()
    slot, peers = rank - 1, world - 1
    shard = _Shard(block_pages)
    while True:
        h = torch.zeros(HEADER, dtype=torch.float64, device=comm)
        _next_command(h, parent)
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
        elif op == OP_ATTEND:
            layer, first, last, lq, g, kvh, d, dt = (int(w) for w in words[1:9])
            q = torch.empty((kvh, g, lq, d), dtype=_DTYPES[dt], device=comm)
            dist.broadcast(q, src=0)
            lo, hi = local_range(first, last, slot, peers)
            o, lse = shard.attend(layer, q.to(device), words[9], lo, hi, page_size)
            dist.gather(_pack(o, lse).to(comm), None, dst=0)


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
