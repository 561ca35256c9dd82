"""Write rails/data/SOURCES.md, the manifest of the probes' public sources, from ``rails/lab/sources.py``.

    python tools/write_sources_md.py [--reports FILE ...] [--folder FOLDER]

Each source: repository, commit, license, the label mapping, every file's path and sha256; given the reports
``flashguard calibrate --sources --report FILE`` wrote (or probe files), the rows each rail used, harmful / benign;
given a sources folder (``FOLDER/<owner>/<name>/<path>``), the rows each source gives each rail now (at its cap),
harmful / benign, and their categories.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from flashguard.rails.lab.sources import SOURCES, rows

OUT = Path(__file__).resolve().parent.parent / "rails" / "data" / "SOURCES.md"

LOCAL_DOCUMENTS = """
## Read on the machine by a benchmark, never fitted on

`python -m benchmarks.long_pastes` (docs/benchmarks/long_pastes.md) reads long documents where they are installed
and commits only derived numbers (per-window scores, `docs/benchmarks/long_pastes.json`, each row named by its
document): the licence files (`*.dist-info/LICENSE*`, `*.dist-info/licenses/*`) and package descriptions
(`*.dist-info/METADATA`) of the Python packages installed beside flashguard, each under its own package's licence
and named by its `.dist-info` folder (package and version); and Debian's per-package copyright files
(`/usr/share/doc/<package>/copyright`, Debian 12.11 on the machine of 2026-12-04, each under the licences it
states), named by package. The hidden rows insert one short harmful request of `project`'s
moderation_input_tune.jsonl. No probe or threshold was fitted on any of them.
"""

WINDOW_PROBE_DOCUMENTS = """
## Fitted on from a snapshot, not downloaded by `calibrate`: the int4 input probe's window probe (v10)

`python tools/fit_window_probe.py --repo <git dir of github/site-policy>` (a snapshot of
https://github.com/github/site-policy at commit 12992597c5d9d8cfc006693c54b9609d9993bc99, license CC0-1.0) cuts
the Markdown files under `Policies/` (57 files: acceptable-use, content-removal, company, privacy and terms
documents) into pieces of about 4,000 characters (at least 1,500) at paragraph breaks, shuffles them (seed 0) and takes 120, each
with one everyday ask appended ("Can you summarise this?", ...), as long benign messages beside the tuning set's
long messages; the fitted window weights are in `rails/probes/SmolLM2-135M-Instruct.Q4_1-int4-input.json` (only
derived numbers; no text of the snapshot is in this repository). The documents `benchmarks.long_pastes` reads
(above) were held apart and judge it.
"""

HEADER = """# The moderation probes' sources

The guard's data: public, labelled text from the repositories named here, pinned by commit and checked by sha256,
and the project's own hand-written short rows (`project`). `rows` is what each source gives each rail now (at its
cap; multi-turn rows carry their earlier turns); `rows used` is what the shipped probes (rails/probes/) were fitted
on (`-`: a source added after them). No third-party text is in this repository; `flashguard calibrate --sources`
downloads these files into the user cache (or reads them from a folder: `--sources FOLDER`, laid out as
`FOLDER/<owner>/<name>/<path>`) and checks each against its sha256. The label mapping of every source to one
taxonomy is in `rails/lab/sources.py` (one reader a source); `train: no` marks a source read for evaluation only (its
license does not allow training, or none is stated). Validation is leave-one-source-out (docs/moderation.md).
Written by `python tools/write_sources_md.py --reports <the float probes> --folder <a sources folder>`.

Reserved for evaluation kept apart from this project, never fetched or read here: XSTest
(paul-rottger/exaggerated-safety) and OpenAI's moderation evaluation set (openai/moderation-api-release).
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reports", nargs="*", default=[], help="calibrate --report files or probe files (rows used per "
                    "source)")
    ap.add_argument("--folder", type=Path, help="a sources folder (<owner>/<name>/<path>): count the rows each "
                    "source gives each rail now")
    args = ap.parse_args(argv)
    now: dict = {}
    if args.folder:
        for s in SOURCES:
            for rail in s.rails:
                got = rows(s, rail, args.folder)
                harmful = sum(r.block for r in got)
                cats = collections.Counter(r.category for r in got if r.block)
                now.setdefault(s.name, []).append(
                    f"{rail} {harmful} / {len(got) - harmful}"
                    + (f" ({', '.join(f'{c} {n}' for c, n in sorted(cats.items(), key=lambda x: (-x[1], x[0])))})"
                       if cats else ""))
    used: dict = {}
    for path in args.reports:
        data = json.loads(Path(path).read_text())   # a calibrate --report file, or a probe file (its metrics)
        counts = data.get("rows_by_source") or data.get("metrics", {}).get("rows_by_source", {})
        for name, e in counts.items():   # a source's sub-sources (jailbreakbench_pair, ...) count as the source
            base = name if any(src.name == name for src in SOURCES) else \
                next((src.name for src in SOURCES if name.startswith(src.name + "_")), name)
            got = used.setdefault(base, {}).setdefault(data["rail"], {"harmful": 0, "benign": 0})
            got["harmful"] += e["harmful"]
            got["benign"] += e["benign"]
    lines = [HEADER, "| source | repository @ commit | license | rails | train | label mapping | rows (harmful / "
             "benign; harmful by category) | rows used (harmful / benign) |", "|---|---|---|---|---|---|---|---|"]
    for s in SOURCES:
        f = s.files[0]
        got = "; ".join(f"{rail} {e['harmful']} / {e['benign']}" for rail, e in sorted(used.get(s.name, {}).items()))
        lines.append(f"| {s.name} | {f.repo} @ {f.commit[:12]} | {s.license} | {', '.join(s.rails)} | "
                     f"{'yes' if s.train else 'no'} | {s.mapping} | {'; '.join(now.get(s.name, [])) or '-'} | "
                     f"{got or '-'} |")
    own = "; ".join(f"{rail} {e['harmful']} / {e['benign']}" for rail, e in sorted(used.get("project", {}).items()))
    lines.append("| project | this repository: rails/data/moderation_tune.jsonl (short rows), moderation_own_replies_v8"
                 ".jsonl, moderation_input_tune.jsonl (short rows) | Apache-2.0 | input, output | yes | as labelled "
                 f"there | - | {own or '-'} |")
    lines += LOCAL_DOCUMENTS.rstrip("\n").split("\n")
    lines += WINDOW_PROBE_DOCUMENTS.rstrip("\n").split("\n")
    lines += ["", "## Files", "", "| source | repository | commit | path | sha256 |", "|---|---|---|---|---|"]
    for s in SOURCES:
        for f in s.files:
            lines.append(f"| {s.name} | {f.repo} | {f.commit} | `{f.path}` | `{f.sha256}` |")
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"written {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
