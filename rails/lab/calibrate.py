"""``flashguard calibrate``: train the moderation probe for the model ``model_path`` points at.

    flashguard calibrate [--config DIR] [--weights float|int4] [--rail output|input] [--out FILE]
    flashguard calibrate --backend openai --sources [FOLDER] [--rail input]   (rails/lab/classifier_fit.py)

Runs every labelled (user, reply) of ``rails/data/moderation_tune.jsonl`` through the model exactly as the
rail does (the chat template, the reply's tokens, the moderation suffix), keeps the hidden states of the
suffix's last token and the mean of the suffix's states (read in the same forward: ``moderation.suffix_state``),
chooses the features (``OUTPUT_FEATURE_OPTIONS``: the last state, or it and the suffix's mean), the layer, the L2
strength and whether to add the question's Yes/No log-odds by 5-fold cross-validation on that set only (an exchange
and its long-paste copy in one fold), fits the chosen probe on all of it and writes it to the user cache
folder, where the rail finds it for that model (and those weights). The test set (tests/data) is never read.

``--rail input`` trains the input rail's probe the same way on ``rails/data/moderation_input_tune.jsonl`` (user
messages: harmful requests, jailbreaks, prompt injections and benign look-alikes, and long pasted documents, code
and logs with and without harm hidden in them), on the hidden states of the generation's own prompt (the
conversation up to the message, and the template's generation prompt): the mean over the user's turn, the last
token's, or both (``FEATURE_OPTIONS``, chosen with the layer and L2 by cross-validation); no question, so the check
is the generation's own prefill. A message longer than ``WINDOW`` tokens is judged by sliding windows over the states
of its own forward (v5): it trains a second, window probe instead, on the mean state of every window (sizes
``SLIDE_WINDOWS``, stride half a window, layers ``LONG_LAYERS``), a window labelled harmful when it holds at least half
of the row's ``harm_span`` (the whole message for a harmful row without one), benign when it holds none of it, and
left out in between (the short messages' mean states join it, ``SHORT_SHARE`` of the weight); its window size,
layer, L2 and the threshold on a message's worst window are chosen by
cross-validation grouped by message (``choose_window_probe``). Every other message follows one benign exchange
(``earlier_exchange``), as a message in a conversation does; a row with ``after`` follows the long paste exchange it
names (``INPUT_PASTES``, tools/make_long_followup_items.py: short messages after a pasted text), and rows
with the same message text are held out together. Rows marked ``short_only`` (v7's blunt one-line requests) train
the short-message probe only; ``--keep-window-probe FILE`` fits as usual, then replaces the window probe with that of
an earlier input probe file (``keep_window_probe``: v7 keeps v6's, so long messages keep their verdicts).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Sequence

import torch

from ..probe import CALIBRATE_HINT, ModelKey, Probe, cross_validate, design, fit_logistic, folds, user_probe_path
from ..settings import ModerationSettings
# (the rows and their features are tuning.py's; their names are calibrate's too)
from ..tuning import (INPUT_PASTES, INPUT_TUNING_SET, LONG_LAYERS, SHORT_SHARE, SLIDE_WINDOWS,  # noqa: F401
                     TUNING_SET, WINDOW, collect, earlier_exchange, harm_tokens, input_moderation_ids,
                     moderation_ids, paste_exchange, read_rows, row_key, window_label)

log = logging.getLogger("flashguard")

L2_GRID = (1.0, 0.1, 0.01)
FOLDS = 5
# the input probe's candidate features (probe.FEATURES), in the order ties go: the message's mean state first
FEATURE_OPTIONS = ("mean", "last+mean", "last")
# the output probe's candidate features, ties going to the first: the suffix's last state (v3), and that state with
# the mean of the suffix's states at the same layer (format 2: read in the same forward over the suffix)
OUTPUT_FEATURE_OPTIONS = ("last", "last+mean")


def _window_fit(x, labels, l2, short=None, layer=None):
    """The window probe's fit: labelled windows (classes weighted equally) and, with ``short`` = (pooled states
    ``[n, layers + 1, d]``, labels), the short messages' mean states at ``layer``, weighing ``SHORT_SHARE`` of it."""
    y = labels.double()
    sw = torch.where(y > 0, 0.5 / y.mean(), 0.5 / (1 - y.mean()))
    if short is not None and SHORT_SHARE > 0:
        xs, ys = short[0][:, layer].double(), torch.tensor(short[1], dtype=torch.float64)
        x, y = torch.cat([x, xs]), torch.cat([y, ys])
        sw = torch.cat([sw, torch.full((len(ys),), SHORT_SHARE * float(sw.sum()) / len(ys), dtype=torch.float64)])
    return fit_logistic(x, y, l2, sample_weight=sw)


