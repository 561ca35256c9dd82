"""Peer-GPU tier benchmark (issue 17): decode with the off-pool pages on GPU 1 vs in L2, and split over two GPUs.

Run on the ``nvidia-h200-x2`` kind (two GPUs of one host), from anywhere the package imports
(docs/benchmarks/peer.md gives the device call)::

    python -m benchmarks.peer --context 131072 --out peer.md --json peer.json
    python -m benchmarks.peer --dead-peer --out dead.md --json dead.json      # the dead-peer check, alone

and on the CPU (gloo, a tiny shape: the smoke test of the same code)::

    python -m benchmarks.peer --device cpu --context 2048
    python -m benchmarks.peer --device cpu --dead-peer

The model: random weights of the DeepSeek-R1-Distill-Qwen-7B shape (Qwen2: 28 layers, hidden 3584, 28 heads,
4 KV heads, head_dim 128), random int4 codes made in host RAM for the decoder linears and lm_head (group 128,
``bench.big.make_model``: no 16-bit copy of the model ever reaches the GPU, so nothing fragments GPU 0's allocator
before the cap) and placed on GPU 0 with the Triton kernels (``layer_stream.place``), the embedding table in host
RAM (as the engine does with int4 weights: ``engine/host_embedding.py``): ~3.7 GiB of weights on GPU 0. The CUDA
allocator runs with expandable segments from the start, and each row starts from an emptied cache. The cache is filled with random K/V
(``--fill random``, the default: the same values in every row, written through ``TieredCache.update`` as a
prefill writes them, so pages leave L1 for L2 and the peers exactly as in a prefill; the model's own 128K prefill
costs minutes per row under the 6 GiB cap). ``--fill model`` runs the model's chunked prefill instead. Then greedy
decode steps through the engine's ``DecodeStep`` (the full model step: CUDA graphs between the attention calls, the
tiered attention eager), exact policy. Rows:

- ``l2``        the pool sized for GPU 0 capped at ``--gpu0-budget`` (6 GiB: 128K of the 7B's fp16 KV, 7 GiB, does
                not fit), the other pages in L2 (host RAM, ``--l2-codec``), streamed every step.
- ``peer``      the same pool; the other pages also on GPU 1 (``kv.peer_gpus: [1]``, NCCL), attended there.
- ``resident``  one GPU, no cap: every token in the pool (the one-GPU reference).
- ``split``     no cap, the pool holds half the context; the other half on GPU 1.

The issue's targets: ``peer`` >= 1.5x ``l2`` decode tok/s; ``split`` within 10% of ``resident``. Correctness:
``check`` attends random fp16 pages of one layer (``--check-tokens``) half on GPU 0, half on GPU 1, merged, against
one-device attention of all of them (the same fused kernel) and an fp64 reference; each row's first decode step's
logits are compared with ``resident``'s (``l2`` with the int8 codec is further off by design).

``--deadline`` bounds the whole run: past it the rows measured so far are written (marked) and the process ends
with the peer processes. ``--dead-peer``: a tiny model decodes with pages on the peer, the peer process is
killed, the cache must meet a ``PeerLostError`` within the group timeout and decode on from L2 with the same
logits; a later call raises at once (503); GPU 0 still runs; ``close`` returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import threading
import time

import torch

from flashguard.kv.session import forwarding
from flashguard.vram.plan import deepseek_7b_config
from benchmarks import emit

ROWS = ("l2", "peer", "resident", "split")
PAGE = 64


def tiny_config(vocab: int = 512, layers: int = 4):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=vocab, max_position_embeddings=1 << 17,
                       rope_theta=10000.0, tie_word_embeddings=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Deadline:
    """Past ``seconds``: ``on_fire`` (writes what was measured), the peer processes killed, the process ended."""

    def __init__(self, seconds: float, on_fire):
        self.tiers: list = []
        self.timer = threading.Timer(seconds, self._fire, args=(on_fire,))
        self.timer.daemon = True
        self.timer.start()

    def _fire(self, on_fire) -> None:
        try:
            print(f"benchmarks.peer: deadline reached; writing what was measured", flush=True)
            on_fire()
        finally:
            for tier in self.tiers:
                for p in tier.processes:
                    if p.is_alive():
                        p.kill()
            os._exit(3)

    def cancel(self) -> None:
        self.timer.cancel()


def build_model(device: torch.device, shape: str):
    """Random weights: the 7B shape with int4 decoder linears and lm_head and a host embedding (GPU; built in
    host RAM as codes, only they reach the GPU), or a tiny fp32 Qwen2."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    if shape == "tiny":
        cfg = tiny_config()
        model = Qwen2ForCausalLM(cfg).to(device).eval()
        return model, cfg
    from benchmarks.big import make_model
    from flashguard.engine.host_embedding import install
    from flashguard.engine.layer_stream import place

    cfg = deepseek_7b_config()
    model = make_model(cfg, dtype=torch.float16, lm_head="int4")
    install(model, device)
    place(model, device, [])
    gc.collect()
    torch.cuda.empty_cache()
    return model, cfg


