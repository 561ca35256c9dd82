"""One-line notices a user sees on stderr without configuring logging: what is being loaded (once per model) and
which rail blocked a turn, and why. Everything else flashguard logs (per-call verdicts, plans, timings) is INFO on
the ``flashguard`` logger, shown with ``-v`` or the application's own logging.

Contract: ``say(message)`` writes ``message`` as one line to stderr through the logger ``flashguard.notice``, which
has its own handler and does not propagate (a configured root logger does not print it twice). Silence it with the
environment variable ``FLASHGUARD_QUIET=1`` or ``logging.getLogger("flashguard.notice").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("flashguard.notice")


class _Stderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is at the time (pytest and notebooks swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.setStream(sys.stderr)
        super().emit(record)


if not log.handlers:
    _handler = _Stderr()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_handler)
    log.propagate = False
    log.setLevel(logging.WARNING if os.environ.get("FLASHGUARD_QUIET") not in (None, "", "0") else logging.INFO)


def say(message: str, *args) -> None:
    log.info(message, *args)
