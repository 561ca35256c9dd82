"""The commands about a model's weights and memory: ``flashguard quantize``, ``plan``, ``smi`` and ``stress``.

Contract: ``cmd_quantize`` / ``cmd_plan`` / ``cmd_smi`` / ``cmd_stress(args)``, the commands as cli.py parses them,
each returning the exit status (``plan``: 1 when the model does not fit). ``plan`` plans this machine unless told
otherwise: its GPU as ``vram_budget: auto`` sizes it, or without a CUDA GPU its CPU and the RAM available
(``plan_on_cpu``); ``plan_model`` and ``plan_weights`` say which model and weights it plans, and why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def cmd_quantize(args) -> int:
    from .engine import loader
    from .quant import awq_search

    source = loader.resolve_model(None if args.src == "embedded" else args.src)
    if Path(args.dst).exists() and not args.force:
        raise SystemExit(f"flashguard: {args.dst!r} exists; choose another DST or pass --force to replace it")
    folder = loader.materialize(source)
    result = awq_search.quantize_folder(folder, args.dst, args.group_size, method=args.method, clip=not args.no_clip,
                                        samples=args.samples, seqlen=args.seqlen, label=source.label)
    print(f"flashguard: wrote {args.dst} ({args.method}, group size {args.group_size}, "
          f"{result['calibration_tokens']} calibration tokens) in {result['seconds']:.0f} s")
    if args.eval:
        from .quant.awq_eval import compare

        print(compare(folder, args.dst))
    return 0


def plan_model(args) -> tuple[str, str, dict]:
    """``(model, where it came from, the config's parameters)`` for ``flashguard plan``: ``--model`` where given,
    else the config's ``model_path`` (the embedded model when it has none)."""
    import yaml

    from .config import main_parameters

    if args.model is not None:
        return args.model, "--model", {}
    path = Path(args.config, "config.yml")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"flashguard: cannot read {path}: {exc}; pass --config DIR or --model") from exc
    params = main_parameters(doc)
    if not params.get("model_path"):
        return "embedded", f"the embedded model: {path} sets no model_path", params
    from .engine import loader

    source = loader.resolve_model(params["model_path"], params.get("gguf_file"))
    model = os.path.join(source.folder, source.gguf_file) if source.gguf_file else source.folder
    return model, f"models[main].parameters.model_path of {path}", params


def plan_weights(args, model: str, params: dict, device: str = "cuda") -> tuple[str, str]:
    """``(weights, why)``: ``--weights`` where given, else the config's ``weights`` key, ``auto`` resolved as the
    engine resolves it on ``device`` (engine/loader.py ``choose_weights``: int4 for a Q4 GGUF on the CPU, as chat
    loads the embedded model there); a named shape is planned in int4."""
    import torch

    from .config import EngineConfig
    from .engine import loader

    if args.weights is not None:
        return ("float" if args.weights == "fp16" else args.weights), "--weights"   # fp16: the old name
    weights = EngineConfig.from_parameters({"weights": params.get("weights", "auto")}).weights
    if weights != "auto":
        return weights, "weights: " + weights + " in the config"
    if model.lower() in ("deepseek-r1-distill-qwen-1.5b", "deepseek-r1-distill-qwen-7b"):
        return "int4", "a named shape is planned in int4; --weights float to compare"
    source = loader.resolve_model(None if model == "embedded" else model)
    return loader.choose_weights("auto", source, torch.device(device))


