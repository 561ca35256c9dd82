"""The labelled tuning rows and what the rails read of them: the features ``flashguard calibrate`` fits on.

Contract:
- ``read_rows(path, side)``: a labelled JSONL file's rows (an error names the file and line); ``TUNING_SET`` and
  ``INPUT_TUNING_SET`` are the project's (rails/data); ``earlier_exchange(i, row)``: the conversation before input
  row ``i`` (none, one benign exchange, or the paste exchange ``after`` names).
- ``moderation_ids`` / ``input_moderation_ids``: the ids a rail runs for a row, built as the rails build them.
- ``collect(engine, rows, settings)``: every row through the rail's own path (the output rail's suffix states, the
  input rail's prompt states, sliding windows over a long message's states), cached by ``row_key``; a long message's
  windows are labelled by ``window_label`` from the row's ``harm_span`` (``harm_tokens``).
- ``WINDOW``, ``SLIDE_WINDOWS``, ``LONG_LAYERS``, ``SHORT_SHARE``: the input probe's window sizes, layers and the
  short messages' share of the window probe's weight, which the fits (calibrate.py, guard_fit.py) share.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from .probe import answer_log_odds
from .prompts import answer_ids, moderation_suffix
from .settings import ModerationSettings

TUNING_SET = Path(__file__).resolve().parent / "data" / "moderation_tune.jsonl"
INPUT_TUNING_SET = Path(__file__).resolve().parent / "data" / "moderation_input_tune.jsonl"

# the paste exchanges (a long pasted text with a question, and a reply) that input tuning rows with ``after`` follow
# (tools/make_long_followup_items.py: short messages after a long paste)
INPUT_PASTES = Path(__file__).resolve().parent / "data" / "moderation_input_pastes.jsonl"

# input rail: a tuning message longer than this (in the model's tokens) trains the probe as its first and its last
# WINDOW tokens (two items, labelled block_head / block_tail where the set says), as the rail judges it
WINDOW = 64

# input rail, v5: a message longer than WINDOW tokens is judged by sliding windows over its own states (the
# generation's prefill); the window probe's candidates: window sizes (stride: half a window) and layers
SLIDE_WINDOWS = (32, 64)
LONG_LAYERS = (6, 8, 10, 12, 14, 16, 18, 20, 22, 24)

# the short tuning messages' mean states join the window probe's training (what a request reads like), weighing
# together this share of the windows' total weight (0.5: balanced cross-validated accuracy on the long tuning messages
# 92.1%, against 88.6% without them, window 32 / layer 18 / L2 0.01; their false blocks were benign requests put before
# or after a paste, 18 of 123 -> 10)
SHORT_SHARE = 0.5


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
                raise TypeError("user must be a string, block a boolean" if side == "input"
                                else "user and bot must be strings, block a boolean")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from exc
        rows.append(row)
    return rows


def moderation_ids(engine, user: str, bot: str, question: str) -> list[int]:
    """The ids the rail runs for a reply the engine generated: the prompt, the reply's tokens, the suffix."""
    prompt = engine.encode_messages([{"role": "user", "content": user}])
    reply = engine.tokenize(bot)
    return list(prompt) + list(reply) + moderation_suffix(engine, question)


def input_moderation_ids(engine, user: str, question: str, history: Sequence[dict] = ()) -> list[int]:
    """The ids the input rail runs for ``history`` + the message: the conversation, then the question."""
    return engine.encode_messages(list(history) + [{"role": "user", "content": user},
                                                   {"role": "user", "content": question}])


