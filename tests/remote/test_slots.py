"""Slot leases (flashguard/remote/slots.py): which of a server's slots each request is sent to. Pure bookkeeping,
run here with real threads; tests/remote/test_llama_server.py runs them against llama-server."""

from __future__ import annotations

import contextvars
import threading
import time

import pytest

from flashguard.remote.slots import SlotLeases, common_prefix, turn


def in_thread(fn):
    """Run ``fn`` on a new thread with a fresh context (no turn), as another request would; returns (thread, box)."""
    box = {}

    def work():
        box["value"] = fn()

    th = threading.Thread(target=contextvars.Context().run, args=(work,), daemon=True)
    th.start()
    return th, box


def test_common_prefix():
    import numpy as np

    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([], dtype=np.int64), np.array([1])) == 0


def test_a_request_goes_to_the_slot_that_holds_its_prefix_else_the_least_recently_used():
    leases = SlotLeases(3)
    a, b = leases.acquire([1, 2, 3]), leases.acquire([7, 8, 9])
    assert a != b
    leases.release(a, [1, 2, 3])
    leases.release(b, [7, 8, 9])
    assert leases.acquire([1, 2, 3, 4, 5]) == a        # continues what slot a holds
    c = leases.acquire([50, 51])                        # shares nothing: the empty slot, least recently used
    assert c not in (a, b)


def test_with_every_slot_busy_a_request_waits_for_one_to_end():
    leases = SlotLeases(1)
    slot = leases.acquire([1, 2])
    th, box = in_thread(lambda: leases.acquire([3, 4]))
    th.join(0.3)
    assert th.is_alive()                                # waiting, not sent to a busy slot
    leases.release(slot, [1, 2])
    th.join(5)
    assert box["value"] == slot


def test_a_turn_keeps_its_slot_between_its_requests_and_gives_it_back_at_its_end():
    leases = SlotLeases(2)
    with turn():
        mine = leases.acquire([1, 2, 3])
        leases.release(mine, [1, 2, 3])
        # another request, even one continuing the same prefix, does not get the turn's idle slot
        th, box = in_thread(lambda: leases.acquire([1, 2, 3, 9]))
        th.join(5)
        other = box["value"]
        assert other != mine
        th2, box2 = in_thread(lambda: leases.acquire([4, 5]))   # both slots taken now: it waits
        th2.join(0.3)
        assert th2.is_alive()
        assert leases.acquire([1, 2, 3, 4]) == mine      # the turn's next request: its slot
        leases.release(mine, [1, 2, 3, 4])
        th2.join(0.3)
        assert th2.is_alive()                            # still the turn's
    th2.join(5)
    assert box2["value"] == mine                         # the turn ended: free for others
    leases.release(other, [1, 2, 3, 9])


def test_a_second_request_of_a_turn_while_its_slot_is_busy_takes_another_slot():
    leases = SlotLeases(2)
    with turn():
        mine = leases.acquire([1, 2, 3])
        assert leases.acquire([1, 2, 3, 4]) != mine      # e.g. a streamed reply's chunk check beside the reply


def test_a_turn_slot_left_idle_goes_back_to_the_others():
    leases = SlotLeases(1, idle_s=0.2)
    with turn():
        mine = leases.acquire([1])
        leases.release(mine, [1])
        t0 = time.monotonic()
        th, box = in_thread(lambda: leases.acquire([2]))
        th.join(5)
        assert box["value"] == mine and time.monotonic() - t0 >= 0.15   # after the hold lapsed, not before
        # the turn's next request now waits like any other, then takes the slot again
        th3, _ = in_thread(lambda: leases.release(mine, [2]))
        assert leases.acquire([1, 5]) == mine


def test_no_slots_is_an_error():
    with pytest.raises(ValueError):
        SlotLeases(0)
