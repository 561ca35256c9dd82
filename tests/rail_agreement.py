"""Both rails' verdicts on the same rows through several engines (in process, behind a server), and how far two
engines agree: what ``tests/remote/test_guard_server.py`` asserts and ``benchmarks/guard_remote.py`` tables."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "rails" / "data"   # the project's tuning rows (moderation_input_tune.jsonl, moderation_tune.jsonl)


def sample(path: Path, n: int, seed: int, side: str) -> list[dict]:
    """``n`` rows of ``path`` (half harmful where there are enough), short enough for a quick run."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    keys = ("user",) if side == "input" else ("user", "bot")
    rows = [r for r in rows if all(isinstance(r.get(k), str) and 0 < len(r[k]) < 1200 for k in keys)]
    rng = random.Random(seed)
    harmful = [r for r in rows if r.get("block")]
    benign = [r for r in rows if not r.get("block")]
    rng.shuffle(harmful)
    rng.shuffle(benign)
    half = min(n // 2, len(harmful))
    return harmful[:half] + benign[:n - half]


def run_input(engines: dict, rows: list[dict], settings) -> list[dict]:
    """``[{engine name: the input rail's Verdict}]``, a row's user message alone as the conversation."""
    from flashguard.rails.moderation import moderate_input

    out = []
    for row in rows:
        msgs = [{"role": "user", "content": row["user"]}]
        out.append({name: moderate_input(engine, msgs, settings) for name, engine in engines.items()})
    return out


def run_output(engines: dict, rows: list[dict], settings) -> tuple[list[dict], dict]:
    """The output rail's verdicts, and each engine's base reads: the same ids read without the adapter just
    before (the same cache state: the turn cached), what the adapter's suffix costs beside. The engine named
    ``server`` is a remote one: its turn is read onto the server's slot, as a generated reply leaves it."""
    from flashguard.engine.engine import Turn
    from flashguard.rails import guard
    from flashguard.rails.moderation import moderate, moderation_suffix

    out, base = [], {name: [] for name in engines}
    for row in rows:
        got = {}
        for name, engine in engines.items():
            prompt = engine.encode_messages([{"role": "user", "content": row["user"]}])
            reply = engine.tokenize(row["bot"])
            if name == "server":   # the turn on the server's slot, as a generated reply leaves it
                engine.read(prompt + reply, task="generation")
                engine.turns.append(Turn(tuple(prompt), tuple(reply), row["bot"]))
            else:
                engine.teacher_force(prompt, reply, row["bot"])
            ids = prompt + reply + moderation_suffix(engine, guard.QUESTIONS["output"])
            start = guard.start_of(ids, engine)
            t0 = time.perf_counter()   # (the server: the invocation in the prompt, no adapter named)
            r = engine.read(ids, task="base", keep=start)
            base[name].append((time.perf_counter() - t0, r.prefilled))
            got[name] = moderate(engine, row["bot"], row["user"], settings, use_memo=False)
        out.append(got)
    return out, base


def agreement(results: list[dict], a: str, b: str) -> dict:
    """How engines ``a`` and ``b`` agree over ``results``: the share of the same verdicts, |p_unsafe a - p_unsafe b|'s
    mean, p95 and max, and how many each blocked."""
    dp = sorted(abs(r[a].p_unsafe - r[b].p_unsafe) for r in results)
    return {"rows": len(results), "same": sum(r[a].allowed == r[b].allowed for r in results) / len(results),
            "mean": statistics.fmean(dp), "p95": dp[min(len(dp) - 1, int(0.95 * len(dp)))], "max": dp[-1],
            "blocked": (sum(not r[a].allowed for r in results), sum(not r[b].allowed for r in results))}
