"""The Engine: one loaded model, its decode loop, and the conversation's KV cache.

Contract:
- One Engine per model identity per process (see ``registry.get_engine``); every provider,
  ``LLMRails`` and server request shares it.
- Calls are serialised by ``self.lock``: ``stream()`` holds it from its first ``next()`` until it
  is exhausted or closed, so two requests never interleave on the cache.
- The engine keeps the KV cache of the last sequence it ran (the *session*). A new call that
  starts with the same token ids reuses that prefix and prefills only the rest; this is what
  makes the next chat turn and the moderation call cheap. ``session_ids`` are exactly the
  tokens whose K/V are in the cache.
- Prefill runs in chunks of ``prefill_chunk`` tokens with ``logits_to_keep=1``, so activation
  memory does not grow with the prompt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..config import EngineConfig
from ..errors import ConfigError, GpuMemoryError, PromptError
from .. import notice
from ..kv import OUT_OF_MEMORY, peer
from ..quant import lm_head
from ..vram import host_heap
from . import loader
from .decode_step import DecodeStep
from .encoding import MessageEncoder
from .reading import Reading
from .sampling import IncrementalText, SamplingParams, StopMatcher, choose
from .stats import EngineStats

log = logging.getLogger("flashguard")


@dataclass(frozen=True)
class Delta:
    """A piece of streamed output. The last Delta of a call has ``finish_reason`` set."""

    text: str
    finish_reason: str | None = None  # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0


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


def joined(deltas: Iterator[Delta]) -> Delta:
    """A stream's Deltas as one: the whole text, the last Delta's finish reason and token counts."""
    parts, last = [], None
    for d in deltas:
        parts.append(d.text)
        last = d
    return Delta("".join(parts), last.finish_reason, last.prompt_tokens, last.completion_tokens)


@dataclass(frozen=True)
class Turn:
    """What the engine ran for one generation: the ids it attended to and the ids it produced."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str


def cache_kwarg(model) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (older): the forward argument for the Cache."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


VRAM_MARGIN = 512 * 2**20   # vram_budget auto: the GPU's free memory at start less this (other programs, the desktop)


KERNEL_MODULES = 192 * 2**20   # CUDA context growth after start, as kernels load lazily (flash, cuBLAS, Triton)


def measure_cuda_context(device: torch.device, margin: int = KERNEL_MODULES) -> int:
    """The GPU memory this process holds outside torch's allocator (the CUDA context), measured through NVML plus
    ``margin`` for kernels that load later; ``vram/plan.py``'s ``CUDA_CONTEXT`` where NVML cannot say.
    (An H200 process measured 0.68 GiB at the end of a run, where the planner assumed 0.39.)"""
    from ..vram.accounting import nvml_process_bytes
    from ..vram.plan import CUDA_CONTEXT

    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.mem_get_info(index)   # creates the context
    held = nvml_process_bytes(index, os.getpid())
    if held is None:
        return CUDA_CONTEXT
    return max(CUDA_CONTEXT, held - torch.cuda.memory_reserved(index) + margin)


def resolve_vram_budget(budget: int | str | None, device: torch.device, context: int | None = None) -> int | None:
    """``vram_budget`` in bytes: the process's whole GPU memory, CUDA context included (what NVML and the task
    manager show). ``auto`` = the GPU's free memory at start (with this process's CUDA context, ``context``,
    counted back in) less ``VRAM_MARGIN``; None off CUDA or uncapped."""
    from ..vram.plan import CUDA_CONTEXT

    if budget is None or device.type != "cuda":
        return None
    if budget == "auto":
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(index)   # creates the context: it is no longer free
        return max(0, free + (CUDA_CONTEXT if context is None else context) - VRAM_MARGIN)
    return int(budget)


def apply_vram_budget(budget: int | None, device: torch.device) -> float | None:
    """Cap this process's CUDA allocator at ``budget`` bytes (``vram_budget`` less the CUDA context, which the
    allocator does not hold); returns the fraction set."""
    if budget is None or device.type != "cuda":
        return None
    import warnings

    try:  # grow segments in place instead of caching whole blocks: less reserved-but-unused memory
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # older torch, or a platform without expandable segments
        pass
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, budget / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("flashguard: GPU allocator capped at %.2f GiB (vram_budget) of %.2f GiB", budget / 2**30, total / 2**30)
    return fraction


