"""Fitting the rails' probes on many sources: the rows, leave-one-source-out validation, the operating points.

``flashguard calibrate --sources [FOLDER]`` (``rails/lab/calibrate.py``) runs this module's steps:

1. ``source_rows(rail, folder)``: the public sources' rows for the rail (``rails/lab/sources.py``; evaluation-only sources
   included, marked) and the project's own hand-written short rows as one more source, ``project``.
2. The rows' hidden states, read by the rail's own path (``calibrate.collect``).
3. ``leave_one_source_out``: for each candidate (layer, features, L2), every source is scored by a probe fitted on
   the *other* training sources (the rule, fixed before the first fit: a source is never scored by a probe that saw
   it; evaluation-only sources are never trained on). The candidate with the best mean balanced accuracy over the
   sources is chosen; its table (blocked harmful and blocked benign per source and category) is what
   docs/moderation.md publishes.
4. ``operating_points``: the thresholds of the strictness levels from the held-out (out-of-source) scores of the
   benign rows: ``medium`` blocks at most 5% of them, ``low`` 2%, ``high`` 10%; each level's measured rates are kept.
5. The chosen probe is fitted on every training source and written with its strictness table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import sources as S
from ..probe import design, fit_logistic

DATA = Path(__file__).resolve().parent.parent / "data"
# the strictness levels: the share of held-out benign rows each may block (rails/moderation.py reads the table)
LEVELS = {"low": 0.02, "medium": 0.05, "high": 0.10}


def project_rows(rail: str) -> list[dict]:
    """The project's own hand-written rows as one source (``project``): the output rail's short exchanges and the
    model's own labelled replies; the input rail's short messages (not the generated long pastes, whose harm was
    spliced into pydoc text from hand-written lists)."""
    out = []
    if rail == "output":
        for name in ("moderation_tune.jsonl", "moderation_own_replies_v8.jsonl"):
            for line in (DATA / name).read_text(encoding="utf-8").splitlines():
                if line.strip():
                    r = json.loads(line)
                    if not r.get("paste"):
                        out.append({"user": r["user"], "bot": r["bot"], "block": r["block"],
                                    "category": r.get("category", ""), "source": "project"})
    else:
        for line in (DATA / "moderation_input_tune.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                r = json.loads(line)
                if not r.get("after") and not r.get("harm_span"):
                    out.append({"user": r["user"], "block": r["block"], "category": r.get("category", ""),
                                "source": "project"})
    return out


def source_rows(rail: str, folder: Optional[Path] = None) -> list[dict]:
    """Every row the rail's probe is validated on, as calibrate's row dicts (``user``, ``bot`` for the output rail,
    ``block``, ``category``, ``source``, ``train``), in a fixed order: the sources' rows interleaved (round robin)
    so that calibrate's alternating earlier exchange (``calibrate.earlier_exchange``) falls on every source alike."""
    per = []
    for s in S.SOURCES:
        got = [{"user": r.user, **({"bot": r.bot} if rail == "output" else {}), "block": r.block,
                "category": r.category, "source": r.source, "train": s.train} for r in S.rows(s, rail, folder)]
        if got:
            per.append(got)
    per.append([dict(r, train=True) for r in project_rows(rail)])
    out = []
    for i in range(max(map(len, per))):
        out.extend(p[i] for p in per if i < len(p))
    return out


@dataclass
class Candidate:
    layer: int
    features: str
    l2: float
    mean_layers: tuple = ()   # the mean averaged over these layers (``Probe.mean_layers``); empty: ``layer``'s


def candidate_x(hidden, pooled, c: Candidate) -> torch.Tensor:
    """A candidate's feature matrix ``[n, d or 2d]``: ``design``'s, the mean averaged over ``c.mean_layers``."""
    if not c.mean_layers:
        return design(hidden, torch.zeros(hidden.shape[0], dtype=torch.float64), c.layer, False, c.features, pooled)
    mean = pooled[:, list(c.mean_layers)].double().mean(1)
    return mean if c.features == "mean" else torch.cat([hidden[:, c.layer].double(), mean], 1)