def plan_on_cpu(args, shape, model: str, where: str, why: str, context_note: str) -> int:
    """``flashguard plan`` where the machine has no CUDA GPU and no ``--gpu-mem`` was given: the engine on this
    CPU, in host RAM (``vram/plan.py`` ``plan_cpu``), against the RAM available now."""
    import psutil

    from .quant import AWQ_GROUP_SIZE
    from .vram import plan as planner

    gguf = model == "embedded" or model.lower().endswith(".gguf")   # a GGUF's Q4 blocks: groups of 32
    parts = planner.plan_cpu(shape, context=args.context, weights=args.weights,
                             prefill_chunk=args.prefill_chunk or 512, group=32 if gguf else AWQ_GROUP_SIZE,
                             guard=planner.guard_bytes(shape, itemsize=4))
    total, available = sum(parts.values()), psutil.virtual_memory().available
    fits = total <= available
    if args.json:
        print(json.dumps({"device": "cpu", "fits": fits, "weights": args.weights, "context": args.context,
                          "host": parts, "total": total, "available": available}, indent=1))
        return 0 if fits else 1
    g = 2**30
    print(f"model: {shape.name} ({where}); weights: {args.weights} ({why}); lm_head: {shape.lm_head}")
    print(f"planned for this machine's CPU ({os.cpu_count()} cores, no CUDA GPU; --gpu-mem 4GiB plans a GPU "
          f"instead) and a context of {args.context} tokens ({context_note})")
    print()
    print("| host RAM | GiB |")
    print("|---|---|")
    for name, size in parts.items():
        print(f"| {name} | {size / g:.3f} |")
    print(f"| **total** | **{total / g:.3f}** |")
    print()
    print(f"fits: {total / g:.2f} GiB of the {available / g:.2f} GiB of RAM available now" if fits else
          f"does NOT fit: {total / g:.2f} GiB, and {available / g:.2f} GiB of RAM is available now; a smaller "
          "--context (max_context in the config) needs less")
    return 0 if fits else 1


