"""A blocking iterator consumed on the event loop: how the provider and the LangChain adapter stream the engine's
synchronous decode loop without holding the loop.

Contract: ``iterate_in_thread(make_iter)`` is an async iterator over ``make_iter()``'s items, which a worker thread
produces in the caller's context (a turn's slot lease, remote/slots.py, goes with it). An exception of the worker is
raised to the consumer; closing the async iterator early stops the worker at its next item and closes the blocking
iterator there (which releases the engine's lock).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import AsyncIterator


async def iterate_in_thread(make_iter) -> AsyncIterator:
    """Run a blocking iterator on a worker thread and yield its items on the event loop.

    Closing the async iterator early stops the worker at its next item (and closes the sync
    iterator there, which releases the engine lock).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    done = object()

    def post(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            stop.set()

    def work():
        try:
            it = make_iter()
            try:
                for item in it:
                    post((item, None))
                    if stop.is_set():
                        break
            finally:
                close = getattr(it, "close", None)
                if close:
                    close()
        except BaseException as exc:  # handed to the consumer, which re-raises it
            post((done, exc))
            return
        post((done, None))

    # the caller's context goes with the work (a turn's slot lease, remote/slots.py), as asyncio.to_thread's does
    thread = threading.Thread(target=contextvars.copy_context().run, args=(work,), name="flashguard-decode",
                              daemon=True)
    thread.start()
    try:
        while True:
            item, exc = await queue.get()
            if item is done:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        stop.set()
