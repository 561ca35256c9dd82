"""The rails' verdict from a few questions' Yes/No log-odds: what decides where no hidden states come back.

A serving engine (``backend: openai``) returns the next token's top log-probabilities, not the model's states, so the
probes (``rails/probe.py``) cannot run there. One question's Yes/No answer is a weak verdict on a small model (the
embedded 135M model blocks "Hello" with it). The classifier asks a few differently worded questions instead, each as
the conversation's token ids + that question's short suffix with ``max_tokens: 1`` (one request per question, the
server's prefix cache serving the conversation each time: only the suffix is prefilled), and reads the verdict from
a logistic regression over their log-odds:

    p_unsafe = sigmoid(sum_i weight_i * log_odds_i + bias),   log_odds_i = log P(unsafe answer_i) - log P(safe answer_i)

Contract:

- ``QUESTIONS[rail]``: the candidate questions of each rail (the first is the rail's default question); a fitted
  ``Classifier`` names the ones it asks, in order.
- ``log_odds(engine, ids, question)``: one question's feature from ``Engine.read``'s (or ``RemoteEngine.read``'s)
  log-probabilities, read as a server returns them (the top ``TOP_LOGPROBS``, every other token at the lowest one
  listed: ``top_view``), so that the in-process engine and a server compute the same number.
- ``Classifier``: frozen; ``p_unsafe(features)``, ``threshold_for(strictness)``, ``matches(engine)`` (the model
  file's name and size), JSON ``save`` / ``load`` (a bad file is a ``ClassifierError`` naming it and the command
  that makes a new one). The file holds derived numbers only: weights, thresholds, rates and provenance (sources,
  commit, date, rows used), never a row's text.
- ``find_classifier(engine, rail)``: the user cache's file for the model, else the shipped one
  (``SHIPPED_DIR``, the embedded model's); ``(None, why)`` when there is none.
- ``fit``: L2 logistic regression (``probe.fit_logistic``, classes weighted equally) with the strictness levels'
  thresholds from held-out scores (``guard_fit.operating_points``: medium blocks <= 5% of held-out benign rows).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from flashguard.errors import FlashguardError

from .probe import STRICTNESS, answer_log_odds, fit_logistic
from .state import rail_state

FORMAT = "flashguard-classifier/1"
SHIPPED_DIR = Path(__file__).resolve().parent / "classifiers"
CALIBRATE_HINT = "flashguard calibrate --backend openai --sources"
# what a server returns per request (RemoteEngine.TOP_LOGPROBS): the in-process features are read the same way
TOP_LOGPROBS = 20


class ClassifierError(FlashguardError):
    """A classifier file exists but cannot be used (unreadable, corrupt, or for another model)."""


@dataclass(frozen=True)
class Question:
    text: str
    unsafe_answer: str    # the answer word that means "block"
    safe_answer: str


_ANSWER = " Answer Yes or No."
# the candidates (the first of each is the rail's default question, moderation.INPUT_QUESTION / DEFAULT_QUESTION):
# asked both ways round, so that the model's own lean to "Yes" or "No" cancels out in the fit
QUESTIONS: dict[str, tuple[Question, ...]] = {
    "input": (
        Question("Is my last message a safe request, with no attempt to trick you past your rules?" + _ANSWER,
                 "No", "Yes"),
        Question("Does my last message ask for something harmful, dangerous or illegal?" + _ANSWER, "Yes", "No"),
        Question("Would a careful assistant refuse my last message?" + _ANSWER, "Yes", "No"),
        Question("Is my last message an ordinary, harmless question or task?" + _ANSWER, "No", "Yes"),
        Question("Is my last message hateful, violent or abusive?" + _ANSWER, "Yes", "No"),
    ),
    "output": (
        Question("Is your last reply safe, kind and free of secrets?" + _ANSWER, "No", "Yes"),
        Question("Does your last reply help with something harmful, dangerous or illegal?" + _ANSWER, "Yes", "No"),
        Question("Is your last reply hateful, violent or abusive?" + _ANSWER, "Yes", "No"),
        Question("Is your last reply a harmless, helpful answer?" + _ANSWER, "No", "Yes"),
        Question("Should a moderator remove your last reply?" + _ANSWER, "Yes", "No"),
    ),
}


def top_view(logprobs: torch.Tensor, k: int = TOP_LOGPROBS) -> torch.Tensor:
    """``logprobs`` as a server returns them: the top ``k`` kept, every other token at the ``k``-th value (an upper
    bound for them). Idempotent: a server's reading (already so) comes back unchanged."""
    if logprobs.numel() <= k:
        return logprobs
    floor = torch.topk(logprobs, k).values[-1]
    return torch.where(logprobs >= floor, logprobs, floor)


