"""The chat page of ``flashguard serve``: plain HTML, CSS and JS shipped in this folder, nothing from a CDN.

Contract: ``routes(last_turn)`` returns the Starlette routes ``build_app`` puts before NeMo's app:

- ``GET /``, ``/chat.css``, ``/chat.js``: the page's three files, served with a Content-Security-Policy that lets
  the page reach its own origin only. The page streams from ``/v1/chat/completions`` and reads the ``flashguard``
  field of the last chunk (server.py) for a blocked reply's verdict.
- ``GET /health``: ``{"status": "ok"}`` (``GET /`` was the health answer before the page).
- ``GET /v1/flashguard/stats``: ``panel(last_turn())``, what the page's live panel draws.
- ``GET /docs``, ``/docs/oauth2-redirect``, ``/redoc``: 404. FastAPI's pages load their CSS and JS from a CDN
  (blank offline); the schema stays at ``/openapi.json``.

``panel`` returns, per local engine: memory by category in bytes (``gpu``: the GPU categories of ``flashguard
smi``, or None on a CPU; ``host``: the engine process's RAM as weights, KV cache, L2 pages and the rest) and the
tokens held in L1 (the live session), L2 (pages in RAM) and L3 (pages on disk); and the last chat request's rails
(each verdict with the tokens it prefilled and reused). ``open_when_up(host, port)`` opens the page in the default
browser (``webbrowser``) once ``/health`` answers.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from functools import lru_cache
from importlib import resources
from typing import Callable

STATS_PATH = "/v1/flashguard/stats"
FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/chat.css": ("chat.css", "text/css; charset=utf-8"),
         "/chat.js": ("chat.js", "text/javascript; charset=utf-8")}
# the page may reach its own origin only (no CDN, no other host); inline script and style are refused too
HEADERS = {"content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                      "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
           "x-content-type-options": "nosniff", "cache-control": "no-cache"}
GPU_CATEGORIES = ("weights", "kv cache", "activations/workspace", "allocator slack", "cuda context/other")


@lru_cache(maxsize=None)
def _file(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def routes(last_turn: Callable[[], dict | None]) -> list:
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def page(request):
        name, media_type = FILES[request.url.path]
        return Response(_file(name), media_type=media_type, headers=HEADERS)

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def stats(request):
        return JSONResponse(await asyncio.to_thread(panel, last_turn()))

    async def docs_off(request):
        message = ("the API docs pages are off: FastAPI's load their CSS and JS from a CDN; the schema is at "
                   "/openapi.json, the chat page at /")
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        return Response(json.dumps(body), status_code=404, media_type="application/json")

    return ([Route(path, page, methods=["GET"]) for path in FILES]
            + [Route("/health", health, methods=["GET"]), Route(STATS_PATH, stats, methods=["GET"])]
            + [Route(path, docs_off) for path in ("/docs", "/docs/oauth2-redirect", "/redoc")])


def panel(last_turn: dict | None) -> dict:
    """What the page's panel draws (JSON-ready): ``{"engines": [...], "last_turn": ...}``."""
    from ...engine.registry import all_engines

    return {"engines": [engine_panel(e) for e in all_engines()], "last_turn": last_turn}


def engine_panel(engine) -> dict:
    import psutil

    from ...vram.accounting import engine_memory

    mem = engine_memory(engine)
    gpu_total = None
    if mem["gpu"]:
        import torch

        gpu_total = torch.cuda.get_device_properties(engine.device.index or 0).total_memory
    return summary(mem, tier_tokens(engine), psutil.virtual_memory().total, gpu_total)


def summary(mem: dict, tokens: dict, ram_total: int, gpu_total: int | None = None) -> dict:
    """One engine's panel from its ``engine_memory`` report (what ``flashguard smi`` prints) and its tier tokens."""
    gpu = None
    if mem["gpu"]:
        g = mem["gpu"]
        gpu = {"categories": {k: g[k] for k in GPU_CATEGORIES if g.get(k) is not None},
               "budget": g.get("budget"), "total": gpu_total}
    host = mem["host"]
    parts = {} if gpu else {"weights": mem.get("cpu_weights", 0), "KV cache (L1)": mem.get("cpu_kv cache", 0)}
    parts["L2 pages"] = host.get("L2 bytes", 0)
    rss = host["process RSS"]
    parts["other (Python, torch, NeMo)"] = max(0, rss - sum(parts.values()))
    return {"model": mem["model"], "device": mem["device"], "gpu": gpu,
            "host": {"categories": parts, "rss": rss, "ram_total": ram_total, "l3_disk": host.get("L3 disk bytes", 0)},
            "tokens": tokens}


def tier_tokens(engine) -> dict:
    """Tokens held in L1 (the engine's live session: sinks and window), L2 (pages in RAM) and L3 (pages on disk),
    as ``flashguard smi`` counts them (a page stored in RAM and on disk counts in both)."""
    from ...kv.cache import TieredCache

    with engine.lock:
        session = engine.session
        cache = getattr(session, "cache", None)
        if cache is None:
            l1 = 0
        elif isinstance(cache, TieredCache):
            l1 = cache.layers[0].l1_len
        else:
            l1 = len(session.ids)
    store = getattr(engine, "store", None)
    if store is None:
        return {"L1": l1, "L2": 0, "L3": 0}
    counts, page = store.tier_counts(), engine.kv.page_size
    return {"L1": l1, "L2": counts["l2_pages"] * page, "L3": counts["l3_pages"] * page}


def page_url(host: str, port: int) -> str:
    """The page's address for a browser on this machine (a wildcard bind is reached on 127.0.0.1)."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def open_when_up(host: str, port: int, timeout: float = 120.0) -> threading.Thread:
    """Open the page in the default browser once ``/health`` answers (a daemon thread; the server keeps running
    if no browser opens)."""
    import urllib.request
    import webbrowser

    url = page_url(host, port)

    def wait_and_open() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "health", timeout=1.0) as resp:
                    if resp.status == 200:
                        if not webbrowser.open(url):
                            print(f"flashguard: no browser found to open; open {url} in one", file=sys.stderr)
                        return
            except OSError:
                time.sleep(0.2)

    thread = threading.Thread(target=wait_and_open, name="flashguard-open-page", daemon=True)
    thread.start()
    return thread