def choose_window_probe(long: dict, l2s: Sequence[float] = L2_GRID, k: int = FOLDS, short=None) -> list[dict]:
    """The window probe's grid (window size x layer x L2), by ``k``-fold cross-validation grouped by message (a
    message's windows are all in one fold): a window probe is fitted on the training folds' labelled windows (classes
    weighted equally), each held-out message is scored by its worst window, and the threshold on that max that is
    right on most long messages (balanced accuracy: the mean of the harmful and the benign messages' accuracies, as
    the tuning set's share of harmful long messages is not a user's) is the row's (the middle of the best run of
    thresholds). Best first; ties go to the
    stronger L2, then the earlier layer, then the smaller window."""
    y_msg = torch.tensor(long["message_labels"], dtype=torch.float64)
    parts = folds(long["message_labels"], k)
    grid = torch.linspace(0.05, 0.95, 91, dtype=torch.float64)
    rows = []
    for size, data in long["windows"].items():
        labels = torch.tensor(data["labels"])
        message = torch.tensor(data["message"])
        for li, layer in enumerate(long["layers"]):
            x = data["means"][li].double()
            for l2 in l2s:
                p = torch.empty(len(labels), dtype=torch.float64)
                for part in parts:
                    held = torch.isin(message, torch.tensor(part))
                    train = ~held & (labels >= 0)
                    w, b = _window_fit(x[train], labels[train], l2, short, layer)
                    p[held] = torch.sigmoid(x[held] @ w + b)
                worst = torch.full((len(y_msg),), -1.0, dtype=torch.float64).scatter_reduce(0, message, p, "amax")
                hit = ((worst[None, :] >= grid[:, None]).double() == y_msg[None, :]).double()
                acc = (hit[:, y_msg > 0].mean(1) + hit[:, y_msg == 0].mean(1)) / 2   # balanced: harmful, benign
                best = torch.nonzero(acc == acc.max()).flatten()
                rows.append({"window": size, "layer": layer, "l2": l2, "cv_accuracy": float(acc.max()),
                             "threshold": float(grid[best[len(best) // 2]]), "oof_max": worst,
                             "window_accuracy": float((((p >= 0.5).long() == labels)[labels >= 0]).double().mean())})
    rows.sort(key=lambda r: (-r["cv_accuracy"], -r["l2"], r["layer"], r["window"]))
    return rows


def fit_window_probe(long: dict, best: dict, short=None) -> tuple[torch.Tensor, float]:
    data = long["windows"][best["window"]]
    labels = torch.tensor(data["labels"])
    x = data["means"][long["layers"].index(best["layer"])].double()[labels >= 0]
    return _window_fit(x, labels[labels >= 0], best["l2"], short, best["layer"])


def train(engine, rows: Sequence[dict], settings: ModerationSettings = ModerationSettings(), *,
          progress: bool = False, features=None, key: ModelKey | None = None,
          layers: Sequence[int] | None = None,
          feature_options: Sequence[str] | None = None) -> tuple[Probe, list[dict]]:
    """Choose (layer, l2, use_answer, features) by cross-validation on ``rows``, fit on all rows. Returns
    ``(probe, cv table best first)``. ``layers``: the candidates (default every decoder layer's output);
    ``feature_options``: the candidate features (default ``FEATURE_OPTIONS`` for the input rail,
    ``OUTPUT_FEATURE_OPTIONS`` for the output rail; "last" only when ``features`` has no means).
    ``features`` (precomputed ``collect`` output) and ``key`` (the model's ModelKey) let a probe be fitted
    again without the engine (``engine=None``)."""
    t0 = time.perf_counter()
    features = features if features is not None else collect(engine, rows, settings, progress)
    hidden, odds = features[:2]
    pooled = features[2] if len(features) > 2 else None   # output: the suffix's means; input: the message's
    labels = list(features[3]) if len(features) > 3 else [int(r["block"]) for r in rows]
    long = features[4] if len(features) > 4 else None
    short_rows = features[5] if len(features) > 5 else rows   # the rows ``labels`` are of
    answers = (False,) if settings.side == "input" else (False, True)   # the input probe's position asks nothing
    # output rail: a long-paste row has the same reply as its short row; they are held out together. Input rail: a
    # short message after a paste exchange (``after``) may reuse a tuning message's text; same text, same fold
    groups = [r["bot" if settings.side == "output" else "user"] for r in short_rows]
    if pooled is None:
        feature_options = ("last",)
    elif feature_options is None:
        feature_options = FEATURE_OPTIONS if settings.side == "input" else OUTPUT_FEATURE_OPTIONS
    table = cross_validate(hidden, odds, labels, layers=layers or range(1, hidden.shape[1]), l2s=L2_GRID, k=FOLDS,
                           answer_options=answers, pooled=pooled, feature_options=tuple(feature_options),
                           groups=groups)
    best = table[0]
    # cross-validated accuracy apart for the rows with a paste (output: ``paste``, a reply after a pasted text;
    # input: ``after``, a message after a paste exchange) and the others
    field, name = ("paste", "pasted") if settings.side == "output" else ("after", "after_paste")
    pasted = [bool(r.get(field)) for r in short_rows]
    paste_metrics: dict = {}

    def split(row) -> dict:   # a CV row's accuracy on the rows with and without a paste
        hit = ((row["oof_p"] >= 0.5).long() == torch.tensor(labels)).tolist()
        return {"cv_accuracy_short": round(sum(h for h, p in zip(hit, pasted) if not p) / pasted.count(False), 4),
                f"cv_accuracy_{name}": round(sum(h for h, p in zip(hit, pasted) if p) / pasted.count(True), 4)}

    if any(pasted):
        paste_metrics = {**split(best), f"{name}_rows": pasted.count(True)}
    if settings.side == "output" and len(set(r["features"] for r in table)) > 1:
        # the best of each candidate feature set, to compare them (``flashguard calibrate`` prints it)
        paste_metrics["cv_by_features"] = {
            f: {"layer": r["layer"], "l2": r["l2"], "use_answer": r["use_answer"],
                "cv_accuracy": round(r["cv_accuracy"], 4), **(split(r) if any(pasted) else {})}
            for f in dict.fromkeys(r["features"] for r in table)
            for r in [next(r for r in table if r["features"] == f)]}
    x = design(hidden, odds, best["layer"], best["use_answer"], best["features"], pooled)
    w, b = fit_logistic(x, torch.tensor(labels), best["l2"])
    answer_weight = float(w[-1]) if best["use_answer"] else 0.0
    weight = w[:-1] if best["use_answer"] else w
    train_acc = float((((x @ w + b) >= 0).long() == torch.tensor(labels)).double().mean())
    key = key or ModelKey.of(engine)
    question_only = float(((odds > torch.log(torch.tensor(settings.threshold / (1 - settings.threshold)))).long()
                           == torch.tensor(labels)).double().mean())
    slide: dict = {}
    long_metrics: dict = {}
    if long is not None and len(set(long["message_labels"])) == 2:
        # the short messages that join the window probe's training: alone or after a short exchange, not the ones
        # after a paste exchange (with them, balanced CV on the long tuning messages fell from 92.1% to 91.4%) nor
        # the rows marked ``short_only`` (v7's blunt one-line requests: with them the window probe blocked 4 of set
        # D's 20 pasted texts instead of v6's 2; v7 ships v6's window probe, ``keep_window_probe``)
        keep = [not r.get("after") and not r.get("short_only") for r in short_rows]
        short = (pooled[torch.tensor(keep)], [y for y, k in zip(labels, keep) if k])
        long_table = choose_window_probe(long, short=short)
        lb = long_table[0]
        lw, lbias = fit_window_probe(long, lb, short=short)
        slide = {"stride": lb["window"] // 2, "long_window": lb["window"], "long_layer": lb["layer"],
                 "long_weight": tuple(float(v) for v in lw), "long_bias": lbias, "long_threshold": lb["threshold"]}
        long_metrics = {"long_messages": len(long["message_labels"]),
                        "windows": len(long["windows"][lb["window"]]["labels"]), "long_l2": lb["l2"],
                        "long_cv_accuracy": round(lb["cv_accuracy"], 4)}
        table = table + [dict(r, rail_part="long") for r in long_table]
    probe = Probe(layer=best["layer"], weight=tuple(float(v) for v in weight), bias=b, answer_weight=answer_weight,
                  threshold=0.5, question=settings.prompt, model_file=key.file, model_bytes=key.bytes,
                  model_identity=key.identity, weights=key.weights, rail=settings.side, features=best["features"],
                  window=WINDOW if settings.side == "input" else 0,
                  metrics={"tuning_rows": len(rows), "tuning_items": len(labels), "cv_folds": FOLDS, "cv_accuracy": round(best["cv_accuracy"], 4),
                           "l2": best["l2"], "train_accuracy": round(train_acc, 4),
                           "question_only_accuracy": round(question_only, 4), **long_metrics, **paste_metrics,
                           "seconds": round(time.perf_counter() - t0, 1)}, **slide)
    return probe, table


WINDOW_FIELDS = ("stride", "long_window", "long_layer", "long_weight", "long_bias", "long_threshold")
KEEP_WINDOW_NEEDS_INPUT = "--keep-window-probe: only the input rail's probe has a window probe (add --rail input)"


def keep_window_probe(probe: Probe, path: Path) -> Probe:
    """``probe`` with the window probe (the long-message part) of the input probe file ``path``, for the same model and
    weights: ``flashguard calibrate --rail input --keep-window-probe FILE`` (v7: new short rows, v6's long verdicts)."""
    if probe.rail != "input":
        raise SystemExit(KEEP_WINDOW_NEEDS_INPUT)
    if not path.is_file():
        raise SystemExit(f"--keep-window-probe {path}: no such file (give an input probe file of this model)")
    kept = Probe.load(path, f"{CALIBRATE_HINT} --rail input")
    if kept.rail != "input" or not kept.long_weight:
        raise SystemExit(f"--keep-window-probe {path}: not an input probe with a window probe")
    if (kept.model_file, kept.model_bytes, kept.weights) != (probe.model_file, probe.model_bytes, probe.weights):
        raise SystemExit(f"--keep-window-probe {path}: made for {kept.model_file} ({kept.weights} weights), not "
                         f"{probe.model_file} ({probe.weights})")
    metrics = {k: v for k, v in probe.metrics.items() if not k.startswith("long_") and k != "windows"}
    metrics.update({k: v for k, v in kept.metrics.items() if k.startswith("long_") or k == "windows"})
    metrics["window_probe_from"] = path.name
    return dataclasses.replace(probe, metrics=metrics, **{f: getattr(kept, f) for f in WINDOW_FIELDS})


def main(args) -> int:
    """The CLI command (``flashguard calibrate``): build the config's engine, train, write the probe."""
    from flashguard.config import EngineConfig, main_parameters
    from flashguard.engine.engine import Engine

    import yaml

    cfg_path = Path(args.config) / "config.yml"
    data = yaml.safe_load(cfg_path.read_text()) or {}
    params = main_parameters(data)
    if args.weights:
        params["weights"] = args.weights
    config = EngineConfig.from_parameters(params)
    side = getattr(args, "rail", None) or "output"
    settings = ModerationSettings.from_custom_data(data.get("custom_data"), side=side)
    choices = getattr(args, "probe_features", None)
    allowed = FEATURE_OPTIONS if side == "input" else OUTPUT_FEATURE_OPTIONS
    if choices and not set(choices.split(",")) <= set(allowed):
        raise SystemExit(f"--probe-features {choices}: the {side} rail's probe reads one of {', '.join(allowed)}")
    if getattr(args, "keep_window_probe", None) and side != "input":   # before the model loads
        raise SystemExit(KEEP_WINDOW_NEEDS_INPUT)
    if getattr(args, "backend", None) == "openai":   # the question classifier (rails/lab/classifier_fit.py)
        from .classifier_fit import main as fit_classifier

        return fit_classifier(args, data, params, settings)
    engine = Engine(config)
    sources = getattr(args, "sources", None)
    if sources is not None:   # the public sources of the manifest and the project's rows (rails/lab/guard_fit.py)
        from .guard_fit import source_rows

        if args.data:
            raise SystemExit("--sources and --data: give one (the sources are the manifest's, rails/data/SOURCES.md)")
        rows = source_rows(side, None if sources == "download" else Path(sources))
        if getattr(args, "max_rows", None):   # the round-robin order keeps every source in a prefix
            rows = rows[:args.max_rows]
    else:
        data_path = Path(args.data) if args.data else (INPUT_TUNING_SET if side == "input" else TUNING_SET)
        rows = read_rows(data_path, side)
    cache_path = getattr(args, "features", None)
    float_states = bool(getattr(args, "float_states", False))
    key = ModelKey.of(engine)
    if float_states and not (cache_path and key.weights.startswith("int4")):
        raise SystemExit("--float-states fits an int4 probe on the float model's states: it needs --weights int4 and "
                         "--features FILE written by a float run of the same rail")
    source = dataclasses.replace(key, weights=key.weights.replace("int4", "float")) if float_states else key
    tag = {"key": source.digest, "side": side}
    cache: dict = {}
    if cache_path and Path(cache_path).is_file():
        saved = torch.load(cache_path, weights_only=False)
        if saved.get("tag") == tag:
            cache = saved["rows"]
            print(f"hidden states of {len(cache)} rows read from {cache_path}")
        else:
            print(f"{cache_path} was collected for another model or rail; collecting again")
    if float_states:   # (a cache from before the output rail kept the suffix's mean lacks it: collect again)
        missing = [i for i, r in enumerate(rows) if (rec := cache.get(row_key(i, r, settings))) is None
                   or (side == "output" and "mean" not in rec)]
        if missing:
            raise SystemExit(f"{cache_path} lacks the float states of {len(missing)} tuning rows; run `flashguard "
                             f"calibrate --rail {side} --weights float --features {cache_path}` first")
    features = collect(engine, rows, settings, progress=True, cache=cache)
    if cache_path and not float_states:
        torch.save({"tag": tag, "rows": cache}, cache_path)
    if sources is not None:
        from .guard_fit import fit_sources

        probe, result = fit_sources(rows, features, settings, key, thresholds=getattr(args, "thresholds", "loso"))
        report_path = getattr(args, "report", None)
        if report_path:
            Path(report_path).write_text(json.dumps(result, indent=1))
        out = Path(args.out) if args.out else user_probe_path(key, side)
        probe.save(out)
        m = result["levels"]["medium"]
        print(f"{side} probe for {probe.model_file} ({probe.weights}): layer {probe.layer}, features {probe.features}, "
              f"l2 {probe.metrics['l2']}; leave-one-source-out balanced accuracy {result['loso_score']:.1%} on "
              f"{result['rows']} rows; at strictness medium (threshold {m['threshold']:.2f}) held-out harmful rows "
              f"blocked {m['harmful_blocked']:.1%}, benign {m['benign_blocked']:.1%}")
        if "long" in result:
            lm = result["long"]["levels"]["medium"]
            print(f"  long messages ({result['long']['rows']}): windows of {probe.long_window}, layer "
                  f"{probe.long_layer}; harmful blocked {lm['harmful_blocked']:.1%}, benign {lm['benign_blocked']:.1%}")
        print(f"written to {out}")
        return 0
    probe, table = train(engine, rows, settings, features=features,
                         feature_options=choices.split(",") if choices else None)
    if float_states:   # the file says which states it was fitted on
        probe = dataclasses.replace(probe, metrics={**probe.metrics, "fitted_on": "float states (--float-states)"})
    keep = getattr(args, "keep_window_probe", None)
    if keep:   # retrain the short-message probe only: long messages keep that file's window probe and verdicts
        probe = keep_window_probe(probe, Path(keep))
    out = Path(args.out) if args.out else user_probe_path(ModelKey.of(engine), side)
    probe.save(out)
    print(f"{side} probe for {probe.model_file} ({probe.weights}): layer {probe.layer}, l2 {probe.metrics['l2']}, "
          f"Yes/No feature {'on' if probe.answer_weight else 'off'}, features {probe.features}; {FOLDS}-fold "
          f"accuracy on {len(rows)} tuning replies {probe.metrics['cv_accuracy']:.1%} (question only {probe.metrics['question_only_accuracy']:.1%})")
    if "cv_accuracy_pasted" in probe.metrics:
        print(f"  short exchanges {probe.metrics['cv_accuracy_short']:.1%}, after a long paste "
              f"{probe.metrics['cv_accuracy_pasted']:.1%} ({probe.metrics['pasted_rows']} rows; folds grouped by reply)")
    for f, r in probe.metrics.get("cv_by_features", {}).items():
        print(f"  best with features {f}: layer {r['layer']}, l2 {r['l2']}, Yes/No "
              f"{'on' if r['use_answer'] else 'off'}: {r['cv_accuracy']:.1%}"
              + (f" (short {r['cv_accuracy_short']:.1%}, after a long paste {r['cv_accuracy_pasted']:.1%})"
                 if "cv_accuracy_pasted" in r else ""))
    if "cv_accuracy_after_paste" in probe.metrics:
        print(f"  short messages alone or after a short exchange {probe.metrics['cv_accuracy_short']:.1%}, after a "
              f"paste exchange {probe.metrics['cv_accuracy_after_paste']:.1%} ({probe.metrics['after_paste_rows']} "
              f"rows; folds grouped by text)")
    if probe.slides:
        print(f"long messages: windows of {probe.long_window} tokens every {probe.stride}, layer {probe.long_layer}, "
              f"l2 {probe.metrics['long_l2']}, threshold {probe.long_threshold:.2f} on the worst window; "
              f"{FOLDS}-fold accuracy on {probe.metrics['long_messages']} long tuning messages "
              f"{probe.metrics['long_cv_accuracy']:.1%}")
    print(f"written to {out}")
    return 0
