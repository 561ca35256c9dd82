"""The engine's retry policy, in one place: which failures are retried, how many times, and what is given back
between the tries. Every retry of the engine lives here; the session runner (session_runner.py) calls it for each
forward, each new session and each crop, and nothing else catches these failures.

Contract:
- Out of GPU memory (``OUT_OF_MEMORY``) in a forward: the session is already back at the tokens before it
  (``KVSession.forward`` undoes), and the allocator's cached blocks go back to the device. Many tokens run again
  in halves, down to ``MIN_CHUNK`` a forward, and the smaller prefill chunk is kept for good: a new plan
  (``EnginePlan.with_prefill_chunk``) handed to the runner (``SessionRunner.take_plan``), never a field written.
  A single decode token gets ``DECODE_OOM_TRIES`` more tries after the decode step's graphs (each holds a memory
  pool of its own) are given back too. Past that, ``GpuMemoryError`` says what to change. ``oom_retries`` counts the
  out-of-memory errors met.
- A page lost in a forward (``PageLost``: a stored page failed verification, or the forward's pages could not be
  settled): the session is dropped without keeping its pages and the whole sequence is recomputed by prefill,
  adopting the stored pages before the lost one, up to ``RECOMPUTE_TRIES`` times (pages adopted by a try can be
  found bad too; each try drops them). Then the last PageLost propagates. A guarded forward's tokens (an adapter's
  ``deltas``) run again with the adapter, the sequence before them without.
- A page lost while a new session adopts stored pages: the store has dropped it (never used); the next try adopts
  the pages before it, up to ``ADOPT_TRIES`` times, then the session starts empty.
- A page lost while a session is cropped: the session is dropped without keeping its pages (the caller prefills
  again).
Any other exception propagates at once, the session back at its ids. The policy writes none of the runner's
fields: it asks the runner to ``open``, ``drop`` or run (``forward_once``), crops the session through its own
method, and hands a smaller chunk forward as a new plan (``SessionRunner.take_plan``). (``Engine.read`` running a probe's span once
more after stored pages were adopted past it is no retry of a failure: its states must come from that call.)
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ..errors import GpuMemoryError
from ..kv import OUT_OF_MEMORY
from ..kv.disk import PageLost

log = logging.getLogger("flashguard")


class RetryPolicy:
    """What the engine retries (see the module docstring), over one ``SessionRunner``."""

    MIN_CHUNK = 16         # the fewest tokens a prefill forward is halved to after an out-of-memory
    DECODE_OOM_TRIES = 1   # a decode token's tries after its first out-of-memory
    RECOMPUTE_TRIES = 3    # recomputations of a sequence after a lost page
    ADOPT_TRIES = 8        # a new session's adoptions of stored pages, one bad page dropped by each

    def __init__(self, sessions):
        self.sessions = sessions
        self.oom_retries = 0

    def forward(self, tokens: Sequence[int], deltas=None) -> torch.Tensor:
        """One forward over ``tokens`` in the session (logits of the last), with both failures retried;
        ``deltas``: an adapter on for ``tokens`` alone."""
        held = list(self.sessions.ids)   # (an out-of-memory split may have stored part of ``tokens`` before a loss)
        try:
            return self._fitting(list(tokens), deltas=deltas)
        except PageLost as exc:
            sessions = self.sessions
            ids = held + list(tokens)
            base = len(held) if deltas is not None else len(ids)   # the tokens run without the adapter
            for _ in range(self.RECOMPUTE_TRIES):
                log.warning("flashguard: %s; recomputing %d tokens by prefill", exc, len(ids))
                sessions.drop(keep_pages=False)
                try:
                    reused = self.start(ids[:base])
                    logits = None
                    chunk = sessions.plan.prefill_chunk   # (an out-of-memory below halves it for later calls)
                    for a in range(reused, base, chunk):
                        logits = self._fitting(ids[a:a + chunk])
                    if base < len(ids):
                        return self._fitting(ids[base:], deltas=deltas)
                    if logits is None:  # every token was adopted: run the last one again for its logits
                        sessions.session.crop(len(ids) - 1)
                        logits = self._fitting(ids[-1:])
                    return logits
                except PageLost as again:
                    exc = again
            raise exc

    def _fitting(self, tokens: list[int], tries_left: int | None = None, deltas=None) -> torch.Tensor:
        """The forward, with an out-of-memory run again in halves (one token: tried again after the step graphs
        are given back)."""
        sessions = self.sessions
        try:
            return sessions.forward_once(tokens, deltas)
        except OUT_OF_MEMORY as exc:
            self.oom_retries += 1   # (session.forward brought every layer back to the tokens before this call; a
            # failure while the pages settled after it arrives as PageLost instead, and forward recomputes)
            self._give_back(step_graphs=False)
            tries_left = self.DECODE_OOM_TRIES if tries_left is None else tries_left
            if len(tokens) <= self.MIN_CHUNK:
                if len(tokens) == 1 and tries_left > 0:
                    # and the step graphs' pools: a new session's long-context decode step ran out of memory
                    # recording its graph beside the graphs of earlier sessions
                    self._give_back(step_graphs=True)
                    return self._fitting(tokens, tries_left - 1, deltas)
                budget = sessions.plan.vram_budget
                raise GpuMemoryError(
                    f"out of GPU memory for a {len(tokens)}-token step"
                    + (f" within vram_budget {budget / 2**30:.2f} GiB" if isinstance(budget, int) else "")
                    + "; set models[main].parameters.weights: int4, a smaller kv.l1_tokens, a smaller "
                    "prefill_chunk, or a larger vram_budget (`flashguard plan` shows what fits)") from exc
            half = len(tokens) // 2
            plan = sessions.plan
            sessions.take_plan(plan.with_prefill_chunk(max(self.MIN_CHUNK, min(plan.prefill_chunk, half))))
            log.warning("flashguard: out of GPU memory on %d tokens; retrying in chunks of %d", len(tokens), half)
            first, rest = _halves(deltas, half)
            self._fitting(tokens[:half], deltas=first)
            return self._fitting(tokens[half:], deltas=rest)

    def _give_back(self, step_graphs: bool) -> None:
        """What goes back to the device between two tries: the allocator's cached blocks, and with
        ``step_graphs`` the decode step's graphs with their pools."""
        sessions = self.sessions
        if sessions.device.type != "cuda":
            return
        if step_graphs:
            if sessions.step is None:
                return
            sessions.step.forget_steps()
        torch.cuda.empty_cache()

    def start(self, ids: Sequence[int]) -> int:
        """A new session for ``ids``, adopting its stored pages; returns the tokens reused."""
        sessions = self.sessions
        sessions.drop(keep_pages=True)
        for _ in range(self.ADOPT_TRIES):
            session = sessions.open()
            try:
                return session.adopt(ids, sessions.dtype, sessions.device)
            except PageLost as exc:
                log.warning("flashguard: %s; adopting the stored pages before it", exc)
                sessions.drop(keep_pages=False)
        sessions.open()
        return 0

    def crop(self, n: int) -> bool:
        """The session keeps its first ``n`` tokens; False when a page lost on the way dropped it."""
        try:
            self.sessions.session.crop(n)   # below the window it refills L1 from stored pages
        except PageLost as exc:
            log.warning("flashguard: %s; starting the session again", exc)
            self.sessions.drop(keep_pages=False)
            return False
        return True


def _halves(deltas, half: int):
    """An adapter's deltas for the two halves of a forward split at ``half``: where they start inside it
    (``Deltas.offset``), each half keeps that point."""
    k = getattr(deltas, "offset", 0)
    if deltas is None or not k:
        return deltas, deltas
    return deltas.from_position(min(k, half)), deltas.from_position(max(0, k - half))