def _balanced(p: torch.Tensor, y: torch.Tensor, threshold: float = 0.5) -> float:
    """Mean of the harmful rows' and the benign rows' accuracies at ``threshold`` (one of them when a source has one
    class)."""
    parts = [float(((p >= threshold) == (y > 0))[y == c].double().mean()) for c in (0, 1) if bool((y == c).any())]
    return sum(parts) / len(parts)


def source_score(oof: torch.Tensor, y: torch.Tensor, src: torch.Tensor, n: int) -> float:
    """A candidate's score from its held-out p_unsafe ``oof`` (labels ``y``, each row's source index ``src`` of
    ``n``): at its own ``medium`` operating point (the threshold that blocks 5% of the held-out benign rows), the mean
    over sources of the balanced accuracy: what a user meets, every source counted alike."""
    t = operating_points(oof, y.long().tolist(), [])["medium"]["threshold"]
    return sum(_balanced(oof[src == k], y[src == k], t) for k in range(n)) / n


def leave_one_source_out(hidden, pooled, labels: Sequence[int], sources: Sequence[str], train: Sequence[bool],
                         candidates: Sequence[Candidate]) -> list[dict]:
    """Each candidate's out-of-source scores: for every source, a probe fitted on the other *training* sources
    (classes weighted equally) scores that source's rows. Returns the candidates best first, each with ``oof``
    (every row's held-out p_unsafe) and ``score`` (``source_score``)."""
    y = torch.tensor(labels, dtype=torch.float64)
    names = sorted(set(sources))
    src = torch.tensor([names.index(s) for s in sources])
    trainable = torch.tensor(list(train))
    out = []
    for c in candidates:
        x = candidate_x(hidden, pooled, c)
        oof = torch.empty(len(y), dtype=torch.float64)
        for k in range(len(names)):
            held = src == k
            fit = ~held & trainable
            w, b = fit_logistic(x[fit], y[fit], c.l2, sample_weight=class_weights(y[fit]))
            oof[held] = torch.sigmoid(x[held] @ w + b)
        score = source_score(oof, y, src, len(names))
        out.append({"layer": c.layer, "features": c.features, "l2": c.l2, "mean_layers": tuple(c.mean_layers),
                    "score": score, "oof": oof})
    out.sort(key=lambda r: (-r["score"], -r["l2"], r["layer"]))
    return out


def class_weights(y: torch.Tensor) -> torch.Tensor:
    """Each row's sample weight for a fit on labels ``y``: the two classes weigh half each, however many rows each
    has (the guard's training uses them too)."""
    pos = float(y.mean())
    return torch.where(y > 0, 0.5 / max(pos, 1e-6), 0.5 / max(1 - pos, 1e-6))


def operating_points(oof: torch.Tensor, labels: Sequence[int], train: Sequence[bool]) -> dict:
    """Each strictness level's threshold: the smallest threshold at which at most ``LEVELS[level]`` of the benign
    rows' held-out scores reach it (all sources, evaluation-only ones too), and the rates measured there."""
    y = torch.tensor(labels)
    benign = oof[y == 0].sort().values
    harmful = oof[y == 1]
    out = {}
    for level, share in LEVELS.items():
        k = max(0, math.ceil(len(benign) * (1 - share)) - 1)
        t = float(min(max(benign[k].item() + 1e-6, 0.05), 0.9999)) if len(benign) else 0.5
        out[level] = {"threshold": round(t, 6),
                      "benign_blocked": round(float((benign >= t).double().mean()), 4),
                      "harmful_blocked": round(float((harmful >= t).double().mean()), 4) if len(harmful) else None}
    return out


def rates(p: torch.Tensor, rows: Sequence[dict], threshold: float, key: str = "source") -> dict:
    """Blocked-harmful and blocked-benign counts per ``key`` (source or category) at ``threshold``."""
    table: dict = {}
    for pi, r in zip(p.tolist(), rows):
        e = table.setdefault(r[key], {"harmful": 0, "harmful_blocked": 0, "benign": 0, "benign_blocked": 0})
        kind = "harmful" if r["block"] else "benign"
        e[kind] += 1
        e[kind + "_blocked"] += int(pi >= threshold)
    return table


