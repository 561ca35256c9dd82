"""``flashguard calibrate``: train the moderation probe for the model ``model_path`` points at.

    flashguard calibrate [--config DIR] [--weights float|int4] [--rail output|input] [--out FILE]

Runs every labelled (user, reply) of ``rails/data/moderation_tune.jsonl`` through the model exactly as the
rail does (the chat template, the reply's tokens, the moderation suffix), keeps the hidden states of the
suffix's last token, chooses the layer, the L2 strength and whether to add the question's Yes/No log-odds by
5-fold cross-validation on that set only, fits the chosen probe on all of it and writes it to the user cache
folder, where the rail finds it for that model (and those weights). The test set (tests/data) is never read.

``--rail input`` trains the input rail's probe the same way on ``rails/data/moderation_input_tune.jsonl`` (user
messages: harmful requests, jailbreaks, prompt injections and benign look-alikes, and long pasted documents, code
and logs with and without harm hidden in them), on the hidden states of the generation's own prompt (the
conversation up to the message, and the template's generation prompt): the mean over the user's turn, the last
token's, or both (``FEATURE_OPTIONS``, chosen with the layer and L2 by cross-validation); no question, so the check
is the generation's own prefill. A message longer than ``WINDOW`` tokens trains (and is judged) as its first and
its last ``WINDOW`` tokens. Every other message follows one benign exchange (``earlier_exchange``), as a message in
a conversation does.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Sequence

import torch

from .moderation import ModerationSettings, answer_ids, moderation_suffix
from .probe import ModelKey, Probe, answer_log_odds, cross_validate, design, fit_logistic, user_probe_path

log = logging.getLogger("flashguard")

TUNING_SET = Path(__file__).resolve().parent / "data" / "moderation_tune.jsonl"
INPUT_TUNING_SET = Path(__file__).resolve().parent / "data" / "moderation_input_tune.jsonl"
L2_GRID = (1.0, 0.1, 0.01)
FOLDS = 5
# input rail: a tuning message longer than this (in the model's tokens) trains the probe as its first and its last
# WINDOW tokens (two items, labelled block_head / block_tail where the set says), as the rail judges it
WINDOW = 64
# the input probe's candidate features (probe.FEATURES), in the order ties go: the message's mean state first
FEATURE_OPTIONS = ("mean", "last+mean", "last")


def read_rows(path: Path, side: str = "output") -> list[dict]:
    """Labelled rows ``{user, bot, block, category}`` (``side="input"``: ``{user, block, category}``); an error
    names the file and line."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            bot_ok = side == "input" or isinstance(row["bot"], str)
            if not (isinstance(row["user"], str) and bot_ok and isinstance(row["block"], bool)):
                raise TypeError("user and bot must be strings, block a boolean")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from exc
        rows.append(row)
    return rows


def moderation_ids(engine, user: str, bot: str, question: str) -> list[int]:
    """The ids the rail runs for a reply the engine generated: the prompt, the reply's tokens, the suffix."""
    prompt = engine.encode_messages([{"role": "user", "content": user}])
    reply = engine.tokenizer(bot, add_special_tokens=False)["input_ids"]
    return list(prompt) + list(reply) + moderation_suffix(engine, question)


def input_moderation_ids(engine, user: str, question: str, history: Sequence[dict] = ()) -> list[int]:
    """The ids the input rail runs for ``history`` + the message: the conversation, then the question."""
    return engine.encode_messages(list(history) + [{"role": "user", "content": user},
                                                   {"role": "user", "content": question}])


