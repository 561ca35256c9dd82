"""Training the guard: an activated LoRA that answers the rails' two questions on the conversation's own states.

``flashguard train-guard`` (``main``) runs these steps for any ``model_path``:

1. Rows: the public sources (``rails/lab/sources.py``, pinned and sha256-checked; ``train: no`` sources are scored,
   never trained on) and the project's own rows, each a conversation judged by one rail (``side``), as messages
   (``guard_data.py``).
2. Examples: each row through ``guard.guard_ids``, the prompts the rails build (the adapter starts at the question's
   tag), cut to ``max_tokens`` (the judged message keeps its head and its tail).
3. Training (``train``): the conversation runs once through the frozen base model without gradients (its K/V are
   what the rails' pages hold), then the question runs with the adapter's deltas on and the loss is the answer
   token's cross-entropy (``No`` = unsafe, ``Yes`` = safe), classes weighted equally within each rail. Only the
   question's few tokens carry gradients: training costs about one forward of the data per epoch.
4. Validation, the rule written first: leave one source out (``loso``). Every training source is scored by an
   adapter trained without it; evaluation-only sources by the adapter trained on all. The strictness levels are
   the thresholds at which 2% / 5% / 10% of the out-of-source benign scores of each rail are blocked
   (``guard_fit.operating_points``). A linear probe on the base model's frozen states of the same prompts is
   validated on the same splits beside it (``probe_baseline``).
5. The adapter trained on every training source is written with its ``guard.json`` (what it was made for, the
   questions, the answers' token ids, the strictness table, the validation's numbers) to the user cache (or
   ``--out``), where ``guard_adapter: auto`` finds it.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .. import guard

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainConfig:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple = TARGETS
    lr: float = 3e-4
    epochs: float = 2.0
    batch_tokens: int = 24576      # prefix tokens a batch holds at most (padded)
    max_batch: int = 48
    max_tokens: int = 1024          # a prompt's length at most (the judged message cut in the middle)
    warmup: float = 0.05
    seed: int = 0
    first_layer: int = 0            # the adapter holds layers first_layer.. (0: every layer)
    benign_weight: float = 1.0      # the allowed rows' weight against the blocked rows' (the safe share, tuned)
    max_seconds: float = 0.0        # > 0: fewer steps where the planned ones would take longer (the schedule follows)


@dataclass
class Example:
    ids: list
    start: int
    side: str
    block: int
    source: str
    category: str
    train: bool = True
    made: str = ""          # the rule that made the row (rails/lab/made_rows.py), "" for a source's own row


# ---- examples ---------------------------------------------------------------------------------------------------

def encoder(tokenizer) -> Callable[[list], list]:
    from flashguard.engine.encoding import MessageEncoder

    return MessageEncoder(tokenizer).encode


def _cut(text: str, tokenizer, keep: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= keep:
        return text
    head = keep // 2
    return tokenizer.decode(ids[:head]) + " ... " + tokenizer.decode(ids[-(keep - head):])


def example(row: dict, tokenizer, encode, max_tokens: int) -> Example:
    """A row (``messages``, ``side``, ``block``, ``category``, ``source``, ``train``) as the guard's prompt. A prompt
    over ``max_tokens`` has its longest message cut in the middle (head and tail kept) until it fits."""
    messages = [dict(m) for m in row["messages"]]
    ids, start = guard.guard_ids(encode, tokenizer, messages, row["side"])
    for _ in range(4):
        if len(ids) <= max_tokens:
            break
        longest = max(range(len(messages)), key=lambda i: len(messages[i]["content"]))
        over = len(ids) - max_tokens
        n = len(tokenizer(messages[longest]["content"], add_special_tokens=False)["input_ids"])
        messages[longest]["content"] = _cut(messages[longest]["content"], tokenizer, max(16, n - over - 8))
        ids, start = guard.guard_ids(encode, tokenizer, messages, row["side"])
    return Example(ids, start, row["side"], int(bool(row["block"])), row["source"], row.get("category", ""),
                   bool(row.get("train", True)), row.get("made", ""))


def examples(rows: Sequence[dict], tokenizer, max_tokens: int, log=print) -> list[Example]:
    encode = encoder(tokenizer)
    out, t0 = [], time.perf_counter()
    for i, r in enumerate(rows):
        out.append(example(r, tokenizer, encode, max_tokens))
        if (i + 1) % 10000 == 0:
            log(f"  tokenized {i + 1} of {len(rows)} rows ({time.perf_counter() - t0:.0f}s)")
    return out


# ---- batches ----------------------------------------------------------------------------------------------------

def batches(exs: Sequence[Example], idx: Sequence[int], cfg: TrainConfig, shuffle: Optional[random.Random]):
    """``idx`` in batches of one rail (their questions have one length) and similar prompt lengths, each holding at
    most ``cfg.batch_tokens`` padded prefix tokens; shuffled by ``shuffle`` (within length bands, and the order)."""
    out = []
    for side in ("input", "output"):
        mine = [i for i in idx if exs[i].side == side]
        if shuffle is not None:
            shuffle.shuffle(mine)
        mine.sort(key=lambda i: exs[i].start // 32)   # stable: shuffled within bands of 32 tokens
        batch: list = []
        for i in mine:
            longest = max([exs[j].start for j in batch] + [exs[i].start])
            if batch and (longest * (len(batch) + 1) > cfg.batch_tokens or len(batch) >= cfg.max_batch):
                out.append(batch)
                batch = []
            batch.append(i)
        if batch:
            out.append(batch)
    if shuffle is not None:
        shuffle.shuffle(out)
    return out


def _pad_left(seqs: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, n - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[r, n - len(s):] = 1
    return ids.to(device), mask.to(device)


def forward_batch(model, exs: Sequence[Example], deltas=None, *, hidden: bool = False):
    """The last position's logits ``[B, vocab]`` of each example's prompt: the conversation (``ids[:start]``)
    without gradients and without the adapter, then the question (``ids[start:]``, one length within a batch)
    with ``deltas`` on (``alora.activated``); ``hidden``: also the base states of the question's positions at every
    layer, ``[B, layers + 1, S, d]`` (for the probe baseline; ``deltas`` None then)."""
    from flashguard.engine.alora import activated
    from flashguard.engine.engine import cache_kwarg

    device = next(model.parameters()).device
    suffixes = [e.ids[e.start:] for e in exs]
    if len({len(s) for s in suffixes}) != 1:
        raise ValueError("a batch's questions must have one length (one rail)")
    pad = 0
    ids, mask = _pad_left([e.ids[:e.start] for e in exs], pad, device)
    lengths = mask.sum(1)
    kw = cache_kwarg(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    suffix = torch.tensor(suffixes, dtype=torch.long, device=device)
    s = suffix.shape[1]
    full = torch.cat([mask, torch.ones_like(suffix)], 1)
    pos = lengths[:, None] + torch.arange(s, device=device)[None]
    ctx = activated(model, deltas) if deltas is not None else _null()
    with ctx:
        out = model(input_ids=suffix, attention_mask=full, position_ids=pos, **{kw: cache}, use_cache=True,
                    logits_to_keep=1, output_hidden_states=hidden)
    logits = out.logits[:, -1].float()
    if hidden:
        return logits, torch.stack(out.hidden_states, 1)
    return logits


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def answer_logodds(logits: torch.Tensor, answers: tuple[int, int]) -> torch.Tensor:
    """``logit(No) - logit(Yes)``: the verdict's log-odds of unsafe."""
    return logits[:, answers[0]] - logits[:, answers[1]]


