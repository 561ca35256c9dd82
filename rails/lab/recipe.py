"""The guard's recipe at scale (issue 47), as jobs over one work folder on one large GPU (tools/guard_gpu.sh runs
them side by side): the adapter on every layer against depth / rank / safe-share candidates, validation by
source groups, a full fine-tune of the same base as the upper bound, and the frozen-state probe on the same splits.

    python -m flashguard.rails.lab.recipe prepare WORK --model M --rows ROWS.jsonl.gz   # examples.pt
    python -m flashguard.rails.lab.recipe run WORK NAME --fit group:K|all [--rank R --first F --benign-weight B
                                                                           --full --seconds S]   # NAME.pt
    python -m flashguard.rails.lab.recipe probe WORK                                   # probe.pt
    python -m flashguard.rails.lab.recipe choose WORK                                  # prints the chosen NAME
    python -m flashguard.rails.lab.recipe collect WORK --out GUARD --recipe NAME       # report.json, the guard
    python -m flashguard.rails.lab.recipe resume GUARD N --rows ROWS --out GUARD2        # N more rows (CPU)
    python -m flashguard.rails.lab.recipe heldout GUARD [--also GUARD2] --rows ROWS      # evaluation-only sources

Validation: the training sources are split into ``GROUPS`` folds by kind (``KINDS``: each fold holds out about a
fifth of the harmful-request, jailbreak, hate-and-toxicity, reply and benign sources, so every fold still trains
on every kind), and a fold's rows (the rows made from them by rails/lab/made_rows.py included) are scored by an
adapter trained on the other folds. Candidates are compared on fold 0 (``sweep``); the chosen recipe runs the
other folds and the final adapter (every training row). Evaluation-only sources (license) are scored by the final
adapter. The strictness levels come from these out-of-source scores.

Contract: each job reads only examples.pt and writes its own file atomically; ``collect`` refuses a recipe with a
missing fold.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .. import guard
from . import guard_train as gt
from .guard_jobs import _load, _model_and_tokenizer, _save, prepare

GROUPS = 5

# every training source's kind (one line a source); a source not listed is "other"
KINDS = {
    "harmful_request": ("advbench", "pair_custom_behaviors", "harmbench", "strongreject", "ailuminate",
                        "simple_safety_tests", "catqa", "dangerousqa", "jailbreak_llms_questions", "aart"),
    "jailbreak": ("jailbreakbench", "jailbreak_llms_prompts", "gptfuzz", "prompt_injection"),
    "hate_toxic": ("toxigen", "davidson", "hatecheck", "edos", "toxic_spans", "convabuse", "ethos", "mlma"),
    "reply": ("harmbench_refusals", "harmbench_targets", "hh_rlhf"),
    "benign": ("coconot", "awesome_chatgpt_prompts", "gpteacher_roleplay", "cyberseceval_frr", "gsm8k",
               "gpteacher_code", "self_instruct", "humaneval", "medquad", "koala", "mt_bench", "project",
               "project_twins"),
}


def kind(source: str) -> str:
    base = source.split("_")[0] if source.startswith("jailbreakbench") else source
    for k, names in KINDS.items():
        if source in names or base in names:
            return k
    return "other"


def groups(exs) -> dict:
    """Training source -> fold (0 .. GROUPS-1): round-robin within each kind, sources sorted by name."""
    names = sorted({e.source for e in exs if e.train})
    out, turn = {}, {}
    for n in names:
        k = kind(n)
        out[n] = turn.get(k, 0) % GROUPS
        turn[k] = turn.get(k, 0) + 1
    return out


def split(exs, fit: str) -> tuple[list, list]:
    """(training indices, scored indices) for ``fit``: ``group:K`` or ``all`` (scored: the evaluation-only rows)."""
    if fit == "all":
        return [i for i, e in enumerate(exs) if e.train], [i for i, e in enumerate(exs) if not e.train]
    k = int(fit.split(":")[1])
    g = groups(exs)
    held = [i for i, e in enumerate(exs) if e.train and g[e.source] == k]
    return [i for i, e in enumerate(exs) if e.train and g[e.source] != k], held


# ---- the full fine-tune (the upper bound: no page sharing) ---------------------------------------------------

def _full_logits(model, batch):
    from . import guard_train

    device = next(model.parameters()).device
    ids, mask = guard_train._pad_left([e.ids for e in batch], 0, device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                use_cache=False, logits_to_keep=1)
    return out.logits[:, -1].float()


def train_full(model, exs, idx, answers, cfg: gt.TrainConfig, log=print, label=""):
    """Every weight but the embedding table trained on the whole prompt (the conversation too), the answer token's
    loss as the adapter's: what the base model can learn from these rows when nothing is shared."""
    for n, p in model.named_parameters():
        p.requires_grad_("embed" not in n and "lm_head" not in n)
    model.train()
    gt.fit_loop(model, model, lambda b: _full_logits(model, b), model.parameters(), exs, idx, answers, cfg, log, label)
    model.requires_grad_(False).eval()
    return model


