"""Int4 (AWQ gemm format, group 128) vs fp16 weights on the GPU, same decode loop, one process.

    python -m flashguard.bench.int4 --out docs/benchmarks/int4_h200.md --json int4.json

A random-weight model with the DeepSeek-R1-Distill-Qwen-1.5B shape. Rows: fp16 (dense) and int4 (flashguard's
Int4Linear on torch's tinygemm kernel; embeddings and lm_head stay 16-bit, as in every AWQ checkpoint). Columns:
weight bytes, prefill tok/s, decode tok/s at 1K and 32K context. A kernel table times every linear shape of a
layer at one token (CUDA events), the level where int4's smaller reads show without per-layer launch overhead,
and a correctness line compares the kernel with the reference dequantization on the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from ..vram.accounting import model_bytes
from ..vram.plan import deepseek_1_5b_config
from . import emit, timed_steps


def decode_speed(model, ctx: int, steps: int, chunk: int, vocab: int) -> dict:
    """Prefill ``ctx`` tokens, then time ``steps`` greedy steps twice on the same DynamicCache: the model's forward
    (eager, what transformers runs) and flashguard's DecodeStep (the layers as CUDA graphs, as the engine runs)."""
    from transformers import DynamicCache

    from flashguard.engine.decode_step import DecodeStep
    from flashguard.engine.engine import cache_kwarg

    kwarg = cache_kwarg(model)
    ids = torch.randint(0, vocab, (1, ctx), device="cuda")
    cache = DynamicCache(config=model.config)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for a in range(0, ctx, chunk):
            logits = model(input_ids=ids[:, a:a + chunk], **{kwarg: cache}, logits_to_keep=1).logits
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        tok = logits[:, -1].argmax(-1, keepdim=True)
        tok, decode = timed_steps(model, cache, tok, None, kwarg, 3, steps)           # the model's forward
        tok, graphs = timed_steps(model, cache, tok, DecodeStep(model), kwarg, 3, steps)  # the engine's step
    del cache
    return {"prefill_tok_s": ctx / prefill, "decode_tok_s": steps / decode, "step_ms": 1e3 * decode / steps,
            "graph_decode_tok_s": steps / graphs}


def kernel_table(cfg, group: int, iters: int = 200) -> list[dict]:
    from flashguard.quant import awq_format
    from flashguard.quant.int4_linear import Int4Linear

    h, i, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    shapes = [("q_proj", h, h), ("k_proj", h, kvd), ("v_proj", h, kvd), ("o_proj", h, h), ("gate_proj", h, i),
              ("up_proj", h, i), ("down_proj", i, h)]
    rows = []
    for name, k, n in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        codes, zeros, scales = awq_format.quantize_rtn(w, group)
        q = Int4Linear.from_codes(codes, zeros, scales, group, None, torch.device("cuda"), "auto")
        x16 = torch.randn(1, k, device="cuda", dtype=torch.float16)
        xb = x16.to(torch.bfloat16)
        times = {}
        for label, fn in [("fp16", lambda: torch.nn.functional.linear(x16, w)), ("int4", lambda: q(xb))]:
            for _ in range(10):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            times[label] = start.elapsed_time(end) * 1e3 / iters  # microseconds
        rows.append({"linear": name, "in": k, "out": n, "fp16_us": times["fp16"], "int4_us": times["int4"],
                     "backend": q.backend})
    return rows


