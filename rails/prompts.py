"""The token ids the rails read and the states they read from them, built only through the engine interface
(engine/interface.py), so that the rails, the guard and calibration build them one way.

Contract:
- ``moderation_suffix(engine, question)``: the ids that close the assistant's turn and ask ``question`` as the next
  user turn (memoised per engine); ``answer_ids(engine, word)``: the first ids of an answer word's usual spellings
  (their logits kept exact: ``keep_exact``).
- ``find_turn(engine, text)``: the engine's recent turn whose reply is ``text``; ``turn_ids``: the ids the output
  rail judges of it (a reasoning model's answer without its reasoning unless ``judge_reasoning``).
- ``message_start`` / ``content_start``: where the user's last message (its turn, its text) starts in a generation
  prompt; ``message_windows``: its first and last ``window`` tokens as text when it is longer; ``window_starts`` /
  ``window_means``: sliding windows over a span's states; ``common_prefix``: the shared length of two id lists.
- ``pooled_state`` / ``suffix_state``: one read that keeps the states a probe needs (``Engine.read``'s ``layers``
  and ``mean_from``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .state import rail_state

if TYPE_CHECKING:
    from .settings import ModerationSettings

_VARIANTS = lambda w: (w, " " + w, w.lower(), " " + w.lower(), w.upper())  # noqa: E731


def moderation_suffix(engine, question: str) -> list[int]:
    """Token ids that close the assistant turn and ask ``question`` as the next user turn (memoised per engine:
    rendering the chat template costs milliseconds, more than the shared-page forward at short contexts)."""
    memo = rail_state(engine).suffixes
    if question not in memo:
        memo[question] = _render_suffix(engine, question)
    return list(memo[question])


def _render_suffix(engine, question: str) -> list[int]:
    marker = "\x00FLASHGUARD-REPLY\x00"
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker},
            {"role": "user", "content": question}]
    text = engine.render_chat(msgs, add_generation_prompt=True)
    tail = text.split(marker, 1)[1]
    return engine.tokenize(tail)


def answer_ids(engine, word: str) -> list[int]:
    """First token ids of ``word`` in its usual spellings (" No", "no", ...), memoised per engine."""
    memo = rail_state(engine).answers
    if word not in memo:
        memo[word] = sorted({engine.tokenize(w)[0] for w in _VARIANTS(word.strip())})
        engine.keep_exact(memo[word])   # (an int4 lm_head recomputes them at every position)
    return list(memo[word])


def find_turn(engine, bot_message: str):
    """The most recent turn the engine generated whose text is ``bot_message`` (or contains it)."""
    wanted = bot_message.strip()
    if not wanted:
        return None
    turns = engine.recent_turns()
    for turn in reversed(turns):
        if turn.text.strip() == wanted:
            return turn
    for turn in reversed(turns):
        if wanted in turn.text:
            return turn
    return None


def turn_ids(engine, turn, settings: ModerationSettings) -> list[int]:
    """The ids of the turn the output rail judges: the prompt and the generated ids; for a reasoning model's turn
    with ``judge_reasoning`` off, the prompt and the final answer only (after an empty ``<think>`` block where the
    prompt opened one, as an R1 model writes when it does not think)."""
    from flashguard.reasoning import CLOSE, ThinkSplitter, opens_think, writes_reasoning

    prompt, output = list(turn.prompt_ids), list(turn.output_ids)
    if settings.judge_reasoning or not writes_reasoning(engine):
        return prompt + output
    inside = opens_think(engine.detokenize(prompt[-8:]))
    splitter = ThinkSplitter(inside=inside)
    reasoning, answer = splitter.feed(turn.text)
    more_reasoning, more_answer = splitter.finish()
    if not (reasoning + more_reasoning).strip():
        return prompt + output
    lead = f"\n{CLOSE}\n\n" if inside else ""
    return prompt + engine.tokenize(lead + answer + more_answer)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of two id lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def message_windows(engine, messages: list[dict], window: int) -> Optional[tuple[str, str]]:
    """The first and the last ``window`` tokens of the user's last message, as text, when it is longer than
    ``window`` tokens (else None: the probe judges the whole message)."""
    last = messages[-1] if messages else {}
    if not window or last.get("role") != "user":
        return None
    ids = engine.tokenize(str(last.get("content") or ""))
    if len(ids) <= window:
        return None
    return engine.detokenize(ids[:window]), engine.detokenize(ids[-window:])


def content_start(engine, messages: list[dict], ids: Optional[list[int]] = None) -> int:
    """Where the text of the user's last message starts in the generation prompt of ``messages`` (after the
    template's system prompt and the turn's header): the first token that differs from the prompt of the same
    conversation with that message empty."""
    ids = engine.encode_messages(messages) if ids is None else ids
    empty = engine.encode_messages(list(messages[:-1]) + [{**messages[-1], "content": ""}])
    n = 0
    while n < min(len(empty), len(ids)) and empty[n] == ids[n]:
        n += 1
    return n


def message_start(engine, messages: list[dict], ids: Optional[list[int]] = None) -> int:
    """Where the user's last message starts in the generation prompt of ``messages`` (``ids``, if already encoded):
    the first token that differs from the prompt of the conversation before it (0 for a first message: its mean then
    covers the template's own system prompt too, in calibration as in the rail)."""
    ids = engine.encode_messages(messages) if ids is None else ids
    if len(messages) < 2:
        return 0
    before = engine.encode_messages(messages[:-1])
    n = 0
    while n < min(len(before), len(ids)) and before[n] == ids[n]:
        n += 1
    return n


def window_starts(length: int, window: int, stride: int) -> list[int]:
    """The first position of each sliding window over ``length`` states: every ``stride``, and one that ends at the
    last state (a single window when ``length <= window``)."""
    if length <= window:
        return [0]
    starts = list(range(0, length - window + 1, stride))
    return starts + ([length - window] if starts[-1] != length - window else [])


def window_means(states: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """``states``: ``[layers, positions, d]`` -> the mean over each sliding window (``window_starts``),
    ``[layers, windows, d]``."""
    n = states.shape[1]
    cs = torch.cat([torch.zeros_like(states[:, :1]), states.double().cumsum(1)], 1)
    starts = torch.tensor(window_starts(n, window, stride))
    ends = (starts + window).clamp(max=n)
    return ((cs[:, ends] - cs[:, starts]) / (ends - starts)[None, :, None]).float()


def pooled_state(engine, ids: list[int], start: int, layers, task: str = "input_moderation", keep: bool = False):
    """One forward over ``ids`` (its unseen part) with the hidden states kept: ``(hidden [layers + 1, d] of the last
    token, the mean state over ids[start:] at each of ``layers`` [len(layers), d], reused)``. Tokens from ``start``
    on must run through this forward for their mean, so a session that already holds them is cropped back to
    ``start`` first (the same message checked twice pays its prefill twice). ``keep``: a fourth value, the states
    of every position from ``start`` on at ``layers`` (``[len(layers), len(ids) - start, d]``)."""
    _, hidden, mean, reused, kept = _pooled_forward(engine, ids, start, layers, task, keep)
    return (hidden, mean, reused, kept) if keep else (hidden, mean, reused)


def suffix_state(engine, ids: list[int], start: int, layers, task: str = "moderation"):
    """The output rail's forward for a probe that reads the suffix's mean (``features: last+mean``, format version
    2): ``(logprobs [vocab], hidden [layers + 1, d] of the last token, the mean state over ids[start:] at each of
    ``layers`` [len(layers), d], reused)``. ``start`` is the suffix's first position: the turn's pages are reused
    as by any read, only the suffix runs."""
    logprobs, hidden, mean, reused, _ = _pooled_forward(engine, ids, start, layers, task, False)
    return logprobs, hidden, mean, reused


def _pooled_forward(engine, ids, start, layers, task, keep):
    r = engine.read(ids, task=task, hidden=True, layers=layers, mean_from=start, keep_states=keep)
    return r.logprobs, r.hidden, r.mean, r.reused, r.states