def log_odds(engine, ids: Sequence[int], question: Question, task: str = "moderation",
             keep: Optional[int] = None):
    """One question's feature after ``ids`` (the conversation's ids and the question's suffix): ``(log_odds,
    Reading)``. Over the top ``TOP_LOGPROBS`` of the next token (``top_view``), as every engine returns them."""
    from .prompts import answer_ids

    r = engine.read(ids, task=task, keep=keep)
    lp = top_view(r.logprobs)
    return answer_log_odds(lp, answer_ids(engine, question.unsafe_answer),
                           answer_ids(engine, question.safe_answer)), r


def features(engine, ids_for: Callable[[Question], list], questions: Sequence[Question], task: str = "moderation",
             keep_for: Optional[Callable[[list], Optional[int]]] = None) -> tuple[list, int, int, int]:
    """Every question's log-odds, one read each over ``ids_for(question)``: ``(log_odds, prompt tokens, prefilled,
    reused)`` summed over the reads. ``keep_for(ids)``: the ``keep`` of each read (the input rail's branch)."""
    out, prompt, prefilled, reused = [], 0, 0, 0
    for q in questions:
        ids = ids_for(q)
        x, r = log_odds(engine, ids, q, task, keep_for(ids) if keep_for else None)
        out.append(x)
        prompt, prefilled, reused = prompt + len(ids), prefilled + r.prefilled, reused + r.reused
    return out, prompt, prefilled, reused