# ---- training ---------------------------------------------------------------------------------------------------

def class_weights(exs: Sequence[Example], idx: Sequence[int], benign: float = 1.0) -> dict:
    """(side, label) -> weight: each rail's harmful and benign rows weigh alike in total (the benign ones
    ``benign`` times that)."""
    counts: dict = {}
    for i in idx:
        key = (exs[i].side, exs[i].block)
        counts[key] = counts.get(key, 0) + 1
    sides = {k[0] for k in counts}
    total = len(idx)
    return {k: total / (len(sides) * 2 * c) * (benign if k[1] == 0 else 1.0) for k, c in counts.items()}


def train(model, exs: Sequence[Example], idx: Sequence[int], answers: tuple[int, int], cfg: TrainConfig,
          log=print, label: str = ""):
    """A ``TrainableLora`` trained on ``exs[idx]`` (see the module docstring)."""
    from flashguard.engine.alora import TrainableLora

    torch.manual_seed(cfg.seed)
    device = next(model.parameters()).device
    lora = TrainableLora(model, cfg.targets, cfg.rank, cfg.alpha, cfg.dropout, seed=cfg.seed,
                         first_layer=cfg.first_layer).to(device)
    return fit_loop(model, lora, lambda batch: forward_batch(model, batch, lora.deltas()), lora.parameters(), exs,
                    idx, answers, cfg, log, label)


