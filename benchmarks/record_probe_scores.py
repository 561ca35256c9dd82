"""Record what the shipped probes score on a few rows: tests/data/probe_scores.json, which
tests/rails/test_probe_scores.py compares the shipped probes against (that they load, find the model's states and score
as they did when they were fitted). Run it again after refitting or replacing a shipped probe (rails/probes/):

    python -m benchmarks.record_probe_scores [--out FILE]

For each rail, 3 rows that the rail should block and 3 it should allow, each of another category, are chosen from
held-out sets (output: short exchanges of tests/data/moderation_test_b.jsonl; input: two short messages of
tests/data/moderation_input_test_b.jsonl, alone or after one benign exchange as ``benchmarks.guard_sets`` runs that
set, and one long message of moderation_input_test_d.jsonl, which the rail judges by sliding windows): the shortest
rows that both the float and the int4 probe judge as labelled with a margin of at least ``MARGIN`` log-odds from
their threshold (so that another machine's rounding cannot move a verdict), among them first those whose p_unsafe is not
saturated (in [0.02, 0.98], where a changed probe shows most). Each row's p_unsafe is recorded per weights kind to 3
decimals, with the sha256 of the probe files that scored it. Accuracy over whole sets is
``python -m benchmarks.guard_sets``'s job, not this file's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

from benchmarks.guard_sets import engine_for, shipped_probes_only
from tests.rail_sets import INPUT_SETS, OUTPUT_SETS, ROOT, as_conversation, input_verdict, output_verdict, rows

OUT = ROOT / "tests" / "data" / "probe_scores.json"
WEIGHTS = ("float", "int4")
PER_LABEL = 3
MARGIN = 1.0   # in log-odds: p_unsafe at most 0.27 or at least 0.73 against a threshold of 0.5, 0.98 against 0.95
SHORT = 300   # characters of the user message and reply that count as short (the test runs these rows)
SEARCH = 16   # rows looked at per pool (its shortest): the unsaturated ones among them first, then saturated ones
SOURCES = {"output": OUTPUT_SETS["B"], "input": INPUT_SETS["moderation_input_test_b"]}
LONG_SOURCE = INPUT_SETS["moderation_input_test_d"]   # the input rail's long messages (sliding windows)


def candidates(rail: str, path: Path) -> list[dict]:
    """Every row of a held-out set as the test runs it (``messages`` for the input rail), shortest first."""
    out = []
    for i, r in enumerate(rows(path, rail)):
        row = {"rail": rail, "source": f"{path.relative_to(ROOT).as_posix()}:{i + 1}", "category": r["category"],
               "block": r["block"]}
        if rail == "output":
            row.update(user=r["user"], bot=r["bot"])
        else:
            row["messages"] = as_conversation(i, r["user"])
        out.append(row)
    return sorted(out, key=length)


def length(row: dict) -> int:
    """Characters the rail reads of ``row``: the user message and the reply, or the conversation."""
    return len(row["user"]) + len(row["bot"]) if row["rail"] == "output" else \
        sum(len(m["content"]) for m in row["messages"])


def logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def score(engine, row: dict):
    return output_verdict(engine, row) if row["rail"] == "output" else input_verdict(engine, row["messages"])


def pick(pool: list[dict], n: int, engines: dict, seen: set) -> list[dict]:
    """``n`` rows of ``pool`` of categories not in ``seen``, judged as labelled by every engine with ``MARGIN``,
    unsaturated ones first, looking at ``SEARCH`` rows at most (in the pool's order); each with its p_unsafe per
    weights kind."""
    fine, saturated, looked = [], [], 0
    for row in pool:
        if row["category"] in seen:
            continue
        if looked == SEARCH:
            break
        looked += 1
        verdicts = {w: score(e, row) for w, e in engines.items()}
        if not all((not v.allowed) == row["block"] and abs(logit(v.p_unsafe) - logit(v.threshold)) >= MARGIN
                   for v in verdicts.values()):
            continue
        seen.add(row["category"])
        row = dict(row, p_unsafe={w: round(v.p_unsafe, 3) for w, v in verdicts.items()})
        (fine if all(0.02 <= p <= 0.98 for p in row["p_unsafe"].values()) else saturated).append(row)
        if len(fine) == n:
            break
    if len(fine + saturated) < n:
        raise SystemExit(f"only {len(fine + saturated)} rows of {pool[0]['source']}'s set are judged as labelled with "
                         f"a margin of {MARGIN} log-odds by every probe")
    return (fine + saturated)[:n]


def choose(rail: str, engines: dict) -> list[dict]:
    """3 blocked and 3 allowed rows of ``rail``, of distinct categories: short ones; for the input rail one of the
    three a long message (judged by sliding windows)."""
    chosen = []
    for block in (True, False):
        seen: set = set()
        short = [r for r in candidates(rail, SOURCES[rail]) if r["block"] == block and length(r) <= SHORT]
        if rail == "output":
            chosen += pick(short, PER_LABEL, engines, seen)
        else:
            long = [r for r in candidates(rail, LONG_SOURCE)
                    if r["block"] == block and r["category"].startswith("long")]
            chosen += pick(short, PER_LABEL - 1, engines, seen) + pick(long, 1, engines, seen)
    return chosen


def probe_record(engines: dict) -> dict:
    """``{weights: {rail: {file, sha256}}}`` of the probes that scored the rows."""
    from flashguard.rails.moderation import ModerationSettings
    from flashguard.rails.probe import SHIPPED_DIR, find_probe

    out = {}
    for w, engine in engines.items():
        out[w] = {}
        for rail, settings in (("output", ModerationSettings()), ("input", ModerationSettings.input_defaults())):
            probe, where = find_probe(engine, settings.prompt, rail)
            if probe is None or Path(where).parent != SHIPPED_DIR or probe.weights != w:
                raise SystemExit(f"{w} {rail}: the rail does not use a shipped {w} probe ({where})")
            out[w][rail] = {"file": Path(where).name, "sha256": hashlib.sha256(Path(where).read_bytes()).hexdigest()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.record_probe_scores", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    shipped_probes_only()
    engines = {w: engine_for(w) for w in WEIGHTS}
    record = {
        "about": "p_unsafe of the shipped probes on a few rows, per weights kind (3 decimals); "
                 "tests/rails/test_probe_scores.py compares; `python -m benchmarks.record_probe_scores` writes it",
        "probes": probe_record(engines),
        "rows": [row for rail in ("output", "input") for row in choose(rail, engines)],
    }
    args.out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for row in record["rows"]:
        text = row.get("bot") or row["messages"][-1]["content"]
        print(f"{row['rail']:6s} {'block' if row['block'] else 'allow'} {row['category']:16s} {row['p_unsafe']} "
              f"{text[:60]!r}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