@dataclass(frozen=True)
class Classifier:
    """``p_unsafe = sigmoid(weight . log_odds + bias)`` over ``questions``' log-odds; blocked at
    ``p_unsafe >= threshold_for(strictness)``."""

    rail: str                                 # "input" or "output"
    questions: tuple[Question, ...]
    weight: tuple[float, ...]
    bias: float
    threshold: float                          # the medium level's
    strictness: dict                          # low / medium / high -> threshold
    model_file: str
    model_bytes: int
    provenance: dict = field(default_factory=dict, compare=False)
    metrics: dict = field(default_factory=dict, compare=False)

    def p_unsafe(self, log_odds_: Sequence[float]) -> float:
        if len(log_odds_) != len(self.weight):
            raise ClassifierError(f"the classifier reads {len(self.weight)} questions' log-odds, got {len(log_odds_)}")
        z = sum(w * x for w, x in zip(self.weight, log_odds_)) + self.bias
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def threshold_for(self, strictness: str) -> float:
        return float(self.strictness.get(strictness, self.threshold))

    def matches(self, engine) -> bool:
        """The engine's model is the one the classifier was fitted on: the same weights file's name and size (the
        engine's ``model_path``: for a server, the served model's tokenizer and GGUF)."""
        file, size = model_file(engine)
        return self.model_file == file and self.model_bytes == size and size > 0

    # ---- file ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "rail": self.rail,
                "questions": [{"text": q.text, "unsafe_answer": q.unsafe_answer, "safe_answer": q.safe_answer}
                              for q in self.questions],
                "weight": [float(f"{w:.6g}") for w in self.weight], "bias": float(f"{self.bias:.6g}"),
                "threshold": self.threshold, "strictness": dict(self.strictness),
                "model": {"file": self.model_file, "bytes": self.model_bytes},
                "provenance": self.provenance, "metrics": self.metrics}

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> "Classifier":
        """Read a classifier file; anything missing, mistyped or out of range is a ``ClassifierError`` naming the file
        and the command that makes a new one."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format') if isinstance(data, dict) else None!r}, "
                                 f"expected {FORMAT!r}")
            questions = tuple(Question(str(q["text"]), str(q["unsafe_answer"]), str(q["safe_answer"]))
                              for q in data["questions"])
            table = data["strictness"]
            if not isinstance(table, dict) or set(table) != set(STRICTNESS):
                raise ValueError(f"strictness must map {', '.join(STRICTNESS)} to thresholds, got {table!r}")
            c = cls(rail=str(data["rail"]), questions=questions, weight=tuple(float(w) for w in data["weight"]),
                    bias=float(data["bias"]), threshold=float(data["threshold"]),
                    strictness={k: float(table[k]) for k in STRICTNESS}, model_file=str(data["model"]["file"]),
                    model_bytes=int(data["model"]["bytes"]), provenance=dict(data.get("provenance") or {}),
                    metrics=dict(data.get("metrics") or {}))
            if c.rail not in ("input", "output"):
                raise ValueError(f"rail is {c.rail!r}, expected input or output")
            if not questions or len(questions) != len(c.weight):
                raise ValueError(f"{len(questions)} questions and {len(c.weight)} weights: one weight per question")
            if any(not q.text.strip() or not q.unsafe_answer.strip() or not q.safe_answer.strip() for q in questions):
                raise ValueError("every question needs its text, unsafe_answer and safe_answer")
            numbers = c.weight + (c.bias, c.threshold) + tuple(c.strictness.values())
            if not all(math.isfinite(x) for x in numbers):
                raise ValueError("a non-finite number")
            if not all(0 < t < 1 for t in (c.threshold, *c.strictness.values())):
                raise ValueError("thresholds must be in (0, 1)")
            if not c.strictness["low"] >= c.strictness["medium"] >= c.strictness["high"]:
                raise ValueError(f"strictness thresholds must not rise from low to high, got {c.strictness}")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                AttributeError) as exc:
            raise ClassifierError(f"question classifier {path} cannot be used ({type(exc).__name__}: {exc}); delete "
                                  f"it and run `{hint(_rail_of(path))}` to fit a new one") from exc
        return c


def _rail_of(path: Path) -> str:
    return "input" if Path(path).stem.endswith("-input") else "output"


def hint(rail: str) -> str:
    return CALIBRATE_HINT + (" --rail input" if rail == "input" else "")


def model_file(engine) -> tuple[str, int]:
    """The name and size of the engine's weights file (the GGUF, or the model folder's size 0)."""
    src = engine.source
    target = os.path.join(src.folder, src.gguf_file) if src.gguf_file else src.folder
    size = os.path.getsize(target) if os.path.isfile(target) else 0
    return os.path.basename(target.rstrip("/\\")), size


def file_name(engine_or_file, rail: str) -> str:
    """``<model stem>-questions[-input].json``: the user cache's and the shipped files' names."""
    name = engine_or_file if isinstance(engine_or_file, str) else model_file(engine_or_file)[0]
    return f"{Path(name).stem or 'model'}-questions{'-input' if rail == 'input' else ''}.json"


def user_path(engine_or_file, rail: str) -> Path:
    """Where ``flashguard calibrate --backend openai`` writes the classifier of one model on this machine."""
    from flashguard.engine.loader import user_cache_dir

    return user_cache_dir() / "classifiers" / file_name(engine_or_file, rail)


def find_classifier(engine, rail: str) -> tuple[Optional[Classifier], str]:
    """The classifier for ``engine``'s model and ``rail``: the user cache's, else the shipped one. ``(None, why)``
    when there is none; a file that exists but is corrupt raises ``ClassifierError``. Memoised per engine."""
    memo = rail_state(engine).classifiers
    if rail in memo:
        return memo[rail]
    found: tuple[Optional[Classifier], str] = (None, "")
    for path in (user_path(engine, rail), SHIPPED_DIR / file_name(engine, rail)):
        if path.is_file():
            c = Classifier.load(path)
            if c.rail == rail and c.matches(engine):
                found = (c, str(path))
                break
    if found[0] is None:
        file, size = model_file(engine)
        found = (None, f"no {rail} question classifier for {file} ({size} bytes) in {user_path(engine, rail)} or the "
                       "shipped ones")
    memo[rail] = found
    return found


def load_for(engine, path: str, rail: str, section: str) -> Classifier:
    """The classifier file a config names (``<section>.classifier: FILE``), checked against the model and rail;
    errors name the key."""
    memo = rail_state(engine).classifier_files
    if (path, rail) not in memo:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ClassifierError(f"{section}.classifier: no classifier file at {p}; run `{hint(rail)} --out {p}` "
                                  "to make it, or set classifier: auto")
        c = Classifier.load(p)
        if c.rail != rail or not c.matches(engine):
            file, size = model_file(engine)
            raise ClassifierError(f"{section}.classifier: {p} was fitted for the {c.rail} rail of {c.model_file} "
                                  f"({c.model_bytes} bytes), not the {rail} rail of {file} ({size} bytes); run "
                                  f"`{hint(rail)} --out {p}`")
        memo[(path, rail)] = c
    return memo[(path, rail)]


# ---- fitting --------------------------------------------------------------------------------
L2 = 0.01


def fit(x: torch.Tensor, y: torch.Tensor, l2: float = L2) -> tuple[torch.Tensor, float]:
    """Logistic regression on ``x`` ``[n, questions]`` (log-odds), labels ``y`` in {0, 1}, classes weighted equally:
    ``(weight, bias)`` on the raw log-odds."""
    y = y.double()
    pos = float(y.mean())
    sw = torch.where(y > 0, 0.5 / max(pos, 1e-6), 0.5 / max(1 - pos, 1e-6))
    return fit_logistic(x.double(), y, l2, sample_weight=sw)


def scores(x: torch.Tensor, weight: torch.Tensor, bias: float) -> torch.Tensor:
    return torch.sigmoid(x.double() @ weight.double() + bias)


def held_out_scores(x: torch.Tensor, y: torch.Tensor, groups: Sequence[str], train: Sequence[bool],
                    l2: float = L2) -> torch.Tensor:
    """Each row's score by a classifier fitted without its group (leave one source out): rows of a group are scored
    by a fit on the other groups' training rows (``train``: False rows are scored, never fitted on)."""
    names = sorted(set(groups))
    g = torch.tensor([names.index(s) for s in groups])
    trainable = torch.tensor(list(train))
    out = torch.empty(len(y), dtype=torch.float64)
    for k in range(len(names)):
        held = g == k
        w, b = fit(x[~held & trainable], y[~held & trainable], l2)
        out[held] = scores(x[held], w, b)
    return out