# ---------------------------------------------------------------------------------------------------- the fit

LAYER_SCREEN = (6, 9, 12, 15, 18, 21, 24, 27)
MEAN_FROM = (12, 18, 24)
L2S = (0.1, 0.01)
WINDOW_LAYERS = (8, 12, 16, 20)


def choose(hidden, pooled, rows: Sequence[dict], options: Sequence[str], log=print) -> list[dict]:
    """The short-message (input) or reply (output) probe's candidate, by leave-one-source-out: single layers
    (``LAYER_SCREEN``, the richest features, L2 0.01) and means averaged over the upper layers (from
    ``MEAN_FROM`` to the last), then the features and the L2 of the best of those. Best first."""
    labels = [int(r["block"]) for r in rows]
    names = [r["source"] for r in rows]
    train = [bool(r.get("train", True)) for r in rows]
    top = hidden.shape[1] - 1
    layers = [la for la in LAYER_SCREEN if la <= top]
    rich = "last+mean" if "last+mean" in options else options[0]
    first = [Candidate(la, rich, 0.01) for la in layers] + \
        [Candidate(top, f, 0.01, tuple(range(a, top + 1))) for a in MEAN_FROM if a < top
         for f in options if "mean" in f]
    screen = leave_one_source_out(hidden, pooled, labels, names, train, first)
    log("  screen: " + ", ".join(f"{_name(r)} {r['score']:.3f}" for r in screen))
    b = screen[0]
    rest = [Candidate(b["layer"], f, l2, b["mean_layers"]) for f in options for l2 in L2S
            if (f, l2) != (b["features"], b["l2"]) and (not b["mean_layers"] or "mean" in f)]
    table = sorted(screen + leave_one_source_out(hidden, pooled, labels, names, train, rest),
                   key=lambda r: (-r["score"], -r["l2"], r["layer"]))
    log("  then: " + ", ".join(f"{_name(r)} {r['score']:.3f}" for r in table[:6]))
    return table


def _name(r: dict) -> str:
    where = f"layers {r['mean_layers'][0]}-{r['mean_layers'][-1]}" if r["mean_layers"] else f"layer {r['layer']}"
    return f"{where} {r['features']} l2 {r['l2']}"


def fit_chosen(hidden, pooled, rows: Sequence[dict], best: dict) -> tuple[torch.Tensor, float]:
    """The chosen candidate fitted on every training row (classes weighted equally)."""
    keep = torch.tensor([bool(r.get("train", True)) for r in rows])
    y = torch.tensor([int(r["block"]) for r in rows], dtype=torch.float64)[keep]
    x = candidate_x(hidden, pooled, Candidate(best["layer"], best["features"], best["l2"],
                                              best["mean_layers"]))[keep]
    return fit_logistic(x, y, best["l2"], sample_weight=class_weights(y))


