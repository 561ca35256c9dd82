"""Two verdicts side by side on the same labelled checks: the tables docs/moderation.md shows for held-out sets.

    python -m benchmarks.guard_compare NAME=REPORT.json [NAME=REPORT.json ...] [--by category|source] [--thresholds T]

Each REPORT is what ``flashguard eval-guard FILE --json REPORT`` wrote (every check's p_unsafe, the rail that judged
it and its label), one per verdict (e.g. ``adapter=...`` with ``guard: adapter``, ``probe=...`` with ``guard:
probe``), of the same file. Printed per rail and per group (the rows' category; ``--by source``: the part of the
category before ``:``, as benchmarks/ held-out files name it ``source:category``): harmful blocked, benign blocked,
precision, recall and F1 at each report's own thresholds (``--thresholds input=0.7,output=0.6`` to decide again
at others, from the recorded p_unsafe: the guard's strictness levels after validation); then, per rail, the
threshold-free separation (ROC AUC, harmful blocked at 2% / 5% / 10% benign blocked).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


HARMFUL = ("unsafe", "1", "true", "harmful", "block", "yes")


def metrics(rows: list[dict]) -> dict:
    harmful = [r for r in rows if r["label"] in HARMFUL]
    benign = [r for r in rows if r not in harmful]
    tp = sum(r["blocked"] for r in harmful)
    fp = sum(r["blocked"] for r in benign)
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / len(harmful) if harmful else None
    f1 = 2 * precision * recall / (precision + recall) if precision and recall else (0.0 if harmful else None)
    return {"harmful": len(harmful), "harmful_blocked": tp, "benign": len(benign), "benign_blocked": fp,
            "precision": precision, "recall": recall, "f1": f1}


def separation(rows: list[dict]) -> dict:
    """Threshold-free: ROC AUC of p_unsafe, and the share of harmful rows blocked where 2% / 5% / 10% of the benign
    rows are (each verdict at its own best cut for that share: how well it ranks, not where it was set)."""
    harmful = [r["p_unsafe"] for r in rows if r["label"] in HARMFUL]
    benign = sorted(r["p_unsafe"] for r in rows if r["label"] not in HARMFUL)
    if not harmful or not benign:
        return {}
    auc = sum((h > b) + 0.5 * (h == b) for h in harmful for b in benign) / len(harmful) / len(benign)
    at = {}
    for share in (0.02, 0.05, 0.10):
        cut = benign[max(0, math.ceil(len(benign) * (1 - share)) - 1)]
        at[share] = sum(h > cut for h in harmful) / len(harmful)
    return {"auc": auc, "at": at}


def _fmt(m: dict) -> str:
    h = f"{m['harmful_blocked']}/{m['harmful']}" if m["harmful"] else "-"
    b = f"{m['benign_blocked']}/{m['benign']}" if m["benign"] else "-"
    f1 = f"{m['f1']:.3f}" if m["f1"] is not None else "-"
    return f"{h} | {b} | {f1}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("reports", nargs="+", help="NAME=REPORT.json")
    p.add_argument("--by", choices=("category", "source"), default="source")
    p.add_argument("--thresholds", action="append", default=[],
                   help="NAME:input=T,output=T: decide NAME's checks again at these thresholds")
    a = p.parse_args(argv)
    named = {}
    for spec in a.reports:
        name, path = spec.split("=", 1)
        named[name] = json.loads(Path(path).read_text())["verdicts"]
    for spec in a.thresholds:
        name, rest = spec.split(":", 1)
        cuts = {k: float(v) for k, v in (x.split("=") for x in rest.split(","))}
        for r in named[name]:
            if r["rail"] in cuts and r.get("p_unsafe") is not None:
                r["blocked"] = r["p_unsafe"] >= cuts[r["rail"]]
    names = list(named)
    for rail in ("input", "output"):
        groups: dict = {}
        for name in names:
            for r in named[name]:
                if r["rail"] != rail:
                    continue
                key = r["category"].split(":")[0] if a.by == "source" else r["category"]
                groups.setdefault(key, {}).setdefault(name, []).append(r)
        if not groups:
            continue
        print(f"\n{rail} rail: harmful blocked | benign blocked | F1, per {a.by}")
        print("| " + a.by + " | " + " | ".join(f"{n}: harmful | {n}: benign | {n}: F1" for n in names) + " |")
        print("|---|" + "---|---|---|" * len(names))
        for key in sorted(groups):
            print(f"| {key} | " + " | ".join(_fmt(metrics(groups[key].get(n, []))) for n in names) + " |")
        print("| **all** | " + " | ".join(_fmt(metrics([r for r in named[n] if r["rail"] == rail])) for n in names)
              + " |")
        seps = {n: separation([r for r in named[n] if r["rail"] == rail]) for n in names}
        if any(seps.values()):
            print(f"\n{rail} rail, threshold-free: ROC AUC | harmful blocked at 2% / 5% / 10% benign blocked")
            print("| verdict | AUC | at 2% | at 5% | at 10% |\n|---|---|---|---|---|")
            for n, sep in seps.items():
                if sep:
                    print(f"| {n} | {sep['auc']:.3f} | " + " | ".join(f"{v:.1%}" for v in sep["at"].values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
