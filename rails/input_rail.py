"""The input rail: judge the user's last message on the conversation's own pages, before the generation.

Contract: ``moderate_input(engine, messages, settings)`` -> ``Verdict`` (``settings``: the
``custom_data.flashguard_input_moderation`` section's, ``ModerationSettings.input_defaults()`` without one). The
check reads the generation's own prompt or branches off it, so the generation that follows reuses every page the
check used; its docstring says how each ``path`` does that. The guard adapter decides where ``guard.chosen`` says so.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from .decide import (choose_classifier, choose_probe, decision_threshold, longest_extra, moderate_windows, score,
                     score_classifier, score_prompt)
from .prompts import common_prefix, content_start, message_start, message_windows, pooled_state, window_means
from .settings import ModerationSettings, Verdict

log = logging.getLogger("flashguard")


def moderate_input(engine, messages: list[dict], settings: Optional[ModerationSettings] = None) -> Verdict:
    """Score the user's last message of ``messages`` (the conversation as the generation will send it) with one
    forward pass on the conversation's own pages.

    With a guard adapter (``guard: auto``, the default where the model has one): the adapter's question branches off
    the conversation after the message (rails/guard.py), and where the guard was measured with the model's input
    probe, the probe's read below runs first and the two make one verdict (``method="adapter+probe"``, ``path`` both
    reads': ``prompt+branch``, ``sliding+branch``, ...). The probe's own verdict (``guard: probe``) is as follows.

    With the model's input probe (``path="prompt"``, the default without a guard adapter): the pass is the generation's
    own prefill (the chat template of ``messages`` with its generation prompt: the engine reuses what it holds of
    the conversation and prefills the new message), and the probe reads the hidden states of the message (their
    mean over its turn, and/or the last token's, where the model is about to answer: ``probe.features``). Nothing
    is added, so the generation that follows prefills one token. A message longer than the probe's ``window``
    tokens (``path="sliding"``, v5 probes) is judged by sliding windows over the states of the same forward (the
    generation's prefill: the generation again prefills one token), each window's mean read by the probe's window
    weights, blocked if the worst window reaches the window threshold: an instruction hidden in the middle of a long
    paste is in some window. (v4 probes, without window weights: ``path="head+tail"``, the first and the last
    ``window`` tokens, each as the user's message after the same conversation, two branches cropped away after.)

    Without a probe (``probe: off``, or none for the model: ``path="branch"``): the question is asked as one more
    user turn after the message; its ids share every token with the generation's prompt up to the end of the
    message (``branch``), and after the verdict the session is cropped back there, so the generation prefills only
    its prompt's tail. A conversation longer than the context is not judged (``path="too-long"``, allowed): the
    generation refuses it with its own error, the server's 400 naming the context. One that fits but not with
    the question after it is judged in windows of the message (``path="windows"``).
    """
    from . import guard

    settings = settings or ModerationSettings.input_defaults()
    with engine.exclusive():
        if guard.chosen(engine, settings):
            return guard.decide(engine, "input", settings,
                                lambda first: guard.moderate_input(engine, messages, settings),
                                lambda: _without_guard(engine, messages, settings))
        return _without_guard(engine, messages, settings)


def _without_guard(engine, messages: list[dict], settings: ModerationSettings) -> Verdict:
    """The input rail's verdict by the probe, the classifier or the question (``moderate_input``'s docstring)."""
    t0 = time.perf_counter()
    probe = choose_probe(engine, settings)
    clf = choose_classifier(engine, settings) if probe is None else None
    conv = engine.encode_messages(messages)
    ids = conv if probe is not None else \
        engine.encode_messages(list(messages) + [{"role": "user", "content": settings.prompt}])
    if len(conv) >= engine.context_length:
        # nothing can be generated from it: the generation refuses it with its own error (the server's 400
        # naming the context), which a refusal here would hide (a long benign text judged in windows can
        # look unsafe); the verdict says so and blocks nothing
        log.info("flashguard moderation: the conversation (%d tokens) is longer than the model's context (%d); "
                 "the generation refuses it, the input rail does not judge it", len(conv), engine.context_length)
        return Verdict(allowed=True, p_unsafe=0.0, path="too-long", prompt_tokens=len(conv), prefilled_tokens=0,
                       reused_tokens=0, seconds=time.perf_counter() - t0, method="none",
                       threshold=settings.threshold)
    if len(ids) + longest_extra(engine, clf, settings.prompt) >= engine.context_length:
        # the question does not fit after the message: the message alone
        last = next((m for m in reversed(messages) if m.get("role") == "user"), messages[-1])
        return moderate_windows(engine, str(last.get("content") or ""), settings, probe, len(ids), t0,
                                 role="user", clf=clf)
    pieces = message_windows(engine, messages, probe.window) if probe is not None else None
    if probe is not None and pieces is not None and probe.slides:
        # a long message (a pasted document, code, a log, a long jailbreak): judged in place by sliding windows
        # over the states of its own forward, which is the generation's prefill (the generation then prefills
        # one token); blocked if any window is
        start = content_start(engine, messages, conv)
        _, _, reused, states = pooled_state(engine, conv, start, (probe.long_layer,), task="input_moderation",
                                            keep=True)
        p_windows = probe.p_windows(window_means(states, probe.long_window, probe.stride)[0])
        p_unsafe, worst = float(p_windows.max()), int(p_windows.argmax())
        threshold, level = decision_threshold(engine, probe, settings, long=True)
        v = Verdict(allowed=p_unsafe < threshold, p_unsafe=p_unsafe, path="sliding",
                    prompt_tokens=len(conv), prefilled_tokens=len(conv) - reused, reused_tokens=reused,
                    seconds=time.perf_counter() - t0, method="probe", threshold=threshold,
                    p_question=float("nan"), strictness=level)
        log.info("flashguard input moderation: %s (p_unsafe=%.3f, threshold=%.2f, %s, on %d windows of %d "
                 "tokens, the worst at token %d of the message) prefilled=%d reused=%d in %.3fs",
                 "allow" if v.allowed else "BLOCK", p_unsafe, v.threshold, v.decided_by, len(p_windows),
                 probe.long_window, worst * probe.stride, v.prefilled_tokens, reused, v.seconds)
        return v
    if probe is not None and pieces is None:
        start = message_start(engine, messages, conv) if probe.pools else 0
        p_unsafe, reused = score_prompt(engine, ids, probe, start)
        threshold, level = decision_threshold(engine, probe, settings)
        method, p_question, path = "probe", float("nan"), "prompt"
    elif probe is not None:
        # a long message (a pasted document, code, a log, a long jailbreak): its first and its last
        # probe.window tokens, each as the user's message after the same conversation (a branch off its pages,
        # cropped away after), blocked if either is; the generation prefills the message itself
        start = message_start(engine, messages, conv)
        p_unsafe, prefilled, reused = 0.0, 0, 0
        for piece in pieces:
            branch = list(messages[:-1]) + [{**messages[-1], "content": piece}]
            branch_ids = engine.encode_messages(branch)
            # each piece is a branch after the conversation: the session goes back to its start after
            p, r = score_prompt(engine, branch_ids, probe, message_start(engine, branch, branch_ids), keep=start)
            p_unsafe, prefilled, reused = max(p_unsafe, p), prefilled + len(branch_ids) - r, max(reused, r)
        threshold, level = decision_threshold(engine, probe, settings)
        method, p_question, path = "probe", float("nan"), "head+tail"
        v = Verdict(allowed=p_unsafe < threshold, p_unsafe=p_unsafe, path=path, prompt_tokens=len(conv),
                    prefilled_tokens=prefilled, reused_tokens=reused, seconds=time.perf_counter() - t0,
                    method=method, threshold=threshold, p_question=p_question, strictness=level)
        log.info("flashguard input moderation: %s (p_unsafe=%.3f, threshold=%.2f, %s, on the first and last %d "
                 "of the message's tokens) prefilled=%d in %.3fs", "allow" if v.allowed else "BLOCK", p_unsafe,
                 threshold, v.decided_by, probe.window, prefilled, v.seconds)
        return v
    elif clf is not None:
        # each question branches off the conversation where its ids leave it: the generation continues from there
        p_unsafe, threshold, prompt, prefilled, reused, p_question = score_classifier(
            engine, clf, settings,
            lambda q: engine.encode_messages(list(messages) + [{"role": "user", "content": q.text}]),
            task="input_moderation", keep_for=lambda q_ids: common_prefix(conv, q_ids))
        v = Verdict(allowed=p_unsafe < threshold, p_unsafe=p_unsafe, path="branch", prompt_tokens=prompt,
                    prefilled_tokens=prefilled, reused_tokens=reused, seconds=time.perf_counter() - t0,
                    method="classifier", threshold=threshold, p_question=p_question,
                    strictness=settings.strictness)
        log.info("flashguard input moderation: %s (p_unsafe=%.3f, threshold=%.2f, %s, %d questions) prefilled=%d "
                 "reused=%d in %.3fs", "allow" if v.allowed else "BLOCK", p_unsafe, threshold, v.decided_by,
                 len(clf.questions), prefilled, reused, v.seconds)
        return v
    else:
        branch = common_prefix(conv, ids)
        # the question branched off at ``branch``: the generation continues from there
        p_unsafe, threshold, method, reused, p_question, level = score(engine, ids, settings, None,
                                                                        task="input_moderation", keep=branch)
        path = "branch"
    v = Verdict(allowed=p_unsafe < threshold, p_unsafe=p_unsafe, path=path, prompt_tokens=len(ids),
                prefilled_tokens=len(ids) - reused, reused_tokens=reused, seconds=time.perf_counter() - t0,
                method=method, threshold=threshold, p_question=p_question, strictness=level)
    log.info("flashguard input moderation: %s (p_unsafe=%.3f, threshold=%.2f, %s) prefilled=%d reused=%d in %.3fs",
             "allow" if v.allowed else "BLOCK", p_unsafe, threshold, v.decided_by, v.prefilled_tokens, reused,
             v.seconds)
    return v
