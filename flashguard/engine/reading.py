"""What ``Engine.read`` returns to the rails, and the forward hooks it sets to collect it.

Contract:
- ``Reading``: the next-token log-probabilities after a sequence, and (when asked) the hidden states a linear probe
  reads: the last token's state at every layer (``hidden``), the mean state over a span at chosen layers
  (``mean``), and every position's state over that span (``states``).
- ``Tap``: made by the engine for one read; ``tap.forward(model, first)`` is a context in which one forward of
  the model over the positions ``first, first + 1, ...`` records what the Tap was asked for. Hooks live only for
  that forward (nothing stays installed on the model). States are numbered as ``output_hidden_states`` numbers
  them: 0 the embedding's output, ``i`` decoder layer ``i``'s for ``1..n-1``, ``n`` the final norm's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass(frozen=True)
class Reading:
    logprobs: torch.Tensor                  # [vocab] of the token after the sequence
    hidden: Optional[torch.Tensor]          # [layers + 1, d] float32 CPU: the sequence's last token (hidden=True)
    mean: Optional[torch.Tensor]            # [len(layers), d]: the mean state over ids[mean_from:] at ``layers``
    states: Optional[torch.Tensor]          # [len(layers), len(ids) - mean_from, d] (keep_states=True)
    reused: int                             # tokens whose K/V the engine already held (not run)
    prefilled: int                          # tokens this read ran


class Tap:
    """The states one read collects (see the module docstring)."""

    def __init__(self, last: bool, layers=(), mean_from: Optional[int] = None, keep_states: bool = False):
        self.last = last
        self.layers = tuple(layers)
        self.mean_from = mean_from
        self.rows: list = []                       # the last position's state per state index (last=True)
        self.sums: dict = {}                       # layer -> sum of the states at positions >= mean_from
        self.count = 0                             # positions summed
        self.kept: Optional[dict] = {} if keep_states else None   # layer -> [rows per forward]

    @contextlib.contextmanager
    def forward(self, model, first: int) -> Iterator[None]:
        """Hooks for one forward whose first position is ``first`` (the tokens the session holds)."""
        inner = model.model
        modules = [inner.embed_tokens] + list(inner.layers[:-1]) + [inner.norm]
        if self.last:
            self.rows = [None] * len(modules)
        skip = 0 if self.mean_from is None else max(0, self.mean_from - first)

        def hook(at: int):
            def keep(module, args, output):
                h = output[0] if isinstance(output, tuple) else output
                if self.last:
                    self.rows[at] = h[:, -1:].clone()
                if self.mean_from is not None and at in self.layers and skip < h.shape[1]:
                    rows = h[0, skip:].float().cpu()
                    self.sums[at] = rows.sum(0) + self.sums.get(at, 0)
                    if at == self.layers[0]:
                        self.count += rows.shape[0]
                    if self.kept is not None:
                        self.kept.setdefault(at, []).append(rows)
            return keep

        handles = [m.register_forward_hook(hook(at)) for at, m in enumerate(modules)
                   if self.last or at in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def hidden(self) -> torch.Tensor:
        return torch.stack([h[0, -1].float().cpu() for h in self.rows])

    def mean(self, expected: int) -> torch.Tensor:
        """The mean over the span; ``expected``: how many positions this read ran in it (a ``RuntimeError`` when
        the forwards covered fewer: a mean over part of the span would be read as the whole)."""
        if len(self.sums) != len(self.layers) or self.count < expected:
            raise RuntimeError(f"the probe's mean covered {self.count} of {expected} tokens")
        return torch.stack([self.sums[layer] for layer in self.layers]) / self.count

    def states(self, expected: int) -> torch.Tensor:
        kept = torch.stack([torch.cat(self.kept[layer], 0) for layer in self.layers])
        if kept.shape[1] != expected:
            raise RuntimeError(f"the input probe's windows covered {kept.shape[1]} of {expected} tokens")
        return kept
