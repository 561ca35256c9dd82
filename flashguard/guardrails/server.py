"""``flashguard serve``: an OpenAI-compatible chat server in front of one ``LLMRails``.

``build_app(rails, nemo_app)`` answers, itself:

- ``POST /v1/chat/completions`` through the rails (plain and ``stream: true``), as OpenAI does: ``usage`` in
  every response (and as a last chunk when ``stream_options.include_usage``), ``role`` in the first delta,
  ``finish_reason`` on the last chunk (``"length"`` when ``max_tokens`` / ``max_completion_tokens`` cut the
  reply), content as a string or a list of text parts. A reply a rail blocks is the config's refusal
  (``bot refuse to respond``) with ``finish_reason: "content_filter"`` in both modes. A request the input rail
  blocks counts its prompt's tokens (the rail read them) and the refusal's as the completion (no LLM call made).
  Beside OpenAI's fields, the response (and the last chunk of a stream, the one with ``finish_reason``) carries
  ``flashguard``: ``{"blocked_by": {"rail": "input" | "output", "p_unsafe", "threshold", "method", "strictness",
  "reason", ...} or null, "rails": [every verdict of the turn, with the tokens each rail prefilled and reused]}``
  (clients that read OpenAI's fields only are unaffected).
- ``GET /v1/models`` (and ``/v1/models/{id}``): the config's main model names. Any name is accepted in a
  request; it is a label, the weights come from ``model_path``.
- ``GET /v1/flashguard/memory`` and ``/metrics``; ``GET /v1/flashguard/stats``: the chat page's panel (memory by
  category, the conversation's tokens in L1 / L2 / L3, the last turn's rails: ``chat/__init__.py``).
- ``GET /``: the chat page (``chat/``: plain HTML, CSS and JS from the package, nothing from a CDN);
  ``GET /health``: ``{"status": "ok"}``. FastAPI's ``/docs`` and ``/redoc`` are off (404): they load their CSS
  and JS from a CDN, so they were blank offline; ``/openapi.json`` stays.

Everything else (``/v1/rails/configs``, ``/v1/checks``, ...) goes to NeMo's server app.

``RequestBounds`` reads the body of a chat request (at most ``max_body_bytes``), checks it, and answers bad
input with a 4xx in OpenAI's error envelope (``param`` names the field) before any work: unsupported fields
(``n > 1``, ``tools``, ``response_format``, ``logprobs``) are refused, not ignored. At most ``max_in_flight``
chat requests are admitted at once (a local engine serves one at a time, the rest wait on its lock; with
``backend: openai`` they go to the server together); past that
the answer is 429 with Retry-After, so memory stays bounded.

``RequestLog`` logs one line per request (method, path, status, tokens, seconds) on the ``flashguard.server``
logger; prompt and reply text only with ``verbose``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import json
import logging
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from ..remote import slots


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
    report = await asyncio.to_thread(memory_report)
    if path == METRICS_PATH:
        body, ctype = prometheus(report).encode(), b"text/plain; version=0.0.4"
    else:
        body, ctype = json.dumps(report).encode(), b"application/json"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# -- the OpenAI-compatible app ----------------------------------------------------------------------------------
log = logging.getLogger("flashguard.server")
DEFAULT_REFUSAL = "I'm sorry, I can't respond to that."
INTERNAL_ERROR = "inform internal error occurred"   # NeMo's decision when a rail's action raised


def build_app(rails, nemo_app, limits: RequestLimits = RequestLimits(), verbose: bool = False):
    """The ASGI app of ``flashguard serve``: chat completions and models on ``rails``, the rest on ``nemo_app``."""
    from starlette.applications import Starlette
    from starlette.routing import Mount, Route

    from . import chat as page

    chat = ChatCompletions(rails, verbose)
    routes = [Route("/v1/chat/completions", chat.complete, methods=["POST"]),
              Route("/v1/models", chat.models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", chat.model, methods=["GET"]),
              *page.routes(lambda: chat.last_turn),
              Mount("/", app=nemo_app)]

    @contextlib.asynccontextmanager
    async def workers(app):
        """The rails' blocking calls run on the loop's default executor (``asyncio.to_thread``), a remote engine's
        while it waits for a server slot too: as many workers as chat requests admitted, not min(32, cores + 4)."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=limits.max_in_flight + 8,
                                                     thread_name_prefix="flashguard-rails")
        asyncio.get_running_loop().set_default_executor(pool)
        try:
            yield
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    return RequestLog(RequestBounds(Starlette(routes=routes, lifespan=workers), limits))