def kernel_check(group: int) -> float:
    """Max |kernel - dequantized reference| / max |reference| for a 1536 -> 8960 layer at 5 tokens."""
    from flashguard.quant import awq_format
    from flashguard.quant.int4_linear import Int4Linear

    w = torch.randn(8960, 1536, device="cuda") * 0.02
    codes, zeros, scales = awq_format.quantize_rtn(w, group)
    x = torch.randn(5, 1536, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ awq_format.dequantize(codes, zeros, scales, group).t()
    got = Int4Linear.from_codes(codes, zeros, scales, group, None, torch.device("cuda"), "auto")(x).float()
    return float((got - ref).abs().max() / ref.abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from transformers import Qwen2ForCausalLM

    from flashguard.quant.int4_linear import quantize_linears_rtn

    cfg = deepseek_1_5b_config()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [],
              "kernel_rel_err": kernel_check(args.group_size), "kernels": kernel_table(cfg, args.group_size)}
    for name in ("fp16", "int4"):
        torch.manual_seed(0)
        gc.collect()
        torch.cuda.empty_cache()
        dtype = torch.float16 if name == "fp16" else torch.bfloat16  # tinygemm takes bf16 activations
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(cfg).to(dtype).eval()
        model.set_attn_implementation("sdpa")
        if name == "int4":
            quantize_linears_rtn(model, args.group_size)
            gc.collect()
            torch.cuda.empty_cache()
        row = {"weights": name, "weight_gib": model_bytes(model) / 2**30}
        for ctx in args.contexts:
            speed = decode_speed(model, ctx, args.steps, args.chunk, cfg.vocab_size)
            row[f"decode_tok_s_{ctx}"] = speed["decode_tok_s"]
            row[f"prefill_tok_s_{ctx}"] = speed["prefill_tok_s"]
            row[f"graph_decode_tok_s_{ctx}"] = speed["graph_decode_tok_s"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del model
    emit(render(result, args.contexts), result, args.out, args.json)
    return 0


def render(result, contexts) -> str:
    rows = {r["weights"]: r for r in result["rows"]}
    lines = [f"{result['device']}, torch {result['torch']}; random-weight DeepSeek-R1-Distill-Qwen-1.5B shape; "
             f"int4 kernel vs reference dequantization: max rel. error {result['kernel_rel_err']:.2e}", "",
             "Decode twice in the same loop: `eager` = the model's forward, `graphs` = flashguard's DecodeStep "
             "(the engine's decode path).", "",
             "| weights | weight GiB | " + " | ".join(
                 f"prefill tok/s @{c} | eager decode tok/s @{c} | graphs decode tok/s @{c}" for c in contexts)
             + " |", "|---|---|" + "---|---|---|" * len(contexts)]
    keys = [f"{k}_{c}" for c in contexts for k in ("prefill_tok_s", "decode_tok_s", "graph_decode_tok_s")]
    for name in ("fp16", "int4"):
        r = rows[name]
        lines.append(f"| {name} | {r['weight_gib']:.3f} | " + " | ".join(f"{r.get(k, float('nan')):.1f}" for k in keys)
                     + " |")
    lines.append("| int4 / fp16 | {:.2f}x | ".format(rows["int4"]["weight_gib"] / rows["fp16"]["weight_gib"]) + " | ".join(
        "{:.2f}x".format(rows["int4"].get(k, float("nan")) / rows["fp16"].get(k, float("nan"))) for k in keys) + " |")
    lines += ["", "Kernel level, one token (CUDA events, microseconds per call):", "",
              "| linear | in x out | fp16 us | int4 us | int4 speed-up |", "|---|---|---|---|---|"]
    tot16 = tot4 = 0.0
    for k in result["kernels"]:
        tot16, tot4 = tot16 + k["fp16_us"], tot4 + k["int4_us"]
        lines.append(f"| {k['linear']} | {k['in']}x{k['out']} | {k['fp16_us']:.1f} | {k['int4_us']:.1f} | "
                     f"{k['fp16_us'] / k['int4_us']:.2f}x |")
    layers = 28
    lines.append(f"| all 7 (one layer) | | {tot16:.1f} | {tot4:.1f} | {tot16 / tot4:.2f}x |")
    step16 = 1e3 / rows["fp16"][f"decode_tok_s_{contexts[0]}"]
    step4 = 1e3 / rows["int4"][f"decode_tok_s_{contexts[0]}"]
    lines += ["", f"At {contexts[0]} context a decode step takes {step16:.2f} ms (fp16) / {step4:.2f} ms (int4); the "
              f"linears' kernels account for {layers * tot16 / 1e3:.2f} ms / {layers * tot4 / 1e3:.2f} ms of it "
              f"({layers} layers), the rest is attention, norms, the lm_head and per-op launch overhead."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
