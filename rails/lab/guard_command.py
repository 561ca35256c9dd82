"""``flashguard train-guard``: the guard adapter for the config's model, trained, validated and written where
``guard_adapter: auto`` finds it.

Steps (rails/lab/guard_train.py says what each does): the rows of the pinned public sources and the project
(``guard_data.rows``; ``--max-rows`` takes an even share of every source, rail and label), the rails' own prompts
(``guard_train.examples``), one frozen forward of each prompt keeping the upper layers' states
(``guard_cache.keep``), the adapter on the upper layers trained on every training source (``guard_cache.train``)
and written at once, then, with ``--loso``, one adapter per held-out training source (on ``--fold-rows`` rows of
the others) for the strictness levels and the validation tables, and the frozen-state probe on the same splits
beside it; guard.json is written again with them. ``--all-layers`` trains an adapter on every layer instead
(``guard_train.train``: the whole prompt each epoch; a GPU's job, see tools/guard_gpu.sh).
"""

from __future__ import annotations

import collections
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .. import guard
from . import guard_train as gt


def even_sample(rows: list, n: int, seed: int = 0) -> list:
    """At most ``n`` rows, an even share of every (source, rail, label) cell (a cell smaller than its share gives
    what it has; the rest is shared among the others)."""
    cells = collections.defaultdict(list)
    for r in rows:
        cells[(r["source"], r["side"], bool(r["block"]))].append(r)
    rng = random.Random(seed)
    for v in cells.values():
        rng.shuffle(v)
    out, left, share = [], dict(cells), n
    while left and len(out) < n:
        share = max(1, (n - len(out)) // len(left))
        for k in list(left):
            take, left[k] = left[k][:share], left[k][share:]
            out.extend(take)
            if not left[k]:
                del left[k]
            if len(out) >= n:
                break
    return out[:n]


def _write(out: Path, lora, source, tok, weights, strictness, metrics, cfg) -> None:
    gt.write_guard(out, lora, source, tok, weights, strictness, metrics, cfg, source.label)


def main(args) -> int:
    import yaml

    from flashguard.config import EngineConfig, main_parameters
    from flashguard.engine import alora, loader

    from . import guard_cache as gc, guard_data

    t_start = time.perf_counter()
    params = main_parameters(yaml.safe_load((Path(args.config) / "config.yml").read_text()) or {})
    if args.model:
        params["model_path"] = args.model
    config = EngineConfig.from_parameters(params)
    source = loader.resolve_model(config.model_path, config.gguf_file)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = gt.TrainConfig(rank=args.rank, alpha=2.0 * args.rank if args.alpha is None else args.alpha,
                         epochs=args.epochs, lr=args.lr, max_tokens=args.max_tokens, seed=args.seed,
                         max_batch=args.batch)
    rows = guard_data.load(Path(args.rows)) if args.rows else \
        guard_data.rows(None if args.sources == "download" else Path(args.sources), log=lambda *_: None)
    if args.save_rows and not args.rows:
        guard_data.save(rows, Path(args.save_rows))
    if args.max_rows and len(rows) > args.max_rows:
        rows = even_sample(rows, args.max_rows, args.seed)
    model, tok = gt.load_training_model(source, device)
    exs = gt.examples(rows, tok, cfg.max_tokens)
    answers = guard.answer_tokens(tok)
    fit = [i for i, e in enumerate(exs) if e.train]
    print(f"flashguard train-guard: {source.label} on {device}: {len(exs)} prompts ({len(fit)} for training, "
          f"{sum(len(e.ids) for e in exs):,} tokens)", flush=True)
    out = Path(args.out) if args.out else alora.cache_dir() / alora.guard_folder_name(alora.model_file_key(source)[0])
    weights = [w.strip() for w in args.weights.split(",")]
    metrics: dict = {"rows": len(exs), "train_rows": len(fit), "sources": sorted({e.source for e in exs}),
                     "eval_only": sorted({e.source for e in exs if not e.train})}
    levels = {side: {"low": 0.5, "medium": 0.5, "high": 0.5} for side in ("input", "output")}
    if args.all_layers:
        lora = gt.train(model, exs, fit, answers, cfg)
        _write(out, lora, source, tok, weights, levels, metrics, cfg)
        print(f"guard written to {out} (all layers; no validation: --loso runs with the upper-layer adapter)")
        return 0
    first = gc.upper_layers(model, args.upper)
    t0 = time.perf_counter()
    kept = gc.keep(model, exs, first, log=lambda s: print(s, flush=True))
    metrics.update(first_layer=first, keep_seconds=round(time.perf_counter() - t0, 1))
    print(f"kept the upper {len(model.model.layers) - first} layers' states of {len(exs)} prompts "
          f"({kept.bytes / 2**30:.2f} GiB) in {metrics['keep_seconds']:.0f}s", flush=True)
    t0 = time.perf_counter()
    lora = gc.train(model, kept, fit, answers, cfg, log=lambda s: print(s, flush=True), label="[all] ")
    metrics["train_seconds"] = round(time.perf_counter() - t0, 1)
    _write(out, lora, source, tok, weights, levels, metrics, cfg)
    print(f"guard written to {out} in {time.perf_counter() - t_start:.0f}s (strictness levels still 0.5 until the "
          f"validation below)" if args.loso else f"guard written to {out}", flush=True)
    if not args.loso:
        return 0
    fold = gt.TrainConfig(**{**asdict(cfg), "epochs": args.fold_epochs})
    rng = random.Random(args.seed)
    oof = torch.full((len(exs),), float("nan"))
    names = sorted({e.source for e in exs if e.train})
    t0 = time.perf_counter()
    for k, name in enumerate(names):
        others = [i for i in fit if exs[i].source != name]
        if args.fold_rows and len(others) > args.fold_rows:
            others = sorted(rng.sample(others, args.fold_rows))
        held = [i for i, e in enumerate(exs) if e.source == name]
        fold_lora = gc.train(model, kept, others, answers, fold, log=lambda *_: None)
        for i, p in gc.score(model, kept, held, fold_lora, answers).items():
            oof[i] = p
        print(f"  [{k + 1}/{len(names)}] held out {name} ({len(held)} rows; {time.perf_counter() - t0:.0f}s)",
              flush=True)
    for i, p in gc.score(model, kept, [i for i, e in enumerate(exs) if not e.train], lora, answers).items():
        oof[i] = p
    metrics["fold_seconds"] = round(time.perf_counter() - t0, 1)
    rep = gt.report(exs, oof)
    probe = gt.report(exs, gc.probe_baseline(kept))
    metrics["loso"] = {side: {k: r[k] for k in ("rows", "harmful", "levels", "harmful_blocked_at_benign_blocked")}
                       for side, r in rep.items()}
    _write(out, lora, source, tok, weights, gt.strictness_table(rep), metrics, cfg)
    if args.report:
        Path(args.report).write_text(json.dumps({**metrics, "loso": rep, "probe_loso": probe,
                                                 "oof": oof.tolist(),
                                                 "rows_meta": [{"source": e.source, "side": e.side, "block": e.block,
                                                                "category": e.category, "train": e.train}
                                                               for e in exs]}, indent=1) + "\n", encoding="utf-8")
    for side, r in rep.items():
        at, pr = r["harmful_blocked_at_benign_blocked"], probe[side]["harmful_blocked_at_benign_blocked"]
        print(f"  {side}: harmful blocked at 1% / 5% benign blocked, leave one source out: adapter {at['1%']} / "
              f"{at['5%']}, frozen-state probe {pr['1%']} / {pr['5%']}", flush=True)
    print(f"guard written to {out} with its strictness levels in {time.perf_counter() - t_start:.0f}s", flush=True)
    return 0


def add_arguments(p, default_config: str = "configs/flash") -> None:
    p.add_argument("--config", default=default_config, help="the config folder whose model the guard is for")
    p.add_argument("--model", help="a model_path instead of the config's")
    p.add_argument("--sources", default="download", metavar="FOLDER",
                   help="the pinned source files: a folder laid out as <owner>/<name>/<path>, or 'download' (the "
                        "user cache, fetched from the pinned commits and checked by sha256)")
    p.add_argument("--rows", help="rows saved by --save-rows (gzip'd JSON lines) instead of the sources")
    p.add_argument("--save-rows", help="write the rows read from the sources to this file (third-party text)")
    p.add_argument("--out", help="the guard folder (default: the user cache, where guard_adapter: auto finds it)")
    p.add_argument("--device", default="auto", help="auto (a GPU where there is one), cpu, cuda or cuda:N")
    p.add_argument("--max-rows", type=int, default=6000,
                   help="rows used at most, an even share of every source, rail and label (default 6000)")
    p.add_argument("--upper", type=float, default=0.5, help="the share of upper layers the adapter holds (default "
                   "0.5, the shipped guard's shape: docs/benchmarks/guard_recipe.md chose it over the upper fifth)")
    p.add_argument("--rank", type=int, default=32, help="the adapter's rank (default 32, the shipped guard's shape; "
                   "flashguard plan sizes this adapter)")
    p.add_argument("--alpha", type=float, default=None, help="the adapter's alpha (default twice the rank, a "
                   "scale of 2, as the shipped guard's recipe: rails/lab/recipe.py)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512, help="a prompt's tokens at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loso", action="store_true", help="validate: one adapter per held-out training source; the "
                                                       "strictness levels come from it")
    p.add_argument("--fold-rows", type=int, default=1500, help="rows each held-out source's adapter trains on")
    p.add_argument("--fold-epochs", type=float, default=2.0)
    p.add_argument("--report", help="with --loso: the validation tables and every row's score, as JSON")
    p.add_argument("--all-layers", action="store_true", help="an adapter on every layer, trained on the whole "
                                                             "prompt each epoch (a GPU's job)")
    p.add_argument("--weights", default="float,int4",
                   help="the weights kinds the guard is declared for (guard.json); the rails refuse others")