def earlier_exchange(i: int) -> list[dict]:
    """The conversation before input tuning row ``i``: none for even rows; for odd rows one benign exchange from
    the output tuning set (its allowed replies, in turn), so the input probe learns messages that come after a
    conversation as well as first messages."""
    if i % 2 == 0:
        return []
    benign = _benign_exchanges()
    user, bot = benign[(i // 2) % len(benign)]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": bot}]


_BENIGN: list = []


def _benign_exchanges() -> list:
    if not _BENIGN:
        _BENIGN.extend((r["user"], r["bot"]) for r in read_rows(TUNING_SET) if not r["block"])
    return _BENIGN


def collect(engine, rows: Sequence[dict], settings: ModerationSettings = ModerationSettings(),
            progress: bool = False):
    """``(hidden[n, layers + 1, hidden_size], log_odds[n])`` for every row: output rail, of the suffix's last token.
    Input rail, ``(hidden, log_odds, pooled, labels)`` for every item: a message, or the first and last ``WINDOW``
    tokens of a longer one (labelled ``block_head`` / ``block_tail`` where the row has them, else ``block``), as the
    rail judges it; the hidden states of the generation prompt's last token, their mean over the user's turn
    (``pooled``, same shape), the question's Yes/No log-odds on its branch (only to report the question verdict's
    accuracy beside the probe's) and the labels. Input rows are numbered as in the file (``earlier_exchange``): pass
    them all."""
    from .moderation import message_start, message_windows, pooled_state

    bad, good = answer_ids(engine, settings.unsafe_answer), answer_ids(engine, settings.safe_answer)
    states, odds, pooled = [], [], []
    it = rows
    if progress:
        from tqdm import tqdm

        it = tqdm(rows, desc="calibrate", unit="reply")
    labels = []
    for i, row in enumerate(it):
        if settings.side == "input":
            history = earlier_exchange(i) + [{"role": "user", "content": row["user"]}]
            pieces = message_windows(engine, history, WINDOW)
            if pieces is None:
                items = [(row["user"], row["block"])]
            else:   # a long message: its first and last WINDOW tokens, labelled by where the harm is (if any)
                items = [(pieces[0], row.get("block_head", row["block"])),
                         (pieces[1], row.get("block_tail", row["block"]))]
            for text, label in items:
                msgs = history[:-1] + [{"role": "user", "content": text}]
                ids = engine.encode_messages(msgs)
                if len(input_moderation_ids(engine, text, settings.prompt, history[:-1])) >= engine.context_length:
                    continue   # longer than a small model's context (with the question)
                labels.append(int(label))
                hidden, mean, _ = pooled_state(engine, ids, message_start(engine, msgs, ids),
                                               range(hidden_layers(engine) + 1), task="calibration")
                pooled.append(mean)
                states.append(hidden)
                logprobs, _, _ = engine.next_token_state(
                    input_moderation_ids(engine, text, settings.prompt, history[:-1]), task="calibration")
                odds.append(answer_log_odds(logprobs, bad, good))
            continue
        else:
            ids = moderation_ids(engine, row["user"], row["bot"], settings.prompt)
            logprobs, hidden, _ = engine.next_token_state(ids, task="calibration", hidden=True)
        states.append(hidden)
        odds.append(answer_log_odds(logprobs, bad, good))
    if settings.side == "input":
        return torch.stack(states), torch.tensor(odds, dtype=torch.float64), torch.stack(pooled), labels
    return torch.stack(states), torch.tensor(odds, dtype=torch.float64)


def hidden_layers(engine) -> int:
    config = engine.model.config
    return int(getattr(config, "num_hidden_layers", None) or config.get_text_config().num_hidden_layers)


def train(engine, rows: Sequence[dict], settings: ModerationSettings = ModerationSettings(), *,
          progress: bool = False, features=None, key: ModelKey | None = None,
          layers: Sequence[int] | None = None) -> tuple[Probe, list[dict]]:
    """Choose (layer, l2, use_answer) by cross-validation on ``rows``, fit on all rows. Returns
    ``(probe, cv table best first)``. ``layers``: the candidates (default every decoder layer's output).
    ``features`` (precomputed ``collect`` output) and ``key`` (the model's ModelKey) let a probe be fitted
    again without the engine (``engine=None``)."""
    t0 = time.perf_counter()
    features = features if features is not None else collect(engine, rows, settings, progress)
    hidden, odds = features[:2]
    pooled, labels = (features[2], list(features[3])) if len(features) > 2 else \
        (None, [int(r["block"]) for r in rows])
    answers = (False,) if settings.side == "input" else (False, True)   # the input probe's position asks nothing
    table = cross_validate(hidden, odds, labels, layers=layers or range(1, hidden.shape[1]), l2s=L2_GRID, k=FOLDS,
                           answer_options=answers, pooled=pooled,
                           feature_options=FEATURE_OPTIONS if pooled is not None else ("last",))
    best = table[0]
    x = design(hidden, odds, best["layer"], best["use_answer"], best["features"], pooled)
    w, b = fit_logistic(x, torch.tensor(labels), best["l2"])
    answer_weight = float(w[-1]) if best["use_answer"] else 0.0
    weight = w[:-1] if best["use_answer"] else w
    train_acc = float((((x @ w + b) >= 0).long() == torch.tensor(labels)).double().mean())
    key = key or ModelKey.of(engine)
    question_only = float(((odds > torch.log(torch.tensor(settings.threshold / (1 - settings.threshold)))).long()
                           == torch.tensor(labels)).double().mean())
    probe = Probe(layer=best["layer"], weight=tuple(float(v) for v in weight), bias=b, answer_weight=answer_weight,
                  threshold=0.5, question=settings.prompt, model_file=key.file, model_bytes=key.bytes,
                  model_identity=key.identity, weights=key.weights, rail=settings.side, features=best["features"],
                  window=WINDOW if settings.side == "input" else 0,
                  metrics={"tuning_rows": len(rows), "tuning_items": len(labels), "cv_folds": FOLDS, "cv_accuracy": round(best["cv_accuracy"], 4),
                           "l2": best["l2"], "train_accuracy": round(train_acc, 4),
                           "question_only_accuracy": round(question_only, 4),
                           "seconds": round(time.perf_counter() - t0, 1)})
    return probe, table


def main(args) -> int:
    """The CLI command (``flashguard calibrate``): build the config's engine, train, write the probe."""
    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine

    import yaml

    cfg_path = Path(args.config) / "config.yml"
    data = yaml.safe_load(cfg_path.read_text()) or {}
    main_model = next((m for m in data.get("models") or [] if m.get("type") == "main"), None) or {}
    params = dict(main_model.get("parameters") or {})
    if args.weights:
        params["weights"] = args.weights
    config = EngineConfig.from_parameters(params)
    side = getattr(args, "rail", None) or "output"
    settings = ModerationSettings.from_custom_data(data.get("custom_data"), side=side)
    engine = Engine(config)
    rows = read_rows(Path(args.data) if args.data else (INPUT_TUNING_SET if side == "input" else TUNING_SET), side)
    probe, table = train(engine, rows, settings, progress=True)
    out = Path(args.out) if args.out else user_probe_path(ModelKey.of(engine), side)
    probe.save(out)
    print(f"{side} probe for {probe.model_file} ({probe.weights}): layer {probe.layer}, l2 {probe.metrics['l2']}, "
          f"Yes/No feature {'on' if probe.answer_weight else 'off'}; {FOLDS}-fold accuracy on {len(rows)} tuning "
          f"replies {probe.metrics['cv_accuracy']:.1%} (question only {probe.metrics['question_only_accuracy']:.1%})")
    print(f"written to {out}")
    return 0
