"""The decode loop: tokens chosen from logits one at a time until a stop, as text in pieces (``Delta``).

Contract:
- ``run(logits, step, params, ...)`` is a generator of Deltas: it chooses a token from ``logits`` (``choose``:
  greedy or sampled, after the penalties of the ids generated so far: ``Penalties``), stops at an end-of-sequence
  id, a stop string or ``max_new`` tokens, otherwise calls
  ``step(token)`` for the next logits. Text is yielded only up to where no stop string can still begin; the last
  Delta has ``finish_reason`` ("stop" | "length") and the token counts. The ids produced are appended to ``out``
  as they are chosen (the caller's stats see them even when the stream is closed early); the generator's return
  value is the final text.
- It knows nothing of sessions, locks or stats: ``Engine.stream`` brings the session to the prompt, holds the lock
  and records the task around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .sampling import IncrementalText, Penalties, SamplingParams, StopMatcher, choose


@dataclass(frozen=True)
class Delta:
    """A piece of streamed output. The last Delta of a call has ``finish_reason`` set."""

    text: str
    finish_reason: str | None = None  # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Turn:
    """What the engine ran for one generation: the ids it attended to and the ids it produced."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str


def joined(deltas: Iterator[Delta]) -> Delta:
    """A stream's Deltas as one: the whole text, the last Delta's finish reason and token counts."""
    parts, last = [], None
    for d in deltas:
        parts.append(d.text)
        last = d
    return Delta("".join(parts), last.finish_reason, last.prompt_tokens, last.completion_tokens)


def run(logits: torch.Tensor, step: Callable[[int], torch.Tensor], params: SamplingParams,
        generator: torch.Generator | None, *, max_new: int, eos_ids: frozenset[int],
        detokenize: Callable[[Sequence[int]], str], prompt_tokens: int, out: list[int]) -> Iterator[Delta]:
    """The loop (see the module docstring); returns the final text."""
    stopper = StopMatcher(params.stop)
    incremental = IncrementalText(detokenize)
    penalties = Penalties(params)
    emitted, finish = 0, "length"
    while len(out) < max_new:
        token = choose(penalties.apply(logits), params, generator)
        if token in eos_ids:
            finish = "stop"
            break
        out.append(token)
        penalties.add(token)
        text = incremental.add(token)
        cut = stopper.find(text)
        if cut is not None:
            finish = "stop"
            if cut > emitted:
                yield Delta(text[emitted:cut])
            emitted = cut
            break
        safe = stopper.safe_length(text)
        if safe > emitted:
            yield Delta(text[emitted:safe])
            emitted = safe
        if len(out) < max_new:
            logits = step(token)
    text = detokenize(out)
    end = stopper.find(text)
    final = text[:end] if end is not None else text
    yield Delta(final[emitted:] if len(final) > emitted else "", finish, prompt_tokens, len(out))
    return final
