"""``flashguard stress``: drive the tiered KV cache at a chosen context, codec and policy, and measure it.

    flashguard stress --context 131072 --steps 256 --weights int4 --vram-budget 4GiB --json out.json

A model (a named shape with random weights, ``embedded``, or a path) prefills ``--context`` random token ids in
chunks and then decodes ``--steps`` greedy tokens, each timed with a device sync. Reported: prefill seconds,
decode latency p50/p99 and tok/s, allocation rate (GB/s of bytes the CUDA allocator handed out during decode),
page faults (L3 reads per decode step), the store's L2 hit ratio, peak allocated/reserved memory, the planner's
prediction for the same settings, the per-category memory table, and joules per token where NVML reports energy.
``--cache dynamic`` runs transformers' DynamicCache instead (the comparison row).

Why this module imports the engine (inside its functions, never at import time): the stress tool is a driver of
the engine's own parts (an ``Engine`` for a model by path, ``DecodeStep``, the allocator's cap), sitting on top of
both vram/ and the engine, as ``flashguard stress`` does. The dependency that matters runs the other way and once:
the engine's plan (``engine/budget.py``) calls into vram/ to plan, and nothing in vram/ that the plan calls
imports the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ..config import INT4_KERNELS


def _energy_mj(device_index: int) -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(device_index)))
    except Exception:
        return None


def build_model(name: str, weights: str, device: torch.device, int4_kernel: str = "auto"):
    """(model, tokenizer-or-None, shape name) for a named random-weight shape, ``embedded`` or a path;
    ``int4_kernel`` is the Int4Linear backend of int4 weights (the YAML key of the same name)."""
    from ..quant.int4_linear import quantize_linears_rtn

    if name == "deepseek-r1-distill-qwen-1.5b":
        from transformers import Qwen2ForCausalLM

        from .plan import deepseek_1_5b_config

        torch.manual_seed(0)
        dtype = torch.bfloat16 if (weights == "int4" or device.type == "cpu") else torch.float16
        if weights == "int4":  # build in host RAM, quantize onto the device: the float model never fits 4 GB
            model = Qwen2ForCausalLM(deepseek_1_5b_config()).to(dtype).eval()
            quantize_linears_rtn(model, 128, backend=int4_kernel, device=device)
            model.to(device)
        else:
            with torch.device(device):
                model = Qwen2ForCausalLM(deepseek_1_5b_config()).to(dtype).eval()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return model
    from ..config import EngineConfig
    from ..engine.engine import Engine

    engine = Engine(EngineConfig(model_path=None if name == "embedded" else name, device=str(device),
                                 weights="int4" if weights == "int4" else "float", int4_kernel=int4_kernel))
    return engine.model


def run(args) -> dict:
    from transformers import DynamicCache

    from ..config import CacheConfig, parse_bytes
    from ..engine.decode_step import DecodeStep, greedy_step
    from ..engine.engine import apply_vram_budget, cache_kwarg
    from ..kv.cache import TieredCache
    from ..kv.attention import forward_kwargs
    from ..kv.session import forwarding
    from ..kv.store import PageStore
    from ..quant.int4_linear import backend_of
    from . import accounting
    from .plan import Shape, plan

    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))
    cuda = device.type == "cuda"
    budget = parse_bytes(args.vram_budget) if args.vram_budget else None
    if cuda and budget:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts
    apply_vram_budget(budget, device)
    model = build_model(args.model, args.weights, device, args.int4_kernel)
    model.requires_grad_(False)
    weights = accounting.model_bytes(model)
    kv = CacheConfig(page_size=args.page_size, l1_tokens=args.l1_tokens, l1_max_tokens=max(args.l1_tokens,
                     args.l1_max_tokens), sink_tokens=args.page_size, l2_tokens=args.l2_tokens,
                     l3_tokens=args.l3_tokens, policy=args.policy, budget_tokens=args.budget_tokens,
                     l2_codec=args.l2_codec, l3_codec=args.l3_codec)
    store = None
    if args.cache == "tiered":
        store = PageStore(kv, pin_memory=cuda)
        cache = TieredCache(model.config, kv, store=store).attach(model)
    else:
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    kwarg = cache_kwarg(model)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        if args.memory_history:
            torch.cuda.memory._record_memory_history(max_entries=500000)
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = None
        for a in range(0, args.context, args.prefill_chunk):
            part = ids[:, a:a + args.prefill_chunk]
            with forwarding(cache, part[0].tolist()):
                logits = model(input_ids=part, **forward_kwargs(kwarg, cache), logits_to_keep=1).logits
        sync()
        prefill_s = time.perf_counter() - t0
        tok = logits[:, -1].argmax(-1, keepdim=True)
        step = DecodeStep(model) if DecodeStep.supports(model) else None   # the engine's decode path
        before = store.stats_dict() if store else None
        alloc0 = torch.cuda.memory_stats(device)["allocated_bytes.all.allocated"] if cuda else 0
        energy0 = _energy_mj(device.index or 0) if cuda else None
        lat = []
        t_dec = time.perf_counter()
        for _ in range(args.steps):
            t = time.perf_counter()
            tok = greedy_step(model, cache, tok, step, kwarg)
            sync()
            lat.append(time.perf_counter() - t)
        decode_s = time.perf_counter() - t_dec
    if cuda and args.memory_history:
        import pickle

        with open(args.memory_history, "wb") as fh:
            pickle.dump(torch.cuda.memory._snapshot(), fh)
        torch.cuda.memory._record_memory_history(enabled=None)
    result = {"model": args.model, "weights": args.weights, "cache": args.cache, "policy": args.policy,
              "int4_kernel": backend_of(model),
              "l2_codec": args.l2_codec, "context": args.context, "steps": args.steps, "device": str(device),
              "prefill_chunk": args.prefill_chunk, "vram_budget": budget, "prefill_s": prefill_s,
              "decode_tok_s": args.steps / decode_s, "p50_ms": 1e3 * statistics.median(lat),
              "p99_ms": 1e3 * sorted(lat)[max(0, int(round(0.99 * len(lat))) - 1)], "weights_bytes": weights}
    if store is not None:
        after = store.stats_dict()
        l2 = after["hits"]["l2"] - before["hits"]["l2"]
        l3 = after["hits"]["l3"] - before["hits"]["l3"]
        miss = after["misses"] - before["misses"]
        result["page_faults_per_step"] = (after["page_faults"] - before["page_faults"]) / args.steps
        result["l2_hit_ratio"] = l2 / (l2 + l3 + miss) if (l2 + l3 + miss) else None
        result["store_reads_per_step"] = (l2 + l3) / args.steps
        result["l2_pages"], result["l3_pages"] = after["l2_pages"], after["l3_pages"]
        result["l2_bytes"] = after["l2_bytes"]
    if cuda:
        stats = torch.cuda.memory_stats(device)
        result["alloc_rate_gb_s"] = (stats["allocated_bytes.all.allocated"] - alloc0) / decode_s / 1e9
        result["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        result["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        energy1 = _energy_mj(device.index or 0)
        if energy0 is not None and energy1 is not None:
            result["joules_per_token"] = (energy1 - energy0) / 1e3 / args.steps
        result["memory"] = accounting.gpu_categories(device, weights, accounting.cache_device_bytes(cache))
        shape = Shape.from_config(model.config, args.model)
        p = plan(shape, gpu_mem=budget or torch.cuda.get_device_properties(device).total_memory,
                 context=args.context, weights="int4" if args.weights == "int4" else "float", cache=args.cache,
                 prefill_chunk=args.prefill_chunk, kv=kv)
        result["plan_peak_reserved"] = p.peak_reserved
        result["plan_vs_measured"] = p.peak_reserved / result["peak_reserved"]
        result["plan_parts"] = p.parts
    else:
        import psutil

        result["rss"] = psutil.Process().memory_info().rss
    return result


def render(r: dict) -> str:
    g = 2**30
    kernel = f" ({r['int4_kernel']})" if r.get("int4_kernel") else ""
    rows = [("context", r["context"]),
            ("weights / cache / policy", f"{r['weights']}{kernel} / {r['cache']} / {r['policy']}"),
            ("prefill s", f"{r['prefill_s']:.1f}"), ("decode tok/s", f"{r['decode_tok_s']:.1f}"),
            ("decode p50 / p99 ms", f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}")]
    if "page_faults_per_step" in r:
        rows += [("page faults (L3 reads) per step", f"{r['page_faults_per_step']:.2f}"),
                 ("store reads per step", f"{r['store_reads_per_step']:.1f}"),
                 ("L2 hit ratio", "n/a" if r["l2_hit_ratio"] is None else f"{100 * r['l2_hit_ratio']:.1f}%"),
                 ("L2 host RAM GiB", f"{r['l2_bytes'] / g:.2f}")]
    if "peak_reserved" in r:
        rows += [("allocation rate GB/s", f"{r['alloc_rate_gb_s']:.2f}"),
                 ("peak allocated GiB", f"{r['peak_allocated'] / g:.3f}"),
                 ("peak reserved GiB", f"{r['peak_reserved'] / g:.3f}"),
                 ("planner's peak reserved GiB", f"{r['plan_peak_reserved'] / g:.3f} "
                                                  f"({100 * (r['plan_vs_measured'] - 1):+.1f}%)")]
        rows += [(f"smi: {k}", f"{v / g:.3f} GiB") for k, v in r["memory"].items()]
        if "joules_per_token" in r:
            rows.append(("energy J/token", f"{r['joules_per_token']:.3f}"))
    else:
        rows.append(("process RSS GiB", f"{r['rss'] / g:.2f}"))
    return "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="deepseek-r1-distill-qwen-1.5b",
                   help="deepseek-r1-distill-qwen-1.5b (random weights), embedded, or a model path")
    p.add_argument("--weights", choices=("int4", "float", "fp16"), default="int4",
                   help="the weights key's values (fp16: the old name of float)")
    p.add_argument("--int4-kernel", choices=INT4_KERNELS, default="auto")
    p.add_argument("--cache", choices=("tiered", "dynamic"), default="tiered")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--policy", choices=("sparse", "exact"), default="sparse")
    p.add_argument("--l2-codec", choices=("int8", "fp16"), default="int8")
    p.add_argument("--l3-codec", default="int4-zstd")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--l1-tokens", type=int, default=2048)
    p.add_argument("--l1-max-tokens", type=int, default=4096)
    p.add_argument("--l2-tokens", type=int, default=1 << 20)
    p.add_argument("--l3-tokens", type=int, default=0)
    p.add_argument("--budget-tokens", type=int, default=2048)
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--vram-budget", default=None, help="e.g. 4GiB: caps the CUDA allocator, as vram_budget does")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None)
    p.add_argument("--memory-history", default=None,
                   help="write torch's CUDA allocation history (a pickle for torch.cuda.memory viewers) here")
