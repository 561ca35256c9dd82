"""KV cache benchmark: DynamicCache, offloaded DynamicCache and flashguard exact/sparse, side by side.

    python -m benchmarks.kv --contexts 8192 32768 131072 --out docs/benchmarks/kv.md

A random-weight model with the DeepSeek-R1-Distill-Qwen-1.5B shape (Qwen2: 28 layers, 12 heads, 2 KV heads,
head_dim 128) runs a chunked prefill of random token ids and then greedy decode steps, in one process, one
row after another. Columns: prefill seconds, decode tok/s, peak allocated / reserved GPU memory (above the
weights), and GPU-resident KV bytes at the end. Ratios to DynamicCache are in the last columns.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from flashguard.engine.decode_step import greedy_step
from flashguard.kv.session import forwarding
from flashguard.vram.accounting import cache_device_bytes
from flashguard.vram.plan import deepseek_1_5b_config
from benchmarks import emit, timed_steps


WARMUP_STEPS = 2  # untimed decode steps of every row (lazy inits, the decode step's CUDA graphs)


def run_row(model, make_cache, ids, chunk, steps, kwarg, step=None):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base_alloc = torch.cuda.memory_allocated()
    base_res = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    cache = make_cache()
    t0 = time.perf_counter()
    logits = None
    with torch.inference_mode():
        for a in range(0, ids.shape[1], chunk):
            part = ids[:, a:a + chunk]
            with forwarding(cache, part[0].tolist()):
                logits = model(input_ids=part, **{kwarg: cache}, logits_to_keep=1).logits
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        _, decode = timed_steps(model, cache, logits[:, -1].argmax(-1, keepdim=True), step, kwarg, WARMUP_STEPS,
                                steps)
    row = {"prefill_s": prefill, "decode_tok_s": steps / decode if steps else 0.0,
           "peak_alloc_gib": (torch.cuda.max_memory_allocated() - base_alloc) / 2**30,
           "peak_reserved_gib": (torch.cuda.max_memory_reserved() - base_res) / 2**30,
           "gpu_kv_mib": cache_device_bytes(cache) / 2**20}
    if hasattr(cache, "stats"):
        st = cache.stats()
        row["pages"] = st["pages"]
        row["page_reads"] = st["page_reads"]
    del cache
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--exact-steps", type=int, default=8)
    ap.add_argument("--rows", nargs="+", default=["dynamic", "offloaded", "exact", "sparse"],
                    help="dynamic, offloaded, quantized (transformers' forward; quantized needs optimum-quanto), exact, sparse (flashguard's decode step, CUDA "
                         "graphs), sparse-eager (TieredCache under transformers' forward), dynamic-step "
                         "(DynamicCache under flashguard's decode step: what the graphs alone give), default (the "
                         "engine's default cache uncapped: every token resident, one-graph steps), default-4gib (its "
                         "sizes under vram_budget 4GiB for an int4 model: the pool, the rest in L2)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="write torch.profiler tables of 4 sparse and 4 exact decode "
                    "steps at the last context here")
    args = ap.parse_args(argv)

    from transformers import DynamicCache, QuantizedCache, Qwen2ForCausalLM

    from flashguard import CacheConfig
    from flashguard.engine.engine import cache_kwarg
    from flashguard.engine.decode_step import DecodeStep
    from flashguard.kv.cache import TieredCache

    torch.manual_seed(0)
    cfg = deepseek_1_5b_config()
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.float16).eval()
    model.set_attn_implementation("sdpa")
    kwarg = cache_kwarg(model)
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    kv = CacheConfig(page_size=64, l1_tokens=2048, sink_tokens=64, l2_tokens=262144, l3_tokens=0,
                     budget_tokens=2048, l1_max_tokens=4096)
    results = []
    step = DecodeStep(model)
    for ctx in args.contexts:
        ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda")
        for name in args.rows:
            def make():
                if name in ("dynamic", "dynamic-step"):
                    model.set_attn_implementation("sdpa")
                    return DynamicCache(config=cfg)
                if name == "offloaded":
                    model.set_attn_implementation("sdpa")
                    return DynamicCache(config=cfg, offloading=True)
                if name == "quantized":  # transformers' QuantizedCache, int4 through optimum-quanto (carried there)
                    model.set_attn_implementation("sdpa")
                    return QuantizedCache(backend="quanto", config=cfg, nbits=4)
                if name == "default":        # the engine's default without a budget: the pool holds the context
                    return TieredCache(cfg, CacheConfig(l3_tokens=0), preallocate=True).attach(model)
                if name == "default-4gib":   # the engine's default sizes under vram_budget: 4GiB (fp16 weights)
                    from flashguard.vram import plan as planner

                    sized = planner.sized_kv(planner.Shape.from_config(cfg), budget=4 << 30, context=ctx,
                                             weights="int4", prefill_chunk=args.chunk, kv=CacheConfig(l3_tokens=0))
                    return TieredCache(cfg, sized, preallocate=True).attach(model)
                policy = "exact" if name == "exact" else "sparse"   # sparse, sparse-eager
                return TieredCache(cfg, CacheConfig(**{**kv.__dict__, "policy": policy})).attach(model)

            steps = args.exact_steps if name == "exact" else args.steps
            try:
                uses_step = name in ("exact", "sparse", "dynamic-step", "default", "default-4gib")
                row = run_row(model, make, ids, args.chunk, steps, kwarg, step if uses_step else None)
            except torch.cuda.OutOfMemoryError as exc:
                row = {"error": f"OOM: {str(exc)[:80]}"}
            except Exception as exc:  # a row that breaks is reported, the others still run
                import traceback

                traceback.print_exc()
                row = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            row.update(context=ctx, cache=name, decode_steps=steps)
            results.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"weights_gib": weights_gib, "rows": results}, fh, indent=1)
    if args.profile:
        with open(args.profile, "w") as fh:
            for policy in ("sparse", "exact"):
                fh.write(f"## {policy}, {args.contexts[-1]} tokens, 4 decode steps\n\n")
                fh.write(profile_steps(model, cfg, kv, kwarg, args.contexts[-1], args.chunk, step, policy) + "\n\n")
    emit(render(results, weights_gib), {"weights_gib": weights_gib, "rows": results}, args.out, args.json)
    return 0


def profile_steps(model, cfg, kv, kwarg, ctx, chunk, step, policy) -> str:
    """Where a decode step of ``policy`` spends its time (CPU and CUDA), after a prefill of ``ctx`` tokens."""
    from torch.profiler import ProfilerActivity, profile

    from flashguard import CacheConfig
    from flashguard.kv.cache import TieredCache

    cache = TieredCache(cfg, CacheConfig(**{**kv.__dict__, "policy": policy})).attach(model)
    ids = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda")
    with torch.inference_mode():
        for a in range(0, ctx, chunk):
            with forwarding(cache, ids[0, a:a + chunk].tolist()):
                model(input_ids=ids[:, a:a + chunk], **{kwarg: cache}, logits_to_keep=1)
        tok = ids[:, -1:]
        for _ in range(4):  # warm the hot set
            tok = greedy_step(model, cache, tok, step, kwarg)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                tok = greedy_step(model, cache, tok, step, kwarg)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)


def render(results, weights_gib) -> str:
    lines = [f"fp16 weights: {weights_gib:.2f} GiB (memory columns are above the weights)", "",
             "| context | cache | prefill s | decode tok/s | decode vs Dynamic | peak alloc GiB | peak reserved GiB "
             "| GPU KV MiB | GPU KV vs Dynamic |", "|---|---|---|---|---|---|---|---|---|"]
    base = {r["context"]: r for r in results if r["cache"] == "dynamic" and "error" not in r}
    for r in results:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['cache']} | {r['error']} | | | | | | |")
            continue
        b = base.get(r["context"])
        dr = f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}x" if b else ""
        kr = f"{100 * r['gpu_kv_mib'] / b['gpu_kv_mib']:.1f}%" if b and b["gpu_kv_mib"] else ""
        lines.append(f"| {r['context']} | {r['cache']} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | {dr} | "
                     f"{r['peak_alloc_gib']:.2f} | {r['peak_reserved_gib']:.2f} | {r['gpu_kv_mib']:.0f} | {kr} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
