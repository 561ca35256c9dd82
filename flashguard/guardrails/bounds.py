"""What ``flashguard serve`` checks of a chat request before any work, and how it refuses one.

Contract:
- ``RequestBounds(app, limits)``: ASGI middleware. A ``POST .../chat/completions`` body is read (at most
  ``limits.max_body_bytes``: else 413), checked (``check``: a 400 in OpenAI's error envelope whose ``param`` names
  the field: malformed messages, ``max_tokens`` out of range, sampling fields out of ``SamplingParams``' bounds,
  fields flashguard cannot honour such as ``n > 1``, ``tools``, ``response_format``, ``logprobs``), and admitted
  only while fewer than ``limits.max_in_flight`` chat requests are in flight (else 429 with Retry-After), each
  inside one remote slot lease (remote/slots.py). ``GET`` of the memory and metrics paths is answered here
  (metrics.py); everything else passes through.
- ``error_body(status, message, param)``: OpenAI's error envelope; ``message_text(content)``: a checked message's
  text; ``SAMPLING_FIELDS``: the request fields handed to the provider.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..remote import slots
from .metrics import MEMORY_PATH, METRICS_PATH, answer_memory


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 4 * 2**20
    max_messages: int = 512
    max_tokens: int = 4096
    max_in_flight: int = 64   # chat requests admitted at once (running + queued on the engine); more get 429


class RequestBounds:
    def __init__(self, app, limits: RequestLimits = RequestLimits()):
        self.app = app
        self.limits = limits
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] in (MEMORY_PATH, METRICS_PATH):
            return await answer_memory(scope["path"], send)
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limits.max_body_bytes:
                return await _reject(send, 413, f"request body is over {self.limits.max_body_bytes} bytes; "
                                                "send a shorter conversation")
            chunks.append(body)
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        problem = self.check(raw)
        if problem:
            return await _reject(send, 400, problem[0], param=problem[1])
        if self.in_flight >= self.limits.max_in_flight:
            return await _reject(send, 429, f"{self.in_flight} requests are already waiting for the model; "
                                            "retry in a few seconds", retry_after=5)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        self.in_flight += 1
        try:
            with slots.lease():   # a remote engine's requests for this reply keep one server slot (remote/slots.py)
                return await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1

    def check(self, raw: bytes) -> tuple[str, str | None] | None:
        """``(message, param)`` of the first problem of a chat request body, or None when it can be served."""
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError):
            return "the request body is not valid JSON", None
        if not isinstance(body, dict):
            return "the request body must be a JSON object with a 'messages' list", None
        messages = body.get("messages")
        example = 'e.g. [{"role": "user", "content": "hi"}]'
        if messages is None:
            return f"messages is missing; send a list of messages, {example}", "messages"
        if not isinstance(messages, list):
            return f"messages must be a list of messages, not {type(messages).__name__}; {example}", "messages"
        if not messages:
            return f"messages is empty; send at least one message, {example}", "messages"
        if len(messages) > self.limits.max_messages:
            return f"{len(messages)} messages is over the limit of {self.limits.max_messages}; send fewer", "messages"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}] must be an object with a 'role'", f"messages[{i}]"
            problem = _content_problem(m.get("content"), f"messages[{i}].content")
            if problem:
                return problem
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 < value <= self.limits.max_tokens):
                return f"{key} must be an integer between 1 and {self.limits.max_tokens}", key
        return _sampling_problem(body) or _unsupported(body)


# the request's sampling fields handed to the provider (OpenAI's, and vLLM's repetition_penalty); unset ones take the
# config's defaults (models[main].parameters)
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "frequency_penalty", "presence_penalty",
                   "repetition_penalty")


def _sampling_problem(body: dict) -> tuple[str, str] | None:
    """The sampling fields the engine reads (``SamplingParams``' own bounds), checked before any work so the 400
    names the field as the others do."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    temperature, top_p, seed, stop = (body.get(k) for k in ("temperature", "top_p", "seed", "stop"))
    if temperature is not None and not (number(temperature) and temperature >= 0):
        return f"temperature must be a number >= 0 (0 is greedy), got {temperature!r}", "temperature"
    for key in ("frequency_penalty", "presence_penalty"):
        value = body.get(key)
        if value is not None and not (number(value) and -2 <= value <= 2):
            return f"{key} must be a number in [-2, 2] (0 is off), got {value!r}", key
    penalty = body.get("repetition_penalty")
    if penalty is not None and not (number(penalty) and penalty > 0):
        return f"repetition_penalty must be a number > 0 (1 is off), got {penalty!r}", "repetition_penalty"
    if top_p is not None and not (number(top_p) and 0 < top_p <= 1):
        return f"top_p must be a number in (0, 1], got {top_p!r}", "top_p"
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return f"seed must be an integer, got {seed!r}", "seed"
    if stop is not None and not (isinstance(stop, str) and stop or isinstance(stop, list)
                                 and all(isinstance(x, str) and x for x in stop)):
        return f"stop must be a non-empty string or a list of them, got {stop!r}", "stop"
    return None


def _content_problem(content, where: str) -> tuple[str, str] | None:
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"{where} must be a string or a list of text parts", where
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            return (f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, "
                    f"got {kind!r}", f"{where}[{j}]")
    return None


def _unsupported(body: dict) -> tuple[str, str] | None:
    """OpenAI fields flashguard cannot honour: a 400 naming the field rather than a silently different answer."""
    n = body.get("n")
    if n is not None and n != 1:
        return f"n={n!r} is not supported: the server returns one choice; send n=1 (or omit n) and repeat the request", "n"
    for key in ("tools", "functions", "tool_choice", "function_call", "parallel_tool_calls"):
        if body.get(key) not in (None, [], "none"):
            return f"{key} is not supported: flashguard serve has no tool calling; remove {key}", key
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        return "response_format is not supported (no JSON mode or schemas); remove it or send {\"type\": \"text\"}", \
            "response_format"
    for key in ("logprobs", "top_logprobs"):
        if body.get(key) not in (None, False):
            return f"{key} is not supported: the server returns no log-probabilities; remove {key}", key
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "stream must be true or false", "stream"
    return None


def message_text(content) -> str:
    """A message's text: the string itself, or its text parts joined (checked by ``RequestBounds`` first)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part["text"] for part in content)


async def _reject(send, status: int, message: str, retry_after: int | None = None, param: str | None = None) -> None:
    payload = error_body(status, message, param)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """OpenAI's error envelope (the ``openai`` client shows ``message``)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}}).encode()
