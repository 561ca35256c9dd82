"""A linear probe on the moderation suffix's hidden state: the output rail's calibrated verdict.

The output rail's forward pass over the turn's own cached tokens plus the moderation suffix ends on the token where
the model would answer the question (an input rail probe, ``rail: input``, reads the last token of the generation's
own prompt instead: where the model is about to answer the user). A logistic regression on that token's hidden state after one decoder
layer (optionally with the question's Yes/No log-odds as one more feature) reads the verdict from what the
model represents there, instead of from the two answer words a small model ranks badly. An output probe with
``features: last+mean`` (file format 2) also reads the mean of the suffix's states at that layer, from the
same forward (``moderation.suffix_state``).

A probe is one small JSON file, trained by ``flashguard calibrate`` (``rails/lab/calibrate.py``) on
``rails/data/moderation_tune.jsonl``. It is only valid for the model (and float/int4 weights) and the
question it was trained with; ``find_probe`` looks for it in the user cache folder, then among the probes
shipped in the package (the embedded SmolLM2's). A probe fitted on the public sources carries a strictness table
(``strictness``: low / medium / high -> threshold, measured on held-out benign rows); the config's ``strictness`` key
picks the row (``moderation.probe_threshold``). Files without one still load: the probe's own threshold decides.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from flashguard.errors import FlashguardError

from .state import rail_state

log = logging.getLogger("flashguard")

FORMAT = "flashguard-probe/1"
# format 2: an output probe that also reads the mean of the moderation suffix's states (``features``
# "last+mean", ``mean_over: suffix``). Version 1 files keep their meaning (``mean``: the user's message, input probes
# only) and are still written for every other probe, so code that knows only version 1 refuses a version 2 file
# instead of reading its mean as something else
FORMAT_2 = "flashguard-probe/2"
# format 3 (v9, the public-source probes): a pooling probe of either rail whose mean may be averaged over several
# layers (``mean_layers``), an output probe that reads the suffix's mean alone (``features: mean``) included
FORMAT_3 = "flashguard-probe/3"
FORMATS = (FORMAT, FORMAT_2, FORMAT_3)
SHIPPED_DIR = Path(__file__).resolve().parent / "probes"
CALIBRATE_HINT = "flashguard calibrate"
FEATURES = ("last", "mean", "last+mean")
# the ``strictness`` levels a config may name (custom_data.flashguard_moderation.strictness): a probe's table maps each
# to its threshold, from fewer blocks (low) to more (high); ``flashguard calibrate --sources`` measures them
STRICTNESS = ("low", "medium", "high")


class ProbeError(FlashguardError):
    """A probe file exists but cannot be used (unreadable, corrupt, or for another model / question)."""


@dataclass(frozen=True)
class ModelKey:
    """What a probe is valid for. ``identity`` is the engine's (path, size, mtime: this machine only);
    ``file`` + ``bytes`` match the same weights file on another machine (how shipped probes are found)."""

    identity: str
    file: str
    bytes: int
    weights: str  # "float" or "int4", with "+lora-<digest>" under an adapter (lora_path)

    @classmethod
    def of(cls, engine) -> "ModelKey":
        src = engine.source
        target = os.path.join(src.folder, src.gguf_file) if src.gguf_file else src.folder
        size = os.path.getsize(target) if os.path.isfile(target) else 0
        # lora_path: the adapter changes the hidden states a probe reads, so a base model's probe is not its probe
        adapter = engine.adapter
        lora = f"+lora-{adapter.digest[:12]}" if adapter is not None else ""
        return cls(identity=src.identity, file=os.path.basename(target.rstrip("/\\")), bytes=size,
                   weights=engine_weights(engine) + lora)

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.identity}|{self.weights}".encode()).hexdigest()[:16]


def engine_weights(engine) -> str:
    """``int4`` when the model runs Int4Linear layers (``weights: int4`` or an AWQ checkpoint), else ``float``."""
    return engine.weights_kind


@dataclass(frozen=True)
class Probe:
    """``p_unsafe = sigmoid(w . hidden[layer] + answer_weight * question_log_odds + bias)``; block at
    ``p_unsafe >= threshold``. ``weight`` applies to the raw hidden state (the training standardisation is
    folded in)."""

    layer: int
    weight: tuple[float, ...]
    bias: float
    answer_weight: float
    threshold: float
    question: str
    model_file: str
    model_bytes: int
    model_identity: str
    weights: str
    metrics: dict = field(default_factory=dict, compare=False)
    rail: str = "output"   # "output": the moderation suffix's last token; "input": the generation prompt's last token
    # what the weights read at ``layer``: "last" (the last token's state), "mean" (the mean of the states over the
    # user's last message, input probes only: ``moderation.message_start``) or "last+mean" (both, concatenated; an
    # output probe's mean is over the moderation suffix's positions: ``mean_over``, format 2)
    features: str = "last"
    # input probes: a message longer than ``window`` tokens is judged by its first and by its last ``window`` tokens,
    # each as the user's message in the same conversation (moderation.message_windows); 0: always the whole message
    window: int = 0
    # input probes, v5: a message longer than ``window`` tokens is judged in place, by sliding windows of ``window``
    # tokens (``long_window``) every ``stride`` over the states of the message's own forward (the generation's prefill) at
    # ``long_layer``: ``p = sigmoid(long_weight . mean(window) + long_bias)``, blocked when the largest reaches
    # ``long_threshold`` (calibrated for the max over a message's windows). Empty ``long_weight``: head+tail (v4)
    stride: int = 0
    long_window: int = 0
    long_layer: int = 0
    long_weight: tuple[float, ...] = ()
    long_bias: float = 0.0
    long_threshold: float = 0.5
    # the strictness levels' thresholds on p_unsafe (``STRICTNESS`` -> threshold; empty: the probe has no table and
    # decides at ``threshold`` whatever the config's level); ``long_strictness``: the same for the worst window of a
    # long message (input probes with window weights), in place of ``long_threshold``
    strictness: dict = field(default_factory=dict, compare=False)
    long_strictness: dict = field(default_factory=dict, compare=False)
    # a pooling probe's mean taken over several layers (the average of the mean states at each; v9, fitted on the
    # public sources: the suffix's or message's mean over the upper layers generalised across sources better than one
    # layer's); empty: ``layer`` alone
    mean_layers: tuple[int, ...] = ()

    @property
    def pool_layers(self) -> tuple[int, ...]:
        """The layers whose mean states a pooling probe averages (``mean_layers``, else ``layer``)."""
        return tuple(self.mean_layers) or (self.layer,)

    @property
    def pools(self) -> bool:
        return "mean" in self.features

    @property
    def mean_over(self) -> str:
        """What a pooling probe's mean covers: the user's message (input probes) or the moderation suffix (output
        probes, format 2); "" for a probe that reads the last state only."""
        return ("message" if self.rail == "input" else "suffix") if self.pools else ""

    @property
    def format(self) -> str:
        if self.mean_layers or (self.rail == "output" and self.features == "mean"):
            return FORMAT_3
        return FORMAT_2 if self.pools and self.rail == "output" else FORMAT

    @property
    def slides(self) -> bool:
        """Long messages are judged by sliding windows over their own states (``p_windows``)."""
        return bool(self.long_weight) and self.window > 0 and self.stride > 0 and self.long_window > 0

    def p_windows(self, means: torch.Tensor) -> torch.Tensor:
        """``means``: ``[windows, hidden_size]`` (the mean state of each window at ``long_layer``); P(unsafe) of each."""
        if means.shape[-1] != len(self.long_weight):
            raise ProbeError(f"the probe's window weights expect states of size {len(self.long_weight)}, the model "
                             f"gives {means.shape[-1]}; run `{CALIBRATE_HINT} --rail input` for this model")
        z = means.double() @ torch.tensor(self.long_weight, dtype=torch.float64) + self.long_bias
        return torch.sigmoid(z.clamp(-60, 60))

    def p_unsafe(self, hidden: torch.Tensor, answer_log_odds: float, pooled: Optional[torch.Tensor] = None) -> float:
        """``hidden``: ``[layers + 1, hidden_size]`` from ``Engine.next_token_state``; ``pooled``: the mean state
        at the probe's layer over the message (input probes) or the moderation suffix (output probes, format 2)
        (``[hidden_size]``), for a probe whose features use it."""
        width = hidden.shape[1] * (2 if self.features == "last+mean" else 1)
        if hidden.shape[0] <= self.layer or width != len(self.weight):
            raise ProbeError(f"the probe expects hidden states of size {len(self.weight)} at layer {self.layer}, "
                             f"the model gives {tuple(hidden.shape)}; run `{CALIBRATE_HINT}` for this model")
        if self.pools and pooled is None:
            raise ProbeError(f"the {self.features} probe needs the mean state over the {self.mean_over}")
        x = {"last": lambda: hidden[self.layer], "mean": lambda: pooled,
             "last+mean": lambda: torch.cat([hidden[self.layer], pooled])}[self.features]()
        z = float(x.double() @ torch.tensor(self.weight, dtype=torch.float64))
        z += self.answer_weight * answer_log_odds + self.bias
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def matches(self, key: ModelKey) -> bool:
        """Same weights: this machine's identity, or the same file name and size (a shipped probe)."""
        if self.weights != key.weights:
            return False
        return self.model_identity == key.identity or (self.model_file == key.file and self.model_bytes == key.bytes
                                                       and self.model_bytes > 0)

    # ---- file ---------------------------------------------------------------------------
    @property
    def digest(self) -> str:
        """What identifies this probe's weights (a guard measured with it names it: ``guard.pairing``)."""
        body = {k: v for k, v in self.to_json().items() if k not in ("metrics", "strictness", "threshold", "model")}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {"format": self.format, "layer": self.layer, "bias": self.bias, "answer_weight": self.answer_weight,
                "threshold": self.threshold, "question": self.question, "rail": self.rail, "features": self.features,
                **({"mean_over": self.mean_over} if self.format in (FORMAT_2, FORMAT_3) else {}),
                "window": self.window,
                **({"long": {"layer": self.long_layer, "window": self.long_window, "stride": self.stride,
                             "bias": self.long_bias,
                             "threshold": self.long_threshold,
                             **({"strictness": dict(self.long_strictness)} if self.long_strictness else {}),
                             "weight": [float(f"{w:.6g}") for w in self.long_weight]}} if self.long_weight else {}),
                "model": {"file": self.model_file, "bytes": self.model_bytes, "identity": self.model_identity,
                          "weights": self.weights},
                **({"strictness": dict(self.strictness)} if self.strictness else {}),
                **({"mean_layers": list(self.mean_layers)} if self.mean_layers else {}),
                "metrics": self.metrics, "weight": [float(f"{w:.6g}") for w in self.weight]}

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path, hint: str = CALIBRATE_HINT) -> "Probe":
        """Read a probe file; a missing key, a wrong type or a non-finite number is a ``ProbeError`` naming
        the file and the command that makes a new one."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            if data.get("format") not in FORMATS:
                raise ValueError(f"format is {data.get('format')!r}, expected one of {', '.join(map(repr, FORMATS))}")
            m = data["model"]
            probe = cls(layer=int(data["layer"]), weight=tuple(float(w) for w in data["weight"]),
                        bias=float(data["bias"]), answer_weight=float(data["answer_weight"]),
                        threshold=float(data["threshold"]), question=str(data["question"]),
                        model_file=str(m["file"]), model_bytes=int(m["bytes"]), model_identity=str(m["identity"]),
                        weights=str(m["weights"]), metrics=dict(data.get("metrics") or {}),
                        rail=str(data.get("rail", "output")), features=str(data.get("features", "last")),
                        window=int(data.get("window", 0)),
                        strictness=_levels(data.get("strictness"), "strictness"),
                        mean_layers=tuple(int(la) for la in data.get("mean_layers") or ()),
                        **({"long_layer": int(data["long"]["layer"]), "stride": int(data["long"]["stride"]),
                            "long_window": int(data["long"]["window"]),
                            "long_bias": float(data["long"]["bias"]),
                            "long_threshold": float(data["long"]["threshold"]),
                            "long_weight": tuple(float(w) for w in data["long"]["weight"]),
                            "long_strictness": _levels(data["long"].get("strictness"), "long.strictness")}
                           if "long" in data else {}))
            if "long" in data and not (probe.rail == "input" and probe.window > 0 and probe.stride > 0
                                       and probe.long_window > 0
                                       and probe.long_weight and 0 < probe.long_threshold < 1
                                       and all(math.isfinite(x) for x in probe.long_weight + (probe.long_bias,))):
                raise ValueError("long: window weights need an input probe with a window, a positive stride, finite "
                                 "weights and a threshold in (0, 1)")
            if probe.rail not in ("output", "input"):
                raise ValueError(f"rail is {probe.rail!r}, expected output or input")
            if data["format"] == FORMAT:   # version 1: a mean is the user's message's, input probes only
                if probe.features not in FEATURES or (probe.pools and probe.rail != "input"):
                    raise ValueError(f"features is {probe.features!r}, expected one of {', '.join(FEATURES)} "
                                     "(mean: input probes only)")
            elif data["format"] == FORMAT_3:   # version 3: a mean over the suffix (output) or message (input)
                if probe.features not in FEATURES or not probe.pools or data.get("mean_over") != probe.mean_over \
                        or any(la < 0 for la in probe.mean_layers):
                    raise ValueError(f"a {FORMAT_3} probe reads a mean ({probe.features!r} given) over the "
                                     f"{probe.mean_over or 'suffix or message'} (mean_over {data.get('mean_over')!r}) "
                                     f"at non-negative layers ({list(probe.mean_layers)})")
            elif not (probe.rail == "output" and probe.features == "last+mean" and data.get("mean_over") == "suffix"):
                # version 2: an output probe that reads the suffix's last state and its mean (nothing else yet)
                raise ValueError(f"a {FORMAT_2} probe is an output probe with features 'last+mean' and mean_over "
                                 f"'suffix', not rail {probe.rail!r}, features {probe.features!r}, mean_over "
                                 f"{data.get('mean_over')!r}")
            if probe.window < 0 or (probe.window and probe.rail != "input"):
                raise ValueError(f"window is {probe.window}, expected 0 or (input probes) a number of tokens")
            numbers = probe.weight + (probe.bias, probe.answer_weight, probe.threshold)
            if not probe.weight or not all(math.isfinite(x) for x in numbers) or not 0 < probe.threshold < 1 \
                    or probe.layer < 0:
                raise ValueError("empty weights, a non-finite number, a threshold outside (0, 1) or a negative layer")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                AttributeError) as exc:
            raise ProbeError(f"moderation probe {path} cannot be used ({type(exc).__name__}: {exc}); delete it and "
                             f"run `{hint}` to train a new one for this model") from exc
        return probe


def _levels(table, key: str) -> dict:
    """A probe file's strictness table (``key``: where it is in the file): absent or empty is ``{}`` (files written
    before the levels); else every level of ``STRICTNESS`` with a threshold in (0, 1), non-increasing from low to
    high (a stricter level never blocks less). A ``ValueError`` naming the key otherwise (``Probe.load`` names the
    file)."""
    if not table:
        return {}
    if not isinstance(table, dict) or set(table) != set(STRICTNESS):
        raise ValueError(f"{key} must map {', '.join(STRICTNESS)} to thresholds, got {table!r}")
    out = {level: float(table[level]) for level in STRICTNESS}
    if not all(math.isfinite(t) and 0 < t < 1 for t in out.values()):
        raise ValueError(f"{key}: every threshold must be in (0, 1), got {out}")
    if not out["low"] >= out["medium"] >= out["high"]:
        raise ValueError(f"{key}: the thresholds must not rise from low to medium to high (a stricter level blocks "
                         f"at least as much), got {out}")
    return out


def user_probe_path(key: ModelKey, side: str = "output") -> Path:
    """Where ``flashguard calibrate [--rail input]`` writes the probe of one model + weights on this machine."""
    from flashguard.engine.loader import user_cache_dir

    stem = Path(key.file).stem or "model"
    return user_cache_dir() / "probes" / f"{stem}-{key.weights}-{key.digest}{'-input' if side == 'input' else ''}.json"


def find_probe(engine, question: str, side: str = "output") -> tuple[Optional[Probe], str]:
    """The probe for ``engine``'s model and ``question`` (of the ``side`` rail: output or input): the user
    cache's, else a shipped one.

    Returns ``(probe, where)``; ``(None, why)`` when there is none (the caller falls back to the question).
    A file that exists but is corrupt raises ``ProbeError`` (naming it). Memoised per engine and question.
    """
    memo = rail_state(engine).probes
    if (side, question) in memo:
        return memo[(side, question)]
    hint = CALIBRATE_HINT + (" --rail input" if side == "input" else "")
    key = ModelKey.of(engine)
    mine = user_probe_path(key, side)
    candidates = [mine] + (sorted(SHIPPED_DIR.glob("*.json")) if SHIPPED_DIR.is_dir() else [])
    found: tuple[Optional[Probe], str] = (None, f"no {side} probe for {key.file} ({key.weights} weights) in "
                                                f"{mine} or the shipped ones")
    for path in candidates:
        if not path.is_file():
            continue
        probe = Probe.load(path, hint)
        if not probe.matches(key):
            if path == candidates[0]:
                raise ProbeError(f"moderation probe {path} was trained for another model ({probe.model_file}, "
                                 f"{probe.weights}); run `{hint}` again")
            continue
        if probe.rail != side:
            continue
        if side == "output" and probe.question != question:   # an input probe reads the prompt: no question
            found = (None, f"probe {path} was trained with the question {probe.question!r}, not {question!r}; "
                           f"run `{hint}` for this question")
            continue
        found = (probe, str(path))
        break
    memo[(side, question)] = found
    return found


# ---- training -----------------------------------------------------------------------------
def answer_log_odds(logprobs: torch.Tensor, bad_ids: Sequence[int], good_ids: Sequence[int]) -> float:
    """``log P(unsafe answer) - log P(safe answer)`` over the answers' spellings, clipped to [-20, 20]."""
    bad = torch.logsumexp(logprobs[list(bad_ids)].double(), 0).item()
    good = torch.logsumexp(logprobs[list(good_ids)].double(), 0).item()
    return max(-20.0, min(20.0, bad - good))