def window_loso(long: dict, long_rows: Sequence[dict], short, short_rows: Sequence[dict], log=print) -> dict:
    """The window probe (input messages longer than the short probe's window) by leave-one-source-out: each
    candidate (window size x ``WINDOW_LAYERS`` x L2) is fitted on the labelled windows of the other training
    sources' long messages and those sources' short messages' mean states (``tuning.SHORT_SHARE`` of the
    weight), and scores a held-out message by its worst window. Returns the best candidate with its ``oof``
    (each long message's held-out worst-window p) and the fit on every training source (``weight``, ``bias``)."""
    from ..tuning import SHORT_SHARE

    y_msg = torch.tensor([int(r["block"]) for r in long_rows], dtype=torch.float64)
    names = sorted(set(r["source"] for r in long_rows))
    src_msg = torch.tensor([names.index(r["source"]) for r in long_rows])
    train_msg = torch.tensor([bool(r.get("train", True)) for r in long_rows])
    short_src = [r["source"] for r in short_rows]
    short_train = torch.tensor([bool(r.get("train", True)) for r in short_rows])
    ys = torch.tensor([int(r["block"]) for r in short_rows], dtype=torch.float64)
    best = None
    for size, data in long["windows"].items():
        labels = torch.tensor(data["labels"])
        message = torch.tensor(data["message"])
        for li, layer in enumerate(long["layers"]):
            if layer not in WINDOW_LAYERS:
                continue
            x = data["means"][li].double()
            xs_all = short[:, layer].double()
            for l2 in L2S:
                worst = torch.full((len(y_msg),), -1.0, dtype=torch.float64)
                for k, name in enumerate(names):
                    held_msg = src_msg == k
                    fit_msg = ~held_msg & train_msg
                    use = fit_msg[message] & (labels >= 0)
                    sk = torch.tensor([s != name for s in short_src]) & short_train
                    w, b = _window_weights(x[use], labels[use].double(), xs_all[sk], ys[sk], l2, SHORT_SHARE)
                    held = held_msg[message]
                    p = torch.sigmoid(x[held] @ w + b)
                    worst.scatter_reduce_(0, message[held], p, "amax")
                score = source_score(worst, y_msg, src_msg, len(names))
                log(f"  window {size} layer {layer} l2 {l2}: {score:.3f}")
                if best is None or score > best["score"] + 1e-9:
                    best = {"window": size, "layer": layer, "l2": l2, "score": score, "oof": worst}
    data = long["windows"][best["window"]]
    labels, message = torch.tensor(data["labels"]), torch.tensor(data["message"])
    x = data["means"][long["layers"].index(best["layer"])].double()
    use = train_msg[message] & (labels >= 0)
    w, b = _window_weights(x[use], labels[use].double(), short[:, best["layer"]].double()[short_train],
                           ys[short_train], best["l2"], SHORT_SHARE)
    best.update(weight=w, bias=b)
    return best


def _window_weights(x, y, xs, ys, l2, share):
    sw = class_weights(y)
    if share > 0 and len(ys):
        x, y = torch.cat([x, xs]), torch.cat([y, ys])
        sw = torch.cat([sw, torch.full((len(ys),), share * float(sw.sum()) / len(ys), dtype=torch.float64)])
    return fit_logistic(x, y, l2, sample_weight=sw)


def report(p: torch.Tensor, rows: Sequence[dict], levels: dict) -> dict:
    """Per source and per category, at each strictness level: the counts ``rates`` gives."""
    return {level: {"threshold": v["threshold"], "by_source": rates(p, rows, v["threshold"]),
                    "by_category": rates(p, rows, v["threshold"], "category")} for level, v in levels.items()}


def cv_scores(hidden, pooled, rows: Sequence[dict], best: dict, k: int = 5) -> torch.Tensor:
    """Every row's score by ``k``-fold cross-validation over all sources (folds grouped by text): the
    in-distribution scores ``thresholds="cv"`` sets the levels from."""
    from ..probe import folds

    y = torch.tensor([int(r["block"]) for r in rows], dtype=torch.float64)
    train = torch.tensor([bool(r.get("train", True)) for r in rows])
    x = candidate_x(hidden, pooled, Candidate(best["layer"], best["features"], best["l2"], best["mean_layers"]))
    oof = torch.empty(len(y), dtype=torch.float64)
    for part in folds(y.long().tolist(), k, groups=[r.get("bot") or r["user"] for r in rows]):
        held = torch.zeros(len(y), dtype=torch.bool)
        held[torch.tensor(part)] = True
        w, b = fit_logistic(x[~held & train], y[~held & train], best["l2"], sample_weight=class_weights(y[~held & train]))
        oof[held] = torch.sigmoid(x[held] @ w + b)
    return oof