class ChatCompletions:
    """``POST /v1/chat/completions`` on one LLMRails (the body was checked by ``RequestBounds``)."""

    def __init__(self, rails, verbose: bool = False):
        self.rails = rails
        self.verbose = verbose
        mains = [m.model for m in rails.config.models if m.type == "main" and m.model]
        self.model_names = mains or ["flashguard"]
        refusals = (rails.config.bot_messages or {}).get("refuse to respond") or [DEFAULT_REFUSAL]
        self.refusal = refusals[0]
        self.last_turn: dict | None = None   # the last chat request's rails and tokens (GET /v1/flashguard/stats)

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [_model_card(name) for name in self.model_names]})

    async def model(self, request):
        from starlette.responses import JSONResponse, Response

        name = request.path_params["model_id"]
        if name not in self.model_names:
            return Response(error_body(404, f"model {name!r} is not served here; GET /v1/models lists "
                                            f"{', '.join(self.model_names)}", "model"),
                            status_code=404, media_type="application/json")
        return JSONResponse(_model_card(name))

    async def complete(self, request):
        from starlette.responses import JSONResponse, Response, StreamingResponse

        body = json.loads(await request.body())
        messages = [{"role": m["role"], "content": message_text(m.get("content"))} for m in body["messages"]]
        params = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens:
            params["max_tokens"] = max_tokens
        model = body.get("model") or self.model_names[0]
        usage = current_usage()
        if self.verbose:
            log.info("request messages: %s", json.dumps(messages, ensure_ascii=False))
        reply = _Reply(model)
        if body.get("stream"):
            stream = self.rails.stream_async(messages=messages, options={"llm_params": params})
            try:  # errors before the first piece (a prompt over the context, ...) are still a plain 4xx
                first = await anext(stream)
            except StopAsyncIteration:
                first = ""
            except Exception as exc:
                return Response(*_error_response(exc), media_type="application/json")
            if usage.error is not None:   # the LLM call failed (a prompt over the context, ...): its 4xx, whatever
                await _close(stream)      # the rails then made of NeMo's error text
                return Response(*_error_response(usage.error), media_type="application/json")
            failed = _stream_error(first)
            if failed and failed.get("type") != "guardrails_violation":
                await _close(stream)
                return Response(*_error_response(usage.error or RuntimeError(failed.get("message"))),
                                media_type="application/json")
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._events(reply, first, stream, usage, include_usage, messages),
                                     media_type="text/event-stream")
        try:
            res = await self.rails.generate_async(messages=messages, options={"llm_params": params,
                                                                              "log": {"activated_rails": True}})
        except Exception as exc:
            return Response(*_error_response(exc), media_type="application/json")
        content = res.response[-1]["content"] if res.response else ""
        stopped = [r for r in (res.log.activated_rails if res.log else []) if r.stop]
        if any(INTERNAL_ERROR in r.decisions for r in stopped):  # a rail failed (NeMo says "internal error")
            failed = next(r.name for r in stopped if INTERNAL_ERROR in r.decisions)
            return Response(*_error_response(usage.error or RuntimeError(f"the {failed!r} rail failed")),
                            media_type="application/json")
        blocker = next((r for r in stopped if r.type in ("input", "output")), None)
        if blocker is not None:
            content = self.refusal
            await self._count_refusal(usage, messages)
        if self.verbose:
            log.info("reply: %s", content)
        finish = "content_filter" if blocker is not None else usage.finish_reason
        extension = self._turn(usage, finish, None if blocker is None else (blocker.type, blocker.name))
        return JSONResponse({**reply.completion(content, finish, usage), "flashguard": extension})

    def _turn(self, usage: "RequestUsage", finish_reason: str | None, blocked: tuple[str, str] | None) -> dict:
        """The response's ``flashguard`` field, kept as ``last_turn`` too. ``blocked``: (rail type, rail name) of
        the rail that stopped the reply; its verdict is the last blocking one flashguard's rails recorded (another
        rail's block says only its name)."""
        blocked_by = None
        if blocked is not None:
            verdict = next((v for v in reversed(usage.verdicts) if v["blocked"] and v["rail"] == blocked[0]), None)
            blocked_by = verdict or {"rail": blocked[0], "name": blocked[1]}
        extension = {"blocked_by": blocked_by, "rails": usage.verdicts}
        self.last_turn = {**extension, "finish_reason": finish_reason, **usage.openai()}
        return extension

    async def _count_refusal(self, usage: "RequestUsage", messages: list[dict]) -> None:
        """A reply blocked before any LLM call (the input rail): the usage is the prompt's tokens, which the rail
        read, and the refusal's tokens as the completion. A call already counted (an output rail's block) stays."""
        if usage.prompt_tokens or usage.completion_tokens:
            return
        from .provider import FlashGuardModel

        llm = getattr(self.rails, "llm", None)
        model = llm if isinstance(llm, FlashGuardModel) else getattr(llm, "raw_llm", None)   # a LangChain wrapper's
        if not isinstance(model, FlashGuardModel):
            return
        engine = model.engine

        def count() -> tuple[int, int]:
            return (len(model.prompt_ids(messages)),
                    len(engine.tokenizer(self.refusal, add_special_tokens=False)["input_ids"]))

        try:
            prompt, completion = await asyncio.to_thread(count)
        except Exception as exc:   # an uncountable prompt leaves the usage at zero; the refusal still goes out
            log.warning("flashguard: the blocked request's tokens could not be counted: %s", exc)
            return
        usage.add(prompt, completion, "content_filter")

    async def _events(self, reply: "_Reply", first, stream, usage: "RequestUsage", include_usage: bool,
                      messages: list[dict]):
        usage_field = {"usage": None} if include_usage else {}
        yield reply.event({"role": "assistant", "content": ""}, **usage_field)
        blocked, parts = False, []
        try:
            piece = first
            while True:
                failed = _stream_error(piece)
                if failed:
                    if failed.get("type") != "guardrails_violation":  # the openai client raises APIError
                        if usage.error is not None:
                            failed = {**failed, "message": str(usage.error)}
                        log.error("chat completion failed mid-stream: %s", failed.get("message"))
                        yield f"data: {json.dumps({'error': failed})}\n\n"
                        return
                    blocked = ("output", failed.get("param") or "output rail")
                    yield reply.event({"content": self.refusal}, **usage_field)
                    break
                if isinstance(piece, str) and piece:
                    parts.append(piece)
                    yield reply.event({"content": piece}, **usage_field)
                try:
                    piece = await anext(stream)
                except StopAsyncIteration:
                    break
        finally:
            await _close(stream)
        if usage.blocked == "input" and not blocked:   # NeMo streams an input rail's refusal as plain text
            blocked = ("input", "flashguard moderate input")
        if blocked:
            await self._count_refusal(usage, messages)
        if self.verbose:
            log.info("reply: %s", self.refusal if blocked else "".join(parts))
        finish = "content_filter" if blocked else usage.finish_reason or "stop"
        yield reply.event({}, finish, **usage_field, flashguard=self._turn(usage, finish, blocked or None))
        if include_usage:
            yield reply.event(None, usage=usage.openai())
        yield "data: [DONE]\n\n"