FILL_BLOCK = 256   # random K/V are drawn per block of tokens (seeded by block and layer): any chunking, same values


def fill_random(cache, cfg, ids, chunk: int, device, dtype) -> None:
    """Write random K/V (the same in every row whatever its chunk: drawn per ``FILL_BLOCK`` tokens, seeded by
    block and layer) through ``cache.update`` as a prefill of ``ids`` would, chunk by chunk."""
    kvh = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator(device=device)

    def block(layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen.manual_seed(1_000_003 * b + layer)
        return (torch.randn((kvh, FILL_BLOCK, d), generator=gen, device=device, dtype=dtype),
                torch.randn((kvh, FILL_BLOCK, d), generator=gen, device=device, dtype=dtype))

    with torch.inference_mode():
        for a in range(0, ids.shape[1], chunk):
            z = min(a + chunk, ids.shape[1])
            first = a // FILL_BLOCK
            with forwarding(cache, ids[0, a:z].tolist()):
                for layer in range(cfg.num_hidden_layers):
                    parts = [block(layer, b) for b in range(first, (z - 1) // FILL_BLOCK + 1)]
                    k = torch.cat([p[0] for p in parts], dim=1)[:, a - first * FILL_BLOCK:z - first * FILL_BLOCK]
                    v = torch.cat([p[1] for p in parts], dim=1)[:, a - first * FILL_BLOCK:z - first * FILL_BLOCK]
                    cache.update(k.unsqueeze(0), v.unsqueeze(0), layer)


def fill_model(model, cache, ids, chunk: int, kwarg: str) -> None:
    with torch.inference_mode():
        for a in range(0, ids.shape[1], chunk):
            with forwarding(cache, ids[0, a:a + chunk].tolist()):
                model(input_ids=ids[:, a:a + chunk], **{kwarg: cache}, logits_to_keep=1)


def row_kv(name: str, cfg, ctx: int, args, device):
    """The cache config of a row, and the GPU 0 allocator cap it runs under (None: uncapped)."""
    from flashguard import CacheConfig
    from flashguard.config import parse_bytes
    from flashguard.vram import plan as planner

    base = CacheConfig(policy="exact", l3_tokens=0, l2_codec=args.l2_codec, l1_codec="fp16", adaptive_l1=False,
                       page_size=PAGE, l2_tokens=ctx + 4096)
    room = -(-(args.warmup + args.steps + 2) // PAGE) * PAGE + PAGE   # decode never moves a page of the pool out
    if name in ("l2", "peer"):
        if device.type != "cuda":
            pool = args.pool or max(4 * PAGE, ctx // 8)
            return base.replace(l1_tokens=pool, l1_max_tokens=pool), None
        budget = parse_bytes(args.gpu0_budget, key="--gpu0-budget")
        shape = dataclasses.replace(planner.Shape.from_config(cfg), lm_head="int4")
        context = getattr(args, "cuda_context", None) or planner.CUDA_CONTEXT
        kv = planner.sized_kv(shape, budget=budget, context=ctx, weights="int4", prefill_chunk=args.plan_chunk,
                              kv=base, cuda_context=context)
        p = planner.plan(shape, gpu_mem=planner.planned(budget), context=ctx, weights="int4",
                         prefill_chunk=args.plan_chunk, kv=kv, cuda_context=context)
        args.plan = {"budget_gib": budget / 2**30, "planned_gib": planner.planned(budget) / 2**30,
                     "pool_tokens": kv.l1_tokens, "pool_max_tokens": kv.l1_max_tokens,
                     **{f"{k}_gib": v / 2**30 for k, v in p.parts.items()}, "total_gib": p.total / 2**30}
        return kv.replace(l2_tokens=ctx + 4096), budget
    pool = ctx + room if name == "resident" else ctx // 2
    return base.replace(l1_tokens=pool, l1_max_tokens=pool), None


def run_row(name, model, cfg, ids, args, tier, step, kwarg, device) -> dict:
    from flashguard.engine.decode_step import greedy_step
    from flashguard.engine.engine import apply_vram_budget, measure_cuda_context
    from flashguard.kv.cache import TieredCache

    ctx = ids.shape[1]
    kv, budget = row_kv(name, cfg, ctx, args, device)
    gc.collect()
    held = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()   # no stale cached blocks from earlier rows (expandable segments: unmapped)
        held = (torch.cuda.memory_allocated(device) / 2**30, torch.cuda.memory_reserved(device) / 2**30)
        if budget is not None:
            context = getattr(args, "cuda_context", None) or measure_cuda_context(device)
            apply_vram_budget(budget - context, device)
        else:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.reset_peak_memory_stats(device)
    cache = TieredCache(cfg, kv, preallocate=device.type == "cuda").attach(model)
    if name in ("peer", "split"):
        cache.use_peers(tier)
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    chunk = max(PAGE, min(args.chunk, kv.l1_tokens // 2) // PAGE * PAGE)
    t0 = time.perf_counter()
    if args.fill == "random":
        fill_random(cache, cfg, ids, chunk, device, dtype)
    else:
        fill_model(model, cache, ids, chunk, kwarg)
    sync(device)
    fill_s = time.perf_counter() - t0
    token = ids[:, -1:]
    with torch.inference_mode():
        with forwarding(cache, token[0].tolist()):
            first = model(input_ids=token, **{kwarg: cache}, logits_to_keep=1).logits[0, -1].float().cpu()
        token = first.argmax().view(1, 1).to(device)
        for _ in range(args.warmup):
            token = greedy_step(model, cache, token, step, kwarg)
        sync(device)
        reads0 = cache.page_reads
        t0 = time.perf_counter()
        for _ in range(args.steps):
            token = greedy_step(model, cache, token, step, kwarg)
        sync(device)
    decode_s = time.perf_counter() - t0
    l0 = cache.layers[0]
    row = {"row": name, "context": ctx, "pool_tokens": kv.l1_tokens, "fill": args.fill, "fill_chunk": chunk,
           "fill_s": fill_s, "decode_tok_s": args.steps / decode_s, "step_ms": 1e3 * decode_s / args.steps,
           "off_pool_pages": max(0, (l0.win_start - cache.sink_tokens) // PAGE),
           "page_reads_per_step": (cache.page_reads - reads0) / args.steps,
           "gpu0_cap_gib": None if budget is None else budget / 2**30,
           "gpu0_peak_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
           "gpu0_before_gib": held,   # (allocated, reserved) when the row started, after empty_cache
           "plan": getattr(args, "plan", None) if budget is not None else None,
           "peers": tier.info() if name in ("peer", "split") else None, "first_logits": first}
    cache.release(keep_pages=False)
    del cache
    return row


def check_sharded(tier, device, cfg, tokens: int) -> dict:
    """(c): one layer's attention over ``tokens`` random fp16 keys, half the pages on this device and half on the
    peer, merged, against the same fused kernel over all of them on this device and an fp64 reference."""
    from flashguard.kv import attention

    kvh, g = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    pages = max(2, tokens // PAGE)
    half = pages // 2
    gen = torch.Generator(device=device).manual_seed(7)
    k = torch.randn((1, kvh, pages, PAGE, d), generator=gen, device=device, dtype=dtype) * 2   # peaked scores
    v = torch.randn((1, kvh, pages, PAGE, d), generator=gen, device=device, dtype=dtype)
    scale = d ** -0.5
    tier.reset()
    tier.put(half, k[:, :, half:], v[:, :, half:])
    ka, va = k[0].reshape(kvh, -1, d), v[0].reshape(kvh, -1, d)
    out = []
    for lq in (1, 16):
        q = torch.randn((kvh, g, lq, d), generator=gen, device=device, dtype=dtype)
        local = attention.segment(q, ka[:, :half * PAGE], va[:, :half * PAGE], scale)
        o, lse = attention.merge_into((local[0].float(), local[1].float()), tier.attend(0, q, scale, half, pages))
        one_o, one_lse = attention.segment(q, ka, va, scale)
        ref_o, ref_lse = attention.partial_attention(q.double(), ka.double(), va.double(), scale)
        norm = ref_o.abs().max().item()
        rel = (o.double() - ref_o).abs().max().item() / norm
        rel_one = (one_o.double() - ref_o).abs().max().item() / norm
        out.append({"queries": lq, "tokens": pages * PAGE, "peer_tokens": (pages - half) * PAGE,
                    "max_abs_vs_one_device": (o - one_o.float()).abs().max().item(),
                    "rel_err_sharded_vs_fp64": rel, "rel_err_one_device_vs_fp64": rel_one,
                    "lse_abs_err_vs_fp64": (lse.double() - ref_lse).abs().max().item(),
                    # fp16 tolerance: within twice one device's own error, or fp16's epsilon
                    "ok": rel <= max(2 * rel_one, 1e-3)})
    tier.reset()
    return {"cases": out, "ok": all(c["ok"] for c in out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--context", type=int, default=None, help="tokens (default 131072 on cuda, 2048 on cpu)")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--fill", choices=("random", "model"), default="random")
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per fill chunk (at most half the pool)")
    ap.add_argument("--plan-chunk", type=int, default=256, help="the prefill chunk GPU 0's budget is planned for")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--gpu0-budget", default="6GiB")
    ap.add_argument("--pool", type=int, default=None, help="cpu: pool tokens of the l2/peer rows")
    ap.add_argument("--l2-codec", choices=("int8", "fp16"), default="int8")
    ap.add_argument("--check-tokens", type=int, default=None, help="tokens of the (c) check (default the context)")
    ap.add_argument("--peer-timeout", type=float, default=None, help="the group timeout (s); 30, or 10 --dead-peer")
    ap.add_argument("--deadline", type=float, default=280.0, help="seconds for the whole run")
    ap.add_argument("--dead-peer", action="store_true", help="only the dead-peer check")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # no NVLink multicast (the shared hosts' rule)
        # every segment expandable from the first allocation on (the peers inherit it): empty_cache then returns
        # what earlier rows freed, so a capped row starts from its own weights alone
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if torch.cuda.device_count() < 2:
            raise SystemExit("needs two GPUs of one host (the nvidia-h200-x2 kind); --device cpu runs gloo")
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.dead_peer:
        return dead_peer(args, device)
    args.context = args.context or (131072 if device.type == "cuda" else 2048)
    args.peer_timeout = args.peer_timeout or 30.0
    shape = "7b" if device.type == "cuda" else "tiny"
    t_start = time.perf_counter()
    rows: list = []
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "gpus": torch.cuda.device_count() if device.type == "cuda" else 0, "torch": torch.__version__,
              "shape": shape, "args": vars(args), "rows": rows, "check": None}

    def write(partial: str | None = None) -> None:
        result["partial"] = partial
        result["wall_s"] = time.perf_counter() - t_start
        out = dict(result, rows=[{k: v for k, v in r.items() if k != "first_logits"} for r in rows])
        emit(render(out), out, args.out, args.json)

    watch = Deadline(args.deadline, lambda: write(f"deadline {args.deadline:.0f} s reached"))
    from flashguard.engine.decode_step import DecodeStep
    from flashguard.engine.engine import cache_kwarg
    from flashguard.kv import peer

    tier = None
    if device.type == "cuda":   # the CUDA context alone, before NCCL's buffers (which the rows' budget must hold:
        from flashguard.engine.engine import measure_cuda_context   # the peer tier's own cost, reported below)
        from flashguard.vram.accounting import nvml_process_bytes

        args.cuda_context = measure_cuda_context(device)
        before = nvml_process_bytes(0, os.getpid())
    if {"peer", "split"} & set(args.rows) or device.type == "cuda":
        peer_dev = "cuda:1" if device.type == "cuda" else "cpu"
        tier = peer.start([peer_dev], device, page_size=PAGE, timeout_s=args.peer_timeout)
        watch.tiers.append(tier)
        if device.type == "cuda" and before is not None:
            after = nvml_process_bytes(0, os.getpid())
            result["nccl_gib_on_gpu0"] = None if after is None else (after - before) / 2**30
    t0 = time.perf_counter()
    model, cfg = build_model(device, shape)
    result["model_s"] = time.perf_counter() - t0
    print(f"model ready in {result['model_s']:.1f} s", flush=True)
    kwarg = cache_kwarg(model)
    step = DecodeStep(model)
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    try:
        if tier is not None:
            try:
                result["check"] = check_sharded(tier, device, cfg, args.check_tokens or args.context)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                result["check"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "ok": False}
            print(json.dumps({"check": result["check"]}, default=str), flush=True)
        for name in args.rows:
            try:
                row = run_row(name, model, cfg, ids, args, tier, step, kwarg, device)
            except Exception as exc:  # noqa: BLE001 - a row that breaks is reported; the others still run
                row = {"row": name, "context": args.context, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "first_logits"}, default=str), flush=True)
            if tier is not None and tier.lost is not None:
                print(f"peer tier lost: {tier.lost}", flush=True)
    finally:
        if tier is not None:
            tier.close()
    ref = next((r["first_logits"] for r in rows if r["row"] == "resident" and "error" not in r), None)
    for r in rows:
        logits = r.get("first_logits")
        if ref is not None and logits is not None:
            r["max_abs_logit_diff_vs_resident"] = (logits - ref).abs().max().item()
            r["same_argmax_as_resident"] = bool(logits.argmax() == ref.argmax())
    result["logit_scale"] = None if ref is None else ref.abs().max().item()
    watch.cancel()
    write()
    return 0


def render(result) -> str:
    a = result["args"]
    if "dead_peer" in result:
        return render_dead(result)
    lines = [f"peer-GPU tier, {result['device']} x{result['gpus']}, {result['shape']} shape (random weights"
             f"{', int4 decoder linears, host embedding' if result['shape'] == '7b' else ''}), exact policy, "
             f"{a['context']} tokens, {a['steps']} decode steps (full model step), cache filled with "
             f"{'random K/V (no model prefill)' if a['fill'] == 'random' else 'the model prefill'}, L2 codec "
             f"{a['l2_codec']}, GPU 0 budget {a['gpu0_budget']} for l2/peer; wall {result.get('wall_s', 0):.0f} s",
             ""]
    if result.get("partial"):
        lines += [f"**PARTIAL: {result['partial']}**", ""]
    if a.get("cuda_context"):
        lines += [f"GPU 0's cap for l2/peer: the budget less the CUDA context measured before the process group "
                  f"({a['cuda_context'] / 2**30:.2f} GiB); NCCL's own buffers come on top (GPU 0 NVML growth at the "
                  f"tier's start: {result.get('nccl_gib_on_gpu0') or 0:.2f} GiB; its communicators start lazily)", ""]
    lines += ["command: python -m benchmarks.peer " + " ".join(
                 f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                 for k, v in a.items() if k not in ("out", "json", "dead_peer", "cuda_context", "plan") and v is not None), "",
              "| row | pool tokens | off-pool pages | fill s | decode tok/s | ms/step | L2 page reads/step | "
              "GPU 0 cap GiB | GPU 0 peak GiB | peer GiB | logits vs resident (max abs) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {r["row"]: r for r in result["rows"] if "error" not in r}
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['error']} | | | | | | | | | |")
            continue
        peer_gib = f"{r['peers']['bytes_held'] / 2**30:.3f}" if r.get("peers") else ""
        diff = r.get("max_abs_logit_diff_vs_resident")
        cap, peak = r.get("gpu0_cap_gib"), r.get("gpu0_peak_gib")
        lines.append(f"| {r['row']} | {r['pool_tokens']} | {r['off_pool_pages']} | {r['fill_s']:.1f} | "
                     f"{r['decode_tok_s']:.2f} | {r['step_ms']:.2f} | {r['page_reads_per_step']:.0f} | "
                     f"{'' if cap is None else f'{cap:.2f}'} | {'' if peak is None else f'{peak:.2f}'} | {peer_gib} | "
                     f"{'' if diff is None else f'{diff:.3g}'}"
                     f"{'' if r.get('same_argmax_as_resident', True) else ' (other argmax)'} |")
    lines.append("")
    pl = next((r["plan"] for r in result["rows"] if r.get("plan")), None)
    if pl:
        lines += ["GPU 0's plan for l2/peer (vram/plan.py, int4 lm_head, GiB): " + ", ".join(
            f"{k[:-4]} {v:.3f}" for k, v in pl.items() if k.endswith("_gib")) +
            f"; pool {pl['pool_tokens']} tokens (max {pl['pool_max_tokens']})", ""]
    held = [(r["row"], r["gpu0_before_gib"]) for r in result["rows"] if r.get("gpu0_before_gib")]
    if held:
        lines += ["GPU 0 allocated / reserved GiB as each row started (after empty_cache): " + ", ".join(
            f"{n} {a:.2f} / {b:.2f}" for n, (a, b) in held), ""]
    if result.get("logit_scale") is not None:
        lines.append(f"resident first-step logits: max |logit| {result['logit_scale']:.3g}")
    if "peer" in by and "l2" in by:
        lines.append(f"(a) peer / l2 decode: {by['peer']['decode_tok_s'] / by['l2']['decode_tok_s']:.2f}x "
                     "(target >= 1.5x)")
    if "split" in by and "resident" in by:
        lines.append(f"(b) split / resident decode: {by['split']['decode_tok_s'] / by['resident']['decode_tok_s']:.2f}x "
                     "(target >= 0.90x)")
    c = result.get("check")
    if c:
        if "error" in c:
            lines.append(f"(c) sharded attention check: ERROR {c['error']}")
        else:
            lines += ["", "(c) one layer's attention, half the pages on each GPU, merged, vs one device:", "",
                      "| queries | tokens | on peer | max abs vs one device | rel err sharded (vs fp64) | "
                      "rel err one device (vs fp64) | lse err | ok |", "|---|---|---|---|---|---|---|---|"]
            for x in c["cases"]:
                lines.append(f"| {x['queries']} | {x['tokens']} | {x['peer_tokens']} | {x['max_abs_vs_one_device']:.3g} | "
                             f"{x['rel_err_sharded_vs_fp64']:.3g} | {x['rel_err_one_device_vs_fp64']:.3g} | "
                             f"{x['lse_abs_err_vs_fp64']:.3g} | {'yes' if x['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


# ---- the dead-peer check ----------------------------------------------------------------------------------------
def dead_peer(args, device) -> int:
    """A tiny Qwen2 decodes with its off-window pages on the peer; the peer process is killed mid-conversation;
    the cache meets the loss within the group timeout and decodes on from L2 (an fp16 codec: the same logits);
    a later tier call raises PeerLostError at once; GPU 0 still computes; close() returns."""
    from transformers import DynamicCache

    from flashguard import CacheConfig
    from flashguard.engine.engine import cache_kwarg
    from flashguard.kv import peer
    from flashguard.kv.cache import TieredCache

    timeout = args.peer_timeout or 10.0
    t_start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "args": vars(args), "dead_peer": {}}
    out = result["dead_peer"]
    watch = Deadline(args.deadline, lambda: (out.update(partial="deadline reached"),
                                             emit(render_dead(result), result, args.out, args.json)))
    torch.manual_seed(0)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(tiny_config(layers=2)).to(device, dtype).eval()
    kwarg = cache_kwarg(model)
    ids = torch.randint(0, 512, (1, 600), generator=torch.Generator().manual_seed(1)).to(device)
    prefix, kill_at = 512, 20
    kv = CacheConfig(policy="exact", l3_tokens=0, l2_codec="fp16", l1_codec="fp16", adaptive_l1=False,
                     page_size=16, sink_tokens=16, l1_tokens=64, l1_max_tokens=64, l2_tokens=4096)

    def run(cache, tier=None):
        rows, times = [], []
        with torch.inference_mode():
            for a in range(0, prefix, 128):
                with forwarding(cache, ids[0, a:a + 128].tolist()):
                    model(input_ids=ids[:, a:a + 128], **{kwarg: cache})
            for t in range(prefix, ids.shape[1]):
                if tier is not None and t == prefix + kill_at:
                    tier.processes[0].kill()
                    tier.processes[0].join(5)
                    out["killed_at_step"] = kill_at
                t0 = time.perf_counter()
                with forwarding(cache, ids[0, t:t + 1].tolist()):
                    rows.append(model(input_ids=ids[:, t:t + 1], **{kwarg: cache}).logits[0, -1].float().cpu())
                times.append(time.perf_counter() - t0)
        return torch.stack(rows), times

    ref, _ = run(DynamicCache(config=model.config))
    tier = peer.start(["cuda:1" if device.type == "cuda" else "cpu"], device, page_size=kv.page_size, timeout_s=timeout)
    watch.tiers.append(tier)
    try:
        cache = TieredCache(model.config, kv).attach(model).use_peers(tier)
        got, times = run(cache, tier)
        out["peer_pages_before_kill"] = tier.info()["pages"]
        out["lost"] = tier.lost
        out["slowest_step_s"] = max(times)
        out["steps_after_detection_s"] = max(times[times.index(max(times)) + 1:] or [0.0])
        out["max_abs_logit_diff_vs_dynamic_cache"] = (got - ref).abs().max().item()
        out["logit_scale"] = ref.abs().max().item()
        out["same_argmax"] = bool((got.argmax(-1) == ref.argmax(-1)).all())
        out["page_reads_from_l2"] = cache.page_reads
        t0 = time.perf_counter()
        try:
            tier.attend(0, torch.randn(2, 2, 1, 32, device=device, dtype=dtype), 0.2, 1, 4)
            out["later_call"] = "no error"
        except peer.PeerLostError as err:
            out["later_call"] = f"PeerLostError {err.status_code}: {str(err)[:160]}"
        out["later_call_s"] = time.perf_counter() - t0
        x = torch.randn(256, 256, device=device, dtype=dtype)
        out["gpu0_still_computes"] = bool(torch.isfinite((x @ x).float().sum()).item())
    except Exception as exc:  # noqa: BLE001 - reported
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        t0 = time.perf_counter()
        tier.close()
        out["close_s"] = time.perf_counter() - t0
    tol = 2e-2 * out.get("logit_scale", 1.0) if dtype == torch.float16 else 1e-3
    out["ok"] = bool("error" not in out and out.get("lost") and out["slowest_step_s"] < timeout + 10
                     and out["max_abs_logit_diff_vs_dynamic_cache"] <= tol and out["later_call"].startswith("Peer")
                     and out["later_call_s"] < 1.0 and out["gpu0_still_computes"] and out["close_s"] < 30)
    out["group_timeout_s"] = timeout
    out["wall_s"] = time.perf_counter() - t_start
    watch.cancel()
    emit(render_dead(result), result, args.out, args.json)
    return 0 if out["ok"] else 1


def render_dead(result) -> str:
    o = result["dead_peer"]
    lines = [f"peer-GPU tier, dead peer ({result['device']}, torch {result['torch']}): a tiny Qwen2 decodes with its "
             f"off-window pages on the peer; the peer process is killed (SIGKILL) at decode step "
             f"{o.get('killed_at_step')}; group timeout {o.get('group_timeout_s')} s", "",
             "| what | value |", "|---|---|"]
    for k in ("ok", "partial", "error", "peer_pages_before_kill", "lost", "slowest_step_s", "steps_after_detection_s",
              "max_abs_logit_diff_vs_dynamic_cache", "logit_scale", "same_argmax", "page_reads_from_l2", "later_call",
              "later_call_s", "gpu0_still_computes", "close_s", "wall_s"):
        if k in o:
            v = o[k]
            lines.append(f"| {k} | {f'{v:.3g}' if isinstance(v, float) else v} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
