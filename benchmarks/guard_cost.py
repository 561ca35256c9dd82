"""What a guarded turn's two checks cost after a long conversation: the guard adapter against the probe, one engine.

    python -m benchmarks.guard_cost [--context 2048] [--repeats 7] [--weights int4] [--guard FOLDER] [--out FILE.md]

A conversation of about ``--context`` tokens (benign exchanges of the project's tuning set, each reply
teacher-forced as the engine's own turn, so its pages are the generation's) ends with one more user message and
its reply; then, alternately, each verdict kind judges the last reply (output rail) and the last user message
(input rail) on the conversation's own pages: ``guard: auto`` (configs/flash's default: the adapter and the probe
together), ``guard: adapter`` (the guard's question through the adapter) and ``guard: probe`` (the shipped probe,
the verdict before the guard; the input probe reads the generation's own prefill, so its check is the prompt's last
token). Printed: the median and p90 milliseconds of each check, the tokens it prefilled and reused,
and the ratios auto / probe and adapter / probe. The session goes back to the conversation between repeats (the checks' suffixes
are cropped away), as in a chat turn. Timings on a shared machine vary with its load: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def conversation(engine, context: int) -> list[dict]:
    rows = [json.loads(x) for x in (ROOT / "rails" / "data" / "moderation_tune.jsonl").read_text().splitlines() if x]
    benign = [r for r in rows if not r["block"] and "paste" not in r]
    msgs: list[dict] = []
    i = 0
    while len(engine.encode_messages(msgs or [{"role": "user", "content": "hi"}])) < context:
        r = benign[i % len(benign)]
        msgs += [{"role": "user", "content": r["user"]}, {"role": "assistant", "content": r["bot"]}]
        i += 1
    return msgs


def main(argv=None) -> int:
    from flashguard import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.rails.moderation import ModerationSettings, moderate, moderate_input

    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--weights", default="int4")
    p.add_argument("--guard", default="auto", help="the guard folder (default: the one made for the model)")
    p.add_argument("--out", help="write the table here (markdown)")
    a = p.parse_args(argv)
    engine = Engine(EngineConfig.from_parameters({"weights": a.weights, "guard_adapter": a.guard}))
    if engine.guard is None:
        raise SystemExit("no guard adapter for this model: give --guard FOLDER")
    msgs = conversation(engine, a.context)
    prompt = engine.encode_messages(msgs[:-1])
    reply = msgs[-1]["content"]
    engine.teacher_force(prompt, engine.tokenizer(reply, add_special_tokens=False)["input_ids"], reply)
    ctx = len(prompt) + len(engine.turns[-1].output_ids)
    table = {}
    for _ in range(a.repeats + 1):
        for kind in ("auto", "adapter", "probe"):
            out_s = ModerationSettings(guard=kind)
            in_s = ModerationSettings.input_defaults(guard=kind)
            engine.teacher_force(prompt, engine.turns[-1].output_ids, reply)   # the session at the turn
            for rail in ("output", "input"):   # (the input check crops the reply away, as the next turn does)
                t0 = time.perf_counter()
                v = moderate_input(engine, msgs[:-1], in_s) if rail == "input" else \
                    moderate(engine, reply, msgs[-2]["content"], out_s, use_memo=False)
                ms = (time.perf_counter() - t0) * 1000
                table.setdefault((kind, rail), []).append((ms, v.prefilled_tokens, v.reused_tokens, v.method))
    lines = [f"context {ctx} tokens, {a.weights} weights, {engine.device}, median of {a.repeats} (first dropped)", "",
             "| rail | verdict | median ms | p90 ms | prefilled | reused |", "|---|---|---|---|---|---|"]
    for (kind, rail), vals in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ms = sorted(v[0] for v in vals[1:])
        lines.append(f"| {rail} | {vals[-1][3]} | {statistics.median(ms):.0f} | {ms[int(0.9 * (len(ms) - 1))]:.0f} | "
                     f"{vals[-1][1]} | {vals[-1][2]} |")
    for rail in ("input", "output"):
        pr = statistics.median(v[0] for v in table[("probe", rail)][1:])
        for kind in ("auto", "adapter"):
            ms = statistics.median(v[0] for v in table[(kind, rail)][1:])
            lines.append(f"{'' if kind == 'adapter' else chr(10)}{rail} rail: {table[(kind, rail)][-1][3]} / probe = "
                         f"{ms / pr:.2f}x")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(f"`python -m benchmarks.guard_cost {' '.join(argv or [])}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
