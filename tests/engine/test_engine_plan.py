"""The engine's one plan (``engine/budget.py``): made once from the loaded model by one walk forward (the layers that
stream, then the tiers and the prefill chunk), frozen, and replaced only by a new object where a documented event
changes it (the GPU warm-up's ``settle``, an out-of-memory retry). The budgeted path runs on the GPU alone; here it
runs on the CPU over a placement that stands for an int4 model on CUDA, against the planner's own functions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashguard.config import CacheConfig, EngineConfig
from flashguard.engine import budget as budget_module
from flashguard.engine.budget import Budget, EnginePlan
from flashguard.errors import ConfigError
from flashguard.kv import policy
from flashguard.vram import plan as planner

SEVEN = planner.resolve_shape("deepseek-r1-distill-qwen-7b")
SMALL = planner.resolve_shape("deepseek-r1-distill-qwen-1.5b")
GIB = 2**30


class Int4OnCuda:
    """What the Budget reads of a loaded model (``engine/placement.Placement``): an int4 model on CUDA."""

    device = torch.device("cuda")
    weights_kind = "int4"

    def __init__(self, shape, head: str = "float"):
        self._shape = dataclasses.replace(shape, lm_head=head)
        self.lm_head_kind = head

    def shape(self):
        return self._shape

    def int4_group(self) -> int:
        return 32


def budget_of(gib: float, context_bytes: int = 900 * 2**20, **parameters) -> Budget:
    """A Budget as ``Budget(config, cuda)`` leaves it under ``vram_budget`` (``gib``), made on the CPU."""
    b = Budget(EngineConfig(device="cpu", vram_budget=None, **parameters), torch.device("cpu"))
    b.vram_budget, b.cuda_context, b.device = int(gib * GIB), context_bytes, torch.device("cuda")
    return b


def counting(monkeypatch) -> dict:
    """The planner's entry points, counted."""
    calls = {"layer_placement": 0, "fit_to_budget": 0}
    for name in calls:
        real = getattr(planner, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(planner, name, counted)
    return calls


@pytest.mark.parametrize("gib", [3, 4, 6])
def test_the_plan_is_one_walk_through_the_planner(monkeypatch, gib):
    """``Budget.plan`` = the layers that stream (``layer_placement``, which may lower the chunk), then the tiers
    within what is left (``fit_to_budget`` of those layers and that chunk): the planner once each, and the figures
    the planner's functions give for the same model."""
    b, placement, context = budget_of(gib), Int4OnCuda(SEVEN, "int8"), 32768
    calls = counting(monkeypatch)
    plan = b.plan(placement, context)
    assert calls == {"layer_placement": 1, "fit_to_budget": 1}
    streamed, chunk = planner.layer_placement(
        placement.shape(), budget=b.vram_budget, context=context, weights="int4", cache="tiered",
        prefill_chunk=Budget.GPU_CHUNK, kv=CacheConfig(), cuda_context=b.cuda_context, group=32, shrink_chunk=True)
    kv, chunk, memory, notes = planner.fit_to_budget(
        placement.shape(), budget=b.vram_budget, context=context, weights="int4", cache="tiered",
        prefill_chunk=chunk, kv=CacheConfig(), cuda_context=b.cuda_context, host_available=policy.host_available(),
        l2_bytes_per_token=SEVEN.layers * 2 * SEVEN.kv_heads * SEVEN.head_dim * (
            1 if CacheConfig().l2_codec == "int8" else 2), group=32, streamed=streamed)
    assert (plan.streamed, plan.prefill_chunk, plan.kv.l1_max_tokens) == (streamed, chunk, kv.l1_max_tokens)
    assert plan.memory.parts == memory.parts and plan.memory.fits and plan.notes == tuple(notes)
    assert (plan.vram_budget, plan.cuda_context, plan.context) == (b.vram_budget, b.cuda_context, context)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prefill_chunk = 16   # nothing writes into a plan


def test_a_budget_too_small_is_named_when_the_plan_is_made():
    with pytest.raises(ConfigError) as err:
        budget_of(1.5).plan(Int4OnCuda(SEVEN, "int8"), 32768)
    assert err.value.key == "vram_budget"


def test_without_a_budget_the_pool_is_the_whole_context():
    b = Budget(EngineConfig(device="cpu"), torch.device("cpu"))
    plan = b.plan(Int4OnCuda(SEVEN), 4096)
    assert plan.memory is None and plan.vram_budget is None and plan.streamed == 0
    assert plan.kv.sized and plan.kv.l1_max_tokens >= 4096 and plan.prefill_chunk == Budget.CPU_CHUNK


def test_settle_makes_a_new_plan_only_where_the_context_grew(monkeypatch):
    """After the warm-up: the same plan object when the CUDA context is as estimated; a new one, made again from the
    config with the measured context (the same streamed layers), when it grew; the old one kept, and the Budget's
    context with it, when the new one does not fit."""
    monkeypatch.setattr(budget_module, "apply_vram_budget", lambda budget, device: None)
    b, placement = budget_of(4), Int4OnCuda(SMALL, "int8")
    plan = b.plan(placement, 32768)
    monkeypatch.setattr(budget_module, "measure_cuda_context", lambda device, margin: b.cuda_context)
    assert b.settle(plan, placement) is plan
    grown = b.cuda_context + 200 * 2**20
    monkeypatch.setattr(budget_module, "measure_cuda_context", lambda device, margin: grown)
    settled = b.settle(plan, placement)
    assert isinstance(settled, EnginePlan) and settled is not plan
    assert settled.cuda_context == grown == b.cuda_context and settled.streamed == plan.streamed
    assert settled.memory.parts["cuda context"] == grown
    assert settled.kv.l1_max_tokens <= plan.kv.l1_max_tokens
    before = b.cuda_context
    monkeypatch.setattr(budget_module, "measure_cuda_context", lambda device, margin: before + 3 * GIB)
    assert b.settle(settled, placement) is settled and b.cuda_context == before


def test_an_out_of_memory_hands_a_new_plan_forward():
    plan = EnginePlan(context=4096, kv=CacheConfig(), prefill_chunk=256)
    smaller = plan.with_prefill_chunk(32)
    assert smaller is not plan and plan.prefill_chunk == 256 and smaller.prefill_chunk == 32
    assert smaller.kv is plan.kv
