"""What decides a moderation rail's verdict, and how one read becomes a score.

Contract:
- ``choose_probe(engine, settings)``: the probe that decides (``probe: auto``: the model's own, user cache then
  shipped; a file the config names; None where none is found, ``probe: off``, or the engine returns no states),
  warning once per engine where that weakens the verdict; ``choose_classifier``: the question classifier where no
  probe decides (``classifier: auto`` on an engine without states, or a file the config names), or None.
- ``probe_threshold`` / ``decision_threshold``: the threshold a probe decides at under ``strictness``
  (``decision_threshold`` says once where a probe has no strictness table); ``hint``: the command that trains the
  probe a setting needs.
- ``score`` (one read: the probe's or the question's p_unsafe), ``score_prompt`` (an input probe on a generation
  prompt), ``score_classifier`` (one read per question): what a verdict is made of; ``moderate_windows``: a message
  too long for the context with the question, judged by windows of it; ``longest_extra``: how much longer the
  classifier's longest question is than the rail's.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Optional

from .probe import answer_log_odds
from .prompts import answer_ids, moderation_suffix
from .settings import DEFAULT_THRESHOLD, INPUT_THRESHOLD, ModerationSettings, Verdict
from .state import rail_state

log = logging.getLogger("flashguard")


def hint(settings: ModerationSettings) -> str:
    """The command that trains the probe ``settings`` need."""
    from .probe import CALIBRATE_HINT

    return CALIBRATE_HINT + (" --rail input" if settings.side == "input" else "")


def probe_threshold(probe, settings: ModerationSettings, long: bool = False) -> tuple[float, str]:
    """The threshold ``probe`` decides at under ``settings.strictness``, and the level it came from: the level's entry
    of the probe's strictness table (``long``: the window table, ``long_strictness``, for the worst window of a long
    message), else the probe's own threshold (``long_threshold``) and ``""`` (no table: the level does not apply)."""
    table = probe.long_strictness if long else probe.strictness
    if table:
        return table[settings.strictness], settings.strictness
    return (probe.long_threshold if long else probe.threshold), ""


def decision_threshold(engine, probe, settings: ModerationSettings, long: bool = False) -> tuple[float, str]:
    """``probe_threshold``; a probe without the table says so once per engine, rail and table (INFO)."""
    threshold, level = probe_threshold(probe, settings, long)
    if not level:
        warned = rail_state(engine).strictness_warned
        if (settings.side, long) not in warned:
            warned.add((settings.side, long))
            log.info("flashguard moderation: the %s probe has no %sstrictness table (fitted before the levels); it "
                     "decides at its own threshold %.2f, so %s.strictness (%s) does not apply. `%s --sources` fits "
                     "one with the table", settings.side, "window " if long else "", threshold, settings.section,
                     settings.strictness, hint(settings))
    return threshold, level


def choose_probe(engine, settings: ModerationSettings, quiet: bool = False):
    """The probe the verdict uses, or None for the question verdict (``probe: auto`` without a probe warns once
    per engine and question, naming the file ``flashguard calibrate`` would write). ``quiet``: no log lines (the
    guard adapter asks which probe it would pair with; its verdict needs none of them)."""
    from .probe import Probe, ProbeError, find_probe, ModelKey, CALIBRATE_HINT

    mode = settings.probe.strip()
    if mode == "off" or settings.guard == "question":
        return None
    if not engine.returns_states:   # a serving engine (backend: openai) returns log-probabilities, not states
        warned = rail_state(engine).probe_warned
        if not quiet and ("remote", settings.side) not in warned:
            warned.add(("remote", settings.side))
            log.info("flashguard moderation: the openai backend returns no hidden states; %s.probe is not used "
                     "(the %s rail decides by its questions' log-odds)", settings.section, settings.side)
        return None
    if mode == "auto":
        probe, where = find_probe(engine, settings.prompt, settings.side)
        default = INPUT_THRESHOLD if settings.side == "input" else DEFAULT_THRESHOLD
        if probe is not None and settings.threshold != default and not quiet:
            warned = rail_state(engine).threshold_warned
            if settings.threshold not in warned:
                warned.add(settings.threshold)
                log.warning("flashguard moderation: %s.threshold (%s) applies to the "
                            "question verdict; the probe %s decides with its own calibrated threshold %.2f (set "
                            "strictness: low, medium or high to move it). Set probe: off to decide by the question "
                            "and that threshold", settings.section, settings.threshold, where,
                            probe_threshold(probe, settings)[0])
        if probe is None and not quiet:
            warned = rail_state(engine).probe_warned
            if settings.prompt not in warned:
                warned.add(settings.prompt)
                log.warning("flashguard moderation: %s; the rail uses the question's Yes/No verdict, which is much "
                            "less accurate (docs/moderation.md). Run `%s` to train a probe for this model",
                            where, hint(settings))
        return probe
    memo = rail_state(engine).probe_files
    if mode not in memo:
        from pathlib import Path

        path = Path(mode).expanduser()
        if not path.is_file():
            raise ProbeError(f"{settings.section}.probe: no probe file at {path}; run "
                             f"`{hint(settings)} --out {path}` to make it, or set probe: auto")
        probe = Probe.load(path, hint(settings))
        if not probe.matches(ModelKey.of(engine)) or probe.question != settings.prompt:
            raise ProbeError(f"{settings.section}.probe: {path} was trained for {probe.model_file} "
                             f"({probe.weights} weights) with the question {probe.question!r}, not for this "
                             f"model and question; run `{hint(settings)} --out {path}` again")
        memo[mode] = probe
    return memo[mode]


