"""Per-request accounting: what one request's LLM calls and rails did, for its response, its log line and the CLI.

Contract:
- A ``RequestUsage`` is current inside ``usage_scope()`` (``flashguard generate`` / ``chat``: was the reply cut at
  ``max_tokens``?) and inside every HTTP request of ``flashguard serve`` (``RequestLog``, which logs one line per
  request: method, path, status, prompt and completion tokens, seconds). Outside both there is none, and recording
  does nothing.
- The provider calls ``record_call`` at the end of each LLM call (its tokens and finish reason) and ``record_error``
  when one fails (the server answers with that error's status and message).
- The rails' verdicts arrive through ``flashguard.rails.listeners``, which this module subscribes to when imported
  (``record_verdict``): the rails import no server.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time

from ..rails import listeners

log = logging.getLogger("flashguard.server")


class RequestUsage:
    """Tokens of the LLM calls one request made (the provider adds each call's last Delta) and the finish
    reason of its reply."""

    def __init__(self):
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: BaseException | None = None   # a flashguard error an LLM call raised (its status and message)
        self.blocked: str | None = None   # "input": flashguard's input rail blocked the request (record_verdict)
        self.verdicts: list[dict] = []    # flashguard's rails' verdicts, in order (record_verdict)

    def add(self, prompt_tokens: int, completion_tokens: int, finish_reason: str | None) -> None:
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        self.finish_reason = finish_reason

    def openai(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


_usage: contextvars.ContextVar[RequestUsage | None] = contextvars.ContextVar("flashguard_request_usage",
                                                                              default=None)


def current_usage() -> RequestUsage:
    """The running request's ``RequestUsage`` (a fresh one outside a request: adding to it is harmless)."""
    return _usage.get() or RequestUsage()


@contextlib.contextmanager
def usage_scope():
    """A ``RequestUsage`` that the LLM calls made inside the block count toward (as a server request's do): how
    ``flashguard generate`` and ``chat`` learn that a reply was cut at max_tokens (``finish_reason``)."""
    usage = RequestUsage()
    token = _usage.set(usage)
    try:
        yield usage
    finally:
        _usage.reset(token)


def record_call(prompt_tokens: int, completion_tokens: int, finish_reason: str | None) -> None:
    """Called by the provider at the end of each LLM call: counts it toward the running request, if any."""
    usage = _usage.get()
    if usage is not None:
        usage.add(prompt_tokens, completion_tokens, finish_reason)


def record_error(exc: BaseException) -> None:
    """Called by the provider when an LLM call fails: the server answers with this error's status and message."""
    usage = _usage.get()
    if usage is not None:
        usage.error = exc


def record_verdict(rail: str, allowed: bool, meta: dict) -> None:
    """Each verdict of flashguard's rails (subscribed to ``flashguard.rails.listeners`` below; ``rail``: "input" or
    "output"; ``meta``: p_unsafe, threshold, method, strictness, path, prefilled_tokens, reused_tokens, reason): the
    response's ``flashguard`` field and the chat page's panel. An input rail's block marks the request blocked: a
    streamed reply then ends with ``finish_reason: "content_filter"`` and counts the prompt and the refusal, though
    NeMo streams the refusal as plain text."""
    usage = _usage.get()
    if usage is not None:
        if rail == "input" and not allowed:
            usage.blocked = rail
        usage.verdicts.append({"rail": rail, "blocked": not allowed, **meta})


listeners.subscribe(record_verdict)


class RequestLog:
    """One log line per HTTP request: method, path, status, prompt/completion tokens, seconds."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        usage, status, start = RequestUsage(), [500], time.perf_counter()
        token = _usage.set(usage)

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            _usage.reset(token)
            log.info("%s %s %d prompt_tokens=%d completion_tokens=%d %.2fs", scope["method"], scope["path"],
                     status[0], usage.prompt_tokens, usage.completion_tokens, time.perf_counter() - start)