@torch.no_grad()
def score_full(model, exs, idx, answers, cfg) -> dict:
    out = {}
    for b in gt.batches(exs, idx, cfg, None):
        odds = gt.answer_logodds(_full_logits(model, [exs[i] for i in b]), answers)
        out.update(zip(b, torch.sigmoid(odds).tolist()))
    return out


# ---- jobs -------------------------------------------------------------------------------------------------------

def run(work: Path, name: str, fit: str, device: str, cfg_over: dict, full: bool, below: float = 0.0) -> None:
    """One training job: ``fit`` rows (``split``), ``cfg_over`` on the prepared config, the adapter on the layers
    above the lowest ``below`` share (or every weight with ``full``); the scored rows' p_unsafe to NAME.pt, and with
    ``fit`` ``all`` the adapter to the folder NAME."""
    data, exs, cfg = _load(work)
    source, tok, model = _model_and_tokenizer(data["model"], device)
    cfg = gt.TrainConfig(**{**asdict(cfg), **cfg_over,
                            "first_layer": int(round(len(model.model.layers) * below))})
    train_idx, held = split(exs, fit)
    t0 = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if full:
        train_full(model, exs, train_idx, data["answers"], cfg, log, f"[{name}] ")
        scores = score_full(model, exs, held, data["answers"], cfg)
        steps, seen = model.steps, model.rows_seen
    else:
        lora = gt.train(model, exs, train_idx, data["answers"], cfg, log, f"[{name}] ")
        scores = gt.score(model, lora, exs, held, data["answers"], cfg)
        steps, seen = lora.steps, lora.rows_seen
        if fit == "all":
            lora.save(work / name, guard.invocation(tok), base_model=source.label)
    _save({"name": name, "fit": fit, "cfg": asdict(cfg), "full": full, "scores": scores, "train_rows": len(train_idx),
           "steps": steps, "rows_seen": seen, "seconds": time.perf_counter() - t0}, work / f"{name}.pt")
    print(f"{name}: {fit}, {len(train_idx)} rows ({seen} seen in {steps} steps), {len(held)} scored in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)


def probe(work: Path, device: str) -> None:
    """The frozen-state probe (``guard_train.probe_baseline``: its features and fit) on the same source groups."""
    data, exs, cfg = _load(work)
    _, _, model = _model_and_tokenizer(data["model"], device)
    t0 = time.perf_counter()
    mean, _ = gt.base_features(model, exs, cfg)
    g = groups(exs)
    oof = gt.probe_baseline(exs, mean, log=lambda s: print(s, flush=True), unit=lambda e: f"group {g[e.source]}")
    _save({"oof": oof, "seconds": time.perf_counter() - t0}, work / "probe.pt")
    print(f"probe: {len(exs)} rows in {time.perf_counter() - t0:.0f}s", flush=True)


# ---- the tables ---------------------------------------------------------------------------------------------------

def auc(p: torch.Tensor, y: torch.Tensor) -> float:
    """ROC AUC: the chance that a harmful row scores above a benign one (ties count half)."""
    pos, neg = p[y == 1].double(), p[y == 0].double().sort().values
    if not len(pos) or not len(neg):
        return float("nan")
    below = torch.searchsorted(neg, pos, right=False).double()
    upto = torch.searchsorted(neg, pos, right=True).double()
    return float(((below + upto) / 2).sum() / (len(pos) * len(neg)))


def at_benign(p: torch.Tensor, y: torch.Tensor, share: float) -> float:
    benign = p[y == 0].sort().values
    if not len(benign) or not (y == 1).any():
        return float("nan")
    t = float(benign[max(0, math.ceil(len(benign) * (1 - share)) - 1)]) + 1e-6
    return float((p[y == 1] >= t).double().mean())


def summary(exs, p: torch.Tensor, idx=None) -> dict:
    """Per rail: rows, ROC AUC, harmful blocked at 1% / 5% benign blocked, over ``idx`` (default: scored rows)."""
    out = {}
    for side in ("input", "output"):
        rows = [i for i, e in enumerate(exs) if e.side == side and (idx is None or i in idx) and not math.isnan(float(p[i]))]
        if not rows:
            continue
        q = p[rows].double()
        y = torch.tensor([exs[i].block for i in rows])
        out[side] = {"rows": len(rows), "auc": round(auc(q, y), 4), "at_1%": round(at_benign(q, y, 0.01), 4),
                     "at_5%": round(at_benign(q, y, 0.05), 4)}
    return out


def pair(pa: torch.Tensor, pp: torch.Tensor, w: float) -> torch.Tensor:
    lg = lambda p: torch.log(p.clamp(1e-6, 1 - 1e-6)) - torch.log1p(-p.clamp(1e-6, 1 - 1e-6))  # noqa: E731
    return torch.sigmoid(w * lg(pa) + (1 - w) * lg(pp))


def collect(work: Path, out: Path, recipe: str, weights: list[str]) -> dict:
    from flashguard.engine import alora

    data, exs, cfg = _load(work)
    runs = {f.stem: torch.load(f, weights_only=False) for f in sorted(work.glob("*.pt"))
            if f.stem not in ("examples", "probe")}

    def oof(prefix: str) -> torch.Tensor:
        p = torch.full((len(exs),), float("nan"))
        folds = [r for n, r in runs.items() if n.startswith(prefix + "-g")]
        for r in folds:
            for i, v in r["scores"].items():
                p[i] = v
        return p, len(folds)

    g = groups(exs)
    report: dict = {"rows": len(exs), "groups": g,
                    "runs": {n: {k: r[k] for k in ("fit", "train_rows", "steps", "rows_seen", "seconds", "full")}
                             | {"rank": r["cfg"]["rank"], "first_layer": r["cfg"]["first_layer"],
                                "benign_weight": r["cfg"]["benign_weight"]} for n, r in runs.items()}}
    g0 = {i for i, e in enumerate(exs) if e.train and g[e.source] == 0}
    report["sweep_fold0"] = {n: summary(exs, oof(n)[0], g0) for n in sorted({n.rsplit("-g", 1)[0] for n in runs
                                                                                  if "-g0" in n})}
    pa, n = oof(recipe)
    if n != GROUPS:
        raise SystemExit(f"collect: the recipe {recipe} has {n} of {GROUPS} folds")
    report["loso"] = {}
    for prefix in sorted({n.rsplit("-g", 1)[0] for n in runs if "-g" in n}):
        p, n = oof(prefix)
        if n == GROUPS:
            report["loso"][prefix] = summary(exs, p)
    if (work / "probe.pt").exists():
        pp = torch.load(work / "probe.pt", weights_only=False)["oof"]
        report["loso"]["probe"] = summary(exs, pp, {i for i, e in enumerate(exs) if e.train})
        both = torch.where(torch.tensor([e.side == "input" for e in exs]), pair(pa, pp, 0.8), pair(pa, pp, 0.6))
        report["loso"][f"{recipe}+probe"] = summary(exs, both)
    final = runs.get(f"{recipe}-all")
    if final:
        for i, v in final["scores"].items():
            pa[i] = v
    rep = gt.report(exs, pa)
    report["levels"] = {side: r["levels"] for side, r in rep.items()}
    report["per_source"] = {side: r["per_source"] for side, r in rep.items()}
    report["per_category"] = {side: r["per_category"] for side, r in rep.items()}
    made = sorted({e.made for e in exs if e.made})
    report["per_made"] = {m: summary(exs, pa, {i for i, e in enumerate(exs) if e.made == m}) for m in made}
    (work / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (work / "scores.json").write_text(json.dumps({"oof": pa.tolist(), "rows": [
        {"source": e.source, "side": e.side, "block": e.block, "category": e.category, "train": e.train,
         "made": e.made, "turns": e.ids[:e.start].count(e.ids[0]) if e.ids else 0} for e in exs]}) + "\n")
    if final:
        source, tok = _model_and_tokenizer(data["model"], tokenizer_only=True)
        out.mkdir(parents=True, exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (out / f).write_bytes((work / f"{recipe}-all" / f).read_bytes())
        name, size = alora.model_file_key(source)
        meta = {"format": alora.FORMAT, "version": time.strftime("%Y-%m-%d"), "model_file": name,
                "model_bytes": size, "model": source.label, "weights": weights, "questions": guard.QUESTIONS,
                "answers": guard.ANSWERS, "answer_ids": list(guard.answer_tokens(tok)), "tag": guard.TAG,
                "invocation": guard.invocation(tok), "strictness": gt.strictness_table(rep),
                "train": final["cfg"], "metrics": {"rows": len(exs), "train_rows": final["train_rows"],
                                                   "train_seconds": round(final["seconds"], 1),
                                                   "validation": "source groups (rails/lab/recipe.py)",
                                                   "loso": report["loso"]}}
        (out / alora.META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    for k, v in report["loso"].items():
        print(k, json.dumps(v), flush=True)
    return report


def load_adapter(folder: Path, model, targets=gt.TARGETS, dropout: float = 0.0):
    """A written guard adapter (PEFT files) as a ``TrainableLora`` on ``model``, to train further or to score."""
    from safetensors.torch import load_file

    from flashguard.engine.alora import TrainableLora, _PREFIX

    config = json.loads((folder / "adapter_config.json").read_text())
    first = min(config.get("layers_to_transform") or [0])
    lora = TrainableLora(model, targets, config["r"], config["lora_alpha"], dropout, first_layer=first)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, a, b in zip(lora.names, lora.a, lora.b):
            a.copy_(saved[f"{_PREFIX}{name}.lora_A.weight"].float())
            b.copy_(saved[f"{_PREFIX}{name}.lora_B.weight"].float())
    return lora


def heldout(folders: list, rows_path: Path, n: int, max_tokens: int, seed: int = 0, device: str = "cpu") -> None:
    """Guard folders side by side on ``n`` rows taken evenly from the evaluation-only sources of ``rows_path``
    (``train: no``: never trained on): per rail, ROC AUC and harmful / benign blocked at each guard's own
    ``medium`` (float weights, the training's scorer)."""
    from . import guard_data
    from .guard_command import even_sample

    _, tok, model = _model_and_tokenizer("embedded", device)
    rows = even_sample([r for r in guard_data.load(rows_path) if not r["train"]], n, seed)
    exs = gt.examples(rows, tok, max_tokens, log=lambda *_: None)
    cfg = gt.TrainConfig(max_tokens=max_tokens, batch_tokens=8192, max_batch=32)
    for folder in folders:
        folder = Path(folder)
        medium = {k: v["medium"] for k, v in json.loads((folder / "guard.json").read_text())["strictness"].items()}
        scores = gt.score(model, load_adapter(folder, model), exs, range(len(exs)), guard.answer_tokens(tok), cfg)
        p = torch.tensor([scores[i] for i in range(len(exs))])
        for side, v in summary(exs, p).items():
            rows_ = [i for i, e in enumerate(exs) if e.side == side]
            y = torch.tensor([exs[i].block for i in rows_])
            blocked = p[rows_] >= medium[side]
            hb = f"{float(blocked[y == 1].float().mean()):.1%}" if (y == 1).any() else "-"
            print(f"| {folder.name} | {side} | {v['rows']} | {v['auc']:.3f} | {hb} | "
                  f"{float(blocked[y == 0].float().mean()):.1%} |", flush=True)


def resume(guard_folder: Path, rows_path: Path, n: int, out: Path, lr: float, max_tokens: int, seed: int = 1,
           device: str = "cpu") -> None:
    """More training for a written guard adapter (``guard_folder``) on the CPU: ``n`` rows taken evenly from every
    training source, rail and label of ``rows_path`` (``guard_command.even_sample``), one epoch at ``lr``, the same
    loss and prompts; written to ``out`` with the same guard.json. For an adapter whose GPU run stopped early."""
    from . import guard_data
    from .guard_command import even_sample

    source, tok, model = _model_and_tokenizer("embedded", device)
    meta = json.loads((guard_folder / "guard.json").read_text())
    cfg = gt.TrainConfig(**{**meta["train"], "targets": tuple(meta["train"]["targets"]), "epochs": 1.0, "lr": lr,
                            "max_tokens": max_tokens, "max_seconds": 0.0, "seed": seed, "warmup": 0.1,
                            "batch_tokens": 8192, "max_batch": 32})
    lora = load_adapter(guard_folder, model, cfg.targets, cfg.dropout)
    rows = [r for r in guard_data.load(rows_path) if r["train"]]
    rows = even_sample(rows, n, seed)
    exs = gt.examples(rows, tok, max_tokens, log=lambda *_: None)
    t0 = time.perf_counter()
    gt.fit_loop(model, lora, lambda batch: gt.forward_batch(model, batch, lora.deltas()), lora.parameters(), exs,
                list(range(len(exs))), guard.answer_tokens(tok), cfg, lambda s: print(s, flush=True), "[resume] ")
    out.mkdir(parents=True, exist_ok=True)
    lora.save(out, guard.invocation(tok), base_model=source.label)
    meta["train"] = {**meta["train"], "resumed_on_cpu": {"rows": len(exs), "epochs": 1.0, "lr": lr,
                                                         "max_tokens": max_tokens,
                                                         "seconds": round(time.perf_counter() - t0, 1)}}
    (out / "guard.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    print(f"resume: {len(exs)} rows in {time.perf_counter() - t0:.0f}s, written to {out}", flush=True)


def choose(work: Path) -> str:
    """The sweep's choice: the candidate (``NAME-g0``, adapters only) blocking the most harmful rows at 5% benign
    blocked on fold 0, averaged over the two rails; ties go to the smaller rank."""
    data, exs, _ = _load(work)
    g = groups(exs)
    g0 = {i for i, e in enumerate(exs) if e.train and g[e.source] == 0}
    best = None
    for f in sorted(work.glob("*-g0.pt")):
        r = torch.load(f, weights_only=False)
        if r["full"]:
            continue
        p = torch.full((len(exs),), float("nan"))
        for i, v in r["scores"].items():
            p[i] = v
        s = summary(exs, p, g0)
        key = (sum(v["at_5%"] for v in s.values()) / max(1, len(s)), -r["cfg"]["rank"])
        print(f"{f.stem[:-3]}: {json.dumps(s)}", file=sys.stderr)
        if best is None or key > best[0]:
            best = (key, f.stem[:-3])
    if best is None:
        raise SystemExit("choose: no adapter ran on group 0")
    return best[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashguard.rails.lab.recipe")
    p.add_argument("job", choices=("prepare", "run", "probe", "choose", "collect", "resume", "heldout"))
    p.add_argument("work", type=Path)
    p.add_argument("name", nargs="?")
    p.add_argument("--model", default="embedded")
    p.add_argument("--rows", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--fit", default="all")
    p.add_argument("--rank", type=int)
    p.add_argument("--first", type=float, help="the share of layers below the adapter (0: every layer)")
    p.add_argument("--benign-weight", type=float)
    p.add_argument("--epochs", type=float)
    p.add_argument("--lr", type=float)
    p.add_argument("--seconds", type=float)
    p.add_argument("--batch-tokens", type=int)
    p.add_argument("--max-batch", type=int)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--full", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", type=Path)
    p.add_argument("--also", type=Path, action="append", default=[], help="heldout: another guard folder beside WORK")
    p.add_argument("--recipe", default="r32")
    p.add_argument("--weights", default="float,int4")
    a = p.parse_args(argv)
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if a.job == "prepare":
        prepare(a.work, a.model, a.rows, gt.TrainConfig(rank=32, alpha=64.0, max_tokens=a.max_tokens, epochs=1.0,
                                                        lr=1e-3), a.workers)
    elif a.job == "run":
        over = {k: v for k, v in (("rank", a.rank), ("benign_weight", a.benign_weight), ("epochs", a.epochs),
                                  ("lr", a.lr), ("max_seconds", a.seconds), ("batch_tokens", a.batch_tokens),
                                  ("max_batch", a.max_batch)) if v is not None}
        if a.rank is not None:
            over["alpha"] = 2.0 * a.rank
        run(a.work, a.name, a.fit, a.device, over, a.full, below=a.first or 0.0)
    elif a.job == "probe":
        probe(a.work, a.device)
    elif a.job == "heldout":   # WORK (and more): guard folders; NAME: rows; --rows
        heldout([a.work] + a.also, a.rows, 1200, a.max_tokens, device=a.device)
    elif a.job == "resume":   # WORK: the guard folder to train further; --rows; --out; --lr; --max-tokens
        resume(a.work, a.rows, int(a.name or 4000), a.out, a.lr or 3e-4, a.max_tokens, device=a.device)
    elif a.job == "choose":
        print(choose(a.work))
    else:
        collect(a.work, a.out or a.work / "guard", a.recipe, [w.strip() for w in a.weights.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
