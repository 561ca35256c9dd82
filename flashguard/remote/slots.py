"""Slot leases: a guarded turn keeps one of llama-server's slots from its first request to its last
(``slot_leases: auto``). A *slot* here is the server's (``--parallel N`` slots, a request's ``id_slot``), not a page
slot of the KV store.

llama-server holds each conversation's KV in one of its slots. With more conversations than slots, a request that
lands on a slot holding another conversation first saves that slot's state to host RAM and restores its own (or
prefills it again), in the server's single loop, which stalls every slot. A guarded turn makes three requests (the
input rail's question, the reply, the output rail's question); left to the server, another conversation's request
can take the slot between any two of them, and each of the three then pays a swap where an unguarded turn pays one.

Contract:
- ``lease()``: a context manager that scopes one turn (``flashguard serve`` opens one per chat request; a program
  driving ``LLMRails`` itself may too). The turn's first request takes a slot; its later requests go to that slot
  while it is idle; no other request of this process is sent to it until the turn ends or the slot has stayed idle
  for ``IDLE_S`` (a turn that stalls cannot starve the others). Outside a lease each request takes a slot for
  itself alone. A lease that has ended claims nothing (a worker thread that outlives its request).
- ``SlotLeases.acquire(ids, timeout)`` returns the slot for a request over ``ids``: the lease's own slot when it has
  one and it is idle; else a free slot no lease holds, the one whose last request shares the longest prefix with
  ``ids`` (the server reuses that much), the least recently used among equals. Requests that wait for a free slot
  are served in arrival order; one that waited ``timeout`` seconds raises ``TimeoutError``. A request of a lease
  whose slot is busy (a streamed reply's chunk check beside the reply) takes another free slot for itself alone.
  ``release(slot, ids)`` after the request ends (its reply read or its stream closed).
- One ``SlotLeases`` per server URL in a process (``for_server``). Other processes' requests to the same server are
  not seen: a slot they use makes ours wait in the server's queue (``slot_leases: off`` for a shared server).
- Only which slot serves a request changes: the server decides what to reuse from what the slot holds, so a wrong
  guess costs time, never a wrong answer. Thread-safe (the rails and the reply call from worker threads).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import threading
import time
from typing import Iterator, Sequence

import numpy as np

IDLE_S = 5.0   # a lease's slot idle this long goes back to the others


class Lease:
    """One turn's claim: the slot it holds on each ``SlotLeases``, and who to tell when it ends."""

    def __init__(self):
        self.slots: dict[SlotLeases, int] = {}
        self.ended = False
        self._lock = threading.Lock()

    def hold(self, leases: "SlotLeases", index: int, slot: "_Slot") -> None:
        """``slot`` (number ``index`` of ``leases``) is this lease's from now on, unless the lease has ended (a
        worker thread that outlives its request claims nothing)."""
        with self._lock:
            if not self.ended:
                slot.holder = self
                self.slots[leases] = index

    def end(self) -> None:
        with self._lock:
            self.ended = True
            held = list(self.slots)
        for leases in held:
            leases.give_back(self)


_lease: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("flashguard_lease", default=None)


@contextlib.contextmanager
def lease() -> Iterator[Lease]:
    """Scope one guarded turn (see the module docstring). A nested call joins the outer lease."""
    outer = _lease.get()
    if outer is not None:
        yield outer
        return
    claim = Lease()
    token = _lease.set(claim)
    try:
        yield claim
    finally:
        _lease.reset(token)
        claim.end()


class _Slot:
    __slots__ = ("busy", "ids", "holder", "idle_since")

    def __init__(self):
        self.busy = False
        self.ids = np.zeros(0, dtype=np.int64)   # the prompt of the last request sent to it
        self.holder: Lease | None = None
        self.idle_since = 0.0                    # also the least-recently-used order


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class SlotLeases:
    """The slots of one server (``count``: its ``total_slots``), leased as the module docstring says."""

    def __init__(self, count: int, idle_s: float = IDLE_S):
        if count <= 0:
            raise ValueError(f"a server with {count} slots")
        self.slots = [_Slot() for _ in range(count)]
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._queue: collections.deque[int] = collections.deque()   # tickets of the requests waiting, in order
        self._tickets = itertools.count()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        with self._cond:
            return len(self._queue)

    def acquire(self, ids: Sequence[int], timeout: float | None = None) -> int:
        arr = np.asarray(ids, dtype=np.int64)
        claim = _lease.get()
        if claim is not None and claim.ended:
            claim = None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            mine = claim.slots.get(self) if claim is not None else None
            if self._own_idle(claim, mine):
                self.slots[mine].busy = True
                return mine
            ticket = next(self._tickets)
            if mine is not None:   # the lease's slot is busy with its reply: ahead of new turns
                self._queue.appendleft(ticket)
            else:
                self._queue.append(ticket)
            try:
                while True:
                    now = time.monotonic()
                    self._lapse(now)
                    if self._own_idle(claim, mine):
                        self.slots[mine].busy = True
                        return mine
                    free = [i for i, s in enumerate(self.slots) if not s.busy and s.holder is None]
                    if free and self._queue[0] == ticket:
                        break
                    if deadline is not None and now >= deadline:
                        raise TimeoutError(f"no slot of the server's {len(self.slots)} came free in {timeout:g} s")
                    wait = self._next_lapse(now)
                    if deadline is not None:
                        wait = min(wait if wait is not None else deadline - now, deadline - now)
                    self._cond.wait(timeout=wait)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()   # the next in the queue may go now
            best = max(free, key=lambda i: (common_prefix(self.slots[i].ids, arr), -self.slots[i].idle_since))
            slot = self.slots[best]
            slot.busy = True
            if claim is not None and (mine is None or self.slots[mine].holder is not claim):
                claim.hold(self, best, slot)   # the lease's first request (or its claim lapsed): the slot is its
            return best

    def _own_idle(self, claim: Lease | None, mine: int | None) -> bool:
        return mine is not None and self.slots[mine].holder is claim and not self.slots[mine].busy

    def release(self, slot: int, ids: Sequence[int]) -> None:
        with self._cond:
            s = self.slots[slot]
            s.busy, s.ids, s.idle_since = False, np.asarray(ids, dtype=np.int64), time.monotonic()
            self._cond.notify_all()

    def give_back(self, claim: Lease) -> None:
        """``claim`` ended: its slot is free for any request."""
        with self._cond:
            slot = claim.slots.pop(self, None)
            if slot is not None and self.slots[slot].holder is claim:
                self.slots[slot].holder = None
            self._cond.notify_all()

    def _lapse(self, now: float) -> None:
        for s in self.slots:
            if s.holder is not None and not s.busy and now - s.idle_since >= self.idle_s:
                s.holder = None

    def _next_lapse(self, now: float) -> float | None:
        held = [s.idle_since + self.idle_s - now for s in self.slots if s.holder is not None and not s.busy]
        return max(0.01, min(held)) if held else None


_servers: dict[str, SlotLeases] = {}
_servers_lock = threading.Lock()


def for_server(url: str, count: int) -> SlotLeases:
    """The one ``SlotLeases`` of the server at ``url`` in this process (a new one if its slot count changed)."""
    with _servers_lock:
        leases = _servers.get(url)
        if leases is None or len(leases.slots) != count:
            leases = _servers[url] = SlotLeases(count)
        return leases
