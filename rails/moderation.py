"""The moderation rails: ask the same model about the same conversation.

Output rail (``moderate``, here): judges the bot's reply. Input rail (``moderate_input``, input_rail.py): judges
the user's last message; its probe reads the generation's own prompt (the check is the generation's prefill), and
without a probe the Yes/No question branches off the conversation's own ids and is cropped away after the verdict;
either way the generation that follows reuses every page the check used.

The moderation input is the token ids the engine actually ran for the turn (prompt ids + the ids
it generated, never re-tokenised text) followed by a short suffix: the chat template's end of the
assistant turn and a user question. Because that input starts with the turn's own ids, the engine
finds them in its cache and prefills only the suffix.

The verdict comes from that one forward pass (the model never generates free text), or from two:

- ``adapter+probe`` (``guard: auto``, configs/flash's default where the model has a guard adapter measured with its
  probe, as the embedded SmolLM2 has): the guard adapter's read and the probe's read, each a suffix on the turn's
  pages, made one verdict (``guard.decide``); ``adapter`` (``guard: adapter``, or a guard measured with no probe):
  the guard adapter's read alone (rails/guard.py).
- ``probe`` (``guard: probe``, or no guard adapter for the model): a logistic regression on the hidden state of
  the suffix's last token (``rails/probe.py``), trained by ``flashguard calibrate`` on a labelled set; the
  embedded SmolLM2's probes (float and int4) ship in the package.
- ``classifier`` (the default where the engine returns no hidden states: ``backend: openai``): a logistic regression
  over the Yes/No log-odds of a few differently worded questions (``rails/classifier.py``), each asked as the
  conversation's ids + its own suffix (one read per question; the conversation's pages or the server's prefix cache
  are reused by each); fitted by ``flashguard calibrate --backend openai --sources``, the embedded SmolLM2's shipped.
- ``question`` (the fallback, or ``probe: off`` / ``classifier: off``): the next-token probabilities of the two
  allowed answers ("Is your last reply safe...?": "No" = unsafe, "Yes" = safe).

If the turn is not found (another process produced the text, or a message the engine did not
generate), the rail prefills the exchange from text; ``Verdict.path`` says which way it went and
the engine's moderation stats count it as a fallback.

The rails' parts each have their own module, and this one re-exports their public names (``from
flashguard.rails.moderation import ...`` keeps working): ``settings.py`` (ModerationSettings, Verdict),
``prompts.py`` (the ids and states the rails read), ``decide.py`` (what decides and how a read becomes a score),
``input_rail.py`` (the input rail), ``guard.py`` (the guard adapter's verdict).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from .decide import (choose_classifier, choose_probe, decision_threshold, hint, longest_extra,  # noqa: F401
                     moderate_windows, probe_threshold, score, score_classifier, score_prompt)
from .input_rail import moderate_input  # noqa: F401
from .prompts import (answer_ids, common_prefix, content_start, find_turn, message_start,  # noqa: F401
                      message_windows, moderation_suffix, pooled_state, suffix_state, turn_ids, window_means,
                      window_starts)
from .settings import (DEFAULT_POLICY, DEFAULT_QUESTION, DEFAULT_THRESHOLD, GUARD_MODES,  # noqa: F401
                       INPUT_QUESTION, INPUT_THRESHOLD, SECTIONS, ModerationSettings, Verdict)
from .state import rail_state

log = logging.getLogger("flashguard")

_MEMO_SIZE = 64


def moderate(engine, bot_message: str, user_message: Optional[str] = None,
             settings: ModerationSettings = ModerationSettings(), *, allow_shared: bool = True,
             use_memo: bool = True) -> Verdict:
    """Score ``bot_message`` against the policy with one forward pass.

    A verdict is remembered per (turn, text, settings): NeMo's streaming output rails check the final
    text again after the last chunk, and that second check costs nothing.
    """
    with engine.exclusive():  # the streaming chunk check and the final check can arrive together
        turn = find_turn(engine, bot_message) if allow_shared else None
        state = rail_state(engine)
        memo = state.verdicts
        key = (turn, bot_message.strip(), user_message if turn is None else None, settings)
        with state.lock:
            v = memo.get(key) if use_memo and allow_shared else None
        if v is not None:
            log.info("flashguard moderation: %s (p_unsafe=%.3f, threshold=%.2f) remembered from the same turn's "
                     "earlier check", "allow" if v.allowed else "BLOCK", v.p_unsafe, v.threshold)
            return v
        verdict = _moderate(engine, bot_message, user_message, settings, turn, allow_shared)
        if allow_shared:
            with state.lock:
                memo[key] = verdict
                while len(memo) > _MEMO_SIZE:
                    memo.pop(next(iter(memo)))
        return verdict


def _moderate(engine, bot_message, user_message, settings, turn, allow_shared) -> Verdict:
    from . import guard

    if guard.chosen(engine, settings):
        return guard.decide(engine, "output", settings,
                            lambda first: guard.moderate_output(engine, bot_message, user_message, settings, turn,
                                                                allow_shared, count_fallback=first),
                            lambda: _without_guard(engine, bot_message, user_message, settings, turn, allow_shared))
    return _without_guard(engine, bot_message, user_message, settings, turn, allow_shared)


def _without_guard(engine, bot_message, user_message, settings, turn, allow_shared) -> Verdict:
    """The output rail's verdict by the probe, the classifier or the question."""
    t0 = time.perf_counter()
    question = settings.prompt
    probe = choose_probe(engine, settings)
    clf = choose_classifier(engine, settings) if probe is None else None
    suffix = moderation_suffix(engine, question)
    if turn is not None:
        base = turn_ids(engine, turn, settings)
        ids, path = base + suffix, "shared"
        ids_for = lambda q: base + moderation_suffix(engine, q.text)   # noqa: E731
    else:
        msgs = ([{"role": "user", "content": user_message}] if user_message else []) + [
            {"role": "assistant", "content": bot_message}]
        ids, path = engine.encode_messages(msgs + [{"role": "user", "content": question}]), "prefill"
        ids_for = lambda q: engine.encode_messages(msgs + [{"role": "user", "content": q.text}])   # noqa: E731
        if allow_shared:
            engine.stats.record("moderation", prompt=0, prefilled=0, reused=0, generated=0, seconds=0.0,
                                fallback=True)
    if len(ids) + longest_extra(engine, clf, question) >= engine.context_length:
        return moderate_windows(engine, bot_message, settings, probe, len(ids), t0, clf=clf)
    if clf is not None:
        p_unsafe, threshold, prompt, prefilled, reused, p_question = score_classifier(engine, clf, settings, ids_for)
        v = Verdict(allowed=p_unsafe < threshold, p_unsafe=p_unsafe, path=path, prompt_tokens=prompt,
                    prefilled_tokens=prefilled, reused_tokens=reused, seconds=time.perf_counter() - t0,
                    method="classifier", threshold=threshold, p_question=p_question, strictness=settings.strictness)
    else:
        p_unsafe, threshold, method, reused, p_question, level = score(engine, ids, settings, probe)
        v = Verdict(allowed=p_unsafe < threshold, p_unsafe=p_unsafe, path=path, prompt_tokens=len(ids),
                    prefilled_tokens=len(ids) - reused, reused_tokens=reused, seconds=time.perf_counter() - t0,
                    method=method, threshold=threshold, p_question=p_question, strictness=level)
    log.info("flashguard moderation: %s (p_unsafe=%.3f, threshold=%.2f, %s) path=%s prefilled=%d reused=%d in %.3fs",
             "allow" if v.allowed else "BLOCK", p_unsafe, threshold, v.decided_by, path, v.prefilled_tokens,
             reused, v.seconds)
    return v