def choose_classifier(engine, settings: ModerationSettings):
    """The question classifier the verdict uses where no probe decides (``ModerationSettings.classifier``), or None
    for the single question. ``auto`` on an engine without hidden states says once per engine and rail which one
    decides (INFO with the classifier, WARNING without)."""
    from .classifier import QUESTIONS, find_classifier, load_for

    mode = settings.classifier.strip()
    if mode == "off" or settings.guard == "question":
        return None
    if mode != "auto":
        return load_for(engine, mode, settings.side, settings.section)
    if engine.returns_states:   # in process, probe: off keeps the single question unless a file is named
        return None
    default = (QUESTIONS[settings.side][0].text, "", "No", "Yes")
    mine = (settings.question, settings.policy.strip(), settings.unsafe_answer, settings.safe_answer)
    clf, where = find_classifier(engine, settings.side) if mine == default else \
        (None, f"{settings.section} sets its own question (the question classifier asks the default ones)")
    warned = rail_state(engine).probe_warned
    if ("classifier", settings.side) not in warned:
        warned.add(("classifier", settings.side))
        if clf is not None:
            log.info("flashguard moderation: the %s rail decides by the question classifier %s (%d questions: %d "
                     "requests per check, each the conversation + a ~%d-token question)", settings.side, where,
                     len(clf.questions), len(clf.questions), len(moderation_suffix(engine, clf.questions[0].text)))
        else:
            log.warning("flashguard moderation: %s; the %s rail decides by one question's Yes/No verdict at %s.threshold "
                        "%.2f, which is much less accurate. Run `%s` to fit one", where, settings.side,
                        settings.section, settings.threshold, _classifier_hint(settings))
    return clf


def _classifier_hint(settings: ModerationSettings) -> str:
    from .classifier import hint as classifier_hint

    return classifier_hint(settings.side)


def score_classifier(engine, clf, settings: ModerationSettings, ids_for, task: str = "moderation",
                      keep_for=None) -> tuple[float, float, int, int, int, float]:
    """The classifier's verdict: one read per question over ``ids_for(question)`` (``classifier.features``).
    ``(p_unsafe, threshold, prompt tokens, prefilled, reused, p_question)``, tokens summed over the reads;
    ``p_question`` is the first (the rail's default) question's own P(unsafe answer)."""
    from .classifier import features

    x, prompt, prefilled, reused = features(engine, ids_for, clf.questions, task, keep_for)
    return (clf.p_unsafe(x), clf.threshold_for(settings.strictness), prompt, prefilled, reused,
            1.0 / (1.0 + math.exp(-x[0])))


def longest_extra(engine, clf, question: str) -> int:
    """How many more tokens the classifier's longest question's suffix has than ``question``'s (0 without one)."""
    if clf is None:
        return 0
    base = len(moderation_suffix(engine, question))
    return max(0, max(len(moderation_suffix(engine, q.text)) for q in clf.questions) - base)


