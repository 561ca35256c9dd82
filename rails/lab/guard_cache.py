"""Training the guard on kept states: one forward of the data, then every epoch and fold runs only the question.

The guard adapter here holds the upper decoder layers only (``first_layer`` and above). Below them nothing of the
prompt depends on the adapter, so one frozen forward of each prompt keeps all that training needs:

- the conversation's K/V in the upper layers (positions before the invocation), float16;
- the question's hidden states entering ``first_layer`` (the positions from the invocation on), float16;
- the question's mean state over the upper third of the layers, the frozen-state probe's features (the probe
  baseline reads them from the same forward).

A training step then runs the question through the upper layers alone, with the adapter on, attending the kept
K/V (``replay``): a few dozen tokens through a quarter of the model instead of the whole prompt through all of it,
so leave-one-source-out validation (one adapter per source) costs a fraction of one pass over the data. The
lower layers are replaced for that forward by pass-through modules and their cache entries by zeros nobody reads.
``replay`` gives the same logits as the whole prompt run with the adapter (``guard_train.forward_batch``; tested).

Contract: ``keep(model, exs, first_layer)`` -> ``Kept`` (needs prompts within every layer's attention window:
``guard_train.example`` cuts them to ``max_tokens``); ``replay(model, kept, idx, deltas)`` -> the last position's
logits ``[len(idx), vocab]``; ``train`` / ``score`` as ``guard_train``'s, over ``Kept``.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import guard_train as gt


@dataclass
class Kept:
    first_layer: int
    examples: list                      # guard_train.Example, one per kept prompt
    kv: list = field(default_factory=list)        # per example: [upper layers, 2, kv heads, T, head dim] fp16
    question: list = field(default_factory=list)  # per example: [S, d] fp16, the states entering first_layer
    features: list = field(default_factory=list)  # per example: [d] fp16, the probe baseline's features

    @property
    def bytes(self) -> int:
        return sum(t.numel() * 2 for part in (self.kv, self.question, self.features) for t in part)


def upper_layers(model, share: float = 0.25) -> int:
    """The first layer of the upper ``share`` of the decoder (the adapter's layers)."""
    n = len(model.model.layers)
    return n - max(1, round(n * share))


@torch.no_grad()
def keep(model, exs: Sequence[gt.Example], first_layer: int, log=print) -> Kept:
    """One frozen forward per prompt (batch 1: no padding), keeping what ``replay`` needs."""
    layers = model.model.layers
    n = len(layers)
    probe_layers = list(range(max(1, (2 * n) // 3), n))
    kept = Kept(first_layer, list(exs))
    t0 = time.perf_counter()
    for j, e in enumerate(exs):
        grab: dict = {}
        hooks = [layers[first_layer].register_forward_pre_hook(
            lambda m, args, kwargs: grab.__setitem__("q", (args[0] if args else kwargs["hidden_states"])[0, e.start:]
                                                     .clone()), with_kwargs=True)]
        sums: list = []
        for i in probe_layers:
            hooks.append(layers[i].register_forward_hook(
                lambda m, a, out: sums.append((out[0] if isinstance(out, tuple) else out)[0, e.start:].float()
                                              .mean(0))))
        try:
            out = model(input_ids=torch.tensor([e.ids]), use_cache=True, logits_to_keep=1)
        finally:
            for h in hooks:
                h.remove()
        cache = out.past_key_values
        kv = torch.stack([torch.stack([cache.layers[i].keys[0, :, :e.start], cache.layers[i].values[0, :, :e.start]])
                          for i in range(first_layer, n)]).half()
        kept.kv.append(kv)
        kept.question.append(grab["q"].half())
        kept.features.append(torch.stack(sums).mean(0).half())
        if (j + 1) % 500 == 0:
            log(f"  kept {j + 1} of {len(exs)} prompts ({time.perf_counter() - t0:.0f}s, "
                f"{kept.bytes / 2**30:.2f} GiB)")
    return kept


class _PassThrough(nn.Module):
    """A decoder layer left out of a replay: the hidden states go through unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


@contextlib.contextmanager
def _lower_layers_skipped(model, first_layer: int, question: torch.Tensor):
    """Layers below ``first_layer`` pass their input through, and ``first_layer`` receives ``question`` (the kept
    states) in place of what reaches it."""
    layers = model.model.layers
    saved = [layers[i] for i in range(first_layer)]
    for i in range(first_layer):
        layers[i] = _PassThrough()

    def swap(module, args, kwargs):
        if args:
            return (question,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": question}

    hook = layers[first_layer].register_forward_pre_hook(swap, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
        for i, layer in enumerate(saved):
            layers[i] = layer


def replay(model, kept: Kept, idx: Sequence[int], deltas=None) -> torch.Tensor:
    """The last position's logits of ``kept.examples[idx]`` (one rail: one question length) with ``deltas`` on the
    upper layers, from the kept states."""
    from transformers import DynamicCache

    from flashguard.engine.alora import activated
    from flashguard.engine.engine import cache_kwarg

    exs = [kept.examples[i] for i in idx]
    s = len(exs[0].ids) - exs[0].start
    if any(len(e.ids) - e.start != s for e in exs):
        raise ValueError("a batch's questions must have one length (one rail)")
    b, t = len(exs), max(e.start for e in exs)
    n = len(model.model.layers)
    first = kept.first_layer
    dtype = next(model.parameters()).dtype
    kvh, hd = kept.kv[idx[0]].shape[2], kept.kv[idx[0]].shape[4]
    mask = torch.zeros(b, t, dtype=torch.long)
    upper = torch.zeros(n - first, 2, b, kvh, t, hd, dtype=dtype)
    for r, i in enumerate(idx):
        length = kept.examples[i].start
        mask[r, t - length:] = 1
        upper[:, :, r, :, t - length:] = kept.kv[i].to(dtype)
    cache = DynamicCache(config=model.config)
    zeros = torch.zeros(1, 1, 1, 1, dtype=dtype).expand(b, kvh, t, hd)
    for layer in range(n):
        if layer < first:
            cache.update(zeros, zeros, layer)
        else:
            cache.update(upper[layer - first, 0], upper[layer - first, 1], layer)
    question = torch.stack([kept.question[i] for i in idx]).to(dtype)
    full = torch.cat([mask, torch.ones(b, s, dtype=torch.long)], 1)
    pos = mask.sum(1)[:, None] + torch.arange(s)[None]
    ids = torch.tensor([e.ids[e.start:] for e in exs])
    with _lower_layers_skipped(model, first, question), \
            (activated(model, deltas) if deltas is not None else contextlib.nullcontext()):
        out = model(input_ids=ids, attention_mask=full, position_ids=pos, cache_position=torch.arange(t, t + s),
                    **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


def _batches(kept: Kept, idx: Sequence[int], size: int, rng: random.Random | None):
    out = []
    for side in ("input", "output"):
        mine = [i for i in idx if kept.examples[i].side == side]
        if rng is not None:
            rng.shuffle(mine)
        mine.sort(key=lambda i: kept.examples[i].start // 64)
        out.extend(mine[a:a + size] for a in range(0, len(mine), size))
    if rng is not None:
        rng.shuffle(out)
    return out


def train(model, kept: Kept, idx: Sequence[int], answers: tuple[int, int], cfg: gt.TrainConfig, log=print,
          label: str = ""):
    """A ``TrainableLora`` on the upper layers, trained on ``kept.examples[idx]`` (``guard_train.train``'s loss,
    class weights and schedule)."""
    from flashguard.engine.alora import TrainableLora

    torch.manual_seed(cfg.seed)
    lora = TrainableLora(model, cfg.targets, cfg.rank, cfg.alpha, cfg.dropout, seed=cfg.seed,
                         first_layer=kept.first_layer)
    weights = gt.class_weights(kept.examples, idx)
    rng = random.Random(cfg.seed)
    per_epoch = len(_batches(kept, idx, cfg.max_batch, None))
    steps = max(1, int(per_epoch * cfg.epochs))
    opt = torch.optim.AdamW(lora.parameters(), lr=cfg.lr, weight_decay=0.0)
    warm = max(1, int(steps * cfg.warmup))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda st: min(1.0, (st + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, st / steps))))
    target = {1: answers[0], 0: answers[1]}
    step, t0, running = 0, time.perf_counter(), None
    while step < steps:
        for b in _batches(kept, idx, cfg.max_batch, rng):
            if step >= steps:
                break
            logits = replay(model, kept, b, lora.deltas())
            exs = [kept.examples[i] for i in b]
            y = torch.tensor([target[e.block] for e in exs])
            w = torch.tensor([weights[(e.side, e.block)] for e in exs])
            loss = (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
            if step % 200 == 0 or step == steps:
                log(f"  {label}step {step}/{steps} loss {running:.4f} ({time.perf_counter() - t0:.0f}s)")
    lora.eval()
    return lora


@torch.no_grad()
def score(model, kept: Kept, idx: Sequence[int], lora, answers: tuple[int, int], size: int = 32) -> dict:
    out = {}
    deltas = lora.deltas() if lora is not None else None
    for b in _batches(kept, idx, size, None):
        odds = gt.answer_logodds(replay(model, kept, b, deltas), answers)
        out.update(zip(b, torch.sigmoid(odds).tolist()))
    return out


def loso(model, kept: Kept, answers, cfg: gt.TrainConfig, log=print) -> torch.Tensor:
    """Every kept row's out-of-source p_unsafe (``guard_train.loso``'s rule): training sources by an adapter trained
    without them; evaluation-only ones are left NaN (the final adapter scores them)."""
    exs = kept.examples
    oof = torch.full((len(exs),), float("nan"))
    names = sorted({e.source for e in exs if e.train})
    for k, name in enumerate(names):
        fit = [i for i, e in enumerate(exs) if e.train and e.source != name]
        held = [i for i, e in enumerate(exs) if e.source == name]
        lora = train(model, kept, fit, answers, cfg, log=lambda *_: None)
        for i, p in score(model, kept, held, lora, answers).items():
            oof[i] = p
        log(f"  [{k + 1}/{len(names)}] held out {name}: {len(held)} rows")
    return oof


def probe_baseline(kept: Kept) -> torch.Tensor:
    """The frozen-state probe on the same rows and splits (``guard_train.probe_baseline``'s rule), from the features
    kept by the same forward."""
    mean = torch.stack(kept.features).float()[:, None, :]      # [n, 1, d]: one "layer", the upper third's mean
    return gt.probe_baseline(kept.examples, mean.expand(-1, 2, -1).contiguous(), mean, log=lambda *_: None)
