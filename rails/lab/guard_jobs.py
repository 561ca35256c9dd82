"""``flashguard train-guard``'s steps as separate jobs over one work folder, so that a machine with one large GPU
runs the leave-one-source-out folds side by side (tools/guard_gpu.sh). The same functions as ``guard_train.main``,
in this order:

    python -m flashguard.rails.lab.guard_jobs prepare WORK --model PATH --rows ROWS.jsonl.gz   # examples.pt
    python -m flashguard.rails.lab.guard_jobs fold WORK --part 0 --of 4                        # fold_*.pt (any order)
    python -m flashguard.rails.lab.guard_jobs final WORK [--probe-baseline]                    # final/ and final.pt
    python -m flashguard.rails.lab.guard_jobs collect WORK --out GUARD_FOLDER                  # report.json, guard.json

Contract: each job reads only what earlier jobs wrote in WORK and writes its own files atomically; ``fold`` jobs
with different ``--part`` never share a source; ``collect`` refuses to run while a training source has no fold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .. import guard
from . import guard_train as gt


def _save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _tokenize_part(args):
    rows, model, max_tokens = args
    _, tokenizer = _model_and_tokenizer(model, tokenizer_only=True)
    return gt.examples(rows, tokenizer, max_tokens, log=lambda *_: None)


def _model_and_tokenizer(model_path: str, device: str = "cpu", tokenizer_only: bool = False):
    from flashguard.engine import loader
    from flashguard.engine.engine import PLAIN_CHAT_TEMPLATE

    source = loader.resolve_model(model_path if model_path != "embedded" else None)
    if tokenizer_only:
        tok = loader.load_tokenizer(source)
        tok = tok[0] if isinstance(tok, tuple) else tok
        if getattr(tok, "chat_template", None) is None:
            tok.chat_template = PLAIN_CHAT_TEMPLATE
        return source, tok
    model, tok = gt.load_training_model(source, torch.device(device))
    return source, tok, model


def prepare(work: Path, model: str, rows_path: Path, cfg: gt.TrainConfig, workers: int = 8) -> None:
    from multiprocessing import get_context

    from . import guard_data

    t0 = time.perf_counter()
    rows = guard_data.load(rows_path)
    chunks = [rows[i::workers] for i in range(workers)]
    with get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_tokenize_part, [(c, model, cfg.max_tokens) for c in chunks])
    exs = [None] * len(rows)
    for k, part in enumerate(parts):
        for j, e in enumerate(part):
            exs[k + j * workers] = e
    source, tok, _ = _model_and_tokenizer(model, "cpu")   # a GGUF's float copy made once, before the jobs share it
    work.mkdir(parents=True, exist_ok=True)
    _save({"examples": [asdict(e) for e in exs], "model": model, "cfg": asdict(cfg),
           "answers": guard.answer_tokens(tok)}, work / "examples.pt")
    print(f"prepare: {len(exs)} examples, {sum(len(e.ids) for e in exs):,} tokens in {time.perf_counter() - t0:.0f}s",
          flush=True)


def _load(work: Path):
    data = torch.load(work / "examples.pt", weights_only=False)
    exs = [gt.Example(**e) for e in data["examples"]]
    return data, exs, gt.TrainConfig(**{**data["cfg"], "targets": tuple(data["cfg"]["targets"])})


def training_sources(exs) -> list[str]:
    return sorted({e.source for e in exs if e.train})


def fold(work: Path, part: int, of: int, device: str, fold_epochs: float, fold_rows: int | None) -> None:
    import random

    data, exs, cfg = _load(work)
    fold_cfg = gt.TrainConfig(**{**asdict(cfg), "epochs": fold_epochs})
    _, _, model = _model_and_tokenizer(data["model"], device)
    names = training_sources(exs)
    for k, name in enumerate(names):
        if k % of != part or (work / f"fold_{name}.pt").exists():
            continue
        t0 = time.perf_counter()
        fit = [i for i, e in enumerate(exs) if e.train and e.source != name]
        if fold_rows and len(fit) > fold_rows:
            fit = sorted(random.Random(k).sample(fit, fold_rows))
        held = [i for i, e in enumerate(exs) if e.source == name]
        lora = gt.train(model, exs, fit, data["answers"], fold_cfg, log=lambda s: print(s, flush=True),
                        label=f"[{name}] ")
        scores = gt.score(model, lora, exs, held, data["answers"], cfg)
        _save({"source": name, "scores": scores, "rows": len(fit), "seconds": time.perf_counter() - t0},
              work / f"fold_{name}.pt")
        print(f"fold {name}: trained on {len(fit)} rows, {len(held)} scored in {time.perf_counter() - t0:.0f}s",
              flush=True)


def final(work: Path, device: str, probe_baseline: bool) -> None:
    data, exs, cfg = _load(work)
    source, tok, model = _model_and_tokenizer(data["model"], device)
    t0 = time.perf_counter()
    fit = [i for i, e in enumerate(exs) if e.train]
    lora = gt.train(model, exs, fit, data["answers"], cfg, log=lambda s: print(s, flush=True), label="[all] ")
    seconds = time.perf_counter() - t0
    lora.save(work / "final", guard.invocation(tok), base_model=source.label)
    evaluation = [i for i, e in enumerate(exs) if not e.train]
    scores = gt.score(model, lora, exs, evaluation, data["answers"], cfg)
    out = {"scores": scores, "train_seconds": seconds, "train_rows": len(fit)}
    if probe_baseline:
        mean, last = gt.base_features(model, exs, cfg)
        out["probe_oof"] = gt.probe_baseline(exs, mean, last, log=lambda s: print(s, flush=True))
    _save(out, work / "final.pt")
    print(f"final: trained on {len(fit)} rows in {seconds:.0f}s", flush=True)


def collect(work: Path, out: Path, weights: list[str]) -> dict:
    from flashguard.engine import alora
    from flashguard.engine.alora import TrainableLora  # noqa: F401 - the saved folder is read by name below

    data, exs, cfg = _load(work)
    names = training_sources(exs)
    missing = [n for n in names if not (work / f"fold_{n}.pt").exists()]
    if missing:
        raise SystemExit(f"collect: no fold yet for {', '.join(missing)}")
    oof = torch.full((len(exs),), float("nan"))
    fold_seconds = 0.0
    for n in names:
        f = torch.load(work / f"fold_{n}.pt", weights_only=False)
        fold_seconds += f["seconds"]
        for i, p in f["scores"].items():
            oof[i] = p
    fin = torch.load(work / "final.pt", weights_only=False)
    for i, p in fin["scores"].items():
        oof[i] = p
    rep = gt.report(exs, oof)
    metrics = {"rows": len(exs), "train_rows": fin["train_rows"], "train_seconds": round(fin["train_seconds"], 1),
               "fold_seconds": round(fold_seconds, 1), "sources": sorted({e.source for e in exs}),
               "eval_only": sorted({e.source for e in exs if not e.train}), "loso": rep}
    if "probe_oof" in fin:
        metrics["probe_loso"] = gt.report(exs, fin["probe_oof"])
    source, tok = _model_and_tokenizer(data["model"], tokenizer_only=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (out / f).write_bytes((work / "final" / f).read_bytes())
    name, size = alora.model_file_key(source)
    meta = {"format": alora.FORMAT, "version": time.strftime("%Y-%m-%d"), "model_file": name, "model_bytes": size,
            "model": source.label, "weights": weights, "questions": guard.QUESTIONS, "answers": guard.ANSWERS,
            "answer_ids": list(guard.answer_tokens(tok)), "tag": guard.TAG, "invocation": guard.invocation(tok),
            "strictness": gt.strictness_table(rep), "train": asdict(cfg),
            "metrics": {k: v for k, v in metrics.items() if k not in ("loso", "probe_loso")} | {
                "loso": {side: {k: r[k] for k in ("rows", "harmful", "levels", "harmful_blocked_at_benign_blocked")}
                         for side, r in rep.items()}}}
    (out / alora.META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    (work / "report.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    scores = {"oof": oof.tolist(), "probe_oof": fin["probe_oof"].tolist() if "probe_oof" in fin else None,
              "rows": [{"source": e.source, "side": e.side, "block": e.block, "category": e.category,
                        "train": e.train} for e in exs]}
    (work / "scores.json").write_text(json.dumps(scores) + "\n", encoding="utf-8")
    for side, r in rep.items():
        print(f"{side}: harmful blocked at 1/2/5/10% benign blocked: {r['harmful_blocked_at_benign_blocked']}"
              + (f"; probe {metrics['probe_loso'][side]['harmful_blocked_at_benign_blocked']}"
                 if "probe_loso" in metrics else ""), flush=True)
    return metrics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashguard.rails.lab.guard_jobs")
    p.add_argument("job", choices=("prepare", "fold", "final", "collect"))
    p.add_argument("work", type=Path)
    p.add_argument("--model", default="embedded")
    p.add_argument("--rows", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--part", type=int, default=0)
    p.add_argument("--of", type=int, default=1)
    p.add_argument("--fold-epochs", type=float, default=1.0)
    p.add_argument("--fold-rows", type=int, default=None)
    p.add_argument("--probe-baseline", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--weights", default="float,int4")
    p.add_argument("--rank", type=int, default=gt.TrainConfig.rank)
    p.add_argument("--epochs", type=float, default=gt.TrainConfig.epochs)
    p.add_argument("--lr", type=float, default=gt.TrainConfig.lr)
    p.add_argument("--workers", type=int, default=8)
    a = p.parse_args(argv)
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if a.job == "prepare":
        prepare(a.work, a.model, a.rows, gt.TrainConfig(rank=a.rank, epochs=a.epochs, lr=a.lr), a.workers)
    elif a.job == "fold":
        fold(a.work, a.part, a.of, a.device, a.fold_epochs, a.fold_rows)
    elif a.job == "final":
        final(a.work, a.device, a.probe_baseline)
    else:
        collect(a.work, a.out, [w.strip() for w in a.weights.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