def score(engine, ids, settings, probe, task: str = "moderation",
           keep: Optional[int] = None) -> tuple[float, float, str, int, float, str]:
    """One forward over ``ids`` (the unseen suffix of them): ``(p_unsafe, threshold, method, reused,
    p_question, strictness level)`` (the level "" where none applies: ``probe_threshold``). A probe that reads the
    suffix's mean (``features: last+mean``, format 2) gets it from the same forward: the mean over the last
    ``len(moderation_suffix)`` positions of ``ids`` (the suffix, which ends every output rail's ids), so the prefill
    is still only the suffix. ``keep``: as ``Engine.read``'s."""
    pooled = None
    if probe is not None and probe.pools:
        start = len(ids) - len(moderation_suffix(engine, settings.prompt))
        r = engine.read(ids, task=task, hidden=True, layers=probe.pool_layers, mean_from=start, keep=keep)
        pooled = r.mean.mean(0)
    else:
        r = engine.read(ids, task=task, hidden=probe is not None, keep=keep)
    logprobs, hidden, reused = r.logprobs, r.hidden, r.reused
    log_odds = answer_log_odds(logprobs, answer_ids(engine, settings.unsafe_answer),
                               answer_ids(engine, settings.safe_answer))
    p_question = 1.0 / (1.0 + math.exp(-log_odds))
    if probe is not None:
        threshold, level = decision_threshold(engine, probe, settings)
        return probe.p_unsafe(hidden, log_odds, pooled), threshold, "probe", reused, p_question, level
    return p_question, settings.threshold, "question", reused, p_question, ""


def score_prompt(engine, ids, probe, start: int = 0, keep: Optional[int] = None) -> tuple[float, int]:
    """An input probe on the generation prompt ``ids``: the state of its last token and, for a probe that reads it,
    the mean state over ``ids[start:]`` (the user's message: ``message_start``). ``(p_unsafe, reused)``. ``keep``:
    the session afterwards holds at most ``ids[:keep]`` (``Engine.read``)."""
    if not probe.pools:
        r = engine.read(ids, task="input_moderation", hidden=True, keep=keep)
        return probe.p_unsafe(r.hidden, 0.0), r.reused
    r = engine.read(ids, task="input_moderation", hidden=True, layers=probe.pool_layers, mean_from=start, keep=keep)
    return probe.p_unsafe(r.hidden, 0.0, r.mean.mean(0)), r.reused


def moderate_windows(engine, bot_message, settings, probe, total, t0, role: str = "assistant", clf=None) -> Verdict:
    """A reply (or, with ``role="user"``, a user message) that with the question does not fit the model's
    context: judge consecutive windows of its tokens (each with the question, prefilled from text) and keep the
    worst. ``path`` is ``"windows"``."""
    reply = engine.tokenize(bot_message)
    overhead = len(engine.encode_messages([{"role": role, "content": ""},
                                           {"role": "user", "content": settings.prompt}])) + \
        longest_extra(engine, clf, settings.prompt)
    size = engine.context_length - overhead - 16  # re-tokenising a window's text can merge or split a few ids
    if size < 16:
        from flashguard.errors import PromptError

        raise PromptError(f"the model's context ({engine.context_length} tokens) cannot hold the moderation question "
                          "and a piece of the reply; raise models[main].parameters.max_context")
    worst, threshold, method, prefilled, level = 0.0, settings.threshold, "question", 0, ""
    for a in range(0, len(reply), size):
        window = [{"role": role, "content": engine.detokenize(reply[a:a + size])}]
        if probe is not None and probe.rail == "input":   # the input probe reads the window's own prompt
            ids = engine.encode_messages(window)
            (p, reused), method = score_prompt(engine, ids, probe), "probe"
            threshold, level = decision_threshold(engine, probe, settings)
        elif clf is not None:
            p, threshold, _, window_prefilled, _, _ = score_classifier(
                engine, clf, settings, lambda q: engine.encode_messages(window + [{"role": "user", "content": q.text}]))
            method, level = "classifier", settings.strictness
            worst, prefilled = max(worst, p), prefilled + window_prefilled
            continue
        else:
            ids = engine.encode_messages(window + [{"role": "user", "content": settings.prompt}])
            p, threshold, method, reused, _, level = score(engine, ids, settings, probe)
        worst, prefilled = max(worst, p), prefilled + len(ids) - reused
    log.warning("flashguard moderation: the %s (%d tokens with the question) is longer than the model's context "
                "(%d); judged in %d windows, p_unsafe=%.3f", "reply" if role == "assistant" else "user's message",
                total, engine.context_length,
                -(-len(reply) // size), worst)
    return Verdict(allowed=worst < threshold, p_unsafe=worst, path="windows", prompt_tokens=total,
                   prefilled_tokens=prefilled, reused_tokens=0, seconds=time.perf_counter() - t0, method=method,
                   threshold=threshold, strictness=level)
