"""The session runner: the engine's one KVSession (the last sequence it ran), brought to a prompt and run forward.

Contract:
- ``session`` is the KVSession of the last sequence run, or None; ``ids`` the tokens whose K/V it holds. The
  runner is the only code that makes, crops or drops a session and the only writer of its own fields: ``open``
  is the one place a session starts (the retry policy asks for it), ``drop`` the one place it ends (its page
  references go back to the store, the step graphs over buffers that are gone go with them).
- ``plan`` is the engine's plan (``budget.EnginePlan``, frozen): the cache's settings (``plan.kv``) and the prefill
  chunk are read from it at each use, never copied. ``take_plan`` is how a new plan arrives (``Budget.settle``
  after the warm-up; an out-of-memory retry's smaller chunk): nothing else replaces it, and nothing writes into it.
- ``prefill(ids)`` brings the session to ``ids``: the longest prefix it holds is kept (or a new session adopts
  stored pages), the rest runs in chunks of the plan's ``prefill_chunk``; returns (the next token's logits,
  tokens reused). ``forward(tokens)`` runs more tokens after what the session holds. Both go through the retry
  policy (retry.py) for out-of-memory and lost pages; ``forward_once`` is the bare forward it retries.
- A single token runs as a decode step (``DecodeStep``: one graph per step where the pages are resident) unless a
  ``tap`` (``reading.Tap``, set by ``Engine.read``) collects states or the forward is guarded.
- ``bring_to(ids)`` leaves the session holding exactly ``ids``; ``forward(tokens, deltas)`` with an activated
  adapter's ``deltas`` (engine/alora.py) runs ``tokens`` through the model's forward with the adapter on, as a
  private forward (its pages never keyed by content: ``KVSession.forward``); the caller crops them away after.
- The tiered cache's PageStore and the GPU pool's buffers (``kv/pool.py``) live here, from one session to the
  next; ``forget_pool`` lets the buffers and the graphs recorded over them go (a new plan sizes them again).
- Callers hold the engine's lock.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Sequence

import torch

from ..kv import peer
from ..kv.attention import forward_kwargs
from .retry import RetryPolicy

log = logging.getLogger("flashguard")



# The CPU int4 kernel (aten._weight_int4pack_mm_for_cpu) rounds a row by the chunk it runs in: its block of this many
# rows from the chunk's first, and the chunk's length. A prompt whose prefill resumes at a multiple of it, after
# tokens a longer chunk ran, gets the K/V of the same prompt prefilled whole (tests/engine/test_prefill_rounding.py);
# the input rail's guard leaves the session there for the generation (``Engine.read(then=...)``).
ROW_BLOCK = 16

class SessionRunner:
    def __init__(self, model, config, device: torch.device, dtype: torch.dtype, plan, step, model_identity: str,
                 cache_kwarg: str):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.plan = plan   # budget.EnginePlan: its kv (the cache's settings) and prefill_chunk, read at each use
        self.step = step   # decode_step.DecodeStep, or None (the model's forward runs single tokens too)
        self.model_identity = model_identity
        self.cache_kwarg = cache_kwarg
        self.session = None   # the KVSession of the last sequence run (kv/session.py)
        self.pool = None   # kv/pool.PoolBuffers: the GPU pool's buffers, from one session to the next
        self.store = None  # the tiered cache's PageStore (kv_cache: tiered), made by the first session
        self.peers = None   # kv/peer.PeerTier: the conversation's off-window pages on the peer GPUs (kv.peer_gpus)
        self.tap = None   # Engine.read: the reading.Tap collecting states in the forwards of one read
        self.retry = RetryPolicy(self)

    def take_plan(self, plan) -> None:
        """``plan`` (a new ``budget.EnginePlan``) from now on: the settled plan after the warm-up, or an
        out-of-memory retry's plan with a smaller prefill chunk."""
        self.plan = plan

    @property
    def ids(self) -> list[int]:
        """The tokens whose K/V the session's cache holds (empty without a session)."""
        return self.session.ids if self.session is not None else []

    # ---- sessions ------------------------------------------------------------------------------------------
    def page_store(self):
        """The engine's one PageStore (sessions share pages by content hash), made on first use; None off the
        tiered cache."""
        if self.store is None and self.config.kv_cache == "tiered":
            from ..kv.store import PageStore

            self.store = PageStore(self.plan.kv, pin_memory=self.device.type == "cuda")
        return self.store

    def new_session(self):
        """A new, empty session of the configured cache (over the pool's buffers on a GPU)."""
        from ..kv.session import DynamicSession, TieredSession

        if self.config.kv_cache == "tiered":
            on_gpu = self.device.type == "cuda"
            if on_gpu and self.pool is None:
                from ..kv.pool import PoolBuffers

                self.pool = PoolBuffers()
            session = TieredSession(self.model, self.plan.kv, self.page_store(), self.model_identity,
                                    preallocate=on_gpu, pool=self.pool if on_gpu else None)
            if self.peers is not None and self.peers.lost is None:
                try:
                    session.cache.use_peers(self.peers)
                except peer.PeerLostError as err:   # the pages stay in the store alone
                    log.warning("flashguard: %s; serving from the store", err)
            return session
        return DynamicSession(self.model.config)

    def open(self):
        """A new, empty session (``new_session``) becomes the runner's; returns it. (What it holds before is
        ``drop``ped first by the caller.)"""
        self.session = self.new_session()
        return self.session

    def drop(self, keep_pages: bool) -> None:
        """The one place a session ends: its page references go back to the store."""
        if self.session is not None:
            self.session.release(keep_pages=keep_pages)
            self.session = None
            # the buffers go to the next session (kv/pool.py) with the graphs recorded over them; graphs over
            # buffers that are gone (a cache without the pool, buffers a long chunk replaced) go
            if self.step is not None:
                self.step.forget_steps(keep=self.pool.ptrs() if self.pool is not None else None)

    def forget_store(self) -> None:
        """Every stored page goes with the store (closed: its workers and L3 files); the next prompt makes a new,
        empty one. Only without a session (``drop`` first)."""
        if self.store is not None:
            self.store.close()
            self.store = None

    def forget_pool(self) -> None:
        """The kept pool buffers and the step graphs recorded over them go (a new plan sizes the pool again)."""
        if self.pool is not None:
            self.pool.clear()
        if self.step is not None:
            self.step.forget_steps()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- bringing the session to a prompt ------------------------------------------------------------------
    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Bring the cache to ``ids[:-1]`` + feed the rest; returns (last logits row, reused count)."""
        logits = None
        a = 0
        # a prompt's pages stay in L2 while it is prefilled (each chunk attends all of them: none is read back
        # from disk), the pages a new session adopts from disk too; their L3 files are written on the store's
        # worker meanwhile (kv/store.py ``deferred``), and L2 goes back to its budget at the end. The store is made
        # here if this is the engine's first prompt: a first prefill outside ``deferred`` read its own pages back
        # from disk in every chunk once L2 was full (a fresh engine's 128K prompt with a 16K L2 never finished)
        store = self.page_store()
        kv = self.plan.kv
        with store.deferred() if store is not None else contextlib.nullcontext():
            reused = self.reuse_prefix(ids)
            rest = ids[reused:]
            # the prompt's pages stay in L2 until it is prefilled: room made at once, for all of them (with the
            # pages past the pool alone, the 128K prompt's arena grew again after it, and the sparse steps' graphs
            # were recorded once more over the new one: 2-3 s of its first token). A prompt that fits the pool
            # announces nothing: a 32K prompt's 0.5 GiB, pinned and never used, showed as 0.59 s of cudaHostAlloc
            # in its prefill's profile
            if store is not None and self.session.leaving(len(rest)):
                store.expect_tokens(len(rest))
            # the last token runs alone, as a reused prompt's does (ids[:-1] held, one token fed): the first
            # token's logits then come from the same computation whether the prompt was prefilled now or held, so
            # greedy replies do not depend on what the session held before (int4 kernels round a token's
            # activations differently in a chunk of many than alone)
            # (only while the prompt fits the pool: past it a token fed alone attends the sparse policy's pages,
            # where a prefill chunk attends every page)
            alone = self.config.kv_cache == "dynamic" or kv.l1_tokens is None or len(ids) <= kv.l1_tokens
            body = rest[:-1] if alone else rest
            while a < len(body):
                chunk = self.plan.prefill_chunk  # may shrink inside forward after an out-of-memory (a new plan)
                logits = self.forward(body[a:a + chunk])
                a += chunk
            if alone:
                logits = self.forward(rest[-1:])
        return logits, reused

    def reuse_prefix(self, ids: list[int]) -> int:
        """The session cropped to the longest prefix of ``ids[:-1]`` it holds, or a new one adopting stored pages;
        returns the tokens reused."""
        held = self.ids
        common = 0
        limit = min(len(ids) - 1, len(held))  # always feed at least one token
        while common < limit and held[common] == ids[common]:
            common += 1
        if self.session is None or common == 0:
            return self.retry.start(ids[:-1])
        if not self.retry.crop(common):   # below the window it refills L1 from stored pages
            return self.retry.start(ids[:-1])
        return common

    def rewind(self, ids: list[int], start: int) -> None:
        """The session back to ``start`` tokens when it holds ``ids`` past ``start`` (the next prefill then runs
        them); to nothing for ``start`` 0 (its pages stay in the store)."""
        held = self.ids
        if len(held) > start and held[:start + 1] == ids[:start + 1]:
            if start > 0:
                self.retry.crop(start)
            else:
                self.drop(keep_pages=True)

    def bring_to(self, ids: list[int]) -> int:
        """The session holding exactly ``ids``: cropped to them where it holds more of them, else the rest run
        (``prefill``); returns the tokens reused."""
        held = self.ids
        n = len(ids)
        if self.session is not None and len(held) >= n and held[:n] == ids:
            if self.retry.crop(n):
                return n
        return self.prefill(ids)[1]

    def branch_back(self, ids: list[int], keep: int) -> None:
        """After a read: the session back to ``ids[:keep]`` when it holds more of ``ids`` (``keep`` > 0)."""
        held = self.ids
        if 0 < keep < len(held) and held[:keep] == ids[:keep]:
            self.retry.crop(keep)

    # ---- forwards ------------------------------------------------------------------------------------------
    def forward(self, tokens: Sequence[int], deltas=None) -> torch.Tensor:
        """``tokens`` run after the ones the session holds; the last one's logits (retried: retry.py). ``deltas``:
        an activated adapter's (engine/alora.py), on for these tokens only."""
        return self.retry.forward(tokens, deltas)

    def forward_once(self, tokens: list[int], deltas=None) -> torch.Tensor:
        """One forward over ``tokens`` in the session (``KVSession.forward``: settled after, undone on a failure):
        a single token runs as a decode step (graphs or the lean eager path) unless a read taps the states or an
        adapter's ``deltas`` are on (then the model's forward runs them, as a private forward)."""
        from .alora import activated

        session, tap = self.session, self.tap
        with session.forward(tokens, private=deltas is not None) as cache:
            if len(tokens) == 1 and self.step is not None and tap is None and deltas is None:
                return self.step.step(tokens[0], cache)
            inp = torch.tensor([tokens], dtype=torch.long, device=self.device)
            with tap.forward(self.model, len(session.ids)) if tap is not None else contextlib.nullcontext(), \
                    activated(self.model, deltas) if deltas is not None else contextlib.nullcontext():
                with torch.inference_mode():
                    out = self.model(input_ids=inp, **forward_kwargs(self.cache_kwarg, cache), use_cache=True,
                                     logits_to_keep=1)
            return out.logits[0, -1]

    def warm_up_prompt(self, context: int) -> None:
        """Two prompt chunks through a throwaway session of the engine's own cache: the kernels a first prompt
        builds (the int4 GEMMs at the chunk's size, the pool's attention over a chunk and over what precedes it)
        are built now (an 8-token forward uses neither; the first long prompt ran at less than half the speed of
        later ones). The session is released without keeping its pages (with a pool smaller than two chunks, the
        few that left its window stay in the store unreferenced, the first to be evicted)."""
        chunk = self.plan.prefill_chunk
        ids = [0] * max(2, min(2 * chunk, context - 1))
        saved, self.session = self.session, self.new_session()
        try:
            for a in range(0, len(ids), chunk):
                self.forward_once(ids[a:a + chunk])
        finally:
            self.drop(keep_pages=False)
            self.session = saved

    def l3_reads(self) -> int:
        """Pages read back from disk so far (the store's page faults)."""
        return self.store.stats.page_faults if self.store is not None else 0
