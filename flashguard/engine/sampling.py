"""Next-token choice and stop-string handling for the engine's decode loop.

``SamplingParams`` is one call's decoding, exactly as given: its own defaults are plain greedy decoding with no
penalty (what benchmarks and tools that time a fixed number of tokens want). The defaults a user gets (``flashguard
generate`` / ``chat`` / ``serve``, ``LLMRails``) come from the config (``EngineConfig``: a repetition penalty that
stops a small model's loops, docs/benchmarks/replies.md) through ``SamplingParams.from_config``.

Penalties (``Penalties``) look at the ids this call generated, never the prompt's (a reply may and must repeat the
question's words), and change the logits before the choice:

- ``repetition_penalty`` (``r``, as in transformers and llama.cpp): a generated token's logit ``l`` becomes
  ``l / r`` where ``l > 0`` and ``l * r`` otherwise (1 = off);
- ``frequency_penalty`` / ``presence_penalty`` (``f``, ``p``, as OpenAI defines them): ``l - f * count - p`` for a
  token generated ``count >= 1`` times (0 = off);
- ``no_repeat_ngram`` (``n``, transformers' ``no_repeat_ngram_size``): a token that would complete an n-gram the
  reply already holds is never chosen (0 = off).

Their cost is a gather and an ``index_add_`` over the distinct generated ids (a few hundred at most), not a pass
over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PromptError


@dataclass(frozen=True)
class SamplingParams:
    """How one call decodes. ``temperature == 0`` is greedy; the penalties are described in the module docstring
    (their defaults here are off: ``from_config`` gives the config's)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise PromptError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise PromptError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise PromptError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise PromptError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
        if not self.repetition_penalty > 0:
            raise PromptError(f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise PromptError(f"{name} must be in [-2, 2] (0 is off), got {getattr(self, name)!r}")
        if isinstance(self.no_repeat_ngram, bool) or not isinstance(self.no_repeat_ngram, int) \
                or self.no_repeat_ngram < 0:
            raise PromptError(f"no_repeat_ngram must be an integer >= 0 (0 is off), got {self.no_repeat_ngram!r}")

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.no_repeat_ngram > 0)

    @classmethod
    def from_config(cls, config, *, max_tokens=None, temperature=None, top_p=None, seed=None, stop=None,
                    repetition_penalty=None, frequency_penalty=None, presence_penalty=None,
                    no_repeat_ngram=None) -> "SamplingParams":
        """A call's values where given (not None), the engine config's defaults otherwise."""
        def given(value, default):
            return default if value is None else value

        return cls(max_tokens=int(max_tokens or config.max_tokens),
                   temperature=float(given(temperature, config.temperature)),
                   top_p=float(top_p or config.top_p), stop=tuple(stop or ()),
                   seed=given(seed, config.seed),
                   repetition_penalty=float(given(repetition_penalty, config.repetition_penalty)),
                   frequency_penalty=float(given(frequency_penalty, config.frequency_penalty)),
                   presence_penalty=float(given(presence_penalty, config.presence_penalty)),
                   no_repeat_ngram=int(given(no_repeat_ngram, config.no_repeat_ngram)))


class Penalties:
    """One call's penalty state: the ids it generated (``add``) and the logits they change (``apply``). The distinct
    ids and their counts are kept in growing tensors (a Python list made into a tensor at every token cost more than
    the penalty itself: ~70 us for 200 ids)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.on = params.penalized
        self.counting = bool(params.frequency_penalty or params.presence_penalty)
        self.slot: dict[int, int] = {}            # generated id -> its place in ``ids`` / ``counts``
        self.ids = torch.empty(64, dtype=torch.long)
        self.counts = torch.zeros(64)
        self.out: list[int] = []
        self.follows: dict[tuple[int, ...], set[int]] = {}   # no_repeat_ngram: (n-1)-gram -> tokens seen after it

    def add(self, token: int) -> None:
        if not self.on:
            return
        at = self.slot.get(token)
        if at is None:
            at = self.slot[token] = len(self.slot)
            if at == len(self.ids):
                self.ids = torch.cat([self.ids, torch.empty_like(self.ids)])
                self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.ids[at] = token
        if self.counting:
            self.counts[at] += 1
        self.out.append(token)
        n = self.params.no_repeat_ngram
        if n and len(self.out) >= n:
            self.follows.setdefault(tuple(self.out[len(self.out) - n:-1]), set()).add(token)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (1-D) as the penalties change them (a new tensor where they change anything)."""
        if not self.on or not self.slot:
            return logits
        p, k = self.params, len(self.slot)
        logits = logits.clone()
        ids = self.ids[:k].to(logits.device, non_blocking=True)
        if p.repetition_penalty != 1:
            seen = logits.index_select(0, ids)
            logits.index_copy_(0, ids, torch.where(seen > 0, seen / p.repetition_penalty,
                                                   seen * p.repetition_penalty))
        if p.frequency_penalty or p.presence_penalty:
            counts = self.counts[:k].to(logits.device, logits.dtype, non_blocking=True)
            logits.index_add_(0, ids, counts * -p.frequency_penalty - p.presence_penalty)
        n = p.no_repeat_ngram
        if n:
            banned = self.follows.get(tuple(self.out[len(self.out) - (n - 1):]))
            if banned:
                logits[torch.tensor(sorted(banned), device=logits.device)] = float("-inf")
        return logits


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from a 1-D logits row."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        pick = torch.multinomial(sorted_p.cpu(), 1, generator=generator)
        return int(order[int(pick)])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class StopMatcher:
    """Finds stop strings in the growing text and says how much text is safe to emit.

    Text that could still become the start of a stop string is held back while streaming,
    so a stream never shows a partial stop string.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        end = len(text)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            end = text.rstrip("\ufffd").__len__()
        if not self.stop:
            return end
        # hold back the longest suffix that is a prefix of some stop string
        for k in range(min(self.holdback, end), 0, -1):
            tail = text[end - k:end]
            if any(s.startswith(tail) for s in self.stop):
                return end - k
        return end


class IncrementalText:
    """The text of a growing list of generated tokens, decoding only a short tail per token.

    Why: decoding the whole list at every token is quadratic; after 2K tokens (a DeepSeek-R1 answer with its
    reasoning) it cost ~0.9 ms a token on the host, a third of a fast GPU's 8K decode step. As in the incremental
    detokenizers of vLLM and TGI, ``add`` decodes the tokens since ``prefix`` twice (with and without the newest
    ones) and appends the difference once it no longer ends in an incomplete UTF-8 sequence; a few tokens of left
    context keep tokenizers whose pieces depend on their neighbours (SentencePiece's leading spaces) right.

    Contract: after ``add(t)`` for each token, ``text`` equals ``decode(all tokens)`` except for a held-back tail
    of tokens that do not yet form whole characters (the caller decodes the whole list once at the end).
    """

    def __init__(self, decode):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self.prefix = 0    # the left context starts here
        self.read = 0      # tokens before this are in ``text``

    def add(self, token: int) -> str:
        self.ids.append(token)
        head = self.decode(self.ids[self.prefix:self.read])
        full = self.decode(self.ids[self.prefix:])
        if len(full) > len(head) and not full.endswith("\ufffd"):
            self.text += full[len(head):]
            self.prefix, self.read = max(0, self.read - 4), len(self.ids)
        return self.text

