"""The guard benchmark: the rails' accuracy on text they were not fitted on, float and int4, as a user meets them.

    python -m benchmarks.guard [--weights float int4] [--sets FILE ...] [--reports FILE ...] [--strictness LEVEL]

Two tables, both printed as docs/moderation.md shows them:

1. **Leave-one-source-out** (from the reports ``flashguard calibrate --sources --report FILE`` wrote; the committed
   ones are docs/benchmarks/guard/*.json): each source scored by a probe fitted on the *other* sources, at each
   strictness level: blocked harmful and blocked benign rows per source and per category.
2. **Held-apart sets through ``LLMRails.check``** (``rails/lab/evaluate.py``, what ``flashguard eval-guard`` runs): the
   project's benchmark sets (benchmarks/data/guard_*.jsonl: everyday requests and exchanges, harmful ones, safe
   requests that sound unsafe; written for this benchmark, never fitted on), or any labelled files given, on
   configs/flash with the embedded model in each ``--weights`` kind.

Accuracy is a benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SETS = (ROOT / "benchmarks" / "data" / "guard_everyday.jsonl", ROOT / "benchmarks" / "data" / "guard_requests.jsonl")
REPORTS = tuple(sorted((ROOT / "docs" / "benchmarks" / "guard").glob("loso_*.json")))


def _pct(a: int, n: int) -> str:
    return f"{a}/{n} ({a / n:.0%})" if n else "-"


def loso_table(report: dict, level: str = "medium", key: str = "by_source", part: str = "") -> str:
    """One calibrate report's leave-one-source-out table at ``level`` (``part="long"``: the input rail's long
    messages)."""
    data = report["long"] if part else report
    rep = data["report"][level]
    lines = [f"{report['rail']} rail{' (long messages)' if part else ''}, strictness {level} (threshold "
             f"{rep['threshold']:.3f}): held-out rows blocked, {key[3:]}",
             f"| {key[3:]} | harmful blocked | benign blocked |", "|---|---|---|"]
    tot = {"harmful": 0, "harmful_blocked": 0, "benign": 0, "benign_blocked": 0}
    for name, e in sorted(rep[key].items()):
        lines.append(f"| {name} | {_pct(e['harmful_blocked'], e['harmful'])} | {_pct(e['benign_blocked'], e['benign'])} |")
        for k in tot:
            tot[k] += e[k]
    lines.append(f"| **all** | {_pct(tot['harmful_blocked'], tot['harmful'])} | "
                 f"{_pct(tot['benign_blocked'], tot['benign'])} |")
    return "\n".join(lines)


def levels_table(report: dict, part: str = "") -> str:
    data = report["long"] if part else report
    lines = ["| strictness | threshold | held-out harmful blocked | held-out benign blocked |", "|---|---|---|---|"]
    for level, v in data["levels"].items():
        lines.append(f"| {level} | {v['threshold']:.3f} | {v['harmful_blocked']:.1%} | {v['benign_blocked']:.1%} |")
    return "\n".join(lines)


def config_for(weights: str, strictness: str, folder: Path) -> Path:
    """configs/flash with ``weights`` and both rails at ``strictness`` (a copy in ``folder``)."""
    target = folder / f"flash-{weights}-{strictness}"
    shutil.copytree(ROOT / "configs" / "flash", target, dirs_exist_ok=True)
    cfg = yaml.safe_load((target / "config.yml").read_text())
    main = next(m for m in cfg["models"] if m.get("type") == "main")
    main.setdefault("parameters", {})["weights"] = weights
    for section in ("flashguard_moderation", "flashguard_input_moderation"):
        cfg.setdefault("custom_data", {}).setdefault(section, {})["strictness"] = strictness
    (target / "config.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", nargs="+", choices=("float", "int4"), default=["float", "int4"])
    ap.add_argument("--sets", nargs="*", default=[str(p) for p in SETS], help="labelled JSONL / CSV files")
    ap.add_argument("--reports", nargs="*", default=[str(p) for p in REPORTS], help="calibrate --report files")
    ap.add_argument("--strictness", default="medium", choices=("low", "medium", "high"))
    ap.add_argument("--json", default=None, help="write every held-apart verdict to this file")
    args = ap.parse_args(argv)

    for path in args.reports:
        report = json.loads(Path(path).read_text())
        print(f"\n## {Path(path).name}: chosen {report['chosen']}, leave-one-source-out score "
              f"{report['loso_score']:.3f} on {report['rows']} rows\n")
        print(levels_table(report))
        print()
        print(loso_table(report, args.strictness))
        print()
        print(loso_table(report, args.strictness, "by_category"))
        if "long" in report:
            print()
            print(levels_table(report, "long"))
            print()
            print(loso_table(report, args.strictness, part="long"))

    from flashguard.rails.lab.evaluate import evaluate, format_report, read_labelled, report_json

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for weights in args.weights:
            config = config_for(weights, args.strictness, Path(tmp))
            from nemoguardrails import LLMRails, RailsConfig

            rails = LLMRails(RailsConfig.from_path(str(config)))
            for path in args.sets:
                rows = read_labelled(path)
                for rail in ("input", "output"):
                    if rail == "output" and not any(r.bot for r in rows):
                        continue
                    report = evaluate(rows, rails, rail=rail, file=path)
                    print(f"\n## {Path(path).name}, {rail} rail, weights {weights}, strictness {args.strictness}\n")
                    print(format_report(report))
                    out[f"{Path(path).name}:{rail}:{weights}"] = report_json(report)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
