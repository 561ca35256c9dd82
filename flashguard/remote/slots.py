"""Slot leases: a guarded turn keeps one of llama-server's slots from its first request to its last
(``slot_leases: auto``).

llama-server holds each conversation's KV in one of its ``--parallel`` slots. With more conversations than slots, a
request that lands on a slot holding another conversation first saves that slot's state to host RAM and restores
its own (or prefills it again), in the server's single loop, which stalls every slot. A guarded turn makes three
requests (the input rail's question, the reply, the output rail's question); left to the server, another
conversation's request can take the slot between any two of them, and each of the three then pays a swap where an
unguarded turn pays one (32 conversations on 8 slots: turn p95 2.2-2.4x the rails-off load, docs/benchmarks/remote.md).

Contract:
- ``turn()``: a context manager that scopes one turn (``flashguard serve`` opens one per chat request; a program
  driving ``LLMRails`` itself may too). The turn's first request takes a slot; its later requests go to that slot;
  no other request is sent to it until the turn ends. Outside a turn each request takes a slot for itself alone.
- ``SlotLeases.acquire(ids)`` returns the slot for a request over ``ids`` (llama-server's ``id_slot``), waiting while
  none is free: the turn's own slot when it has one and it is idle; else the free slot no turn holds whose last
  request shares the longest prefix with ``ids`` (the server reuses that much), the least recently used among
  equals. A request of a turn whose slot is busy (a streamed reply's chunk check beside the reply) takes another
  free slot for itself alone. ``release(slot, ids)`` after the request ends (its reply read or its stream closed).
- A turn's slot that stays idle for ``IDLE_S`` is taken back (a turn that stalls or never ends cannot starve the
  others), so a wait lasts at most until a request ends or a hold lapses: no deadlock.
- Only which slot serves a request changes: the server decides what to reuse from what the slot holds, so a wrong
  guess costs time, never a wrong answer. Thread-safe (the rails and the reply call from worker threads).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Iterator, Sequence

import numpy as np

IDLE_S = 5.0   # a turn's slot idle this long goes back to the others


class Turn:
    """One turn's claim: the slot it holds on each ``SlotLeases`` (keyed by the leases' id), and who to tell when
    it ends."""

    def __init__(self):
        self.slots: dict[int, int] = {}
        self._on_end: list = []

    def end(self) -> None:
        for callback in self._on_end:
            callback(self)
        self._on_end.clear()


_turn: contextvars.ContextVar[Turn | None] = contextvars.ContextVar("flashguard_turn", default=None)


@contextlib.contextmanager
def turn() -> Iterator[Turn]:
    """Scope one guarded turn (see the module docstring). Nested calls join the outer turn."""
    outer = _turn.get()
    if outer is not None:
        yield outer
        return
    t = Turn()
    token = _turn.set(t)
    try:
        yield t
    finally:
        _turn.reset(token)
        t.end()


class _Slot:
    __slots__ = ("busy", "ids", "holder", "idle_since")

    def __init__(self):
        self.busy = False
        self.ids = np.zeros(0, dtype=np.int64)   # the prompt of the last request sent to it
        self.holder: Turn | None = None
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

    def acquire(self, ids: Sequence[int]) -> int:
        arr = np.asarray(ids, dtype=np.int64)
        t = _turn.get()
        with self._cond:
            while True:
                now = time.monotonic()
                self._lapse(now)
                mine = t.slots.get(id(self)) if t is not None else None
                if mine is not None and self.slots[mine].holder is t and not self.slots[mine].busy:
                    self.slots[mine].busy = True
                    return mine
                free = [i for i, s in enumerate(self.slots) if not s.busy and s.holder is None]
                if free:
                    best = max(free, key=lambda i: (common_prefix(self.slots[i].ids, arr),
                                                    -self.slots[i].idle_since))
                    slot = self.slots[best]
                    slot.busy = True
                    if t is not None and (mine is None or self.slots[mine].holder is not t):
                        slot.holder = t   # the turn's first request (or its claim lapsed): the slot is the turn's
                        t.slots[id(self)] = best
                        if self._ended not in t._on_end:
                            t._on_end.append(self._ended)
                    return best
                self._cond.wait(timeout=self._next_lapse(now))

    def release(self, slot: int, ids: Sequence[int]) -> None:
        with self._cond:
            s = self.slots[slot]
            s.busy, s.ids, s.idle_since = False, np.asarray(ids, dtype=np.int64), time.monotonic()
            self._cond.notify_all()

    def _ended(self, t: Turn) -> None:
        with self._cond:
            slot = t.slots.pop(id(self), None)
            if slot is not None and self.slots[slot].holder is t:
                self.slots[slot].holder = None
            self._cond.notify_all()

    def _lapse(self, now: float) -> None:
        for s in self.slots:
            if s.holder is not None and not s.busy and now - s.idle_since >= self.idle_s:
                s.holder = None

    def _next_lapse(self, now: float) -> float | None:
        held = [s.idle_since + self.idle_s - now for s in self.slots if s.holder is not None and not s.busy]
        return max(0.01, min(held)) if held else None
