"""Bounded load against the guarded server on 127.0.0.1: no 5xx, no cross-talk, bounded memory.

    python examples/load_test.py --clients 32 --seconds 120          # starts `flashguard serve` itself
    python examples/load_test.py --url http://127.0.0.1:8000 --pid PID

Every prompt is first answered once, serially (greedy decoding is deterministic); then the clients send the
prompts concurrently, half of them streaming, and every answer must equal the serial answer to its own prompt.
Reports requests, status codes, latency, and the server's RSS after warm-up and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

import httpx
import psutil

COUNTRIES = ["France", "Italy", "Spain", "Germany", "Japan", "Egypt", "Canada", "Peru"]
LONG = ("Here is a note about a museum visit. " * 30) + "\nIn one sentence, what is this note about?"
REFUSAL = "I'm sorry, I can't respond to that."  # configs/flash's `bot refuse to respond`
BLOCKED = "<blocked by the output rail>"  # the refusal (plain or streamed) and an error frame are the same outcome
PROMPTS = [f"What is the capital of {c}?" for c in COUNTRIES] + [LONG.replace("museum", m) for m in
                                                                  ("museum", "garden", "harbour", "library")]


async def ask(client: httpx.AsyncClient, url: str, prompt: str, stream: bool) -> tuple[int, str]:
    body = {"model": "flashguard", "messages": [{"role": "user", "content": prompt}], "max_tokens": 48}
    if not stream:
        r = await client.post(url + "/v1/chat/completions", json=body)
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""
        return r.status_code, BLOCKED if text == REFUSAL else text
    parts = []
    async with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return r.status_code, BLOCKED
                if "choices" in chunk:
                    parts.append(chunk["choices"][0]["delta"].get("content") or "")
        text = "".join(parts)
        return r.status_code, BLOCKED if text == REFUSAL else text


async def run(url: str, pid: int, clients: int, seconds: float, warmup: float | None = None) -> dict:
    """Serial reference pass, a concurrent warm-up (``warmup`` s, default a quarter of ``seconds``), then
    ``seconds`` of measured concurrent load. RSS growth is measured over the last phase."""
    proc = psutil.Process(pid)
    async with httpx.AsyncClient(timeout=600) as client:
        expected = {}
        for p in PROMPTS:
            status, text = await ask(client, url, p, stream=False)
            if status != 200:
                raise SystemExit(f"serial request failed with {status}")
            expected[p] = text
        await _phase(client, url, clients, seconds / 4 if warmup is None else warmup, expected, {}, [], [])
        rss_warm = proc.memory_info().rss
        statuses: dict[int, int] = {}
        wrong, latencies = [], []
        await _phase(client, url, clients, seconds, expected, statuses, wrong, latencies)
        rss_end = proc.memory_info().rss
    latencies.sort()
    return {"requests": sum(statuses.values()), "statuses": statuses,
            "server_errors": sum(n for s, n in statuses.items() if s >= 500), "wrong_answers": len(wrong),
            "wrong_examples": wrong[:3], "p50_s": latencies[len(latencies) // 2] if latencies else None,
            "max_s": latencies[-1] if latencies else None, "rss_warm_mib": rss_warm / 2**20,
            "rss_end_mib": rss_end / 2**20, "rss_growth": rss_end / rss_warm - 1}


async def _phase(client, url, clients, seconds, expected, statuses, wrong, latencies) -> None:
    deadline = time.monotonic() + seconds

    async def worker(i: int):
        rng = random.Random(i)
        while time.monotonic() < deadline:
            p = rng.choice(PROMPTS)
            t0 = time.monotonic()
            status, text = await ask(client, url, p, stream=rng.random() < 0.5)
            latencies.append(time.monotonic() - t0)
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200 and text != expected[p]:
                wrong.append((p[:40], expected[p][:60], text[:60]))

    await asyncio.gather(*(worker(i) for i in range(clients)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--pid", type=int)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args(argv)
    server = None
    url, pid = args.url, args.pid
    if url is None:
        server = subprocess.Popen([sys.executable, "-m", "flashguard.cli", "serve", "--port", str(args.port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url, pid = f"http://127.0.0.1:{args.port}", server.pid
        for _ in range(600):
            try:
                if httpx.get(url + "/v1/rails/configs", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
    try:
        report = asyncio.run(run(url, pid, args.clients, args.seconds))
    finally:
        if server:
            server.terminate()
            server.wait(timeout=30)
    print(json.dumps(report, indent=2))
    ok = report["server_errors"] == 0 and report["wrong_answers"] == 0 and report["rss_growth"] < 0.10
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
