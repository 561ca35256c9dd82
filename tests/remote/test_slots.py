"""Slot leases (flashguard/remote/slots.py): which of a server's slots each request is sent to. Pure bookkeeping,
run here with real threads; tests/remote/test_llama_server.py runs them against llama-server."""

from __future__ import annotations

import contextvars
import threading
import time

import numpy as np
import pytest
import yaml

from flashguard.config import EngineConfig
from flashguard.remote.slots import SlotLeases, common_prefix, lease


def in_thread(fn, ctx: contextvars.Context | None = None):
    """Run ``fn`` on a new thread, in ``ctx`` (default: a fresh context, no lease, as another request's); returns
    (thread, box) where box holds its value and the time it returned."""
    box = {}

    def work():
        box["value"] = fn()
        box["at"] = time.monotonic()

    th = threading.Thread(target=(ctx or contextvars.Context()).run, args=(work,), daemon=True)
    th.start()
    return th, box


def wait_for(cond, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_common_prefix():
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


def test_with_every_slot_busy_requests_wait_and_are_served_in_arrival_order():
    leases = SlotLeases(1)
    slot = leases.acquire([1, 2])
    first, box1 = in_thread(lambda: leases.acquire([3, 4]))
    wait_for(lambda: leases.waiting == 1)
    second, box2 = in_thread(lambda: leases.acquire([5, 6]))
    wait_for(lambda: leases.waiting == 2)               # both wait: neither was sent to the busy slot
    leases.release(slot, [1, 2])
    first.join(5)
    assert box1["value"] == slot and second.is_alive()
    leases.release(slot, [3, 4])
    second.join(5)
    assert box2["value"] == slot


def test_a_wait_longer_than_the_timeout_is_an_error():
    leases = SlotLeases(1)
    leases.acquire([1])
    with pytest.raises(TimeoutError, match="no slot of the server's 1 came free in 0.05 s"):
        leases.acquire([2], timeout=0.05)
    assert leases.waiting == 0


def test_a_lease_keeps_its_slot_between_its_requests_and_gives_it_back_at_its_end():
    leases = SlotLeases(2)
    with lease():
        mine = leases.acquire([1, 2, 3])
        leases.release(mine, [1, 2, 3])
        # another request, even one continuing the same prefix, does not get the lease's idle slot
        th, box = in_thread(lambda: leases.acquire([1, 2, 3, 9]))
        th.join(5)
        other = box["value"]
        assert other != mine
        th2, box2 = in_thread(lambda: leases.acquire([4, 5]))
        wait_for(lambda: leases.waiting == 1)            # both slots taken: it waits
        assert leases.acquire([1, 2, 3, 4]) == mine      # the lease's next request: its slot, past the queue
        leases.release(mine, [1, 2, 3, 4])
        assert leases.waiting == 1                        # still the lease's
        ended = time.monotonic()
    th2.join(5)
    assert box2["value"] == mine and box2["at"] >= ended  # the lease ended: free for others
    leases.release(other, [1, 2, 3, 9])


def test_a_second_request_of_a_lease_while_its_slot_is_busy_takes_another_slot():
    leases = SlotLeases(2)
    with lease():
        mine = leases.acquire([1, 2, 3])
        assert leases.acquire([1, 2, 3, 4]) != mine      # e.g. a streamed reply's chunk check beside the reply


def test_a_lease_slot_left_idle_goes_back_to_the_others():
    leases = SlotLeases(1, idle_s=0.2)
    with lease():
        mine = leases.acquire([1])
        leases.release(mine, [1])
        th, box = in_thread(lambda: leases.acquire([2]))
        th.join(5)
        assert box["value"] == mine and box["at"] >= leases.slots[mine].idle_since + 0.2   # after the hold lapsed
        leases.release(mine, [2])
        assert leases.acquire([1, 5]) == mine             # the lease takes a slot again like any request


def test_an_ended_lease_claims_nothing():
    """A worker thread that outlives its request (a client gone) still carries the lease it was started in."""
    leases = SlotLeases(1)
    with lease():
        ctx = contextvars.copy_context()
    th, box = in_thread(lambda: leases.acquire([1]), ctx)
    th.join(5)
    leases.release(box["value"], [1])
    assert leases.slots[0].holder is None                 # free for the next request at once
    assert leases.acquire([2], timeout=0.5) == 0


def test_no_slots_is_an_error():
    with pytest.raises(ValueError):
        SlotLeases(0)


def test_slot_leases_off_in_yaml_is_off():
    """YAML 1.1 reads a bare ``off`` as false: the key still means what it says."""
    assert EngineConfig.from_parameters(yaml.safe_load("slot_leases: off")).slot_leases == "off"
    assert EngineConfig.from_parameters({}).slot_leases == "auto"


async def test_the_lease_reaches_the_worker_threads_the_engine_is_called_from():
    """The rails call the engine through ``asyncio.to_thread``, the provider streams through ``iterate_in_thread``:
    both run in the request's context, so a reply's requests and its rails' share its lease."""
    import asyncio

    from flashguard.guardrails.provider import iterate_in_thread
    from flashguard.remote import slots

    with lease() as claim:
        streamed = [x async for x in iterate_in_thread(lambda: iter([slots._lease.get()]))]
        rails = await asyncio.to_thread(slots._lease.get)
    assert streamed == [claim] and rails is claim and claim.ended


async def test_flashguard_serve_opens_one_lease_per_chat_request():
    from flashguard.guardrails.server import RequestBounds
    from flashguard.remote import slots

    seen = []

    async def app(scope, receive, send):   # what runs the chat request inside flashguard serve's bounds
        seen.append(slots._lease.get())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    body = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        pass

    bounds = RequestBounds(app)
    for _ in range(2):
        await bounds({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive, send)
    assert len(seen) == 2 and all(c is not None and c.ended for c in seen) and seen[0] is not seen[1]
