"""Fitting the question classifier on the public sources: ``flashguard calibrate --backend openai --sources [FOLDER]``.

    flashguard calibrate --backend openai --sources [FOLDER] [--rail input] [--max-rows N] [--features FILE]
                         [--report FILE] [--out FILE]

Steps (``fit_sources``):

1. Rows: ``guard_fit.source_rows`` (the pinned public sources of ``rails/data/SOURCES.md`` and the project's own rows),
   the first ``--max-rows`` (default ``MAX_ROWS``) of its round-robin order, so every source keeps its share, topped up
   so that a source with both classes has at least ``--min-per-class`` (default ``MIN_PER_CLASS``) of each
   (``chosen_rows``).
2. Features: every candidate question's Yes/No log-odds for every row, read as the rail reads them
   (``classifier.collect``), by the config's engine: in process (the same numbers as a server's, ``classifier.top_view``;
   much faster on a CPU than a server) or, with ``backend: openai`` in the config, through the server.
   ``--features FILE`` keeps them (a ``.pt`` of derived numbers) so that a second fit reads instead of running.
3. Questions: forward selection from the rail's default question, adding the candidate that most raises the
   leave-one-source-out score (``guard_fit.source_score``: mean over sources of the balanced accuracy at the threshold
   that blocks 5% of held-out benign rows) while it gains at least ``MIN_GAIN``: each question is one more request a check.
4. Thresholds: the strictness levels from the chosen classifier's held-out (leave-one-source-out) scores
   (``guard_fit.operating_points``: medium blocks <= 5% of held-out benign rows, low 2%, high 10%).
5. The classifier fitted on every training row, written with its provenance (sources and their commits, the
   project's commit, the date, the rows used per source) and the held-out table beside the old single question's.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import classifier as C
from .guard_fit import operating_points, rates, source_rows, source_score

MAX_ROWS = 1200
MIN_GAIN = 0.003
MIN_QUESTIONS = 3
# every source with both classes gets at least this many rows of each (``chosen_rows``)
MIN_PER_CLASS = 30


def chosen_rows(rows: Sequence[dict], limit: int, least: int = MIN_PER_CLASS) -> list[dict]:
    """The first ``limit`` rows of ``source_rows``' round-robin order, then, for every source that has rows of both
    classes, its next rows of a class it has fewer than ``least`` of so far, up to ``least`` (a source's rows keep
    their own order in the round robin: the project's greetings and everyday messages come after its harmful ones,
    so a prefix alone held none of them)."""
    out = list(rows[:limit])
    both = {s for s in {r["source"] for r in rows}
            if len({r["block"] for r in rows if r["source"] == s}) == 2}
    have: dict = {}
    for r in out:
        have[(r["source"], r["block"])] = have.get((r["source"], r["block"]), 0) + 1
    for r in rows[limit:]:
        key = (r["source"], r["block"])
        if r["source"] in both and have.get(key, 0) < least:
            have[key] = have.get(key, 0) + 1
            out.append(r)
    return out


def loso_score(x: torch.Tensor, y: torch.Tensor, groups: Sequence[str], train: Sequence[bool]) -> tuple[float, torch.Tensor]:
    """``(score, held-out scores)`` of a classifier over the columns of ``x`` (``guard_fit.source_score``)."""
    oof = C.held_out_scores(x, y, groups, train)
    names = sorted(set(groups))
    src = torch.tensor([names.index(s) for s in groups])
    return source_score(oof, y, src, len(names)), oof


def select(x: torch.Tensor, y: torch.Tensor, groups: Sequence[str], train: Sequence[bool], log=print) -> list[int]:
    """Forward selection of the questions (step 3): column indices, the default question (0) first."""
    chosen = [0]
    best, _ = loso_score(x[:, chosen], y, groups, train)
    log(f"  question 0 alone: {best:.4f}")
    while len(chosen) < x.shape[1]:
        trials = {j: loso_score(x[:, chosen + [j]], y, groups, train)[0] for j in range(x.shape[1]) if j not in chosen}
        j = max(trials, key=trials.get)
        log("  + " + ", ".join(f"{k}: {v:.4f}" for k, v in sorted(trials.items())))
        if trials[j] - best < MIN_GAIN and len(chosen) >= MIN_QUESTIONS:
            break
        chosen.append(j)
        best = trials[j]
    return chosen


def _rates(p: torch.Tensor, y: torch.Tensor, t: float) -> dict:
    return {"threshold": round(float(t), 4),
            "harmful_blocked": round(float((p[y > 0] >= t).double().mean()), 4),
            "benign_blocked": round(float((p[y == 0] >= t).double().mean()), 4)}


def fit_sources(rows: Sequence[dict], x: torch.Tensor, rail: str, model: tuple[str, int], question_threshold: float,
                features_by: str, log=print) -> tuple[C.Classifier, dict]:
    """Steps 3-5 on ``x`` (``[rows, candidates]``, ``classifier.collect``'s). Returns ``(classifier, report)``."""
    candidates = C.QUESTIONS[rail]
    y = torch.tensor([int(r["block"]) for r in rows], dtype=torch.float64)
    groups = [r["source"] for r in rows]
    train = [bool(r.get("train", True)) for r in rows]
    log(f"{rail} rail: {len(rows)} rows from {len(set(groups))} sources, {len(candidates)} candidate questions")
    chosen = select(x, y, groups, train, log)
    score, oof = loso_score(x[:, chosen], y, groups, train)
    levels = operating_points(oof, y.long().tolist(), train)
    keep = torch.tensor(train)
    w, b = C.fit(x[keep][:, chosen], y[keep])
    # the old verdict: the default question's own P(unsafe answer) at the config's threshold (nothing fitted, so every
    # row is held out), and at the threshold that blocks 5% of benign rows (the same operating point as medium)
    p_question = torch.sigmoid(x[:, 0])
    question_5 = operating_points(p_question, y.long().tolist(), train)["medium"]["threshold"]
    table = {"question": _rates(p_question, y, question_threshold),
             "question_at_5pct_benign": _rates(p_question, y, question_5),
             "classifier": _rates(oof, y, levels["medium"]["threshold"])}
    counts: dict = {}
    for r in rows:
        e = counts.setdefault(r["source"], {"harmful": 0, "benign": 0, "train": bool(r.get("train", True))})
        e["harmful" if r["block"] else "benign"] += 1
    by_source = {
        name: {"question": rates(p_question, rows, question_threshold)[name],
               "classifier": rates(oof, rows, levels["medium"]["threshold"])[name]} for name in counts}
    provenance = {"fitted_on": "public sources pinned in rails/data/SOURCES.md and the project's own rows",
                  "sources": _source_commits(counts), "rows_by_source": counts, "rows": len(rows),
                  "validation": "leave one source out (each source scored by a classifier fitted on the others' "
                                "training rows)",
                  "features_read_by": features_by, "top_logprobs": C.TOP_LOGPROBS,
                  "flashguard_commit": _commit(), "date": datetime.date.today().isoformat()}
    clf = C.Classifier(rail=rail, questions=tuple(candidates[j] for j in chosen), weight=tuple(float(v) for v in w),
                       bias=float(b), threshold=levels["medium"]["threshold"],
                       strictness={k: v["threshold"] for k, v in levels.items()}, model_file=model[0],
                       model_bytes=model[1], provenance=provenance,
                       metrics={"loso_score": round(score, 4), "levels": levels, "held_out": table})
    report = {"rail": rail, "rows": len(rows), "chosen": chosen, "loso_score": score, "levels": levels,
              "held_out": table, "by_source": by_source}
    return clf, report


def _source_commits(counts: dict) -> dict:
    """Each source used: its files' repositories and pinned commits (``rails/data/source_files.json``)."""
    from .sources import BY_NAME

    return {name: sorted({f"{f.repo}@{f.commit[:12]}" for f in BY_NAME[name].files})
            for name in counts if name in BY_NAME}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def table_lines(report: dict) -> list[str]:
    """The held-out table as Markdown rows (docs/benchmarks/remote.md)."""
    t = report["held_out"]
    out = []
    for name, label in (("question", "one question (the old verdict)"),
                        ("question_at_5pct_benign", "one question at 5% benign"),
                        ("classifier", f"classifier, {len(report['chosen'])} questions (medium)")):
        r = t[name]
        out.append(f"| {report['rail']} | {label} | {r['threshold']:.3f} | {100 * r['harmful_blocked']:.1f}% | "
                   f"{100 * r['benign_blocked']:.1f}% |")
    return out


def main(args, data: dict, params: dict, settings) -> int:
    """``flashguard calibrate --backend openai``: the features by the config's engine, the fit, the file."""
    from flashguard.config import EngineConfig
    from flashguard.engine import get_engine

    sources = getattr(args, "sources", None)
    if sources is None:
        raise SystemExit("--backend openai fits on the public sources: add --sources [FOLDER] (rails/data/SOURCES.md)")
    rail = settings.side
    rows = source_rows(rail, None if sources == "download" else Path(sources))
    least = getattr(args, "min_per_class", None)
    rows = chosen_rows(rows, args.max_rows or MAX_ROWS, MIN_PER_CLASS if least is None else least)
    model = next((m.get("model") for m in data.get("models") or [] if m.get("type") == "main"), None) or "flashguard"
    engine = get_engine(EngineConfig.from_parameters(params), model)
    features_by = "a server (backend: openai)" if not engine.returns_states else \
        f"the in-process engine ({engine.weights_kind} weights)"
    cache_path: Optional[Path] = Path(args.features) if getattr(args, "features", None) else None
    cache: dict = torch.load(cache_path) if cache_path and cache_path.is_file() else {}
    save = (lambda: torch.save(cache, cache_path)) if cache_path else None
    x = C.collect(engine, rail, rows, C.QUESTIONS[rail], cache=cache, progress=True, save=save)
    if save:
        save()
    clf, report = fit_sources(rows, x, rail, C.model_file(engine), settings.threshold, features_by)
    out = Path(args.out) if args.out else C.user_path(engine, rail)
    clf.save(out)
    if getattr(args, "report", None):
        Path(args.report).write_text(json.dumps(report, indent=1))
    print("| rail | verdict | threshold | harmful blocked | benign blocked |\n|---|---|---|---|---|")
    print("\n".join(table_lines(report)))
    print(f"{rail} question classifier for {clf.model_file}: {len(clf.questions)} questions, leave-one-source-out "
          f"score {report['loso_score']:.3f} on {len(rows)} rows; written to {out}")
    return 0