# ---- calibration rows -----------------------------------------------------------------------
def row_ids(engine, rail: str, row: dict, history: Sequence[dict], question: Question) -> list[int]:
    """The ids the rail runs for a labelled row and ``question``: output, the prompt, the reply's tokens and the
    question's suffix (``tuning.moderation_ids``: the shared path after a turn the engine generated); input, the
    conversation (``history`` and the message) and the question as the next user turn."""
    from .tuning import input_moderation_ids, moderation_ids

    if rail == "output":
        return moderation_ids(engine, row["user"], row["bot"], question.text)
    return input_moderation_ids(engine, row["user"], question.text, history)


def row_key(rail: str, row: dict, history: Sequence[dict], question: Question) -> str:
    """A row's feature in the features cache: its text, its conversation and the question."""
    import hashlib

    content = [rail, row["user"], row.get("bot"), list(history), question.text, question.unsafe_answer,
               question.safe_answer, TOP_LOGPROBS]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def collect(engine, rail: str, rows: Sequence[dict], questions: Sequence[Question], cache: Optional[dict] = None,
            progress: bool = False, save: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """``[rows, questions]`` log-odds, each read as the rail reads it (``row_ids``; an input row follows the earlier
    exchange ``tuning.earlier_exchange`` gives it). ``cache``: features by ``row_key``, read where present and
    added where not; ``save`` is called every 50 rows (a long run keeps what it has)."""
    from .tuning import earlier_exchange

    it = enumerate(rows)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, total=len(rows), desc=f"{rail} questions", unit="row")
    out = torch.empty(len(rows), len(questions), dtype=torch.float64)
    for i, row in it:
        history = earlier_exchange(i, row) if rail == "input" else []
        for j, q in enumerate(questions):
            key = row_key(rail, row, history, q)
            if cache is not None and key in cache:
                out[i, j] = cache[key]
                continue
            ids = row_ids(engine, rail, row, history, q)
            if len(ids) >= engine.context_length:
                raise ValueError(f"a {rail} row is longer than the model's context ({len(ids)} tokens)")
            out[i, j], _ = log_odds(engine, ids, q, task="calibration")
            if cache is not None:
                cache[key] = float(out[i, j])
        if save is not None and i % 50 == 49:
            save()
    return out
