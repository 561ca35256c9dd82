"""The Engine: one loaded model, its decode loop, and the conversation's KV cache; the public facade.

Contract:
- One Engine per model identity per process (see ``registry.get_engine``); every provider,
  ``LLMRails`` and server request shares it.
- It implements ``interface.EngineInterface``, all the rails use of it.
- Calls are serialised by ``self.lock`` (``exclusive()``): ``stream()`` holds it from its first ``next()`` until it
  is exhausted or closed, so two requests never interleave on the cache.
- The engine keeps the KV cache of the last sequence it ran (the *session*). A new call that
  starts with the same token ids reuses that prefix and prefills only the rest; this is what
  makes the next chat turn and the moderation call cheap. ``session_ids`` are exactly the
  tokens whose K/V are in the cache.
- Prefill runs in chunks of ``prefill_chunk`` tokens with ``logits_to_keep=1``, so activation
  memory does not grow with the prompt.
- ``keep_exact(token_ids)``: those tokens' logits are computed exactly whatever the lm_head (``lm_head: int4``
  recomputes only its top candidates otherwise); the rails name their answers once.

The work is done by parts, each in its own module, which the Engine holds and wires together: ``budget.Budget``
(vram_budget, the allocator's cap, and the engine's one plan: ``budget.EnginePlan``), ``placement.Placement`` (where
the weights live), ``session_runner.SessionRunner`` (the session: prefill, forwards, crops), ``retry.RetryPolicy``
(every retry, held by the runner) and ``decode_loop`` (tokens to text). Start-up runs forward: the Budget, the
weights loaded where it forecasts, the lm_head held as it calls, the plan made once from the loaded model, the
layers placed as it says, and the runner given it; the plan changes only by a new object from ``Budget.settle``
(after the GPU warm-up) or an out-of-memory retry, handed to the runner (``plan`` reads the current one). Public
entry points are the Engine's methods; ``prefill`` and ``step`` are the supported way for benchmarks and tools to
drive the decode loop themselves.

Why this file passes 500 lines: it is the facade, every public entry point and the read-only views of the parts'
state (``info()``, ``flashguard smi``, benchmarks) in one class; the work itself is in the parts.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterator, Sequence

import torch

from ..config import EngineConfig
from ..errors import ConfigError, PromptError
from .. import notice
from ..kv import OUT_OF_MEMORY, peer  # noqa: F401 - OUT_OF_MEMORY: imported from here by callers
from . import decode_loop, loader
from .budget import Budget, apply_vram_budget, measure_cuda_context, resolve_vram_budget  # noqa: F401
from .decode_loop import Delta, Turn, joined
from .decode_step import DecodeStep
from .encoding import MessageEncoder
from .interface import EngineInterface, layers_of
from .placement import Placement, load_target
from .reading import Reading
from .retry import RetryPolicy
from .sampling import SamplingParams
from .session_runner import ROW_BLOCK, SessionRunner
from .stats import EngineStats

log = logging.getLogger("flashguard")

__all__ = ["Engine", "Delta", "Turn", "joined", "checked_prompt", "context_length", "cache_kwarg",
           "PLAIN_CHAT_TEMPLATE", "apply_vram_budget", "measure_cuda_context", "resolve_vram_budget"]


def checked_prompt(ids: Sequence[int], context: int, vocab: int) -> list[int]:
    """``ids`` as ints, or a PromptError saying what to change: empty, not shorter than the model's ``context``, or a
    token outside the ``vocab`` rows (a GPU lookup of a host table reads what it is given: no index check). The local
    and the remote engine check prompts with it."""
    ids = [int(i) for i in ids]
    if not ids:
        raise PromptError("the prompt is empty; send at least one message with text")
    if len(ids) >= context:
        raise PromptError(
            f"the prompt is {len(ids)} tokens but the model's context is {context} tokens; "
            "shorten the conversation or raise models[main].parameters.max_context "
            "(up to the model's own limit)")
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(i for i in ids if not 0 <= i < vocab)
        raise PromptError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})")
    return ids


def context_length(model_config, max_context: int | None) -> int:
    """The model's context (``max_position_embeddings``, 2048 where it has none), capped at ``max_context``."""
    n = getattr(model_config, "max_position_embeddings", None) or 2048
    return int(min(n, max_context) if max_context else n)