class _Reply:
    """The id, time and model label shared by a response's chunks."""

    def __init__(self, model: str):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def completion(self, content: str, finish_reason: str | None, usage: "RequestUsage") -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": finish_reason or "stop", "logprobs": None}],
                "usage": usage.openai()}

    def event(self, delta: dict | None, finish_reason: str | None = None, **extra) -> str:
        """One SSE ``chat.completion.chunk``; ``delta=None`` is the usage chunk (no choices)."""
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices, **extra}
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


async def _close(stream) -> None:
    """Stop NeMo's stream (and with it the generation task) when the client is answered or gone."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "flashguard"}


def _stream_error(piece) -> dict | None:
    """The ``error`` object of NeMo's terminal error frame (a JSON string in the stream), else None."""
    if isinstance(piece, dict):
        return piece.get("error") if isinstance(piece.get("error"), dict) else None
    if not isinstance(piece, str) or not piece.startswith('{"error"'):
        return None
    try:
        error = json.loads(piece).get("error")
    except ValueError:
        return None
    return error if isinstance(error, dict) and error.get("type") in (
        "generation_error", "downstream_error", "guardrails_violation", "internal_error") else None


def _error_response(exc: BaseException) -> tuple[bytes, int]:
    """Body and status for an exception of the rails: a flashguard error's own status and message (found in
    NeMo's wrapping), else 500."""
    from ..errors import FlashguardError

    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, FlashguardError):
            return error_body(e.status_code, str(e)), e.status_code
        inner = getattr(e, "inner_exception", None)
        e = inner if isinstance(inner, BaseException) else (e.__cause__ or e.__context__)
    log.error("chat completion failed: %s: %s", type(exc).__name__, exc)
    return error_body(500, f"the request failed: {type(exc).__name__}: {exc}"), 500


