"""The GPU memory budget and the engine's one plan: ``vram_budget`` in bytes, the allocator capped at it, the plan
made within it once (where the decoder layers live, the cache's tiers, the prefill chunk), and memory given back
after each task.

Contract:
- ``Budget(config, device)`` measures the CUDA context (only under a ``vram_budget``), resolves ``vram_budget``
  (``auto``: the GPU's free memory at start less ``VRAM_MARGIN``) and caps torch's allocator at it less the
  context, which the allocator does not hold. Off CUDA or without a budget nothing is capped (``vram_budget`` None).
- This module is the engine's only caller of the planner (``vram/plan.py``); the walk from the config runs forward:
  ``streams_at_load`` (before the model exists: whether its int4 layers load into host RAM), ``head_budget_wins``
  (the loaded model: whether ``vram_budget`` calls for a smaller lm_head), then ``plan(placement, context)``, once:
  the layers that stream, the prefill chunk and the cache's tiers, as one frozen ``EnginePlan``. It raises the
  ConfigError naming ``vram_budget`` when the smallest plan does not fit. ``announce`` logs what the plan decided.
- The parts that run take what they need from the plan (``Placement.place(plan.streamed)``, the session runner's
  ``plan.kv`` and ``plan.prefill_chunk``) and never write into it or into each other. Two documented events make a
  new plan object, handed forward to the session runner (``SessionRunner.take_plan``):
  ``settle`` after the GPU warm-up (where the CUDA context grew past the start's estimate, the cap and the plan are
  made again, or the old ones kept with a warning when the new plan does not fit), and an out-of-memory in a
  forward (retry.py: the same plan with a smaller ``prefill_chunk``, for good).
- ``give_back`` after every task (the CPU heap's free pages, the GPU allocator's cached blocks past a threshold).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from ..config import CacheConfig, EngineConfig
from ..errors import ConfigError
from ..vram import host_heap

log = logging.getLogger("flashguard")

VRAM_MARGIN = 512 * 2**20   # vram_budget auto: the GPU's free memory at start less this (other programs, the desktop)


KERNEL_MODULES = 192 * 2**20   # CUDA context growth after start, as kernels load lazily (flash, cuBLAS, Triton)


def measure_cuda_context(device: torch.device, margin: int = KERNEL_MODULES) -> int:
    """The GPU memory this process holds outside torch's allocator (the CUDA context), measured through NVML plus
    ``margin`` for kernels that load later; ``vram/plan.py``'s ``CUDA_CONTEXT`` where NVML cannot say.
    (A process measured 0.68 GiB at the end of a GPU run, where the planner assumed 0.39.)"""
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


@dataclass(frozen=True)
class EnginePlan:
    """What loading, placement and cache sizing decided for one engine (``Budget.plan``): made once, and again only
    by a documented event (``Budget.settle``, an out-of-memory retry), each a new object."""

    context: int               # the engine's context (tokens)
    kv: CacheConfig            # the cache's settings as sized (the config's where nothing was sized)
    prefill_chunk: int         # tokens a prefill forward runs at most
    streamed: int = 0          # decoder layers streamed from host RAM (the last ones)
    vram_budget: int | None = None   # bytes, or None (no budget: the CPU, or uncapped)
    cuda_context: int = 0      # the CUDA context the plan counted (bytes)
    memory: object = None      # vram/plan.py's Plan within vram_budget (categories, fits), or None without one
    notes: tuple = ()          # what fitting changed (``announce`` logs them)

    def with_prefill_chunk(self, chunk: int) -> "EnginePlan":
        """This plan with a smaller prefill chunk: the new plan an out-of-memory retry hands forward."""
        return dataclasses.replace(self, prefill_chunk=chunk)


class Budget:
    """``vram_budget`` and the plan made within it (see the module docstring)."""

    # prefill_chunk auto: larger chunks on a GPU (fewer launches; measured in docs/benchmarks/e2e.md)
    GPU_CHUNK, CPU_CHUNK = 2048, 512
    CACHED_KEEP = 128 * 2**20   # cached, unused GPU memory an engine keeps between tasks
    KERNEL_MARGIN_AFTER_WARM_UP = 64 * 2**20   # kernels still to load after the warm-up (a rail's, a rare path's)

    def __init__(self, config: EngineConfig, device: torch.device):
        self.config, self.device = config, device
        # the CUDA context is measured, not assumed (it differs by GPU and driver), and left out of the allocator's cap
        self.cuda_context = measure_cuda_context(device) if config.vram_budget is not None else 0
        self.vram_budget = resolve_vram_budget(config.vram_budget, device, self.cuda_context)   # bytes, or None
        self.fraction = apply_vram_budget(
            None if self.vram_budget is None else max(0, self.vram_budget - self.cuda_context), device)
        self._reserved_after_release = 0   # give_back: the allocator's reserved bytes after its last release

    @property
    def start_chunk(self) -> int:
        """The prefill chunk planning starts from: the config's, or ``auto``'s (larger on a GPU)."""
        return self.config.prefill_chunk or (self.GPU_CHUNK if self.device.type == "cuda" else self.CPU_CHUNK)

    # ---- the walk forward: before loading, the lm_head, the plan ------------------------------------------------
    def streams_at_load(self, shape, context: int) -> bool:
        """Before the model exists (``shape`` from its config, the lm_head as ``lm_head.planned`` expects it):
        whether its int4 decoder layers will not all fit ``vram_budget`` (the loader then loads into host RAM)."""
        from ..vram import plan as planner

        streamed, _ = planner.layer_placement(
            shape, budget=self.vram_budget, context=context, weights="int4", cache=self.config.kv_cache,
            prefill_chunk=self.config.prefill_chunk or self.GPU_CHUNK, kv=self.config.kv,
            cuda_context=self.cuda_context)
        return streamed > 0

    def _budgeted(self, placement) -> bool:
        """int4 decoder layers on CUDA under a ``vram_budget``: the case the planner places layers for."""
        return self.vram_budget is not None and placement.device.type == "cuda" and placement.weights_kind == "int4"

    def _layer_placement(self, placement, shape, context: int) -> tuple[int, int]:
        """``planner.layer_placement`` of ``shape`` from the config's cache and the start's chunk: (streamed,
        chunk)."""
        from ..vram import plan as planner

        return planner.layer_placement(
            shape, budget=self.vram_budget, context=context, weights="int4", cache=self.config.kv_cache,
            prefill_chunk=self.start_chunk, kv=self.config.kv, cuda_context=self.cuda_context,
            group=placement.int4_group(), shrink_chunk=self.config.prefill_chunk is None)

    def head_budget_wins(self, placement, context: int) -> bool:
        """Whether ``vram_budget`` calls for a smaller lm_head on the loaded model (``placement``): with the 16-bit
        head more int4 decoder layers would stream from host RAM (or none of the placements would fit) than with
        the Q8_0 one (``lm_head.apply`` then holds the fewest device bytes it can: int4 codes where their rows stay
        in host RAM, else Q8_0)."""
        if not self._budgeted(placement) or placement.lm_head_kind != "float":
            return False
        streamed = []
        for kind in ("float", "int8"):
            try:
                streamed.append(self._layer_placement(
                    placement, dataclasses.replace(placement.shape(), lm_head=kind), context)[0])
            except ConfigError:   # nothing fits: the plan after this raises it, naming vram_budget
                streamed.append(1 << 30)
        return streamed[1] < streamed[0]

    def plan(self, placement, context: int, streamed_layers: int | None = None) -> EnginePlan:
        """The engine's plan, once, for the loaded model (``placement``: its shape, weights and lm_head as held):
        how many decoder layers stream (``planner.layer_placement``: the fewest that let the int4 layers and the
        smallest KV window fit ``vram_budget`` on CUDA, which may lower the prefill chunk; ``streamed_layers``: the
        count the engine was given, for experiments), then the tiers and the prefill chunk (``fit``). ConfigErrors
        name ``vram_budget``."""
        if streamed_layers is not None:
            streamed, chunk = streamed_layers, self.start_chunk
        elif self._budgeted(placement):
            streamed, chunk = self._layer_placement(placement, placement.shape(), context)
        else:
            streamed, chunk = 0, self.start_chunk
        return self.fit(placement, context, chunk, streamed)

    def fit(self, placement, context: int, chunk: int, streamed: int) -> EnginePlan:
        """The tiers and the prefill chunk for ``streamed`` layers and a starting ``chunk``: within ``vram_budget``
        on a GPU the pool (L1) is the largest the plan for the full ``context`` fits (the whole context when it
        fits: every page stays resident); without a budget (the CPU) the pool is the whole context. L2 takes what
        host RAM holds (``kv.policy``). A budget that cannot hold the weights and the smallest pool is a
        ConfigError naming ``vram_budget``."""
        from ..kv import policy
        from ..vram import plan as planner

        kv = self.config.kv
        shape = placement.shape()
        l2_per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * (1 if kv.l2_codec == "int8" else 2)
        if self.vram_budget is None:
            if self.config.kv_cache == "tiered" and not kv.sized:
                kv = policy.size_tiers(kv, context=context, pool_tokens=context, l2_bytes_per_token=l2_per_token,
                                       host_available=policy.host_available(), kv_heads=shape.kv_heads)
            return EnginePlan(context=context, kv=kv, prefill_chunk=chunk, streamed=streamed)
        kv, chunk, memory, notes = planner.fit_to_budget(
            shape, budget=self.vram_budget, context=context, weights=placement.weights_kind,
            cache=self.config.kv_cache, prefill_chunk=chunk, kv=kv, cuda_context=self.cuda_context,
            host_available=policy.host_available(), l2_bytes_per_token=l2_per_token, group=placement.int4_group(),
            streamed=streamed)
        if not memory.fits:
            need = memory.peak_reserved / 2**30
            raise ConfigError(
                f"{self.vram_budget / 2**30:.2f} GiB cannot hold this model with a {context}-token context: the "
                f"smallest plan needs {need:.2f} GiB (weights {memory.parts['weights'] / 2**30:.2f} GiB). Raise "
                "vram_budget, set weights: int4, or lower max_context (`flashguard plan` shows the categories)",
                key="vram_budget")
        return EnginePlan(context=context, kv=kv, prefill_chunk=chunk, streamed=streamed,
                          vram_budget=self.vram_budget, cuda_context=self.cuda_context, memory=memory,
                          notes=tuple(notes))

    def announce(self, plan: EnginePlan) -> None:
        """Log what ``plan`` decided within ``vram_budget`` (nothing without one)."""
        if plan.vram_budget is None:
            return
        gib = plan.vram_budget / 2**30
        kv, context = plan.kv, plan.context
        for note in plan.notes:
            log.warning("flashguard: vram_budget %.2f GiB: %s", gib, note)
        log.info("flashguard: vram_budget %.2f GiB: pool %d tokens on the GPU (L1) of a %d-token context, L2 %d tokens",
                 gib, kv.l1_max_tokens or 0, context, kv.l2_tokens or 0)
        if self.config.kv_cache == "tiered" and kv.l1_codec == "int8" and (kv.l1_max_tokens or 0) < context:
            log.warning("flashguard: kv.l1_codec int8 with a pool (%d tokens) shorter than the context (%d): decode "
                        "steps past the pool dequantize the pool in every layer (slow); kv.l1_codec: auto keeps a "
                        "16-bit pool here", kv.l1_max_tokens or 0, context)

    def settle(self, plan: EnginePlan, placement) -> EnginePlan:
        """After the warm-up, with its kernels loaded: the CUDA context measured again. Where it grew past the
        start's estimate (context + ``KERNEL_MODULES``), the allocator's cap and the plan are made again from the
        larger one (the same streamed layers; the tiers and the chunk from the config again), and the new plan is
        returned: the caller hands it forward before any session holds memory (the warm-up's buffers were sized by
        the old plan): a process of 128K conversations reached 4.17 GiB of NVML within a 4 GiB budget, ~0.2 GiB
        of context past the estimate. A plan that no longer fits keeps the old one (returned as it is), with a
        warning; a failure to measure changes nothing."""
        if self.vram_budget is None:
            return plan
        measured = measure_cuda_context(self.device, margin=self.KERNEL_MARGIN_AFTER_WARM_UP)
        if measured <= self.cuda_context:
            return plan
        old = self.cuda_context
        log.info("flashguard: the CUDA context is %.2f GiB after the warm-up (%.2f GiB estimated at start): the pool "
                 "is planned again", measured / 2**30, old / 2**30)
        self.cuda_context = measured
        self.fraction = apply_vram_budget(max(0, self.vram_budget - measured), self.device)
        try:
            new = self.fit(placement, plan.context, self.config.prefill_chunk or self.GPU_CHUNK, plan.streamed)
        except ConfigError as exc:
            log.warning("flashguard: %s; keeping the plan made at start (the process may pass vram_budget by %.2f "
                        "GiB)", exc, (measured - old) / 2**30)
            self.cuda_context = old
            self.fraction = apply_vram_budget(max(0, self.vram_budget - old), self.device)
            return plan
        self.announce(new)
        return new

    def give_back(self) -> None:
        """After a task. On the CPU the heap's free pages go back to the OS (``vram/host_heap.py``): without it a
        server's resident set grows for minutes under load. On a GPU the allocator's cached blocks go back to the
        device when they pass ``CACHED_KEEP``: a task's transient buffers (a long prompt's chunks, a rail's windows)
        stayed reserved after it, and the process's GPU memory grew from turn to turn (a 128K conversation under a
        4 GiB budget: 3.59 GiB of NVML after its first turn, 3.90 after its second, with 0.46 GiB cached unused).
        Below it they stay, so consecutive tasks do not map and unmap the same activation memory."""
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