def fit_logistic(x: torch.Tensor, y: torch.Tensor, l2: float, iters: int = 200,
                 sample_weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, float]:
    """L2-regularised logistic regression on standardised ``x`` ``[n, d]``, labels ``y`` in {0, 1}
    (``sample_weight``: each row's weight in the loss, mean 1; default equal).

    Returns ``(weight[d], bias)`` on the *raw* features (standardisation folded in). Deterministic (LBFGS)."""
    x = x.double()
    y = y.double()
    sw = None if sample_weight is None else (sample_weight.double() / sample_weight.double().mean())
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mean) / std
    w = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=iters, tolerance_grad=1e-9, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y, weight=sw) + l2 * (w * w).sum() / 2
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    w_raw = (w / std).detach()
    return w_raw, float(b.detach() - (w_raw * mean).sum())


def folds(labels: Sequence[int], k: int, seed: int = 0, groups: Optional[Sequence] = None) -> list[list[int]]:
    """Stratified ``k`` folds of indices (deterministic). ``groups``: items with the same group go to the same fold
    (the output tuning set's long-paste copy of an exchange stays with the exchange: same reply, same fold); the
    groups are dealt out as the items are without them (with every group of one item, the same folds)."""
    if groups is not None:
        first: dict = {}
        for i, gr in enumerate(groups):
            first.setdefault(gr, i)
        heads = sorted(first.values())
        where = {groups[i]: n for n, i in enumerate(heads)}
        parts = folds([labels[i] for i in heads], k, seed)
        fold_of = {n: f for f, part in enumerate(parts) for n in part}
        out_g: list[list[int]] = [[] for _ in range(k)]
        for i, gr in enumerate(groups):
            out_g[fold_of[where[gr]]].append(i)
        return out_g
    g = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(k)]
    for cls in sorted(set(labels)):
        idx = [i for i, y in enumerate(labels) if y == cls]
        for j, p in enumerate(torch.randperm(len(idx), generator=g).tolist()):
            out[j % k].append(idx[p])
    return out