def cmd_plan(args) -> int:
    import dataclasses

    import torch

    from .config import CacheConfig, EngineConfig, parse_bytes
    from .quant import lm_head
    from .vram import plan as planner

    model, where, params = plan_model(args)
    shape = planner.resolve_shape(model)   # an unknown model: one line
    on_cpu = args.gpu_mem is None and not torch.cuda.is_available()   # unless told otherwise: this machine
    args.weights, why = plan_weights(args, model, params, "cpu" if on_cpu else "cuda")
    head_key = args.lm_head or EngineConfig.from_parameters({"lm_head": params.get("lm_head", "auto")}).lm_head
    shape = dataclasses.replace(shape, lm_head=lm_head.planned(head_key, args.weights))
    context_note = "--context"
    if args.context is None:
        args.context, context_note = shape.context or 131072, "the model's own; --context to change"
    elif shape.context and args.context > shape.context:
        context_note = f"--context {args.context} is past the model's own {shape.context}, which the engine caps at"
        args.context = shape.context
    if on_cpu:
        return plan_on_cpu(args, shape, model, where, why, context_note)
    gpu_note = "--gpu-mem: the process's share, CUDA context included"
    if args.gpu_mem is None:   # this machine's GPU, as vram_budget: auto sizes it
        from .engine.budget import VRAM_MARGIN, resolve_vram_budget

        args.gpu_mem = f"{resolve_vram_budget('auto', torch.device('cuda')) / 2**30:.2f}GiB"
        gpu_note = (f"this machine's {torch.cuda.get_device_name(0)}: its free memory less {VRAM_MARGIN / 2**30:.1f} "
                    "GiB, as vram_budget: auto; --gpu-mem to plan another")
    if not args.json:
        print(f"model: {shape.name} ({where}); weights: {args.weights} ({why}); lm_head: {shape.lm_head}")
        print(f"planned for a GPU of {args.gpu_mem} ({gpu_note}) and a context of {args.context} tokens "
              f"({context_note})")
        if not torch.cuda.is_available():
            print("(this machine has no CUDA GPU: without --gpu-mem, plan plans its CPU)")
    # auto (None): the largest pool that fits, as the engine sizes it
    kv = CacheConfig(l1_tokens=args.l1_tokens, peer_gpus=args.peer_gpus)
    gpu = parse_bytes(args.gpu_mem, key="--gpu-mem")
    # int4 decoder layers that do not fit stream from host RAM, as the engine places them (a ConfigError naming
    # vram_budget and the smallest budget when not even that fits)
    streamed, args.prefill_chunk = planner.layer_placement(
        shape, budget=gpu, context=args.context, weights=args.weights, cache=args.kv_cache,
        prefill_chunk=args.prefill_chunk or 2048, kv=kv, shrink_chunk=args.prefill_chunk is None)
    p = planner.plan(shape, gpu_mem=gpu, context=args.context, weights=args.weights, cache=args.kv_cache,
                     prefill_chunk=args.prefill_chunk, kv=kv, streamed=streamed,
                     guard=planner.guard_bytes(shape) if params.get("guard_adapter", "auto") != "off" else 0)
    if args.kv_cache == "tiered" and not args.json:
        sized = planner.sized_kv(shape, budget=gpu, context=args.context, weights=args.weights,
                                 prefill_chunk=args.prefill_chunk, kv=kv, streamed=streamed)
        where = "every token resident" if sized.l1_tokens >= args.context else \
            f"{args.context - sized.l1_tokens} tokens off the pool, in L2 (host RAM) / L3 (disk)"
        print(f"kv.l1_tokens (the pool on the GPU): {sized.l1_tokens} tokens in {sized.l1_codec}, {where}")
        read = planner.decode_bytes(shape, weights=args.weights, context=args.context, kv=sized)
        ref = planner.llamacpp_decode_bytes(shape, context=args.context)["total"]
        print("read per decoded token at this context: " + ", ".join(
            f"{k} {v / 1e9:.3f} GB" for k, v in read.items() if k != "total") + f"; {read['total'] / 1e9:.3f} GB in "
            f"all ({read['total'] / ref:.2f}x llama.cpp's Q4_K_M with a q8_0 cache), at least "
            f"{read['total'] / 1e6 / planner.LAPTOP_GB_S:.1f} ms a token on a {planner.LAPTOP_GB_S} GB/s laptop GPU")
        if args.weights == "int4" and (shape.lm_head != "int4" or sized.l1_codec != "int8"):
            few = dataclasses.replace(shape, lm_head="int4")
            few_kv = planner.sized_kv(few, budget=gpu, context=args.context, weights=args.weights,
                                      prefill_chunk=args.prefill_chunk,
                                      kv=dataclasses.replace(kv, l1_codec="int8"), streamed=streamed)
            least = planner.decode_bytes(few, weights=args.weights, context=args.context, kv=few_kv)["total"]
            print(f"fewest bytes (a bandwidth-bound laptop GPU; on a fast one they cost time): lm_head: int4 and kv: "
                  f"{{l1_codec: int8}} read {least / 1e9:.3f} GB ({least / ref:.2f}x), at least "
                  f"{least / 1e6 / planner.LAPTOP_GB_S:.1f} ms a token")
        print()
    if args.json:
        print(json.dumps({"fits": p.fits, "gpu": p.parts, "host": p.host, "peak_reserved": p.peak_reserved,
                          "total": p.total, "peers": p.peers, "prefill_chunk": p.prefill_chunk,
                          "layers": {"resident": shape.layers - streamed, "streamed": streamed}}, indent=1))
        return 0 if p.fits else 1
    print(p.table())
    if not p.fits:
        changes = planner.suggest(shape, gpu_mem=gpu, context=args.context, weights=args.weights,
                                  cache=args.kv_cache, prefill_chunk=args.prefill_chunk, kv=kv)
        if "error" in changes:
            print(changes["error"])
        else:
            print("set in models[main].parameters: " + ", ".join(f"{k}: {v}" for k, v in changes.items())
                  + f", vram_budget: {args.gpu_mem}")
    return 0 if p.fits else 1


def cmd_smi(args) -> int:
    import time
    import urllib.request

    from .vram.accounting import machine_memory, render

    def snapshot() -> dict:
        url = args.url.rstrip("/") + "/v1/flashguard/memory"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                report = json.loads(resp.read())
            report["source"] = url
        except OSError:
            report = {"source": "this machine (no flashguard server at " + args.url + ")"}
        # the L3 folders of the server's processes (and this one's), not every flashguard process's on the machine
        report.update(machine_memory({e.get("pid") for e in report.get("engines", [])} | {os.getpid()}))
        return report

    while True:
        report = snapshot()
        if args.json:
            print(json.dumps(report, indent=1, default=str))
        else:
            from rich.console import Console

            if args.watch:
                print("\033[2J\033[H", end="")
            Console().print(f"[bold]flashguard smi[/bold] ({report['source']})")
            print(render(report))
        if not args.watch:
            return 0
        time.sleep(args.watch)


def cmd_stress(args) -> int:
    from .vram import stress

    result = stress.run(args)
    print(stress.render(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0
