"""The one-graph decode step, kernel by kernel: the torch kernels against ``kv/step_kernels.py``, one process.

    python -m benchmarks.step --contexts 8192 32768 --out step.md --json step.json

A random-weight model of the DeepSeek-R1-Distill-Qwen-1.5B shape (``--shape 7b``: the 7B's), int4 on the Triton
backend (group 128, as AWQ) with the 16-bit embedding and lm_head, the context prefilled into a DynamicCache and
copied into a StaticKV the size the engine shows the step (``TieredCache.static_view``: a power of two above the
length, at least 4096), 16-bit or int8 (``kv.l1_codec``). Per row:

- ``ms/step``: the whole step as one CUDA graph, replayed (the median of three timings of ``--steps`` steps);
- ``kernels``: the kernels one step launches and their GPU time, from the profiler over one eager step (the same
  kernels the graph holds), the top ones by time below the table.

What it answers: how much of a step is launches rather than bytes, and what the step kernels save.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict

import torch

from benchmarks import emit

VARIANTS = {"torch": False, "step-kernels": True}


def _static(cache, length: int, int8: bool):
    from flashguard.engine.decode_step import StaticKV

    cap = max(4096, 1 << (length + 1).bit_length())
    kv = StaticKV.from_cache(cache, cap)
    if not int8:
        return kv
    return kv.quantized()


def _profile(step, kv) -> tuple[int, float, list]:
    """(kernels, GPU microseconds, top kernels) of one eager step over ``kv`` (its length restored after)."""
    from torch.profiler import ProfilerActivity, profile

    length = kv.length
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            step._static_layers(kv)
        torch.cuda.synchronize()
    kv.length = length
    per = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += 1
            per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    count = sum(c for c, _ in per.values())
    total = sum(t for _, t in per.values())
    top = sorted(((name[:70], c, t) for name, (c, t) in per.items()), key=lambda r: -r[2])[:12]
    return count, total, top


def run(model, ctx: int, steps: int, chunk: int, int8: bool) -> list[dict]:
    from transformers import DynamicCache

    from flashguard.engine.decode_step import DecodeStep

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, ctx), device="cuda")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for a in range(0, ctx, chunk):
            logits = model(input_ids=ids[:, a:a + chunk], past_key_values=cache, logits_to_keep=1).logits
    first = int(logits[0, -1].argmax())
    rows, ref = [], None
    for name, kernels in VARIANTS.items():
        kv = _static(cache, ctx, int8)
        step = DecodeStep(model, kernels=kernels)
        row = {"context": ctx, "pool": "int8" if int8 else "fp16", "view": kv.capacity, "variant": name,
               "kernels_on": step.kernels}
        try:
            count, gpu_us, top = _profile(step, kv)
            token, speeds, out = first, [], []
            for _ in range(3):   # warm-up (captures the graph), then the timed runs
                token = int(step.step(token, kv).argmax())
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    logits = step.step(token, kv)
                    token = int(logits.argmax())
                torch.cuda.synchronize()
                speeds.append((time.perf_counter() - t0) / steps * 1e3)
            check = step.step(first, _static(cache, ctx, int8)).float()
            if ref is None:
                ref = check
            row.update(ms_step=sorted(speeds)[1], kernels=count, kernel_gpu_ms=gpu_us / 1e3, top=top,
                       max_logit_diff=float((check - ref).abs().max()), same_top1=bool(check.argmax() == ref.argmax()))
        except Exception as exc:   # a kernel that fails to build or run: the row says so, the others go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del kv, step
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--shape", choices=("1.5b", "7b"), default="1.5b")
    ap.add_argument("--pools", nargs="+", choices=("fp16", "int8"), default=["fp16", "int8"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from transformers import Qwen2ForCausalLM

    from benchmarks.int4 import model_config
    from flashguard.kv import step_kernels
    from flashguard.quant.int4_linear import quantize_linears_rtn

    cfg = model_config(args.shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.float16).eval()
    model.set_attn_implementation("sdpa")
    quantize_linears_rtn(model, 128, backend="triton")
    gc.collect()
    torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
              "step_kernels_available": step_kernels.available(torch.device("cuda")),
              "step_kernels_error": step_kernels.available.last_error, "rows": []}
    for ctx in args.contexts:
        for pool in args.pools:
            result["rows"] += run(model, ctx, args.steps, args.chunk, pool == "int8")
    emit(render(result), result, args.out, args.json)
    return 0


def render(result) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, {result['shape']} shape, int4 (Triton), "
             f"step kernels available: {result['step_kernels_available']} {result['step_kernels_error']}", "",
             "| context | pool | view | variant | ms/step | tok/s | kernels a step | kernel GPU ms | top-1 same |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['pool']} | {r['view']} | {r['variant']} | {r['error']} |||||")
            continue
        lines.append(f"| {r['context']} | {r['pool']} | {r['view']} | {r['variant']} | {r['ms_step']:.3f} | "
                     f"{1e3 / r['ms_step']:.1f} | {r['kernels']} | {r['kernel_gpu_ms']:.3f} | {r['same_top1']} |")
    for r in result["rows"]:
        if "top" in r:
            lines += ["", f"{r['context']} {r['pool']} {r['variant']}: top kernels (name, count, us)"]
            lines += [f"- {n} x{c}: {t:.0f}" for n, c, t in r["top"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