def earlier_exchange(i: int, row: Optional[dict] = None, pastes: Optional[Path] = None) -> list[dict]:
    """The conversation before input tuning row ``i``: a row with ``after`` follows the paste exchange it names (a
    long pasted text with a question, and the reply; ``pastes``, default ``INPUT_PASTES``); otherwise none for even
    rows, and for odd rows one benign exchange from the output tuning set (its allowed replies, in turn), so the
    input probe learns messages that come after a conversation as well as first messages."""
    if row is not None and row.get("after"):
        return paste_exchange(row["after"]["exchange"], pastes or INPUT_PASTES)
    if i % 2 == 0:
        return []
    benign = _benign_exchanges()
    user, bot = benign[(i // 2) % len(benign)]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": bot}]


_BENIGN: list = []
_PASTES: dict = {}


def paste_exchange(exchange: str, path: Path = INPUT_PASTES) -> list[dict]:
    """The paste exchange ``exchange`` of ``path`` (``{id, user, bot}`` a line) as two messages."""
    path = Path(path)
    if path not in _PASTES:
        _PASTES[path] = {e["id"]: e for e in map(json.loads, path.read_text(encoding="utf-8").splitlines()) if e}
    e = _PASTES[path].get(exchange)
    if e is None:
        raise ValueError(f"{path} has no paste exchange {exchange!r}")
    return [{"role": "user", "content": e["user"]}, {"role": "assistant", "content": e["bot"]}]


def _benign_exchanges() -> list:
    if not _BENIGN:
        # the short exchanges only: the long-paste rows (``paste``, tools/make_long_output_items.py) came later
        _BENIGN.extend((r["user"], r["bot"]) for r in read_rows(TUNING_SET) if not r["block"] and "paste" not in r)
    return _BENIGN


def collect(engine, rows: Sequence[dict], settings: ModerationSettings = ModerationSettings(),
            progress: bool = False, cache: Optional[dict] = None):
    """``(hidden[n, layers + 1, hidden_size], log_odds[n], pooled[n, layers + 1, hidden_size])`` for every row:
    output rail, the suffix's last token's states and the mean of the suffix's states (read in the rail's forward,
    ``moderation.suffix_state``).
    Input rail, ``(hidden, log_odds, pooled, labels, long)``: for every message of at most ``WINDOW`` tokens, the
    hidden states of the generation prompt's last token, their mean over the user's turn (``pooled``, same shape),
    the question's Yes/No log-odds on its branch (only to report the question verdict's accuracy beside the probe's)
    and the labels; ``long``: for every longer message, the mean states of its sliding windows at ``LONG_LAYERS`` (per
    window size), each window's label (``window_label``) and message, and the messages' labels. Input rows are
    numbered as in the file (``earlier_exchange``): pass them all. ``cache``: each row's states by its number and
    text, read where present and added where not (``flashguard calibrate --features``)."""
    bad, good = answer_ids(engine, settings.unsafe_answer), answer_ids(engine, settings.safe_answer)
    states, odds, pooled = [], [], []
    it = rows
    if progress:
        from tqdm import tqdm

        it = tqdm(rows, desc="calibrate", unit="reply")
    labels, short_rows = [], []   # short_rows: the rows ``labels`` are of (long and skipped rows are not)
    slides = {size: {"means": [], "labels": [], "message": []} for size in SLIDE_WINDOWS}
    long_labels, long_rows = [], []   # long_rows: the rows ``long_labels`` are of
    layers = [layer for layer in LONG_LAYERS if layer <= engine.layer_count]
    for i, row in enumerate(it):
        if settings.side == "input":
            key = row_key(i, row, settings)
            record = cache.get(key) if cache is not None else None
            if record is None:
                record = _input_row(engine, i, row, settings, layers, bad, good)
                if cache is not None:
                    cache[key] = record
            if record["kind"] == "long":
                for size, out in slides.items():
                    out["means"].append(record["means"][size])
                    out["labels"] += record["labels"][size]
                    out["message"] += [len(long_labels)] * len(record["labels"][size])
                long_labels.append(record["label"])
                long_rows.append(row)
            elif record["kind"] == "short":
                labels.append(record["label"])
                short_rows.append(row)
                states.append(record["hidden"])
                pooled.append(record["mean"])
                odds.append(record["odds"])
            continue
        key = row_key(i, row, settings)
        record = cache.get(key) if cache is not None else None
        if record is None or "mean" not in record:   # a cache written before the suffix mean was kept: again
            from .prompts import suffix_state

            ids = moderation_ids(engine, row["user"], row["bot"], settings.prompt)
            start = len(ids) - len(moderation_suffix(engine, settings.prompt))
            logprobs, hidden, mean, _ = suffix_state(engine, ids, start, range(engine.layer_count + 1),
                                                     task="calibration")
            record = {"hidden": hidden, "mean": mean, "odds": answer_log_odds(logprobs, bad, good)}
            if cache is not None:
                cache[key] = record
        states.append(record["hidden"])
        pooled.append(record["mean"])
        odds.append(record["odds"])
    if settings.side == "input":
        long = {"layers": layers, "message_labels": long_labels, "rows": long_rows,
                "windows": {size: {"means": torch.cat(out["means"], 1) if out["means"] else None,
                                   "labels": out["labels"], "message": out["message"]}
                            for size, out in slides.items()}}
        return torch.stack(states), torch.tensor(odds, dtype=torch.float64), torch.stack(pooled), labels, long, \
            short_rows
    return torch.stack(states), torch.tensor(odds, dtype=torch.float64), torch.stack(pooled)


# what a row's states do not depend on: where it came from (rails/lab/guard_fit.py's bookkeeping)
_BOOKKEEPING = ("source", "train")


def row_key(i: int, row: dict, settings: ModerationSettings) -> str:
    """A tuning row's key in the states cache: its text, labels and the question, and for an input row its number
    (its earlier exchange) and, after a paste exchange (``after``), that conversation's text. An output row's states
    depend on its text only, so its key has no number: the rows can be reordered or regrouped without running them
    again."""
    content = {k: v for k, v in row.items() if k not in _BOOKKEEPING}
    if settings.side == "output":
        return hashlib.sha256(json.dumps(["output", content, settings.prompt], sort_keys=True).encode()).hexdigest()
    history = [earlier_exchange(i, row)] if row.get("after") else []
    return hashlib.sha256(json.dumps([i, content, settings.prompt, WINDOW, SLIDE_WINDOWS, LONG_LAYERS] + history,
                                     sort_keys=True).encode()).hexdigest()


def _input_row(engine, i: int, row: dict, settings: ModerationSettings, layers, bad, good) -> dict:
    """One input tuning row through the rail's own path: ``{"kind": "short" | "long" | "skip", ...}``."""
    from .prompts import content_start, message_start, message_windows, pooled_state, window_means, window_starts

    history = earlier_exchange(i, row) + [{"role": "user", "content": row["user"]}]
    ids = engine.encode_messages(history)
    if message_windows(engine, history, WINDOW) is not None:   # long: sliding windows over its own states
        if len(ids) >= engine.context_length:
            return {"kind": "skip"}
        start = content_start(engine, history, ids)
        _, _, _, kept = pooled_state(engine, ids, start, layers, task="calibration", keep=True)
        span = harm_tokens(engine, row)
        return {"kind": "long", "label": int(row["block"]),
                "means": {size: window_means(kept, size, size // 2).half() for size in SLIDE_WINDOWS},
                "labels": {size: [window_label(a, size, span) for a in window_starts(kept.shape[1], size, size // 2)]
                           for size in SLIDE_WINDOWS}}
    question = input_moderation_ids(engine, row["user"], settings.prompt, history[:-1])
    if len(question) >= engine.context_length:
        return {"kind": "skip"}   # longer than a small model's context (with the question)
    hidden, mean, _ = pooled_state(engine, ids, message_start(engine, history, ids),
                                   range(engine.layer_count + 1), task="calibration")
    logprobs = engine.read(question, task="calibration").logprobs
    return {"kind": "short", "label": int(row["block"]), "hidden": hidden, "mean": mean,
            "odds": answer_log_odds(logprobs, bad, good)}


def harm_tokens(engine, row: dict) -> Optional[tuple[int, int]]:
    """The token range of a harmful row's harm in its message (``harm_span``, characters; the whole message when the
    row has none); None for a benign row."""
    if not row["block"]:
        return None
    text = row["user"]
    a, b = row.get("harm_span") or (0, len(text))
    offsets = engine.token_offsets(text)
    first = next((i for i, (x, y) in enumerate(offsets) if y > a), 0)
    last = next((i for i, (x, y) in reversed(list(enumerate(offsets))) if x < b), len(offsets) - 1)
    return first, last + 1


def window_label(start: int, size: int, span: Optional[tuple[int, int]]) -> int:
    """1: the window holds at least half of the harm (or is at least half harm); 0: none of it; -1: a sliver (left
    out of training, ambiguous). Positions count from the message's text (the window's ``start``)."""
    if span is None:
        return 0
    overlap = max(0, min(start + size, span[1]) - max(start, span[0]))
    if overlap == 0:
        return 0
    return 1 if overlap >= 0.5 * min(span[1] - span[0], size) else -1

