"""Request bounds in front of NeMo's server app (used by ``flashguard serve``).

NeMo's ``/v1/chat/completions`` answers an empty message list with an empty 200 and accepts any
body size. This ASGI middleware reads the body (at most ``max_body_bytes``), checks it, and answers
bad input with a 4xx in NeMo's error envelope before NeMo sees it. Valid requests pass unchanged.
At most ``max_in_flight`` chat requests are admitted at once (the engine serves one at a time, the
rest wait on its lock); past that the answer is 429 with Retry-After, so memory stays bounded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


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
            return await _memory(scope["path"], send)
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
            return await _reject(send, 400, problem)
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
            return await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1

    def check(self, raw: bytes) -> str | None:
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError):
            return "the request body is not valid JSON"
        if not isinstance(body, dict):
            return "the request body must be a JSON object with a 'messages' list"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages is empty; send at least one message, e.g. [{\"role\": \"user\", \"content\": \"hi\"}]"
        if len(messages) > self.limits.max_messages:
            return f"{len(messages)} messages is over the limit of {self.limits.max_messages}; send fewer"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"messages[{i}] must be an object with a 'role'"
            if m.get("content") is not None and not isinstance(m["content"], (str, list)):
                return f"messages[{i}].content must be a string"
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or not 0 < max_tokens <= self.limits.max_tokens):
            return f"max_tokens must be an integer between 1 and {self.limits.max_tokens}"
        return None


async def _reject(send, status: int, message: str, retry_after: int | None = None) -> None:
    kind = "invalid_request_error" if status < 500 else "server_error"
    payload = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


MEMORY_PATH = "/v1/flashguard/memory"   # JSON: per-engine memory by category and the task counters
METRICS_PATH = "/metrics"               # the same numbers in the Prometheus text format


def memory_report() -> dict:
    from .. import engine_stats
    from ..engine.registry import all_engines
    from ..vram.accounting import engine_memory

    return {"engines": [engine_memory(e) for e in all_engines()], "stats": engine_stats()}


def prometheus(report: dict) -> str:
    lines = ["# HELP flashguard_memory_bytes Memory by engine, place and category.",
             "# TYPE flashguard_memory_bytes gauge"]
    for eng in report["engines"]:
        model = eng["model"].replace('"', "'")
        places = [("gpu", eng["gpu"] or {}), ("host", eng["host"])]
        places.append(("cpu", {k[4:]: v for k, v in eng.items() if k.startswith("cpu_")}))
        for place, values in places:
            for cat, v in values.items():
                if isinstance(v, (int, float)) and "pages" not in cat:
                    lines.append(f'flashguard_memory_bytes{{model="{model}",place="{place}",category="{cat}"}} {v}')
    lines += ["# HELP flashguard_tokens_total Tokens by task and kind.", "# TYPE flashguard_tokens_total counter"]
    for model, tasks in report["stats"].items():
        model = model.replace('"', "'")
        for task, counters in tasks.items():
            for kind, v in (counters.items() if isinstance(counters, dict) else []):
                if isinstance(v, (int, float)) and "tokens" in kind:
                    lines.append(f'flashguard_tokens_total{{model="{model}",task="{task}",kind="{kind}"}} {v}')
    return "\n".join(lines) + "\n"


async def _memory(path: str, send) -> None:
    import asyncio

    report = await asyncio.to_thread(memory_report)
    if path == METRICS_PATH:
        body, ctype = prometheus(report).encode(), b"text/plain; version=0.0.4"
    else:
        body, ctype = json.dumps(report).encode(), b"application/json"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