# -- per-request accounting and the request log ----------------------------------------------------------------
class RequestUsage:
    """Tokens of the LLM calls one request made (the provider adds each call's last Delta) and the finish
    reason of its reply."""

    def __init__(self):
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.error: BaseException | None = None   # a flashguard error an LLM call raised (its status and message)
        self.blocked: str | None = None   # "input": flashguard's input rail blocked the request (record_block)
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


def record_block(rail: str) -> None:
    """Called by flashguard's input rail when it blocks (``rail``: "input"): a streamed reply then ends with
    ``finish_reason: "content_filter"`` and counts the prompt and the refusal, though NeMo streams the refusal as
    plain text."""
    usage = _usage.get()
    if usage is not None:
        usage.blocked = rail


def record_verdict(rail: str, allowed: bool, meta: dict) -> None:
    """Called by flashguard's rails with each verdict (``rail``: "input" or "output"; ``meta``: p_unsafe,
    threshold, method, strictness, path, prefilled_tokens, reused_tokens, reason): the response's ``flashguard``
    field and the chat page's panel."""
    usage = _usage.get()
    if usage is not None:
        usage.verdicts.append({"rail": rail, "blocked": not allowed, **meta})


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


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def serve(rails, nemo_app, host: str, port: int, verbose: bool = False, open_page: bool = False) -> None:
    """Run the app with uvicorn (its own access log off: ``RequestLog`` writes one line per request);
    ``open_page``: open the chat page in the default browser once the server answers."""
    import uvicorn

    if not verbose:  # NeMo logs whole conversations (prompts, replies) in its warnings; the request log is enough
        logging.getLogger("nemoguardrails").setLevel(logging.CRITICAL)
    print(f"flashguard: serving on http://{host}:{port}/v1 (OpenAI-compatible: /v1/chat/completions, /v1/models); "
          f"chat page: http://{host}:{port}/", file=sys.stderr, flush=True)
    if open_page:
        from .chat import open_when_up

        open_when_up(host, port)
    # uvicorn shuts down gracefully on SIGTERM, then raises it again under the handler it found: with the default
    # one the process died there, before the atexit hooks that remove the KV pages' L3 folder (kv/disk.py)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)
    uvicorn.run(build_app(rails, nemo_app, verbose=verbose), host=host, port=port,
                log_level="info" if verbose else "warning", access_log=verbose)