def fit_sources(rows: Sequence[dict], features, settings, key, log=print, thresholds: str = "loso"):
    """Steps 3-5 of the module docstring on ``calibrate.collect``'s ``features`` of ``rows`` (``source_rows``).
    Returns ``(probe, result)``: the probe (threshold = the ``medium`` level; ``strictness`` and, for the input
    rail, ``long_strictness`` tables) and the validation tables for docs/moderation.md."""
    import dataclasses
    import time

    from ..tuning import WINDOW
    from ..probe import Probe

    t0 = time.perf_counter()
    hidden, pooled = features[0], features[2]
    short_rows = list(features[5]) if settings.side == "input" else list(rows)
    options = ("mean", "last+mean", "last") if settings.side == "input" else ("last+mean", "mean", "last")
    log(f"{settings.side} rail: {len(short_rows)} rows from {len(set(r['source'] for r in short_rows))} sources")
    table = choose(hidden, pooled, short_rows, options, log)
    best = table[0]
    labels = [int(r["block"]) for r in short_rows]
    train = [bool(r.get("train", True)) for r in short_rows]
    levels = operating_points(best["oof"], labels, train)
    loso_levels = levels
    if thresholds == "cv":
        # the levels from in-distribution scores; the leave-one-source-out rates at those thresholds are reported
        cv = operating_points(cv_scores(hidden, pooled, short_rows, best), labels, train)
        y = torch.tensor(labels)
        levels = {k: {**v, "loso_harmful_blocked": round(float((best["oof"][y > 0] >= v["threshold"]).double().mean()), 4),
                      "loso_benign_blocked": round(float((best["oof"][y == 0] >= v["threshold"]).double().mean()), 4)}
                  for k, v in cv.items()}
    elif thresholds != "loso":
        raise ValueError(f"thresholds must be loso or cv, got {thresholds!r}")
    w, b = fit_chosen(hidden, pooled, short_rows, best)
    result = {"rail": settings.side, "rows": len(short_rows),
              "chosen": {k: best[k] for k in ("layer", "features", "l2", "mean_layers")},
              "loso_score": round(best["score"], 4), "levels": levels, "levels_loso": loso_levels,
              "thresholds": thresholds,
              "report": report(best["oof"], short_rows, levels),
              "candidates": [{k: r[k] for k in ("layer", "features", "l2", "mean_layers", "score")} for r in table]}
    extra: dict = {}
    if settings.side == "input" and features[4] is not None and features[4]["message_labels"]:
        long = features[4]
        long_rows = long["rows"]
        best_w = window_loso(long, long_rows, pooled, short_rows, log)
        long_levels = operating_points(best_w["oof"], [int(r["block"]) for r in long_rows],
                                       [bool(r.get("train", True)) for r in long_rows])
        extra = {"stride": best_w["window"] // 2, "long_window": best_w["window"], "long_layer": best_w["layer"],
                 "long_weight": tuple(float(v) for v in best_w["weight"]), "long_bias": float(best_w["bias"]),
                 "long_threshold": long_levels["medium"]["threshold"],
                 "long_strictness": {k: v["threshold"] for k, v in long_levels.items()}}
        result["long"] = {"rows": len(long_rows), "chosen": {k: best_w[k] for k in ("window", "layer", "l2")},
                          "loso_score": round(best_w["score"], 4), "levels": long_levels,
                          "report": report(best_w["oof"], long_rows, long_levels)}
        result["oof_long"] = [round(float(v), 4) for v in best_w["oof"]]
    result["oof"] = [round(float(v), 4) for v in best["oof"]]
    counts: dict = {}
    for r in rows:
        e = counts.setdefault(r["source"], {"harmful": 0, "benign": 0, "train": bool(r.get("train", True))})
        e["harmful" if r["block"] else "benign"] += 1
    result["rows_by_source"] = counts
    probe = Probe(layer=best["layer"], weight=tuple(float(v) for v in w), bias=float(b), answer_weight=0.0,
                  threshold=levels["medium"]["threshold"], question=settings.prompt, model_file=key.file,
                  model_bytes=key.bytes, model_identity=key.identity, weights=key.weights, rail=settings.side,
                  features=best["features"], window=WINDOW if settings.side == "input" else 0,
                  mean_layers=tuple(best["mean_layers"]),
                  metrics={"fitted_on": "public sources (rails/data/SOURCES.md) and the project's own rows",
                           "rows_by_source": counts, "loso_balanced_accuracy": round(best["score"], 4),
                           "l2": best["l2"], "levels": levels,
                           **({"long_levels": result["long"]["levels"],
                               "long_loso_balanced_accuracy": result["long"]["loso_score"]} if extra else {}),
                           "seconds": round(time.perf_counter() - t0, 1)},
                  **extra)
    probe = dataclasses.replace(probe, strictness={k: v["threshold"] for k, v in levels.items()})
    return probe, result
