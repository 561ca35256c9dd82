"""The guard's evaluation files, made from the training rows (``train-guard --save-rows``): third-party text, so
written to a folder outside the repository, never committed.

    python -m benchmarks.guard_heldout --rows ROWS.jsonl.gz --out DIR

- ``DIR/heldout.jsonl``: the evaluation-only sources (rails/data/SOURCES.md: sources no guard or probe trains on):
  up to ``--per-cell`` rows (60) of each source, rail and label, seeded.
- ``DIR/val.jsonl``: ``--val`` rows (1,600) of the training sources, none of them among the rows a ``train-guard
  --max-rows TRAIN_SAMPLE`` run samples (``--train-sample``, 4,000: the first guard's), an even share per source,
  rail and label (``guard_command.even_sample``, seed 1): what sets a guard's strictness levels where the
  leave-one-source-out validation did not run (tools/guard_levels.py).
- ``DIR/rows_noval.jsonl.gz``: every row but those of val.jsonl, for later ``train-guard --rows`` runs.

Each file's rows hold the last exchange only (``user``, and ``bot`` for the output rail; ``label``; ``category`` as
``source:category``), the form ``flashguard eval-guard`` reads. Prints the counts per cell.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
from pathlib import Path

from flashguard.rails.lab import guard_data
from flashguard.rails.lab.guard_command import even_sample


def last_exchange(r: dict) -> dict:
    m = r["messages"]
    out = {"user": m[-1]["content"]} if r["side"] == "input" else {"user": m[-2]["content"], "bot": m[-1]["content"]}
    return {**out, "label": "unsafe" if r["block"] else "safe", "category": f'{r["source"]}:{r["category"]}'}


def key(r: dict) -> tuple:
    m = r["messages"]
    return (m[-1]["content"], None) if r["side"] == "input" else (m[-2]["content"], m[-1]["content"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--per-cell", type=int, default=60)
    ap.add_argument("--val", type=int, default=1600)
    ap.add_argument("--train-sample", type=int, default=4000)
    args = ap.parse_args()
    rows = guard_data.load(args.rows)
    args.out.mkdir(parents=True, exist_ok=True)

    cells = collections.defaultdict(list)
    for r in rows:
        if not r["train"]:
            cells[(r["source"], r["side"], bool(r["block"]))].append(r)
    rng = random.Random(0)
    heldout = []
    for k in sorted(cells):
        heldout += rng.sample(cells[k], min(args.per_cell, len(cells[k])))
    sampled = {json.dumps(r["messages"], sort_keys=True) for r in even_sample(rows, args.train_sample, 0)}
    val = even_sample([r for r in rows if r["train"] and json.dumps(r["messages"], sort_keys=True) not in sampled],
                      args.val, 1)
    for name, part in (("heldout", heldout), ("val", val)):
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(last_exchange(r)) + "\n")
        counts = collections.Counter((r["side"], "unsafe" if r["block"] else "safe") for r in part)
        print(f"{name}: {len(part)} rows, {len({r['source'] for r in part})} sources, " +
              ", ".join(f"{s} {lab} {n}" for (s, lab), n in sorted(counts.items())))
    held_back = {key(r) for r in val}
    guard_data.save([r for r in rows if key(r) not in held_back], args.out / "rows_noval.jsonl.gz")
    print(f"wrote {args.out}/heldout.jsonl, val.jsonl and rows_noval.jsonl.gz")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
