"""The output-moderation rail: asks the same model about the same conversation.

The moderation input is the token ids the engine actually ran for the turn (prompt ids + the ids
it generated, never re-tokenised text) followed by a short suffix: the chat template's end of the
assistant turn and a user question. Because that input starts with the turn's own ids, the engine
finds them in its cache and prefills only the suffix.

The verdict comes from that one forward pass (the model never generates free text):

- ``probe`` (the default where a probe exists for the model): a logistic regression on the hidden state of
  the suffix's last token (``rails/probe.py``), trained by ``flashguard calibrate`` on a labelled set; the
  embedded SmolLM2's probes (float and int4) ship in the package.
- ``question`` (the fallback, or ``probe: off``): the next-token probabilities of the two allowed answers
  ("Is your last reply safe...?": "No" = unsafe, "Yes" = safe).

If the turn is not found (another process produced the text, or a message the engine did not
generate), the rail prefills the exchange from text; ``Verdict.path`` says which way it went and
the engine's moderation stats count it as a fallback.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

from .probe import answer_log_odds

log = logging.getLogger("flashguard")

# Measured on tests/data/moderation_set.jsonl with the embedded SmolLM2-135M (see docs/moderation.md):
# a short question scored better than a long policy text, which the 135M model cannot follow.
DEFAULT_POLICY = ""
DEFAULT_QUESTION = "Is your last reply safe, kind and free of secrets? Answer Yes or No."
DEFAULT_THRESHOLD = 0.64
_VARIANTS = lambda w: (w, " " + w, w.lower(), " " + w.lower(), w.upper())  # noqa: E731


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    p_unsafe: float
    path: str  # "shared" (the turn's pages were reused) or "prefill" (fallback)
    prompt_tokens: int
    prefilled_tokens: int
    reused_tokens: int
    seconds: float
    method: str = "question"  # "probe" (the calibrated probe) or "question" (the Yes/No answer only)
    threshold: float = DEFAULT_THRESHOLD
    p_question: float = 0.5  # the question's own P(unsafe answer) from the same pass (what "question" uses)

    @property
    def reason(self) -> str:
        return f"p_unsafe={self.p_unsafe:.3f} (threshold {self.threshold:.2f}, {self.method}) via {self.path} path"


@dataclass(frozen=True)
class ModerationSettings:
    """From ``custom_data.flashguard_moderation`` in config.yml.

    policy         text put before the question (empty by default)
    question       the question asked as the next user turn
    unsafe_answer  the answer word that means "block" ("No" for the default question)
    safe_answer    the answer word that means "allow"
    threshold      question verdict: block when P(unsafe_answer) / (P(unsafe) + P(safe)) >= threshold
                   (a probe carries its own threshold, calibrated with it)
    probe          "auto": the model's probe (user cache, then shipped) if there is one, else the question
                   verdict with one warning; "off": the question verdict; or the path of a probe file
    """

    policy: str = DEFAULT_POLICY
    question: str = DEFAULT_QUESTION
    unsafe_answer: str = "No"
    safe_answer: str = "Yes"
    threshold: float = DEFAULT_THRESHOLD
    probe: str = "auto"

    @property
    def prompt(self) -> str:
        return f"{self.policy.strip()}\n{self.question}" if self.policy.strip() else self.question

    @classmethod
    def from_custom_data(cls, custom_data: Optional[dict]) -> "ModerationSettings":
        from flashguard.errors import ConfigError

        data = dict((custom_data or {}).get("flashguard_moderation") or {})
        known = {"policy", "question", "unsafe_answer", "safe_answer", "threshold", "probe"}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown key(s) {sorted(unknown)} in custom_data.flashguard_moderation; "
                              f"known keys are {', '.join(sorted(known))}")
        if data.get("probe") is False:   # YAML 1.1 reads a bare `probe: off` as false
            data["probe"] = "off"
        settings = cls(**data)
        if not 0 < settings.threshold < 1:
            raise ConfigError("custom_data.flashguard_moderation.threshold must be between 0 and 1, "
                              f"got {settings.threshold!r}")
        if not settings.unsafe_answer.strip() or not settings.safe_answer.strip():
            raise ConfigError("custom_data.flashguard_moderation.unsafe_answer and safe_answer must be words")
        if not isinstance(settings.probe, str) or not settings.probe.strip():
            raise ConfigError("custom_data.flashguard_moderation.probe must be auto, off or the path of a probe "
                              f"file (`flashguard calibrate` writes one), got {settings.probe!r}")
        return settings


def moderation_suffix(engine, question: str) -> list[int]:
    """Token ids that close the assistant turn and ask ``question`` as the next user turn (memoised per engine:
    rendering the chat template costs milliseconds, more than the shared-page forward at short contexts)."""
    memo = engine.__dict__.setdefault("_moderation_suffix", {})
    if question not in memo:
        memo[question] = _render_suffix(engine, question)
    return list(memo[question])


def _render_suffix(engine, question: str) -> list[int]:
    tok = engine.tokenizer
    marker = "\x00FLASHGUARD-REPLY\x00"
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker},
            {"role": "user", "content": question}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    tail = text.split(marker, 1)[1]
    return list(tok(tail, add_special_tokens=False)["input_ids"])


def answer_ids(engine, word: str) -> list[int]:
    """First token ids of ``word`` in its usual spellings (" No", "no", ...), memoised per engine."""
    memo = engine.__dict__.setdefault("_moderation_answers", {})
    if word not in memo:
        memo[word] = sorted({engine.tokenizer(w, add_special_tokens=False)["input_ids"][0]
                             for w in _VARIANTS(word.strip())})
    return list(memo[word])


def find_turn(engine, bot_message: str):
    """The most recent turn the engine generated whose text is ``bot_message`` (or contains it)."""
    wanted = bot_message.strip()
    if not wanted:
        return None
    for turn in reversed(engine.turns):
        if turn.text.strip() == wanted:
            return turn
    for turn in reversed(engine.turns):
        if wanted in turn.text:
            return turn
    return None


_MEMO_SIZE = 64


def moderate(engine, bot_message: str, user_message: Optional[str] = None,
             settings: ModerationSettings = ModerationSettings(), *, allow_shared: bool = True,
             use_memo: bool = True) -> Verdict:
    """Score ``bot_message`` against the policy with one forward pass.

    A verdict is remembered per (turn, text, settings): NeMo's streaming output rails check the final
    text again after the last chunk, and that second check costs nothing.
    """
    with engine.lock:  # the streaming chunk check and the final check can arrive together
        turn = find_turn(engine, bot_message) if allow_shared else None
        memo = engine.__dict__.setdefault("_moderation_memo", {})
        key = (turn, bot_message.strip(), user_message if turn is None else None, settings)
        if use_memo and allow_shared and key in memo:
            v = memo[key]
            log.info("flashguard moderation: %s (p_unsafe=%.3f, threshold=%.2f) remembered from the same turn's "
                     "earlier check", "allow" if v.allowed else "BLOCK", v.p_unsafe, v.threshold)
            return v
        verdict = _moderate(engine, bot_message, user_message, settings, turn, allow_shared)
        if allow_shared:
            memo[key] = verdict
            while len(memo) > _MEMO_SIZE:
                memo.pop(next(iter(memo)))
        return verdict


def choose_probe(engine, settings: ModerationSettings):
    """The probe the verdict uses, or None for the question verdict (``probe: auto`` without a probe warns once
    per engine and question, naming the file ``flashguard calibrate`` would write)."""
    from .probe import Probe, ProbeError, find_probe, ModelKey, CALIBRATE_HINT

    mode = settings.probe.strip()
    if mode == "off":
        return None
    if mode == "auto":
        probe, where = find_probe(engine, settings.prompt)
        if probe is not None and settings.threshold != DEFAULT_THRESHOLD:
            warned = engine.__dict__.setdefault("_moderation_threshold_warned", set())
            if settings.threshold not in warned:
                warned.add(settings.threshold)
                log.warning("flashguard moderation: custom_data.flashguard_moderation.threshold (%s) applies to the "
                            "question verdict; the probe %s decides with its own calibrated threshold %.2f. Set "
                            "probe: off to decide by the question and that threshold", settings.threshold, where,
                            probe.threshold)
        if probe is None:
            warned = engine.__dict__.setdefault("_moderation_probe_warned", set())
            if settings.prompt not in warned:
                warned.add(settings.prompt)
                log.warning("flashguard moderation: %s; the rail uses the question's Yes/No verdict, which is much "
                            "less accurate (docs/moderation.md). Run `%s` to train a probe for this model",
                            where, CALIBRATE_HINT)
        return probe
    memo = engine.__dict__.setdefault("_moderation_probe_file", {})
    if mode not in memo:
        from pathlib import Path

        path = Path(mode).expanduser()
        if not path.is_file():
            raise ProbeError(f"custom_data.flashguard_moderation.probe: no probe file at {path}; run "
                             f"`{CALIBRATE_HINT} --out {path}` to make it, or set probe: auto")
        probe = Probe.load(path)
        if not probe.matches(ModelKey.of(engine)) or probe.question != settings.prompt:
            raise ProbeError(f"custom_data.flashguard_moderation.probe: {path} was trained for {probe.model_file} "
                             f"({probe.weights} weights) with the question {probe.question!r}, not for this "
                             f"model and question; run `{CALIBRATE_HINT} --out {path}` again")
        memo[mode] = probe
    return memo[mode]


def _moderate(engine, bot_message, user_message, settings, turn, allow_shared) -> Verdict:
    t0 = time.perf_counter()
    question = settings.prompt
    probe = choose_probe(engine, settings)
    suffix = moderation_suffix(engine, question)
    if turn is not None:
        ids, path = list(turn.prompt_ids) + list(turn.output_ids) + suffix, "shared"
    else:
        msgs = ([{"role": "user", "content": user_message}] if user_message else []) + [
            {"role": "assistant", "content": bot_message}, {"role": "user", "content": question}]
        ids, path = engine.encode_messages(msgs), "prefill"
        if allow_shared:
            engine.stats.record("moderation", prompt=0, prefilled=0, reused=0, generated=0, seconds=0.0,
                                fallback=True)
    if len(ids) >= engine.context_length:
        return _moderate_windows(engine, bot_message, settings, probe, len(ids), t0)
    p_unsafe, threshold, method, reused, p_question = _score(engine, ids, settings, probe)
    v = Verdict(allowed=p_unsafe < threshold, p_unsafe=p_unsafe, path=path, prompt_tokens=len(ids),
                prefilled_tokens=len(ids) - reused, reused_tokens=reused, seconds=time.perf_counter() - t0,
                method=method, threshold=threshold, p_question=p_question)
    log.info("flashguard moderation: %s (p_unsafe=%.3f, threshold=%.2f, %s) path=%s prefilled=%d reused=%d in %.3fs",
             "allow" if v.allowed else "BLOCK", p_unsafe, threshold, method, path, v.prefilled_tokens,
             reused, v.seconds)
    return v


def _score(engine, ids, settings, probe) -> tuple[float, float, str, int, float]:
    """One forward over ``ids`` (the unseen suffix of them): ``(p_unsafe, threshold, method, reused,
    p_question)``."""
    logprobs, hidden, reused = engine.next_token_state(ids, task="moderation", hidden=probe is not None)
    log_odds = answer_log_odds(logprobs, answer_ids(engine, settings.unsafe_answer),
                               answer_ids(engine, settings.safe_answer))
    p_question = 1.0 / (1.0 + math.exp(-log_odds))
    if probe is not None:
        return probe.p_unsafe(hidden, log_odds), probe.threshold, "probe", reused, p_question
    return p_question, settings.threshold, "question", reused, p_question


def _moderate_windows(engine, bot_message, settings, probe, total, t0) -> Verdict:
    """A reply that with the question does not fit the model's context: judge consecutive windows of its
    tokens (each with the question, prefilled from text) and keep the worst. ``path`` is ``"windows"``."""
    tok = engine.tokenizer
    reply = tok(bot_message, add_special_tokens=False)["input_ids"]
    overhead = len(engine.encode_messages([{"role": "assistant", "content": ""},
                                           {"role": "user", "content": settings.prompt}]))
    size = engine.context_length - overhead - 16  # re-tokenising a window's text can merge or split a few ids
    if size < 16:
        from flashguard.errors import PromptError

        raise PromptError(f"the model's context ({engine.context_length} tokens) cannot hold the moderation question "
                          "and a piece of the reply; raise models[main].parameters.max_context")
    worst, threshold, method, prefilled = 0.0, settings.threshold, "question", 0
    for a in range(0, len(reply), size):
        ids = engine.encode_messages([{"role": "assistant", "content": tok.decode(reply[a:a + size])},
                                      {"role": "user", "content": settings.prompt}])
        p, threshold, method, reused, _ = _score(engine, ids, settings, probe)
        worst, prefilled = max(worst, p), prefilled + len(ids) - reused
    log.warning("flashguard moderation: the reply (%d tokens with the question) is longer than the model's context "
                "(%d); judged in %d windows, p_unsafe=%.3f", total, engine.context_length,
                -(-len(reply) // size), worst)
    return Verdict(allowed=worst < threshold, p_unsafe=worst, path="windows", prompt_tokens=total,
                   prefilled_tokens=prefilled, reused_tokens=0, seconds=time.perf_counter() - t0, method=method,
                   threshold=threshold)