def fit_loop(model, module, logits_of, params, exs, idx, answers, cfg: TrainConfig, log=print, label: str = ""):
    """The training loop shared by the adapter (``train``) and the lab's full fine-tune: AdamW, warm-up and a
    cosine schedule over the planned steps (fewer where ``cfg.max_seconds`` would be passed: the rate is measured
    on the first 20 steps and the schedule follows the new count), the answer token's weighted cross-entropy."""
    params = [p for p in params if p.requires_grad]
    device = next(model.parameters()).device
    weights = class_weights(exs, idx, cfg.benign_weight)
    rng = random.Random(cfg.seed)
    epoch_batches = batches(exs, idx, cfg, rng)
    plan = [max(1, int(len(epoch_batches) * cfg.epochs))]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    warm = max(1, int(plan[0] * cfg.warmup))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / plan[0]))))
    target = {1: answers[0], 0: answers[1]}
    t0, seen, running = time.perf_counter(), 0, 0.0
    model.eval()
    step = 0
    while step < plan[0]:
        for b in epoch_batches:
            if step >= plan[0]:
                break
            batch = [exs[i] for i in b]
            logits = logits_of(batch)
            y = torch.tensor([target[e.block] for e in batch], device=device)
            w = torch.tensor([weights[(e.side, e.block)] for e in batch], device=device)
            loss = (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            seen += len(batch)
            running = 0.98 * running + 0.02 * loss.item() if step > 1 else loss.item()
            if cfg.max_seconds and step == 20:
                rate = (time.perf_counter() - t0) / step
                fits = step + int((cfg.max_seconds - (time.perf_counter() - t0)) / rate)
                if fits < plan[0]:
                    log(f"  {label}{plan[0]} steps would take {plan[0] * rate:.0f}s: {fits} within {cfg.max_seconds:.0f}s")
                    plan[0] = max(step + 1, fits)
            if step % 200 == 0 or step == plan[0]:
                log(f"  {label}step {step}/{plan[0]} loss {running:.4f} ({seen} rows, {time.perf_counter() - t0:.0f}s)")
        epoch_batches = batches(exs, idx, cfg, rng)
    module.eval()
    module.steps, module.rows_seen = step, seen
    return module


@torch.no_grad()
def score(model, lora, exs: Sequence[Example], idx: Sequence[int], answers: tuple[int, int],
          cfg: TrainConfig) -> dict:
    """idx -> p_unsafe under ``lora``."""
    out = {}
    deltas = lora.deltas() if lora is not None else None
    for b in batches(exs, idx, cfg, None):
        odds = answer_logodds(forward_batch(model, [exs[i] for i in b], deltas), answers)
        for i, o in zip(b, torch.sigmoid(odds).tolist()):
            out[i] = o
    return out


# ---- validation -------------------------------------------------------------------------------------------------

def loso(model, exs: Sequence[Example], answers, cfg: TrainConfig, fold_cfg: TrainConfig, log=print,
         max_rows: Optional[int] = None) -> torch.Tensor:
    """Every row's out-of-source p_unsafe: a training source's rows by an adapter trained on the other training
    sources (``fold_cfg``; at most ``max_rows`` rows, taken evenly), evaluation-only sources' by the adapter trained
    on all (``cfg``). Returns ``[len(exs)]`` and the final adapter."""
    names = sorted({e.source for e in exs if e.train})
    oof = torch.full((len(exs),), float("nan"))
    for k, name in enumerate(names):
        fit = [i for i, e in enumerate(exs) if e.train and e.source != name]
        if max_rows and len(fit) > max_rows:
            fit = random.Random(k).sample(fit, max_rows)
        held = [i for i, e in enumerate(exs) if e.source == name]
        lora = train(model, exs, fit, answers, fold_cfg, log=log, label=f"[{k + 1}/{len(names)} {name}] ")
        for i, p in score(model, lora, exs, held, answers, cfg).items():
            oof[i] = p
        log(f"  held out {name}: {len(held)} rows scored")
        del lora
    return oof


@torch.no_grad()
def base_features(model, exs: Sequence[Example], cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen base model's states on each prompt: the question's mean state at every layer ``[n, L + 1, d]``
    and the last token's ``[n, L + 1, d]`` (what the rails' probes read), float16 on the CPU."""
    mean = last = None
    for b in batches(exs, range(len(exs)), cfg, None):
        _, h = forward_batch(model, [exs[i] for i in b], None, hidden=True)
        if mean is None:
            n, layers, d = len(exs), h.shape[1], h.shape[-1]
            mean = torch.zeros(n, layers, d, dtype=torch.float16)
            last = torch.zeros(n, layers, d, dtype=torch.float16)
        idx = torch.tensor(b)
        mean[idx] = h.float().mean(2).half().cpu()
        last[idx] = h[:, :, -1].half().cpu()
    return mean, last


def probe_baseline(exs: Sequence[Example], mean: torch.Tensor, last: torch.Tensor | None = None, log=print,
                   unit: Callable[[Example], str] = lambda e: e.source) -> torch.Tensor:
    """The frozen-state probe on the same prompts and splits: per rail, a logistic regression (L2 0.1, classes
    weighted alike) on the question's mean state averaged over the upper third of the layers (the shipped output
    probe's features), each held-out ``unit`` of training rows (default: a source, as the adapter's leave one
    source out; the GPU recipe passes its source groups) fitted on the other training rows, evaluation-only rows on
    all of them. Returns every row's out-of-unit p_unsafe."""
    from .guard_fit import class_weights
    from ..probe import fit_logistic

    top = mean.shape[1] - 1
    upper = list(range(max(1, (2 * top) // 3), top + 1))
    x_all = mean[:, upper].double().mean(1)
    oof = torch.full((len(exs),), float("nan"), dtype=torch.float64)
    for side in ("input", "output"):
        rows = [i for i, e in enumerate(exs) if e.side == side]
        if not rows:
            continue
        x = x_all[rows]
        y = torch.tensor([exs[i].block for i in rows], dtype=torch.float64)
        src = [unit(exs[i]) if exs[i].train else "(evaluation only) " + exs[i].source for i in rows]
        names = {s for s, i in zip(src, rows) if exs[i].train}
        trainable = torch.tensor([exs[i].train for i in rows])
        for name in sorted(set(src)):
            held = torch.tensor([s == name for s in src])
            fit = ~held & trainable if name in names else trainable
            w, b = fit_logistic(x[fit], y[fit], 0.1, sample_weight=class_weights(y[fit]))
            oof[torch.tensor(rows)[held]] = torch.sigmoid(x[held] @ w + b)
        log(f"  probe baseline ({side}): {len(rows)} rows, {len(names)} held-out units of training rows")
    return oof.float()


def report(exs: Sequence[Example], oof: torch.Tensor) -> dict:
    """Per rail: the strictness levels (guard_fit.operating_points on the out-of-source scores) with harmful
    blocked at 1% / 2% / 5% / 10% benign blocked, and per source and per category at medium."""
    from .guard_fit import operating_points, rates

    out = {}
    for side in ("input", "output"):
        rows = [i for i, e in enumerate(exs) if e.side == side and not math.isnan(float(oof[i]))]
        if not rows:
            continue
        p = oof[rows].double()
        labels = [exs[i].block for i in rows]
        levels = operating_points(p, labels, [])
        at = {}
        benign = p[torch.tensor(labels) == 0].sort().values
        harmful = p[torch.tensor(labels) == 1]
        for share in (0.01, 0.02, 0.05, 0.10):
            k = max(0, math.ceil(len(benign) * (1 - share)) - 1)
            t = float(benign[k]) + 1e-6 if len(benign) else 0.5
            at[f"{share:.0%}"] = round(float((harmful >= t).double().mean()), 4) if len(harmful) else None
        dicts = [{"source": exs[i].source, "category": exs[i].category or "-", "block": exs[i].block} for i in rows]
        medium = levels["medium"]["threshold"]
        out[side] = {"rows": len(rows), "harmful": int(sum(labels)), "levels": levels,
                     "harmful_blocked_at_benign_blocked": at,
                     "per_source": rates(p, dicts, medium), "per_category": rates(p, dicts, medium, "category")}
    return out


# ---- writing the guard ------------------------------------------------------------------------------------------

def write_guard(folder: Path, lora, source, tokenizer, weights: Sequence[str], strictness: dict, metrics: dict,
                cfg: TrainConfig, label: str) -> Path:
    """The adapter (PEFT files, activated from the tag) and its ``guard.json``."""
    from flashguard.engine import alora

    folder = Path(folder)
    name, size = alora.model_file_key(source)
    lora.save(folder, guard.invocation(tokenizer), base_model=label)
    meta = {"format": alora.FORMAT, "version": time.strftime("%Y-%m-%d"), "model_file": name, "model_bytes": size,
            "model": label, "weights": list(weights), "questions": guard.QUESTIONS, "answers": guard.ANSWERS,
            "answer_ids": list(guard.answer_tokens(tokenizer)), "tag": guard.TAG,
            "invocation": guard.invocation(tokenizer), "strictness": strictness, "train": asdict(cfg),
            "metrics": metrics}
    tmp = folder / (alora.META_FILE + ".part")
    tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    tmp.replace(folder / alora.META_FILE)
    return folder


def strictness_table(rep: dict) -> dict:
    return {side: {level: v["threshold"] for level, v in r["levels"].items()} for side, r in rep.items()}


# ---- the model ---------------------------------------------------------------------------------------------------

def load_training_model(source, device: torch.device):
    """The base model for training: float32 weights as the file stores them (a GGUF dequantized), frozen, on
    ``device``; with the engine's tokenizer (a model without a chat template gets the engine's plain one)."""
    from flashguard.engine import loader
    from flashguard.engine.engine import PLAIN_CHAT_TEMPLATE

    model, tokenizer = loader.load(source, device, torch.float32, "float")
    if getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    model.requires_grad_(False).eval()
    return model, tokenizer
