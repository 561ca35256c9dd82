"""Set a guard's strictness levels from a validation run: the operating points on rows it was not trained on.

    flashguard eval-guard VAL.jsonl --config CFG --json VAL.json     # CFG: guard: adapter on the guard folder
    flashguard eval-guard VAL.jsonl --config CFG2 --json PROBE.json  # CFG2: guard: probe (the shipped probes)
    python tools/guard_levels.py GUARD_FOLDER VAL.json --probe-report PROBE.json --probes rails/probes/*.json

``train-guard --loso`` sets the levels from leave-one-source-out scores; where that validation did not run (a CPU
without the hours it takes), this sets them from an eval-guard report of held-back rows instead: per rail, each
level's threshold is the smallest at which at most its share of the benign rows is blocked (guard_fit.LEVELS: low
2%, medium 5%, high 10%), as ``operating_points`` computes it for the LOSO scores. Writes guard.json in place (its
``strictness`` and ``metrics.levels_from``) and prints each level's rates.

With ``--probe-report`` (the same rows judged by the probes alone), also the pair's table (``with_probe``: the
verdict ``guard: auto`` makes from the adapter and the probe together, rails/guard.py ``paired``): per rail, the
adapter's weight (of 0.5, 0.6, ... 1.0: the one whose harmful-blocked shares at the three levels add up highest on
these rows; ``--weight`` fixes one instead), the digests of the probes it holds for (``--probes``: the files the
probe report was made with, and any others of the same fit) and its levels, from the combined scores of the rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import math

import torch

from flashguard.rails.lab.guard_fit import operating_points
from flashguard.rails.probe import Probe

HARMFUL = ("unsafe", "1", "true", "harmful", "block", "yes")


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("guard", type=Path)
    ap.add_argument("report", type=Path)
    ap.add_argument("--note", default="", help="where the validation rows came from, kept in guard.json")
    ap.add_argument("--probe-report", type=Path, help="eval-guard's report of the same rows with guard: probe")
    ap.add_argument("--probes", nargs="*", type=Path, default=[], help="the probe files the pair holds for")
    ap.add_argument("--weight", type=float, help="the adapter's weight in the pair (default: chosen per rail)")
    args = ap.parse_args()
    rep = json.loads(args.report.read_text(encoding="utf-8"))
    meta_path = args.guard / "guard.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    levels = {}
    for side in ("input", "output"):
        rows = [v for v in rep["verdicts"] if v["rail"] == side and v.get("method") == "adapter"]
        if not rows:
            raise SystemExit(f"{args.report}: no {side} verdicts decided by the adapter alone (the config's "
                             "custom_data.*.guard: adapter?)")
        p = torch.tensor([v["p_unsafe"] for v in rows], dtype=torch.float64)
        labels = [int(str(v["label"]).lower() in HARMFUL) for v in rows]
        points = operating_points(p, labels, [])
        levels[side] = {k: v["threshold"] for k, v in points.items()}
        for k, v in points.items():
            print(f"{side:6} {k:6} threshold {v['threshold']:.4f}: benign blocked {v['benign_blocked']:.1%}, "
                  f"harmful blocked {v['harmful_blocked']:.1%} ({len(rows)} rows, {sum(labels)} harmful)")
    meta["strictness"] = levels
    if args.probe_report:
        probe_rows = json.loads(args.probe_report.read_text(encoding="utf-8"))["verdicts"]
        mine = {(v["row"], v["rail"]): v for v in rep["verdicts"]}
        pair_levels, digests, weights = {}, {}, {}
        for side in ("input", "output"):
            pairs = [(mine[(v["row"], side)], v) for v in probe_rows
                     if v["rail"] == side and v.get("method") == "probe" and (v["row"], side) in mine]
            labels = [int(str(a["label"]).lower() in HARMFUL) for a, _ in pairs]

            def points_at(w: float) -> dict:
                z = torch.tensor([w * _logit(a["p_unsafe"]) + (1 - w) * _logit(b["p_unsafe"]) for a, b in pairs],
                                 dtype=torch.float64)
                return operating_points(torch.sigmoid(z), labels, [])

            grid = [args.weight] if args.weight is not None else [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
            scored = {w: points_at(w) for w in grid}
            for w, pts in scored.items():
                print(f"{side:6} weight {w:.1f}: harmful blocked " +
                      " / ".join(f"{pts[k]['harmful_blocked']:.1%}" for k in pts) + " at " + " / ".join(pts))
            weights[side] = max(grid, key=lambda w: (sum(v["harmful_blocked"] for v in scored[w].values()), -w))
            points = scored[weights[side]]
            pair_levels[side] = {k: v["threshold"] for k, v in points.items()}
            for k, v in points.items():
                print(f"{side:6} {k:6} adapter+probe (weight {weights[side]:.1f}) threshold {v['threshold']:.4f}: "
                      f"benign blocked {v['benign_blocked']:.1%}, harmful blocked {v['harmful_blocked']:.1%} "
                      f"({len(pairs)} rows)")
            digests[side] = sorted({Probe.load(f).digest for f in args.probes if (Probe.load(f).rail == side)})
        meta["with_probe"] = {"weight": weights, "probes": digests, "strictness": pair_levels}
    meta.setdefault("metrics", {})["levels_from"] = {"report": args.report.name, "checks": rep.get("checks"),
                                                     "note": args.note}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    print(f"wrote the strictness levels to {meta_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
