"""The output-moderation rail: asks the same model about the same conversation.

The moderation input is the token ids the engine actually ran for the turn (prompt ids + the ids
it generated, never re-tokenised text) followed by a short suffix: the chat template's end of the
assistant turn and a user question carrying the policy. Because that input starts with the turn's
own ids, the engine finds them in its cache and prefills only the suffix.

The verdict is read from the next-token probabilities of the two allowed answers (by default the
question is "is your reply safe...?", so "No" = unsafe and "Yes" = safe) in one forward pass; the model never generates free text, so a rambling small model
cannot block everything.

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

    @property
    def reason(self) -> str:
        return f"p_unsafe={self.p_unsafe:.3f} via {self.path} path"


@dataclass(frozen=True)
class ModerationSettings:
    """From ``custom_data.flashguard_moderation`` in config.yml.

    policy         text put before the question (empty by default)
    question       the question asked as the next user turn
    unsafe_answer  the answer word that means "block" ("No" for the default question)
    safe_answer    the answer word that means "allow"
    threshold      block when P(unsafe_answer) / (P(unsafe) + P(safe)) >= threshold
    """

    policy: str = DEFAULT_POLICY
    question: str = DEFAULT_QUESTION
    unsafe_answer: str = "No"
    safe_answer: str = "Yes"
    threshold: float = DEFAULT_THRESHOLD

    @property
    def prompt(self) -> str:
        return f"{self.policy.strip()}\n{self.question}" if self.policy.strip() else self.question

    @classmethod
    def from_custom_data(cls, custom_data: Optional[dict]) -> "ModerationSettings":
        from flashguard.errors import ConfigError

        data = dict((custom_data or {}).get("flashguard_moderation") or {})
        known = {"policy", "question", "unsafe_answer", "safe_answer", "threshold"}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown key(s) {sorted(unknown)} in custom_data.flashguard_moderation; "
                              f"known keys are {', '.join(sorted(known))}")
        settings = cls(**data)
        if not 0 < settings.threshold < 1:
            raise ConfigError("custom_data.flashguard_moderation.threshold must be between 0 and 1, "
                              f"got {settings.threshold!r}")
        if not settings.unsafe_answer.strip() or not settings.safe_answer.strip():
            raise ConfigError("custom_data.flashguard_moderation.unsafe_answer and safe_answer must be words")
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
                     "earlier check", "allow" if v.allowed else "BLOCK", v.p_unsafe, settings.threshold)
            return v
        verdict = _moderate(engine, bot_message, user_message, settings, turn, allow_shared)
        if allow_shared:
            memo[key] = verdict
            while len(memo) > _MEMO_SIZE:
                memo.pop(next(iter(memo)))
        return verdict


def _moderate(engine, bot_message, user_message, settings, turn, allow_shared) -> Verdict:
    t0 = time.perf_counter()
    question = settings.prompt
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
    logprobs, reused = engine.next_token_logprobs(ids, task="moderation")
    p_bad = sum(math.exp(float(logprobs[i])) for i in answer_ids(engine, settings.unsafe_answer))
    p_good = sum(math.exp(float(logprobs[i])) for i in answer_ids(engine, settings.safe_answer))
    p_unsafe = p_bad / (p_bad + p_good) if p_bad + p_good > 0 else 0.5
    v = Verdict(allowed=p_unsafe < settings.threshold, p_unsafe=p_unsafe, path=path, prompt_tokens=len(ids),
                prefilled_tokens=len(ids) - reused, reused_tokens=reused, seconds=time.perf_counter() - t0)
    log.info("flashguard moderation: %s (p_unsafe=%.3f, threshold=%.2f) path=%s prefilled=%d reused=%d in %.3fs",
             "allow" if v.allowed else "BLOCK", p_unsafe, settings.threshold, path, v.prefilled_tokens,
             reused, v.seconds)
    return v
