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

Its parts, each in its own module: ``bounds.RequestBounds`` reads the body of a chat request (at most
``max_body_bytes``), checks it, and answers bad input with a 4xx in OpenAI's error envelope (``param`` names the
field) before any work: unsupported fields (``n > 1``, ``tools``, ``response_format``, ``logprobs``) are refused,
not ignored. At most ``max_in_flight`` chat requests are admitted at once (a local engine serves one at a time, the
rest wait on its lock; with ``backend: openai`` they go to the server together); past that the answer is 429 with
Retry-After, so memory stays bounded. ``metrics.py`` answers the memory and metrics paths. ``usage.RequestLog``
logs one line per request (method, path, status, tokens, seconds) on the ``flashguard.server`` logger (prompt and
reply text only with ``verbose``) and keeps the request's ``RequestUsage``: the tokens of its LLM calls and its
rails' verdicts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import signal
import sys
import threading
import time
import uuid

from .bounds import (SAMPLING_FIELDS, RequestBounds, RequestLimits, error_body,  # noqa: F401 - (re-exported)
                     message_text)
from .usage import RequestLog, RequestUsage, current_usage, usage_scope  # noqa: F401 - (re-exported)


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
            return len(model.prompt_ids(messages)), len(engine.tokenize(self.refusal))

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