# A model without a chat template (a base model) gets this one, so the generation, the rails and calibrate render
# conversations one way: the BOS token, "role: text" lines, and "assistant:" to answer.
PLAIN_CHAT_TEMPLATE = ("{{ bos_token or '' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


class Engine:
    reads_states = True   # read() returns hidden states (the probes need them); a RemoteEngine's does not

    def __init__(self, config: EngineConfig, source: loader.ModelSource | None = None, *, model=None,
                 tokenizer=None):
        """Loads the model of ``config``; benchmarks pass an already built ``model`` and ``tokenizer``."""
        self.config = config
        self.source = source or loader.resolve_model(config.model_path, config.gguf_file)
        self.device = loader.resolve_device(config.device)
        self.dtype = loader.resolve_dtype(config.dtype, self.device)
        # kv.peer_gpus: checked against this host before anything loads (a ConfigError naming the key)
        self.peer_devices = peer.resolve_devices(config.kv.peer_gpus, self.device)
        if self.peer_devices and config.kv_cache != "tiered":
            raise ConfigError(f"peer GPUs hold the tiered cache's pages; kv_cache is {config.kv_cache}",
                              key="kv.peer_gpus")
        # the CUDA context is measured, not assumed (it differs by GPU and driver), and left out of the allocator's cap
        self.cuda_context = measure_cuda_context(self.device) if config.vram_budget is not None else 0
        self.vram_budget = resolve_vram_budget(config.vram_budget, self.device, self.cuda_context)   # bytes, or None
        self.budget_fraction = apply_vram_budget(
            None if self.vram_budget is None else max(0, self.vram_budget - self.cuda_context), self.device)
        t0 = time.perf_counter()
        # the weights key resolved (auto: int4 for a Q4 GGUF on the CPU, loader.choose_weights) and why
        weights, self.weights_reason = loader.choose_weights(config.weights, self.source, self.device)
        if model is not None:
            self.model, self.tokenizer = model, tokenizer
            self.dtype = next(model.parameters()).dtype
        else:
            notice.say("flashguard: loading %s on %s, %s weights (%s)", self.source.label,
                       "the CPU" if self.device.type == "cpu" else self.device, weights,
                       self.weights_reason)
            where, kernel = self._load_target(config, weights)   # host RAM when int4 layers stream (_place_layers)
            self.model, self.tokenizer = loader.load(self.source, where, self.dtype, weights, kernel)
        log.info("flashguard: loaded %s on %s (%s) in %.1fs", self.source.label, self.device,
                 str(self.dtype).replace("torch.", ""), time.perf_counter() - t0)
        if getattr(self.tokenizer, "chat_template", None) is None:   # a base model: one plain template for all
            log.warning("flashguard: %s has no chat template (a base model?): conversations are written as "
                        "'role: text' lines ending in 'assistant:'", self.source.label)
            self.tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
        self.adapter = None   # lora_path: on this one engine, so the moderation rail runs with it too
        if config.lora_path is not None:
            from . import lora

            self.adapter = lora.read_adapter(config.lora_path, self.model)
            lora.apply_adapter(self.model, self.adapter, self.dtype)
        self.lock = threading.RLock()
        self.messages = MessageEncoder(self.tokenizer, config.system_prompt)
        self.stats = EngineStats()
        self.context_length = self._context_length()
        # lm_head: the output matrix in 16 bits or as Q8_0 codes (auto: measured, or the budget's call), quant/lm_head.py
        self.lm_head_kind, self.lm_head_reason = lm_head.apply(
            config.lm_head, self.model, self.weights_kind, self.device, config.int4_kernel, self._head_budget_wins())
        log.info("flashguard: lm_head %s (%s)", self.lm_head_kind, self.lm_head_reason)
        self.eos_ids = self._eos_ids()
        self._cache_kwarg = cache_kwarg(self.model)
        self._use_causal_sdpa()
        if self.device.type == "cuda":   # (the CPU keeps transformers' norms: the shipped probes read its states)
            from .decode_step import fuse_norms

            fuse_norms(self.model)
        self.embedding_on_host = False
        if self.device.type == "cuda" and self.weights_kind == "int4":
            # the GPU needs one row of the table per token; its 16-bit copy would take a quarter of an int4
            # model's GPU memory (vram/plan.py's weight_bytes leaves it out of the GPU's weights)
            from .host_embedding import install

            self.embedding_on_host = install(self.model, self.device) > 0
        self.prefill_chunk = config.prefill_chunk or (self.GPU_CHUNK if self.device.type == "cuda" else self.CPU_CHUNK)
        self.kv = config.kv
        self.layer_stream = self._place_layers()   # before DecodeStep: it must see the streamed layers
        self._step = DecodeStep(self.model, graphs=config.cuda_graphs and self.device.type == "cuda") \
            if DecodeStep.supports(self.model) else None
        self.session = None   # the KVSession of the last sequence run (kv/session.py)
        self.pool = None   # kv/pool.PoolBuffers: the GPU pool's buffers, from one session to the next
        self._reserved_after_release = 0   # _give_back_memory: the allocator's reserved bytes after its last release
        self._tap = None   # read(): the reading.Tap collecting states in the forwards of one read
        self.store = None  # the tiered cache's PageStore (kv_cache: tiered)
        self.turns: list[Turn] = []  # recent generations, newest last (bounded)
        # prefill_chunk auto (set above): larger chunks on a GPU (fewer launches; measured in
        # docs/benchmarks/e2e_h200.md); halves (for good) when a chunk does not fit the GPU budget. self.kv: the
        # tiered cache's settings, sized below
        self.oom_retries = 0
        self.plan = None
        self._fit_to_budget()
        self.peers = None   # kv/peer.PeerTier: the conversation's off-window pages on the peer GPUs (kv.peer_gpus)
        if self.peer_devices:
            self.peers = peer.start([f"cuda:{i}" for i in self.peer_devices], self.device, self.kv.page_size)
        if self.device.type == "cuda":   # after sizing: the kernels of the pool and pages as planned
            self._warm_up()
            self._settle_context()

    def _warm_up(self) -> None:
        """At start on a GPU: one 8-token forward (the int4 prompt kernels) and the decode step's kernels
        (``DecodeStep.warm_up``), so that their one-time builds are part of starting, not of the first answer's
        time to first token. A failure here is only logged: the first request builds them instead."""
        try:
            with torch.inference_mode():
                ids = torch.zeros((1, 8), dtype=torch.long, device=self.device)
                self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
                if self._step is not None:   # (and the sparse step's kernels where the cache may take it)
                    kv = self.kv
                    sparse = self.config.kv_cache == "tiered" and kv.policy == "sparse"
                    heads = self.model.config.num_key_value_heads
                    self._step.warm_up(page_size=kv.page_size if sparse else None,
                                       pages=heads * max(1, kv.budget_tokens // kv.page_size) if sparse else 0,
                                       int8=kv.l1_codec == "int8")
                if self.config.kv_cache == "tiered":
                    self._warm_up_prompt()
            torch.cuda.empty_cache()   # (the warm-up's throwaway buffers)
            torch.cuda.synchronize(self.device)
        except Exception as exc:   # noqa: BLE001 - a warm-up must never stop the engine from starting
            log.info("flashguard: warm-up skipped (%s: %s)", type(exc).__name__, exc)

    def _settle_context(self) -> None:
        """After the warm-up, with its kernels loaded: the CUDA context measured again. Where it grew past the
        start's estimate (context + ``KERNEL_MODULES``), the allocator's cap and the plan are made again from the
        larger one, before any session holds memory: on the H200 the 128K conversations' process reached 4.17 GiB
        of NVML within a 4 GiB budget, ~0.2 GiB of context past the estimate. A plan that no longer fits keeps the
        old one, with a warning; a failure to measure changes nothing."""
        if self.vram_budget is None:
            return
        from ..config import ConfigError

        context = measure_cuda_context(self.device, margin=self.KERNEL_MARGIN_AFTER_WARM_UP)
        if context <= self.cuda_context:
            return
        old = (self.cuda_context, self.kv, self.prefill_chunk, self.plan, self.budget_fraction)
        log.info("flashguard: the CUDA context is %.2f GiB after the warm-up (%.2f GiB estimated at start): the pool "
                 "is planned again", context / 2**30, self.cuda_context / 2**30)
        self.cuda_context = context
        self._forget_pool()   # (the warm-up's buffers were sized by the old plan)
        self.kv = self.config.kv
        self.prefill_chunk = self.config.prefill_chunk or self.GPU_CHUNK
        self.budget_fraction = apply_vram_budget(max(0, self.vram_budget - context), self.device)
        try:
            self._fit_to_budget()
        except ConfigError as exc:
            log.warning("flashguard: %s; keeping the plan made at start (the process may pass vram_budget by %.2f "
                        "GiB)", exc, (context - old[0]) / 2**30)
            self.cuda_context, self.kv, self.prefill_chunk, self.plan, _ = old
            self.budget_fraction = apply_vram_budget(max(0, self.vram_budget - old[0]), self.device)

    KERNEL_MARGIN_AFTER_WARM_UP = 64 * 2**20   # kernels still to load after the warm-up (a rail's, a rare path's)

    def _warm_up_prompt(self) -> None:
        """Two prompt chunks through a throwaway session of the engine's own cache: the kernels a first prompt
        builds (the int4 GEMMs at the chunk's size, the pool's attention over a chunk and over what precedes it)
        are built now (the 8-token forward above uses neither; the H200's first 8K prompt ran at 8.6K tok/s where
        later ones ran at 21K). The session is released without keeping its pages (with a pool smaller than two
        chunks, the few that left its window stay in the store unreferenced, the first to be evicted)."""
        chunk = self.prefill_chunk
        ids = [0] * max(2, min(2 * chunk, self.context_length - 1))
        saved, self.session = self.session, self._new_session()
        try:
            for a in range(0, len(ids), chunk):
                self._forward_once(ids[a:a + chunk])
        finally:
            self._drop_session(keep_pages=False)
            self.session = saved

    # ---- prompts -------------------------------------------------------------------------
    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat (list of {role, content}) with the generation prompt appended
        (``encoding.MessageEncoder``: the last few conversations' ids kept)."""
        return self.messages.encode(messages)

    ENCODED_KEPT = MessageEncoder.KEPT   # conversations whose ids encode_messages keeps (the rails' and the generation's)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, ids: Sequence[int], params: SamplingParams, task: str = "generation") -> Delta:
        """Run to completion; returns one Delta with the whole text."""
        return joined(self.stream(ids, params, task=task))

    def stream(self, ids: Sequence[int], params: SamplingParams, task: str = "generation") -> Iterator[Delta]:
        ids = self._check_prompt(ids)
        max_new = min(params.max_tokens, self.context_length - len(ids))
        generator = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else self.config.seed
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
        stopper = StopMatcher(params.stop)
        with self.lock:
            t0 = time.perf_counter()
            faults0 = self._l3_reads()
            logits, reused = self._prefill(ids)
            first_token_s = time.perf_counter() - t0
            out: list[int] = []
            incremental = IncrementalText(self.decode)
            emitted, finish = 0, "length"
            try:
                while len(out) < max_new:
                    token = choose(logits, params, generator)
                    if token in self.eos_ids:
                        finish = "stop"
                        break
                    out.append(token)
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
                        logits = self._forward([token])
                text = self.decode(out)
                end = stopper.find(text)
                final = text[:end] if end is not None else text
                yield Delta(final[emitted:] if len(final) > emitted else "", finish, len(ids), len(out))
                self._remember(Turn(tuple(ids), tuple(out), final))
            finally:
                self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused,
                                  generated=len(out), seconds=time.perf_counter() - t0, first_token_s=first_token_s,
                                  l3_reads=self._l3_reads() - faults0)
                self._give_back_memory()

    def _give_back_memory(self) -> None:
        """After a task. On the CPU the heap's free pages go back to the OS (``vram/host_heap.py``): without it a
        server's resident set grows for minutes under load. On a GPU the allocator's cached blocks go back to the
        device when they pass ``CACHED_KEEP``: a task's transient buffers (a long prompt's chunks, a rail's windows)
        stayed reserved after it, and the process's GPU memory grew from turn to turn (a 128K conversation under a
        4 GiB budget: 3.59 GiB of NVML after its first turn, 3.90 after its second, with 0.46 GiB cached unused,
        ``docs/benchmarks/run_2026-12-02c/call1``). Below it they stay, so consecutive tasks do not map and unmap
        the same activation memory."""
        if self.device.type == "cpu":
            host_heap.trim()
        elif self.device.type == "cuda":
            # (free blocks inside the step graphs' own pools count as cached but stay: released again only once
            # the reserved memory grew past what the last release left)
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            reserved = torch.cuda.memory_reserved(index)
            if reserved - torch.cuda.memory_allocated(index) > self.CACHED_KEEP and \
                    reserved > self._reserved_after_release + self.CACHED_KEEP:
                torch.cuda.empty_cache()
                self._reserved_after_release = torch.cuda.memory_reserved(index)

    CACHED_KEEP = 128 * 2**20   # cached, unused GPU memory an engine keeps between tasks

    def next_token_logprobs(self, ids: Sequence[int], task: str = "moderation") -> tuple[torch.Tensor, int]:
        """Log-probabilities of the token after ``ids`` (one forward over the unseen suffix).

        Returns ``(logprobs[vocab], reused_tokens)``.
        """
        r = self.read(ids, task=task)
        return r.logprobs, r.reused

    def next_token_state(self, ids: Sequence[int], task: str = "moderation", *,
                         hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """``read(ids, hidden=hidden)`` as ``(logprobs[vocab], hidden or None, reused_tokens)``."""
        r = self.read(ids, task=task, hidden=hidden)
        return r.logprobs, r.hidden, r.reused

    def read(self, ids: Sequence[int], task: str = "moderation", *, hidden: bool = False, layers=(),
             mean_from: int | None = None, keep_states: bool = False, keep: int | None = None) -> Reading:
        """The rails' one call: run the part of ``ids`` the session does not hold (its pages reused, the rest
        prefilled; the last token always runs, so the states are this call's) and return what a verdict reads
        (``reading.Reading``):

        - ``hidden``: the last token's state after the embedding and every decoder layer (``[layers + 1, d]``).
        - ``layers`` and ``mean_from``: the mean state over ``ids[mean_from:]`` at those state indices; those tokens
          run in this call (a session that holds them is cropped back to ``mean_from`` first, stored pages adopted
          past it are run again). ``keep_states``: every position's state over that span too.
        - ``keep``: afterwards the session holds at most ``ids[:keep]`` (a branch: the question the rail asked is
          dropped, the generation continues from ``keep``); None keeps all of ``ids``. Only the engine crops.
        """
        from .reading import Tap

        ids = self._check_prompt(ids)
        with self.lock:
            t0 = time.perf_counter()
            faults0 = self._l3_reads()
            span = mean_from is not None
            if span:
                self._rewind(ids, mean_from)
            for attempt in range(2):
                tap = Tap(hidden, layers if span else (), mean_from, keep_states)
                self._tap = tap if hidden or span else None
                try:
                    logits, reused = self._prefill(ids)
                finally:
                    self._tap = None
                if not span or reused <= mean_from or attempt:
                    break
                self._rewind(ids, mean_from)   # stored pages adopted past the span's start: once more, from it
            mean = tap.mean(len(ids) - max(mean_from, reused)) if span else None
            states = tap.states(len(ids) - mean_from) if span and keep_states else None
            if keep is not None:
                self._branch_back(ids, keep)
            seconds = time.perf_counter() - t0
            self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused, generated=0,
                              seconds=seconds, first_token_s=seconds, l3_reads=self._l3_reads() - faults0)
            self._give_back_memory()
            return Reading(logprobs=torch.log_softmax(logits.float(), dim=-1),
                           hidden=tap.hidden() if hidden else None, mean=mean, states=states, reused=reused,
                           prefilled=len(ids) - reused)

    def _rewind(self, ids: list[int], start: int) -> None:
        """The session back to ``start`` tokens when it holds ``ids`` past ``start`` (the next prefill then runs
        them); to nothing for ``start`` 0 (its pages stay in the store)."""
        held = self.session_ids
        if len(held) > start and held[:start + 1] == ids[:start + 1]:
            if start > 0:
                self._crop(start)
            else:
                self._drop_session(keep_pages=True)

    def _branch_back(self, ids: list[int], keep: int) -> None:
        """After a read: the session back to ``ids[:keep]`` when it holds more of ``ids`` (``keep`` > 0)."""
        held = self.session_ids
        if 0 < keep < len(held) and held[:keep] == ids[:keep]:
            self._crop(keep)

    def _crop(self, n: int) -> None:
        """The session keeps its first ``n`` tokens; a page lost on the way drops it (the next call prefills)."""
        from ..kv.cache import PageLost

        try:
            self.session.crop(n)
        except PageLost as exc:
            log.warning("flashguard: %s; starting the session again", exc)
            self._drop_session(keep_pages=False)

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

    # ---- the session cache ---------------------------------------------------------------
    def _check_prompt(self, ids: Sequence[int]) -> list[int]:
        return checked_prompt(ids, self.context_length, self.model.get_input_embeddings().num_embeddings)

    def _fit_to_budget(self) -> None:
        """Size the tiers and the prefill chunk: within ``vram_budget`` on a GPU the pool (L1) is the largest the
        plan for the full context fits (the whole context when it fits: every page stays resident); without a
        budget (the CPU) the pool is the whole context. L2 takes what host RAM holds (``kv.policy``). A budget
        that cannot hold the weights and the smallest pool is a ConfigError naming ``vram_budget``."""
        from ..config import ConfigError
        from ..kv import policy
        from ..vram import plan as planner

        shape = self._plan_shape()
        l2_per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * (1 if self.kv.l2_codec == "int8" else 2)
        if self.vram_budget is None:
            if self.config.kv_cache == "tiered" and not self.kv.sized:
                self.kv = policy.size_tiers(self.kv, context=self.context_length, pool_tokens=self.context_length,
                                            l2_bytes_per_token=l2_per_token, host_available=policy.host_available(),
                                            kv_heads=shape.kv_heads)
            return
        self.kv, self.prefill_chunk, self.plan, notes = planner.fit_to_budget(
            shape, budget=self.vram_budget, context=self.context_length, weights=self.weights_kind,
            cache=self.config.kv_cache, prefill_chunk=self.prefill_chunk, kv=self.kv, cuda_context=self.cuda_context,
            host_available=policy.host_available(), l2_bytes_per_token=l2_per_token, group=self._int4_group(),
            streamed=self.streamed)
        gib = self.vram_budget / 2**30
        if not self.plan.fits:
            need = self.plan.peak_reserved / 2**30
            raise ConfigError(
                f"{gib:.2f} GiB cannot hold this model with a {self.context_length}-token context: the smallest plan "
                f"needs {need:.2f} GiB (weights {self.plan.parts['weights'] / 2**30:.2f} GiB). Raise vram_budget, "
                "set weights: int4, or lower max_context (`flashguard plan` shows the categories)", key="vram_budget")
        for note in notes:
            log.warning("flashguard: vram_budget %.2f GiB: %s", gib, note)
        log.info("flashguard: vram_budget %.2f GiB: pool %d tokens on the GPU (L1) of a %d-token context, L2 %d tokens",
                 gib, self.kv.l1_max_tokens or 0, self.context_length, self.kv.l2_tokens or 0)
        if self.config.kv_cache == "tiered" and self.kv.l1_codec == "int8" and \
                (self.kv.l1_max_tokens or 0) < self.context_length:
            log.warning("flashguard: kv.l1_codec int8 with a pool (%d tokens) shorter than the context (%d): decode "
                        "steps past the pool dequantize the pool in every layer (slow); kv.l1_codec: auto keeps a "
                        "16-bit pool here", self.kv.l1_max_tokens or 0, self.context_length)

    # ---- where the weights live (issue 18) ---------------------------------------------------
    def _plan_shape(self):
        """The planner's Shape of the loaded model; ``lm_head`` says how its output matrix is held."""
        import dataclasses

        from ..vram import plan as planner

        shape = planner.Shape.from_config(self.model.config, self.source.label)
        return dataclasses.replace(shape, lm_head=lm_head.kind_of(self.model.get_output_embeddings()))

    def _head_budget_wins(self) -> bool:
        """Whether ``vram_budget`` calls for a Q8_0 lm_head: with the 16-bit head more int4 decoder layers would
        stream from host RAM (or none of the placements would fit) than with the Q8_0 one."""
        import dataclasses

        from ..vram import plan as planner

        if self.vram_budget is None or self.device.type != "cuda" or self.weights_kind != "int4" or \
                lm_head.kind_of(self.model.get_output_embeddings()) != "float":
            return False
        streamed = []
        for kind in ("float", "int8"):
            try:
                n, _ = planner.layer_placement(
                    dataclasses.replace(self._plan_shape(), lm_head=kind), budget=self.vram_budget,
                    context=self.context_length, weights="int4", cache=self.config.kv_cache,
                    prefill_chunk=self.config.prefill_chunk or self.GPU_CHUNK, kv=self.config.kv,
                    cuda_context=self.cuda_context, group=self._int4_group(),
                    shrink_chunk=self.config.prefill_chunk is None)
            except ConfigError:   # nothing fits: the placement after this raises it, naming vram_budget
                n = 1 << 30
            streamed.append(n)
        return streamed[1] < streamed[0]

    def _load_target(self, config: EngineConfig, weights: str) -> tuple[torch.device, str]:
        """``(device, int4_kernel)`` for the loader: the engine's, or host RAM with the ``dequant`` int4 layout (the
        Triton kernels' bytes, ``layer_stream.place`` switches them) when the model's int4 decoder layers will not
        all fit ``vram_budget``: a 7B's would not fit the device to be moved off it after loading."""
        import dataclasses

        from ..vram import plan as planner

        if self.vram_budget is None or self.device.type != "cuda" or weights != "int4":
            return self.device, config.int4_kernel
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(
                loader.gguf_meta_folder(self.source) if self.source.gguf_file else self.source.folder)
            shape = planner.Shape.from_config(cfg, self.source.label)
            shape = dataclasses.replace(shape, lm_head=lm_head.planned(config.lm_head, weights))
        except (ValueError, OSError, KeyError, AttributeError):   # the loader says what is wrong
            return self.device, config.int4_kernel
        context = min(getattr(cfg, "max_position_embeddings", None) or 2048, config.max_context or 1 << 62)
        streamed, _ = planner.layer_placement(
            shape, budget=self.vram_budget, context=context, weights="int4", cache=config.kv_cache,
            prefill_chunk=config.prefill_chunk or self.GPU_CHUNK, kv=config.kv, cuda_context=self.cuda_context)
        return (torch.device("cpu"), "dequant") if streamed else (self.device, config.int4_kernel)

    def _streamed_count(self) -> int:
        """How many decoder layers stream (``planner.layer_placement``: the fewest that let the int4 layers and the
        smallest KV window fit ``vram_budget`` on CUDA; it may halve the prefill chunk, and raises the ConfigError
        naming ``vram_budget`` and the smallest budget that works)."""
        from ..vram import plan as planner

        if self.vram_budget is None or self.device.type != "cuda" or self.weights_kind != "int4":
            return 0
        streamed, self.prefill_chunk = planner.layer_placement(
            self._plan_shape(), budget=self.vram_budget, context=self.context_length, weights="int4",
            cache=self.config.kv_cache, prefill_chunk=self.prefill_chunk, kv=self.kv, cuda_context=self.cuda_context,
            group=self._int4_group(), shrink_chunk=self.config.prefill_chunk is None)
        return streamed

    def _place_layers(self):
        """The last ``_streamed_count()`` decoder layers in pinned host RAM, copied to the device one layer ahead of
        use (``layer_stream.place``; DecodeStep's graphs hold the copies, see layer_stream's contract), the rest of
        the model on the device. Returns the LayerStream, or None (every layer resident)."""
        from .layer_stream import place

        self.streamed = self._streamed_count()
        n = self.model.config.num_hidden_layers
        on_device = all(t.device.type == self.device.type for t in [*self.model.parameters(), *self.model.buffers()])
        if not self.streamed and on_device:
            return None
        if self.streamed:
            log.info("flashguard: vram_budget %.2f GiB: decoder layers %d-%d stream from pinned host RAM, %d resident",
                     (self.vram_budget or 0) / 2**30, n - self.streamed, n - 1, n - self.streamed)
        return place(self.model, self.device, list(range(n - self.streamed, n)), self.config.int4_kernel)

    def placement(self) -> dict:
        """Where each part of the model lives: the embedding table, lm_head, the resident and streamed layers."""
        n = self.model.config.num_hidden_layers
        stats = self.layer_stream.stats() if self.layer_stream is not None else None
        return {"embedding": "host" if self.embedding_on_host else str(self.device),
                "lm_head": {"device": str(self.device), "weights": self._plan_shape().lm_head,
                            "why": self.lm_head_reason},
                "layers_resident": list(range(n - self.streamed)),
                "layers_streamed": list(range(n - self.streamed, n)),
                "streamed_from": "pinned host RAM" if self.device.type == "cuda" and self.streamed else
                ("host RAM" if self.streamed else None),
                "streamed_layer_bytes": stats["layer_bytes"] if stats else 0,
                "slot_bytes": stats["slot_bytes"] if stats else 0,
                "layer_copies": stats["copies"] if stats else 0}

    def decode_bytes(self, context: int | None = None) -> dict:
        """Bytes one decoded token reads at ``context`` (default: the engine's context length), from the loaded
        tensors: the decoder layers' linears and the lm_head as they are held (int4 codes, 16-bit, an int4 pair),
        and the K/V the cache as sized attends (``vram.plan.kv_read_bytes``). ``engine_info()`` and
        ``benchmarks.e2e`` report it beside llama.cpp's estimate (``vram.plan.llamacpp_decode_bytes``)."""
        from ..vram import plan as planner

        def held(module) -> int:
            return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

        linears = sum(held(m) for layer in self.model.model.layers
                      for name, m in layer.named_modules() if name.endswith("_proj"))
        head = self.model.get_output_embeddings()
        out = {"decoder linears": linears, "lm_head": held(head),
               "kv attended": planner.kv_read_bytes(self._plan_shape(), context=context or self.context_length,
                                                    kv=self.kv, value_bytes=self.dtype.itemsize)}
        out["total"] = sum(out.values())
        return out

    @property
    def weights_kind(self) -> str:
        """"int4" when the decoder's linears are int4, else "float": the ``weights`` key's values, which the
        planner takes too. The lm_head's codes do not count (``lm_head_kind`` says how it is held)."""
        from ..quant.int4_linear import Int4Linear

        out = self.model.get_output_embeddings()
        in_head = {id(m) for m in out.modules()} if out is not None else set()
        return "int4" if any(isinstance(m, Int4Linear) and id(m) not in in_head
                             for m in self.model.modules()) else "float"

    def _int4_group(self) -> int:
        """The int4 group size the planner counts scales for: the smallest of the model's Int4Linear layers (a GGUF
        keeps 32, ``flashguard quantize`` writes 64), or the quantizer's for a float model."""
        from ..quant import AWQ_GROUP_SIZE
        from ..quant.int4_linear import Int4Linear

        return min((m.group_size for m in self.model.modules() if isinstance(m, Int4Linear)), default=AWQ_GROUP_SIZE)

    def _use_causal_sdpa(self) -> None:
        """Plain causal models run flashguard's attention function even with a DynamicCache: SDPA with a
        lower-right causal bias instead of a materialised mask (prefill chunks after the first, the
        moderation suffix)."""
        from ..kv import attention

        if attention.plain_causal(self.model.config):
            attention.register()
            self.model.set_attn_implementation(attention.NAME)

    def _page_store(self):
        """The engine's one PageStore (sessions share pages by content hash), made on first use; None off the
        tiered cache."""
        if self.store is None and self.config.kv_cache == "tiered":
            from ..kv.store import PageStore

            self.store = PageStore(self.kv, pin_memory=self.device.type == "cuda")
        return self.store

    def _new_session(self):
        from ..kv.session import DynamicSession, TieredSession

        if self.config.kv_cache == "tiered":
            on_gpu = self.device.type == "cuda"
            if on_gpu and self.pool is None:
                from ..kv.pool import PoolBuffers

                self.pool = PoolBuffers()
            session = TieredSession(self.model, self.kv, self._page_store(), self.model_identity,
                                    preallocate=on_gpu, pool=self.pool if on_gpu else None)
            if self.peers is not None and self.peers.lost is None:
                try:
                    session.cache.use_peers(self.peers)
                except peer.PeerLostError as err:   # the pages stay in the store alone
                    log.warning("flashguard: %s; serving from the store", err)
            return session
        return DynamicSession(self.model.config)

    @property
    def label(self) -> str:
        """The model's name in ``engine_stats()`` (a remote engine's adds its server)."""
        return self.source.label

    @property
    def model_identity(self) -> str:
        """What the KV pages' namespace is keyed by (kv/store.py ``namespace_for``): the weights' file and the
        adapter's content, whose keys and values differ from the base model's."""
        return self.source.identity + (f"|lora:{self.adapter.digest}" if self.adapter is not None else "")

    def _drop_session(self, keep_pages: bool) -> None:
        """The one place a session ends: its page references go back to the store."""
        if self.session is not None:
            self.session.release(keep_pages=keep_pages)
            self.session = None
            # the buffers go to the next session (kv/pool.py) with the graphs recorded over them; graphs over
            # buffers that are gone (a cache without the pool, buffers a long chunk replaced) go
            if self._step is not None:
                self._step.forget_steps(keep=self.pool.ptrs() if self.pool is not None else None)

    def _forget_pool(self) -> None:
        """The kept pool buffers and the step graphs recorded over them go (a new plan sizes the pool again)."""
        if self.pool is not None:
            self.pool.clear()
        if self._step is not None:
            self._step.forget_steps()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    ADOPT_TRIES = 8

    def _start_session(self, ids: list[int]) -> int:
        """A new session for ``ids``, adopting its stored pages; returns tokens reused. A stored page that fails
        verification while it is adopted is dropped by the store (never used): the next try adopts the pages
        before it, and after ``ADOPT_TRIES`` bad pages the session starts empty."""
        from ..kv.cache import PageLost

        self._drop_session(keep_pages=True)
        for _ in range(self.ADOPT_TRIES):
            self.session = self._new_session()
            try:
                return self.session.adopt(ids, self.dtype, self.device)
            except PageLost as exc:
                log.warning("flashguard: %s; adopting the stored pages before it", exc)
                self._drop_session(keep_pages=False)
        self.session = self._new_session()
        return 0

    def _prefill(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Bring the cache to ``ids[:-1]`` + feed the rest; returns (last logits row, reused count)."""
        logits = None
        a = 0
        # a prompt's pages stay in L2 while it is prefilled (each chunk attends all of them: none is read back
        # from disk), the pages a new session adopts from disk too; their L3 files are written on the store's
        # worker meanwhile (kv/store.py ``deferred``), and L2 goes back to its budget at the end. The store is made
        # here if this is the engine's first prompt: a first prefill outside ``deferred`` read its own pages back
        # from disk in every chunk once L2 was full (a fresh engine's 128K prompt with a 16K L2 never finished)
        store = self._page_store()
        with store.deferred() if store is not None else contextlib.nullcontext():
            reused = self._reuse_prefix(ids)
            rest = ids[reused:]
            # the prompt's pages stay in L2 until it is prefilled: room made at once, for all of them (with the
            # pages past the pool alone, the 128K prompt's arena grew again after it, and the sparse steps' graphs
            # were recorded once more over the new one: 2-3 s of its first token, docs/benchmarks/run_2026-12-02/call2-call3). A prompt
            # that fits the pool announces nothing: a 32K prompt's 0.5 GiB, pinned and never used, showed as 0.59 s
            # of cudaHostAlloc in its prefill's profile (docs/benchmarks/run_2026-12-02/call1/profile_32768.txt)
            if store is not None and self.session.leaving(len(rest)):
                store.expect_tokens(len(rest))
            # the last token runs alone, as a reused prompt's does (ids[:-1] held, one token fed): the first
            # token's logits then come from the same computation whether the prompt was prefilled now or held, so
            # greedy replies do not depend on what the session held before (int4 kernels round a token's
            # activations differently in a chunk of many than alone)
            # (only while the prompt fits the pool: past it a token fed alone attends the sparse policy's pages,
            # where a prefill chunk attends every page)
            alone = self.config.kv_cache == "dynamic" or self.kv.l1_tokens is None or len(ids) <= self.kv.l1_tokens
            body = rest[:-1] if alone else rest
            while a < len(body):
                chunk = self.prefill_chunk  # may shrink inside _forward after an out-of-memory
                logits = self._forward(body[a:a + chunk])
                a += chunk
            if alone:
                logits = self._forward(rest[-1:])
        return logits, reused

    def _reuse_prefix(self, ids: list[int]) -> int:
        held = self.session_ids
        common = 0
        limit = min(len(ids) - 1, len(held))  # always feed at least one token
        while common < limit and held[common] == ids[common]:
            common += 1
        if self.session is None or common == 0:
            return self._start_session(ids[:-1])
        from ..kv.cache import PageLost

        try:
            self.session.crop(common)   # below the window it refills L1 from stored pages
        except PageLost as exc:
            log.warning("flashguard: %s; starting the session again", exc)
            self._drop_session(keep_pages=False)
            return self._start_session(ids[:-1])
        return common

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        from ..kv.cache import PageLost

        try:
            return self._forward_fitting(tokens)
        except PageLost as exc:
            # A page failed verification (or could not be kept) and was dropped, never used: recompute the
            # whole sequence; pages before the lost one are adopted again from the store.
            ids = self.session_ids + list(tokens)
            for _ in range(3):  # pages adopted during the recompute can be found bad too; each try drops them
                log.warning("flashguard: %s; recomputing %d tokens by prefill", exc, len(ids))
                self._drop_session(keep_pages=False)
                try:
                    reused = self._start_session(ids)
                    logits = None
                    for a in range(reused, len(ids), self.prefill_chunk):
                        logits = self._forward_fitting(ids[a:a + self.prefill_chunk])
                    if logits is None:  # every token was adopted: run the last one again for its logits
                        self.session.crop(len(ids) - 1)
                        logits = self._forward_fitting(ids[-1:])
                    return logits
                except PageLost as again:
                    exc = again
            raise exc

    MIN_CHUNK = 16
    GPU_CHUNK, CPU_CHUNK = 2048, 512   # prefill_chunk: auto

    def _forward_fitting(self, tokens: list[int], retried: bool = False) -> torch.Tensor:
        """``_forward_once``, but a CUDA out-of-memory is recovered: the cache is brought back to the tokens
        before this call, the allocator's cached blocks are released, and the tokens run again in halves; the
        engine keeps the smaller prefill chunk afterwards. Only a step that does not fit at ``MIN_CHUNK`` tokens
        (or a single decode token) raises ``GpuMemoryError``, which says what to change."""
        try:
            return self._forward_once(tokens)
        except OUT_OF_MEMORY as exc:
            self.oom_retries += 1   # (session.forward brought every layer back to the tokens before this call; a
            # failure while the pages settled after it arrives as PageLost instead, and _forward recomputes)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(tokens) <= self.MIN_CHUNK:
                if len(tokens) == 1 and not retried:  # one more try after releasing the cached blocks
                    if self._step is not None and self.device.type == "cuda":   # and the step graphs' pools (a
                        self._step.forget_steps()   # new session's 128K decode step ran out of memory recording
                        torch.cuda.empty_cache()    # its graph beside three others, run_2026-12-02/call3/e2e.err)
                    return self._forward_fitting(tokens, retried=True)
                budget = self.vram_budget
                raise GpuMemoryError(
                    f"out of GPU memory for a {len(tokens)}-token step"
                    + (f" within vram_budget {budget / 2**30:.2f} GiB" if isinstance(budget, int) else "")
                    + "; set models[main].parameters.weights: int4, a smaller kv.l1_tokens, a smaller "
                    "prefill_chunk, or a larger vram_budget (`flashguard plan` shows what fits)") from exc
            half = len(tokens) // 2
            self.prefill_chunk = max(self.MIN_CHUNK, min(self.prefill_chunk, half))
            log.warning("flashguard: out of GPU memory on %d tokens; retrying in chunks of %d", len(tokens), half)
            self._forward_fitting(tokens[:half])
            return self._forward_fitting(tokens[half:])

    def _forward_once(self, tokens: list[int]) -> torch.Tensor:
        """One forward over ``tokens`` in the session (``KVSession.forward``: settled after, undone on a failure):
        a single token runs as a decode step (graphs or the lean eager path) unless a read taps the states."""
        session, tap = self.session, self._tap
        with session.forward(tokens) as cache:
            if len(tokens) == 1 and self._step is not None and tap is None:
                return self._step.step(tokens[0], cache)
            inp = torch.tensor([tokens], dtype=torch.long, device=self.device)
            with tap.forward(self.model, len(session.ids)) if tap is not None else contextlib.nullcontext():
                with torch.inference_mode():
                    out = self.model(input_ids=inp, **{self._cache_kwarg: cache}, use_cache=True,
                                     logits_to_keep=1)
            return out.logits[0, -1]

    def _l3_reads(self) -> int:
        return self.store.stats.page_faults if self.store is not None else 0

    @property
    def session_ids(self) -> list[int]:
        """The tokens whose K/V the session's cache holds (empty without a session)."""
        return self.session.ids if self.session is not None else []

    def reset_session(self) -> None:
        """Drop the cached conversation (the next call prefills from scratch, adopting stored pages)."""
        with self.lock:
            self._drop_session(keep_pages=True)

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
                                                          "modules": len(self.adapter.layers)}}
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

    def _remember(self, turn: Turn) -> None:
        self.turns.append(turn)
        del self.turns[:-64]

    # ---- model facts ---------------------------------------------------------------------
    def _context_length(self) -> int:
        return context_length(self.model.config, self.config.max_context)

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
