"""CPU latency the output rail adds per turn, on the embedded model (float and int4).

    python -m benchmarks.moderation_cpu [--rows 24] [--weights float int4]
    python -m benchmarks.moderation_cpu --accuracy FILE.jsonl     per-category accuracy of the rail on FILE

For each of the first ``--rows`` replies of the test set (every fifth, so all categories appear): the reply is
teacher-forced as the engine's turn (what generation leaves in the cache), then the rail runs on the shared
pages, once with the probe (hidden states kept) and once with ``probe: off`` (the question's Yes/No only).
Reported: median and 90th percentile milliseconds of each, the tokens each prefilled, and the prefill of the
turn itself for scale. Timings on a shared machine vary with its load; the numbers say what ran, not a promise.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--weights", nargs="+", default=["float", "int4"])
    ap.add_argument("--accuracy", default=None, help="labelled JSONL: print the rail's accuracy on it instead")
    args = ap.parse_args(argv)
    if args.accuracy:
        return accuracy(args.accuracy, args.weights)

    from pathlib import Path

    import torch

    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.rails.lab.calibrate import read_rows
    from flashguard.rails.moderation import ModerationSettings, moderate

    rows = read_rows(Path(__file__).resolve().parents[2] / "tests" / "data" / "moderation_test.jsonl")[::5]
    rows = rows[:args.rows]
    print(f"torch threads {torch.get_num_threads()}")
    print("| weights | turn prefill ms (tokens) | rail, probe: median / p90 ms | rail, question only: median / p90 ms "
          "| prefilled by the rail |")
    print("|---|---|---|---|---|")
    for weights in args.weights:
        engine = Engine(EngineConfig(weights=weights))
        turn_s, probe_s, question_s, turn_tokens, prefilled = [], [], [], [], set()
        for i, row in enumerate(rows):
            prompt = engine.encode_messages([{"role": "user", "content": row["user"]}])
            reply = engine.tokenizer(row["bot"], add_special_tokens=False)["input_ids"]
            engine.reset_session()
            t = time.perf_counter()
            engine.teacher_force(prompt, reply, row["bot"])
            turn_s.append(time.perf_counter() - t)
            turn_tokens.append(len(prompt) + len(reply))
            for settings, out in ((ModerationSettings(), probe_s), (ModerationSettings(probe="off"), question_s)):
                engine.teacher_force(prompt, reply, row["bot"])  # back to the turn's cache (crops the suffix)
                v = moderate(engine, row["bot"], row["user"], settings, use_memo=False)
                out.append(v.seconds)
                prefilled.add(v.prefilled_tokens)
        q = lambda xs: f"{1e3 * statistics.median(xs):.0f} / {1e3 * sorted(xs)[int(0.9 * len(xs))]:.0f}"  # noqa: E731
        print(f"| {weights} | {1e3 * statistics.median(turn_s):.0f} ({statistics.median(turn_tokens):.0f}) | "
              f"{q(probe_s[1:])} | {q(question_s[1:])} | {sorted(prefilled)} |", flush=True)
    return 0


def accuracy(path: str, weights_kinds) -> int:
    """The rail (shared pages, default settings) on every row of ``path``: accuracy per category and the misses."""
    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.rails.lab.calibrate import read_rows
    from flashguard.rails.moderation import moderate

    rows = read_rows(path)
    for weights in weights_kinds:
        engine = Engine(EngineConfig(weights=weights))
        per: dict[str, list[bool]] = {}
        for row in rows:
            prompt = engine.encode_messages([{"role": "user", "content": row["user"]}])
            engine.teacher_force(prompt, engine.tokenizer(row["bot"], add_special_tokens=False)["input_ids"], row["bot"])
            v = moderate(engine, row["bot"], row["user"], use_memo=False)
            ok = (not v.allowed) == row["block"]
            per.setdefault(row["category"] if row["block"] else f"{row['category']} (allow)", []).append(ok)
            if not ok:
                print(f"  miss ({weights}, {v.method}, p_unsafe {v.p_unsafe:.2f}): {row['bot'][:70]!r}")
        right = sum(sum(v) for v in per.values())
        print(f"{weights}: {right}/{len(rows)} = {right / len(rows):.1%}; "
              + ", ".join(f"{c} {sum(v)}/{len(v)}" for c, v in per.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