def cache_kwarg(model) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (older): the forward argument for the Cache."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# A model without a chat template (a base model) gets this one, so the generation, the rails and calibrate render
# conversations one way: the BOS token, "role: text" lines, and "assistant:" to answer.
PLAIN_CHAT_TEMPLATE = ("{{ bos_token or '' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


def _guard_note(folder) -> str:
    """The start-up line's end: which guard adapter the rails use (docs/moderation.md)."""
    from pathlib import Path

    from . import alora

    if folder is None:
        return ""
    shipped = Path(folder).parent == alora.shipped_dir()
    return "; the rails: the shipped guard adapter" if shipped else f"; the rails: the guard adapter {folder}"


class Engine(EngineInterface):
    returns_states = True   # read() returns hidden states (the probes need them); a RemoteEngine's does not
    MIN_CHUNK = RetryPolicy.MIN_CHUNK
    GPU_CHUNK, CPU_CHUNK = Budget.GPU_CHUNK, Budget.CPU_CHUNK   # prefill_chunk: auto

    def __init__(self, config: EngineConfig, source: loader.ModelSource | None = None, *, model=None,
                 tokenizer=None, streamed_layers: int | None = None):
        """Loads the model of ``config``; benchmarks pass an already built ``model`` and ``tokenizer``, and may
        choose how many of its last decoder layers stream from host RAM (``streamed_layers``; None: the planner
        decides from ``vram_budget``)."""
        self.config = config
        self.source = source or loader.resolve_model(config.model_path, config.gguf_file)
        self.device = loader.resolve_device(config.device)
        self.dtype = loader.resolve_dtype(config.dtype, self.device)
        # kv.peer_gpus: checked against this host before anything loads (a ConfigError naming the key)
        self.peer_devices = peer.resolve_devices(config.kv.peer_gpus, self.device)
        if self.peer_devices and config.kv_cache != "tiered":
            raise ConfigError(f"peer GPUs hold the tiered cache's pages; kv_cache is {config.kv_cache}",
                              key="kv.peer_gpus")
        # vram_budget resolved and the allocator capped before the weights load; the tiers are sized below.
        # prefill_chunk auto: larger on a GPU; halves (for good) when a chunk does not fit the GPU budget
        self.budget = Budget(config, self.device)
        t0 = time.perf_counter()
        # the weights key resolved (auto: int4 for a Q4 GGUF on the CPU, loader.choose_weights) and why
        weights, self.weights_reason = loader.choose_weights(config.weights, self.source, self.device)
        guard_folder = self._guard_folder(config)
        if model is not None:
            self.model, self.tokenizer = model, tokenizer
            self.dtype = next(model.parameters()).dtype
        else:
            # the one start-up line: the model, where, which weights and why, and the rails' guard adapter
            notice.say("flashguard: loading %s on %s, %s weights (%s)%s", self.source.label,
                       "the CPU" if self.device.type == "cpu" else self.device, weights,
                       self.weights_reason, _guard_note(guard_folder))
            # host RAM when int4 layers stream (Placement.place)
            where, kernel = load_target(config, self.source, self.device, self.budget, weights)
            self.model, self.tokenizer = loader.load(self.source, where, self.dtype, weights, kernel)
        log.info("flashguard: loaded %s on %s, %s weights (%s activations) in %.1f s", self.source.label, self.device,
                 weights, str(self.dtype).replace("torch.", ""), time.perf_counter() - t0)
        if getattr(self.tokenizer, "chat_template", None) is None:   # a base model: one plain template for all
            log.warning("flashguard: %s has no chat template (a base model?): conversations are written as "
                        "'role: text' lines ending in 'assistant:'", self.source.label)
            self.tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
        self.adapter = None   # lora_path: on this one engine, so the moderation rail runs with it too
        if config.lora_path is not None:
            from . import lora

            self.adapter = lora.read_adapter(config.lora_path, self.model)
            lora.apply_adapter(self.model, self.adapter, self.dtype)
        # guard_adapter: the rails' activated LoRA, on only for their suffixes (read(adapter_from=...))
        self.guard = self._load_guard(guard_folder, weights)
        self.lock = threading.RLock()
        self.messages = MessageEncoder(self.tokenizer, config.system_prompt)
        self.stats = EngineStats()
        self.context_length = context_length(self.model.config, self.config.max_context)
        self.weights_placement = Placement(self.model, config, self.device, self.dtype, self.source.label)
        # (before the plan: the planner counts the head as held)
        self.weights_placement.hold_lm_head(self.budget.head_budget_wins(self.weights_placement, self.context_length))
        # the engine's one plan (budget.EnginePlan): the layers that stream, the tiers, the prefill chunk
        plan = self.budget.plan(self.weights_placement, self.context_length, streamed_layers)
        self.eos_ids = self._eos_ids()
        self._use_causal_sdpa()
        if self.device.type == "cuda":   # (the CPU keeps transformers' norms: the shipped probes read its states)
            from .decode_step import fuse_norms

            fuse_norms(self.model)
        # before DecodeStep: it must see the streamed layers
        self.weights_placement.place(plan.streamed, plan.vram_budget)
        step = DecodeStep(self.model, graphs=config.cuda_graphs and self.device.type == "cuda") \
            if DecodeStep.supports(self.model) else None
        self.sessions = SessionRunner(self.model, config, self.device, self.dtype, plan, step,
                                      self.model_identity, cache_kwarg(self.model))
        self.turns: list[Turn] = []  # recent generations, newest last (bounded)
        self.budget.announce(plan)
        if self.peer_devices:
            self.peers = peer.start([f"cuda:{i}" for i in self.peer_devices], self.device, plan.kv.page_size)
        if self.device.type == "cuda":   # after sizing: the kernels of the pool and pages as planned
            self._warm_up()
            settled = self.budget.settle(plan, self.weights_placement)
            if settled is not plan:   # the warm-up's buffers and graphs were sized by the old plan
                self.sessions.forget_pool()
                self.sessions.take_plan(settled)

    def _guard_folder(self, config: EngineConfig):
        """The folder of ``guard_adapter`` (engine/alora.py), or None: ``off``, or ``auto`` with none for this model."""
        from . import alora

        if config.guard_adapter == "off":
            return None
        return alora.find(self.source) if config.guard_adapter == "auto" else config.guard_adapter

    def _load_guard(self, folder, weights: str):
        """The guard in ``folder`` (``_guard_folder``), checked against the model and weights; None without one."""
        from . import alora

        if folder is None:
            return None
        guard = alora.load(folder, self.source, self.model, weights, self.device, self.dtype)
        log.info("flashguard: the rails' guard adapter: %s (rank %d on %d modules, %.1f MB)",
                 guard.folder, guard.adapter.rank, len(guard.adapter.layers), guard.bytes / 1e6)
        return guard

    def _warm_up(self) -> None:
        """At start on a GPU: one 8-token forward (the int4 prompt kernels) and the decode step's kernels
        (``DecodeStep.warm_up``), so that their one-time builds are part of starting, not of the first answer's
        time to first token. A failure here is only logged: the first request builds them instead."""
        try:
            with torch.inference_mode():
                ids = torch.zeros((1, 8), dtype=torch.long, device=self.device)
                self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
                step = self.decode_step
                if step is not None:   # (and the sparse step's kernels where the cache may take it)
                    kv = self.kv
                    sparse = self.config.kv_cache == "tiered" and kv.policy == "sparse"
                    heads = self.model.config.num_key_value_heads
                    step.warm_up(page_size=kv.page_size if sparse else None,
                                 pages=heads * max(1, kv.budget_tokens // kv.page_size) if sparse else 0,
                                 int8=kv.l1_codec == "int8")
                if self.config.kv_cache == "tiered":
                    self.sessions.warm_up_prompt(self.context_length)
            torch.cuda.empty_cache()   # (the warm-up's throwaway buffers)
            torch.cuda.synchronize(self.device)
        except Exception as exc:   # noqa: BLE001 - a warm-up must never stop the engine from starting
            log.info("flashguard: warm-up skipped (%s: %s)", type(exc).__name__, exc)

    # ---- state of the parts, read through the engine -----------------------------------------------------------
    @property
    def session(self):
        """The KVSession of the last sequence run (kv/session.py), or None."""
        return self.sessions.session

    @property
    def store(self):
        """The tiered cache's PageStore (None off the tiered cache, or before the first prompt)."""
        return self.sessions.store

    @property
    def pool(self):
        """kv/pool.PoolBuffers: the GPU pool's buffers, kept from one session to the next (or None)."""
        return self.sessions.pool

    @property
    def peers(self):
        """kv/peer.PeerTier: the conversation's off-window pages on the peer GPUs (kv.peer_gpus), or None."""
        return self.sessions.peers

    @peers.setter
    def peers(self, tier) -> None:   # (the next session uses it)
        self.sessions.peers = tier

    @property
    def plan(self):
        """The engine's plan now (``budget.EnginePlan``, frozen): made at start, replaced only by a new one after
        the GPU warm-up (``Budget.settle``) or an out-of-memory retry (a smaller prefill chunk)."""
        return self.sessions.plan

    @property
    def kv(self):
        """The tiered cache's settings as sized at start (the plan's)."""
        return self.plan.kv

    @property
    def prefill_chunk(self) -> int:
        """Tokens a prefill forward runs at most (smaller for good after an out-of-memory)."""
        return self.plan.prefill_chunk

    @property
    def vram_budget(self) -> int | None:
        return self.budget.vram_budget

    @property
    def cuda_context(self) -> int:
        return self.budget.cuda_context

    @property
    def oom_retries(self) -> int:
        """Out-of-memory errors met in forwards (each was retried or raised: retry.py)."""
        return self.sessions.retry.oom_retries

    @property
    def lm_head_kind(self) -> str:
        """How the output matrix is held: "float", "int8" (Q8_0 codes) or "int4" (quant/lm_head.py)."""
        return self.weights_placement.lm_head_kind

    @property
    def lm_head_reason(self) -> str:
        return self.weights_placement.lm_head_reason

    @property
    def layer_stream(self):
        return self.weights_placement.layer_stream

    @property
    def embedding_on_host(self) -> bool:
        return self.weights_placement.embedding_on_host

    @property
    def layer_count(self) -> int:
        return layers_of(self.model.config)

    def exclusive(self):
        """``self.lock``: no other call moves the session inside it (re-entrant)."""
        return self.lock

    @property
    def weights_kind(self) -> str:
        """"int4" when the decoder's linears are int4, else "float": the ``weights`` key's values, which the
        planner takes too."""
        return self.weights_placement.weights_kind

    @property
    def decode_step(self) -> DecodeStep | None:
        """The engine's one-token step (``decode_step.DecodeStep``: CUDA graphs, the CPU's int4 step), or None
        where the model is not one it supports (single tokens then run the model's forward). Read-only."""
        return self.sessions.step

    @property
    def step_graphs(self) -> int:
        """Whole-step CUDA graphs recorded and kept now (one per pool buffers and visible capacity in use)."""
        step = self.decode_step
        return len(step.step_graphs) if step is not None else 0

    @property
    def label(self) -> str:
        """The model's name in ``engine_stats()`` (a remote engine's adds its server)."""
        return self.source.label

    @property
    def model_identity(self) -> str:
        """What the KV pages' namespace is keyed by (kv/store.py ``namespace_for``): the weights' file and the
        adapter's content, whose keys and values differ from the base model's."""
        return self.source.identity + (f"|lora:{self.adapter.digest}" if self.adapter is not None else "")

    @property
    def session_ids(self) -> list[int]:
        """The tokens whose K/V the session's cache holds (empty without a session)."""
        return self.sessions.ids

    # ---- prompts -------------------------------------------------------------------------
    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat (list of {role, content}) with the generation prompt appended
        (``encoding.MessageEncoder``: the last few conversations' ids kept)."""
        return self.messages.encode(messages)

    ENCODED_KEPT = MessageEncoder.KEPT   # conversations whose ids encode_messages keeps (the rails' and the generation's)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _check_prompt(self, ids: Sequence[int]) -> list[int]:
        return checked_prompt(ids, self.context_length, self.model.get_input_embeddings().num_embeddings)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, ids: Sequence[int], params: SamplingParams, task: str = "generation") -> Delta:
        """Run to completion; returns one Delta with the whole text."""
        return joined(self.stream(ids, params, task=task))

    def stream(self, ids: Sequence[int], params: SamplingParams, task: str = "generation") -> Iterator[Delta]:
        """The reply to ``ids`` in pieces (``decode_loop.run``), after the session is brought to ``ids``."""
        ids = self._check_prompt(ids)
        max_new = min(params.max_tokens, self.context_length - len(ids))
        generator = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else self.config.seed
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
        with self.lock:
            t0 = time.perf_counter()
            faults0 = self.sessions.l3_reads()
            logits, reused = self.sessions.prefill(ids)
            first_token_s = time.perf_counter() - t0
            out: list[int] = []
            try:
                final = yield from decode_loop.run(
                    logits, lambda token: self.sessions.forward([token]), params, generator, max_new=max_new,
                    eos_ids=self.eos_ids, detokenize=self.decode, prompt_tokens=len(ids), out=out)
                self._remember(Turn(tuple(ids), tuple(out), final))
            finally:
                self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused,
                                  generated=len(out), seconds=time.perf_counter() - t0, first_token_s=first_token_s,
                                  l3_reads=self.sessions.l3_reads() - faults0)
                self.budget.give_back()

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        """The session brought to ``ids`` as ``generate`` brings it before its first token: the prefix it holds
        kept (or stored pages adopted), the rest run in chunks of ``prefill_chunk``. Returns ``(logits[vocab] of
        the token after ids, tokens reused)``. A supported entry point for benchmarks and tools that run the
        decode loop themselves, with ``step``: no stats are recorded and no memory is given back afterwards. Hold
        ``engine.lock`` across a prefill and its steps so that no other call moves the session between them."""
        ids = self._check_prompt(ids)
        with self.lock:
            return self.sessions.prefill(ids)

    def step(self, token: int) -> torch.Tensor:
        """One decode step: ``token`` appended after what the session holds (a ``prefill``, then steps); returns
        the next token's ``logits[vocab]``. The same step ``generate`` takes (``decode_step``: one CUDA graph per
        step where the pages are resident), with the same retries (retry.py). A PromptError when the session is at
        the model's context."""
        with self.lock:
            if len(self.session_ids) + 1 >= self.context_length:
                raise PromptError(f"the session holds {len(self.session_ids)} tokens: one more reaches the model's "
                                  f"context of {self.context_length} tokens")
            return self.sessions.forward([int(token)])

    def next_token_logprobs(self, ids: Sequence[int], task: str = "moderation") -> tuple[torch.Tensor, int]:
        """Log-probabilities of the token after ``ids`` (one forward over the unseen suffix).

        Returns ``(logprobs[vocab], reused_tokens)``.
        """
        r = self.read(ids, task=task)
        return r.logprobs, r.reused

    def keep_exact(self, token_ids: Sequence[int]) -> None:
        """Compute these tokens' logits exactly even where the lm_head is read approximately (``lm_head: int4``
        recomputes only its top candidates): the rails' answers, whose log-odds a verdict reads."""
        from ..quant.lm_head import RescoredHead

        head = self.model.get_output_embeddings()
        if isinstance(head, RescoredHead):
            head.keep_exact(token_ids)

    def next_token_state(self, ids: Sequence[int], task: str = "moderation", *,
                         hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """``read(ids, hidden=hidden)`` as ``(logprobs[vocab], hidden or None, reused_tokens)``."""
        r = self.read(ids, task=task, hidden=hidden)
        return r.logprobs, r.hidden, r.reused

    def read(self, ids: Sequence[int], task: str = "moderation", *, hidden: bool = False, layers=(),
             mean_from: int | None = None, keep_states: bool = False, keep: int | None = None,
             adapter_from: int | None = None, then: Sequence[int] | None = None) -> Reading:
        """The rails' one call: run the part of ``ids`` the session does not hold (its pages reused, the rest
        prefilled; the last token always runs, so the states are this call's) and return what a verdict reads
        (``reading.Reading``):

        - ``hidden``: the last token's state after the embedding and every decoder layer (``[layers + 1, d]``).
        - ``layers`` and ``mean_from``: the mean state over ``ids[mean_from:]`` at those state indices; those tokens
          run in this call (a session that holds them is cropped back to ``mean_from`` first, stored pages adopted
          past it are run again). ``keep_states``: every position's state over that span too.
        - ``keep``: afterwards the session holds at most ``ids[:keep]`` (a branch: the question the rail asked is
          dropped, the generation continues from ``keep``); None keeps all of ``ids``. Only the engine crops.
        - ``adapter_from``: ``ids[adapter_from:]`` (the guard's invocation and question) run with the guard adapter
          on (``guard_adapter``: an activated LoRA, engine/alora.py); the tokens before are the base model's: the part
          the caller keeps (``keep``) reused or prefilled as a read of it alone would be, the rest up to the
          invocation run on base weights in the adapter's forward. Afterwards the session holds at most
          ``ids[:min(keep, adapter_from)]``: nothing the adapter
          computed stays or is ever adopted by another sequence. No states are read then.
        - ``then`` (with ``adapter_from``): the ids the caller runs next (the input rail: the generation's prompt),
          which share ``ids[:keep]``: the session is brought to ``then`` as that prefill would bring it, and cropped
          for the read, so the kept tokens are rounded as the generation's own prefill rounds them (the CPU int4
          kernel rounds a row by the chunk it runs in).
        """
        from .reading import Tap

        ids = self._check_prompt(ids)
        if adapter_from is not None:
            return self._read_guarded(ids, task, adapter_from, keep, then)
        with self.lock:
            t0 = time.perf_counter()
            faults0 = self.sessions.l3_reads()
            span = mean_from is not None
            if span:
                self.sessions.rewind(ids, mean_from)
            for attempt in range(2):
                tap = Tap(hidden, layers if span else (), mean_from, keep_states)
                self.sessions.tap = tap if hidden or span else None
                try:
                    logits, reused = self.sessions.prefill(ids)
                finally:
                    self.sessions.tap = None
                if not span or reused <= mean_from or attempt:
                    break
                self.sessions.rewind(ids, mean_from)   # stored pages adopted past the span's start: once more, from it
            mean = tap.mean(len(ids) - max(mean_from, reused)) if span else None
            states = tap.states(len(ids) - mean_from) if span and keep_states else None
            if keep is not None:
                self.sessions.branch_back(ids, keep)
            seconds = time.perf_counter() - t0
            self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused, generated=0,
                              seconds=seconds, first_token_s=seconds, l3_reads=self.sessions.l3_reads() - faults0)
            self.budget.give_back()
            return Reading(logprobs=torch.log_softmax(logits.float(), dim=-1),
                           hidden=tap.hidden() if hidden else None, mean=mean, states=states, reused=reused,
                           prefilled=len(ids) - reused)


    def _read_guarded(self, ids: list[int], task: str, start: int, keep: int | None,
                      then: Sequence[int] | None = None) -> Reading:
        """``read(adapter_from=start)``: the session brought to ``ids[:back]`` (``back = min(keep, start)``: the part
        the caller keeps, chunked as a read of it alone would be), then ``ids[back:]`` in one private forward with the
        guard's deltas on from ``start`` (``Deltas.from_position``: the question's opening runs on base weights),
        then cropped back to ``back``. Where nothing is kept or more than a prefill chunk lies between ``back`` and
        ``start`` (the input rail's ``window``), the session is brought to ``ids[:start]`` and only the question
        runs with the deltas."""
        if self.guard is None:
            raise ConfigError("no guard adapter is loaded for this model (guard_adapter is off, or none was found); "
                              "the rails' guard verdict needs one: `flashguard train-guard`", key="guard_adapter")
        if not 0 < start < len(ids):
            raise ValueError(f"adapter_from must fall inside the ids (0 < {start} < {len(ids)})")
        back = start if keep is None else min(keep, start)
        with self.lock:
            t0 = time.perf_counter()
            faults0 = self.sessions.l3_reads()
            # the conversation first, as the generation holds it (``ids[:back]``): a prefill chunked differently
            # gives other float roundings, and greedy replies parted at near-ties; then the question's opening (base)
            # and the question (the adapter on from the invocation) in one forward
            one = 0 < back and start - back <= self.prefill_chunk   # else (a window, no shared part): as before
            then = self._check_prompt(then) if then is not None else None
            kept = back
            if one and then is not None and len(then) > back and then[:back] == ids[:back]:
                # the generation's prompt first, as its own prefill runs it (a chunk of another length rounds the
                # kept tokens otherwise), then back to the shared part; afterwards the session keeps a whole number
                # of ROW_BLOCKs of it, so that the generation's prefill resumes where the rows round as they did
                reused = self.sessions.prefill(then)[1]
                self.sessions.bring_to(ids[:back])   # (a crop)
                kept = back - back % ROW_BLOCK or back
            else:
                reused = self.sessions.bring_to(ids[:back] if one else ids[:start])
            try:
                if one:
                    deltas = self.guard.deltas.from_position(start - back) if back < start else self.guard.deltas
                    logits = self.sessions.forward(ids[back:], deltas)
                else:
                    logits = self.sessions.forward(ids[start:], self.guard.deltas)
            finally:
                self.sessions.branch_back(ids, kept)
            seconds = time.perf_counter() - t0
            self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused, generated=0,
                              seconds=seconds, first_token_s=seconds, l3_reads=self.sessions.l3_reads() - faults0)
            self.budget.give_back()
            return Reading(logprobs=torch.log_softmax(logits.float(), dim=-1), hidden=None, mean=None, states=None,
                           reused=reused, prefilled=len(ids) - reused)

    def teacher_force(self, prompt_ids: Sequence[int], output_ids: Sequence[int], text: str | None = None) -> Turn:
        """Run ``prompt_ids + output_ids`` through the model as if it had generated ``output_ids``.

        Records the Turn (so moderation finds its pages). Used for replayed conversations and tests.
        """
        ids = list(prompt_ids) + list(output_ids)
        self.next_token_logprobs(ids, task="generation")
        turn = Turn(tuple(prompt_ids), tuple(output_ids), text if text is not None else self.decode(output_ids))
        with self.lock:
            self._remember(turn)
        return turn


    # ---- where the weights live (placement.py) ------------------------------------------------------------------
    def placement(self) -> dict:
        """Where each part of the model lives: the embedding table, lm_head, the resident and streamed layers."""
        return self.weights_placement.info()

    def decode_bytes(self, context: int | None = None) -> dict:
        """Bytes one decoded token reads at ``context`` (default: the engine's context length), from the loaded
        tensors: the decoder layers' linears and the lm_head as they are held (int4 codes, 16-bit, an int4 pair),
        and the K/V the cache as sized attends (``vram.plan.kv_read_bytes``). ``engine_info()`` and
        ``benchmarks.e2e`` report it beside llama.cpp's estimate (``vram.plan.llamacpp_decode_bytes``)."""
        return self.weights_placement.decode_bytes(context or self.context_length, self.kv)

    def reset_session(self, keep_pages: bool = True) -> None:
        """Drop the cached conversation (the next call prefills from scratch, adopting stored pages). With
        ``keep_pages`` False no page is kept: not the session's, nor any in the store (a new, empty store at the next
        prompt), so the next call prefills every token (benchmarks of prefill)."""
        with self.lock:
            self.sessions.drop(keep_pages=keep_pages)
            if not keep_pages:
                self.sessions.forget_store()

    def info(self) -> dict:
        """What ``flashguard.engine_info()`` shows for this engine (sizes as configured after start-up sizing; bytes
        of the tiers as held now)."""
        from ..quant.int4_linear import Int4Linear
        from ..vram import plan as planner

        shape = planner.Shape.from_config(self.model.config, self.source.label)
        kv_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * self.dtype.itemsize
        if self.kv.l1_codec == "int8":
            from ..kv.int8_pool import bytes_per_value

            kv_token = int(shape.layers * 2 * shape.kv_heads * shape.head_dim * bytes_per_value())
        kernels = sorted({m.backend for m in self.model.modules() if isinstance(m, Int4Linear)})
        out = {"model": self.source.label, "device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
               "weights": self.weights_kind, "weights_reason": self.weights_reason,
               "int4_kernel": kernels[0] if len(kernels) == 1 else kernels or None,
               "cache": self.config.kv_cache, "vram_budget": self.vram_budget, "context": self.context_length,
               "prefill_chunk": self.prefill_chunk,
               "embedding": "host" if self.embedding_on_host else str(self.device),
               "placement": self.placement(),
               "decode_bytes": self.decode_bytes(),
               "lora": None if self.adapter is None else {"path": self.adapter.path, "rank": self.adapter.rank,
                                                          "modules": len(self.adapter.layers)},
               "guard": None if self.guard is None else self.guard.info()}
        with self.lock:
            session = self.session.stats() if self.session is not None else {}
        if self.config.kv_cache == "tiered":
            k = self.kv
            store = self.store.stats_dict() if self.store is not None else {}
            out["tiers"] = {
                "page_size": k.page_size, "policy": k.policy,
                "pool": {"tokens": k.l1_max_tokens, "codec": k.l1_codec, "bytes": k.l1_max_tokens * kv_token},
                "l1": {"tokens": k.l1_tokens, "sink_tokens": k.sink_tokens, "bytes_now": session.get("l1_bytes", 0)},
                "l2": {"tokens": k.l2_tokens, "codec": k.l2_codec, "pages_now": store.get("l2_pages", 0),
                       "bytes_now": store.get("l2_bytes", 0)},
                "l3": {"tokens": k.l3_tokens, "codec": k.l3_codec, "pages_now": store.get("l3_pages", 0),
                       "dir": self.store.l3_dir if self.store is not None else None,
                       # why L3 is off or failing (a missing package, an unusable folder), None while it works
                       "error": None if self.store is None else self.store.l3_error},
                "peers": self.peers.info() if self.peers is not None else None,
            }
        out["session"] = session
        return out

    # ---- model facts ---------------------------------------------------------------------
    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(src)
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<end_of_turn>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return frozenset(ids)

    def _use_causal_sdpa(self) -> None:
        """Plain causal models run flashguard's attention function even with a DynamicCache: SDPA with a
        lower-right causal bias instead of a materialised mask (prefill chunks after the first, the
        moderation suffix)."""
        from ..kv import attention

        if attention.plain_causal(self.model.config):
            attention.register()
            self.model.set_attn_implementation(attention.NAME)
