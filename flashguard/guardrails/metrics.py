"""``GET /v1/flashguard/memory`` and ``GET /metrics``: every engine's memory by category and the task counters.

Contract:
- ``memory_report()``: ``{"engines": [vram.accounting.engine_memory(engine) per engine], "stats": engine_stats()}``.
- ``prometheus(report)``: the same numbers in the Prometheus text format (memory bytes by model, place and category;
  token counters by model, task and kind).
- ``answer_memory(path, send)``: the ASGI response to a GET of ``MEMORY_PATH`` or ``METRICS_PATH`` (the report is
  made on a worker thread: it takes each engine's lock).
"""

from __future__ import annotations

import asyncio
import json


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


async def answer_memory(path: str, send) -> None:
    """The response to a GET of ``MEMORY_PATH`` (JSON) or ``METRICS_PATH`` (Prometheus text)."""
    report = await asyncio.to_thread(memory_report)
    if path == METRICS_PATH:
        body, ctype = prometheus(report).encode(), b"text/plain; version=0.0.4"
    else:
        body, ctype = json.dumps(report).encode(), b"application/json"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
