"""Peer-GPU tier benchmark (issue 17): decode with the off-pool pages on GPU 1 vs in L2, and split over two GPUs.

Run on the ``nvidia-h200-x2`` kind (two GPUs of one host), from the repository root::

    python -m flashguard.bench.peer --context 131072 --out docs/benchmarks/peer_h200x2.md --json peer_h200x2.json

Fewer rows per command if its time limit is short (``--rows l2 peer``, then ``--rows resident split``).

A random-weight model with the DeepSeek-R1-Distill-Qwen-7B shape (Qwen2: 28 layers, 28 heads, 4 KV heads,
head_dim 128), int4 weights (RTN, group 128, flashguard's kernels) on GPU 0, a chunked prefill of random token ids,
then greedy decode steps through the engine's ``DecodeStep``, exact policy. Rows:

- ``l2``        the pool sized for GPU 0 capped at ``--gpu0-budget`` (6 GiB: 128K of the 7B's fp16 KV, 7 GiB, does
                not fit), the other pages in L2 (host RAM, ``--l2-codec``), streamed every step.
- ``peer``      the same pool; the other pages also on GPU 1 (``kv.peer_gpus: [1]``, NCCL), attended there.
- ``resident``  one GPU, no cap: every token in the pool (the one-GPU reference).
- ``split``     no cap, the pool holds half the context; the other half on GPU 1.

The issue's targets: ``peer`` >= 1.5x ``l2`` decode tok/s; ``split`` within 10% of ``resident``. The check line
compares the first decode step's logits of each row with ``resident`` (fp16 tolerance; ``l2`` with the int8
codec is further off by design). Numbers are claimed only from a run of this script, with its command.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from ..vram.plan import deepseek_7b_config
from . import emit

ROWS = ("l2", "peer", "resident", "split")


def prefill(model, cache, ids, chunk: int, kwarg: str):
    with torch.inference_mode():
        for a in range(0, ids.shape[1], chunk):
            cache.feed(ids[0, a:a + chunk].tolist())
            logits = model(input_ids=ids[:, a:a + chunk], **{kwarg: cache}, logits_to_keep=1).logits
    return logits[:, -1]


def run_row(name, model, cfg, ids, args, tier, step, kwarg) -> dict:
    from flashguard import CacheConfig
    from flashguard.config import parse_bytes
    from flashguard.engine.decode_step import greedy_step
    from flashguard.engine.engine import apply_vram_budget, measure_cuda_context
    from flashguard.kv.cache import TieredCache
    from flashguard.vram import plan as planner

    ctx = ids.shape[1]
    base = CacheConfig(policy="exact", l3_tokens=0, l2_codec=args.l2_codec, l1_codec="fp16", adaptive_l1=False)
    if name in ("l2", "peer"):
        budget = parse_bytes(args.gpu0_budget, key="--gpu0-budget")
        kv = planner.sized_kv(planner.Shape.from_config(cfg), budget=budget, context=ctx, weights="int4",
                              prefill_chunk=args.chunk, kv=base)
        apply_vram_budget(budget - measure_cuda_context(torch.device("cuda", 0)), torch.device("cuda", 0))
    else:
        pool = ctx if name == "resident" else ctx // 2
        kv = base.replace(l1_tokens=pool, l1_max_tokens=pool, l2_tokens=ctx)
        torch.cuda.set_per_process_memory_fraction(1.0, 0)   # uncapped
    gc.collect()
    torch.cuda.empty_cache()
    cache = TieredCache(cfg, kv, preallocate=True).attach(model)
    if name in ("peer", "split"):
        cache.use_peers(tier)
    t0 = time.perf_counter()
    last = prefill(model, cache, ids, args.chunk, kwarg)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    token = last.argmax(-1, keepdim=True)
    with torch.inference_mode():
        first = model(input_ids=token, **{kwarg: cache}, logits_to_keep=1).logits[0, -1].float().cpu()
        cache.feed(token[0].tolist())
        token = first.argmax().view(1, 1).cuda()
        for _ in range(args.warmup):
            token = greedy_step(model, cache, token, step, kwarg)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            token = greedy_step(model, cache, token, step, kwarg)
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - t0
    row = {"row": name, "context": ctx, "pool_tokens": kv.l1_tokens, "prefill_s": prefill_s,
           "decode_tok_s": args.steps / decode_s, "page_reads": cache.stats()["page_reads"],
           "gpu0_peak_gib": torch.cuda.max_memory_reserved(0) / 2**30,
           "peers": tier.info() if name in ("peer", "split") else None, "first_logits": first}
    cache.release(keep_pages=False)
    del cache
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gpu0-budget", default="6GiB")
    ap.add_argument("--l2-codec", choices=("int8", "fp16"), default="int8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs of one host (the nvidia-h200-x2 kind)")

    from transformers import Qwen2ForCausalLM

    from flashguard.engine.decode_step import DecodeStep
    from flashguard.engine.engine import cache_kwarg
    from flashguard.kv import peer
    from flashguard.quant.int4_linear import quantize_linears_rtn

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    cfg = deepseek_7b_config()
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.float16).eval()
    quantize_linears_rtn(model, 128)
    gc.collect()
    torch.cuda.empty_cache()
    kwarg = cache_kwarg(model)
    step = DecodeStep(model)
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), device="cuda", generator=None)
    tier = peer.start(["cuda:1"], "cuda:0", page_size=64) if {"peer", "split"} & set(args.rows) else None
    rows = []
    try:
        for name in args.rows:
            try:
                row = run_row(name, model, cfg, ids, args, tier, step, kwarg)
            except Exception as exc:   # a row that breaks is reported; the others still run
                row = {"row": name, "context": args.context, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "first_logits"}, default=str), flush=True)
    finally:
        if tier is not None:
            tier.close()
    ref = next((r["first_logits"] for r in rows if r["row"] == "resident" and "error" not in r), None)
    for r in rows:
        logits = r.pop("first_logits", None)
        if ref is not None and logits is not None:
            r["max_abs_logit_diff_vs_resident"] = (logits - ref).abs().max().item()
    result = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
              "args": vars(args), "rows": rows}
    emit(render(result), result, args.out, args.json)
    return 0


def render(result) -> str:
    a = result["args"]
    lines = [f"peer-GPU tier, {result['device']} x{result['gpus']}, DeepSeek-R1-Distill-Qwen-7B shape (random int4 "
             f"weights), exact policy, {a['context']} tokens, {a['steps']} decode steps, L2 codec {a['l2_codec']}, "
             f"GPU 0 budget {a['gpu0_budget']} for l2/peer", "",
             "command: python -m flashguard.bench.peer " + " ".join(
                 f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                 for k, v in a.items() if k not in ("out", "json") and v is not None), "",
             "| row | pool tokens | prefill s | decode tok/s | page reads (L2) | GPU 0 peak GiB | peer GiB | "
             "logits vs resident |", "|---|---|---|---|---|---|---|---|"]
    by = {r["row"]: r for r in result["rows"] if "error" not in r}
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['error']} | | | | | | |")
            continue
        peer_gib = f"{r['peers']['bytes_held'] / 2**30:.2f}" if r.get("peers") else ""
        diff = r.get("max_abs_logit_diff_vs_resident")
        lines.append(f"| {r['row']} | {r['pool_tokens']} | {r['prefill_s']:.1f} | {r['decode_tok_s']:.2f} | "
                     f"{r['page_reads']} | {r['gpu0_peak_gib']:.2f} | {peer_gib} | "
                     f"{'' if diff is None else f'{diff:.3g}'} |")
    lines.append("")
    if "peer" in by and "l2" in by:
        lines.append(f"peer / l2 decode: {by['peer']['decode_tok_s'] / by['l2']['decode_tok_s']:.2f}x (target >= 1.5x)")
    if "split" in by and "resident" in by:
        lines.append(f"split / resident decode: {by['split']['decode_tok_s'] / by['resident']['decode_tok_s']:.2f}x "
                     "(target >= 0.90x)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