def design(hidden: torch.Tensor, log_odds: torch.Tensor, layer: int, use_answer: bool,
           features: str = "last", pooled: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Feature matrix ``[n, d (+ d) (+1)]`` from stacked states ``[n, layers + 1, d]`` (``pooled``: the message
    means, same shape, for ``features`` "mean" / "last+mean") and log-odds ``[n]``."""
    x = {"last": lambda: hidden[:, layer], "mean": lambda: pooled[:, layer],
         "last+mean": lambda: torch.cat([hidden[:, layer], pooled[:, layer]], 1)}[features]().double()
    return torch.cat([x, log_odds.double()[:, None]], 1) if use_answer else x


def cross_validate(hidden: torch.Tensor, log_odds: torch.Tensor, labels: Sequence[int], *, layers: Sequence[int],
                   l2s: Sequence[float], answer_options: Sequence[bool] = (False, True), k: int = 5,
                   pooled: Optional[torch.Tensor] = None, feature_options: Sequence[str] = ("last",),
                   groups: Optional[Sequence] = None) -> list[dict]:
    """Out-of-fold accuracy (threshold 0.5) for every (features, layer, l2, use_answer). Sorted best first; ties go
    to the stronger regularisation, then the earlier layer, then the order of ``feature_options``. ``groups``: items
    of one group are held out together (``folds``)."""
    y = torch.tensor(labels, dtype=torch.float64)
    parts = folds(labels, k, groups=groups)
    rows = []
    for layer, use_answer, features in [(a, b, c) for a in layers for b in answer_options for c in feature_options]:
        x = design(hidden, log_odds, layer, use_answer, features, pooled)
        for l2 in l2s:
            p = torch.empty(len(labels), dtype=torch.float64)
            for part in parts:
                test = torch.tensor(part)
                train = torch.tensor(sorted(set(range(len(labels))) - set(part)))
                w, b = fit_logistic(x[train], y[train], l2)
                p[test] = torch.sigmoid(x[test] @ w + b)
            acc = float(((p >= 0.5).double() == y).double().mean())
            rows.append({"layer": layer, "l2": l2, "use_answer": use_answer, "cv_accuracy": acc,
                         "oof_p": p, "features": features})
    order = {f: i for i, f in enumerate(feature_options)}
    rows.sort(key=lambda r: (-r["cv_accuracy"], -r["l2"], r["layer"], r["use_answer"], order[r["features"]]))
    return rows
