"""Who hears the rails' verdicts besides NeMo, so that the rails import nothing that listens.

Contract:
- ``subscribe(listener)``: ``listener(rail, allowed, meta)`` is called with every verdict the rails' actions give
  from then on, in this process (once per listener however often it subscribes). ``rail``: "input" or "output";
  ``meta``: ``p_unsafe``, ``threshold``, ``method``, ``strictness``, ``path``, ``prefilled_tokens``,
  ``reused_tokens``, ``reason``. The server's request accounting subscribes when it is imported
  (flashguard/guardrails/usage.py: the response's ``flashguard`` field, a blocked request's usage).
- ``publish(rail, allowed, meta)``: rails/actions.py, once per verdict, on the thread that judged it.
A listener must be quick and must not raise: it runs inside the rail's action.
"""

from __future__ import annotations

import threading
from typing import Callable

Listener = Callable[[str, bool, dict], None]

_listeners: tuple[Listener, ...] = ()
_lock = threading.Lock()


def subscribe(listener: Listener) -> None:
    global _listeners
    with _lock:
        if listener not in _listeners:
            _listeners = _listeners + (listener,)


def publish(rail: str, allowed: bool, meta: dict) -> None:
    for listener in _listeners:
        listener(rail, allowed, meta)
