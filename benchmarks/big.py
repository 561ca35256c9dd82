"""The 7B in 4 GiB (issue 18): DeepSeek-R1-Distill-Qwen-7B's shape, int4, through the engine under ``vram_budget``.

    python -m benchmarks.big --tokenizer .devcarry/ds-tokenizer --budget 4GiB --contexts 8192 32768 \\
        --out big.md --json big.json
    python -m benchmarks.big --tiny --device cpu      # the same code on a 4-layer toy, CPU, seconds

The model is made in int4 directly, never in 16-bit (a 15 GB checkpoint would take minutes to write): random packed
codes (``make_model``: one random draw per projection shape, each layer XOR-ed with its own byte), a fixed scale and
zero 8, group 128, in host RAM with the ``dequant`` int4 backend, whose bytes are the Triton kernels' format; the
lm_head is int4 as well (``--lm-head float`` keeps it 16-bit), the embedding table 16-bit (the engine keeps it in
host RAM). The engine then places it as it places a loaded model (``engine/placement.py``): under ``vram_budget``
the planner keeps as many decoder layers resident as fit beside the smallest KV window and streams the rest from
pinned host RAM (``engine/layer_stream.py``), and the KV pool takes what is left.

Per prefill-chunk variant (``--chunks``, one engine each; ``auto`` is the engine's 2048 on a GPU), after a short
warm-up conversation (kernel compilation, graph capture), per context: the prompt (the real tokenizer on prose, a
different first page per row so nothing is reused) is prefilled through ``Engine.prefill`` (TTFT: to the first
token's logits on the host), then ``--steps`` greedy decode steps through ``Engine.step`` (the engine's decode
path: DecodeStep's graphs, the tiered cache), timed after ``--warmup-steps``. Memory: torch's peak reserved and the
process's peak NVML figure (sampled every 20 ms) per row. An out-of-memory or any other error in a row is reported
in that row; the rest still run.

Also: the time one streamed layer's weights take to cross PCIe (the layer stream's own copy, pinned host -> slot,
median of 5), what a ~12 GB/s PCIe 4.0 x8 laptop link would make of the streamed layers per token, and (``--cpu-layer``)
the time the host's CPU takes for one layer's seven int4 projections at one token: the alternative to copying a
layer on a slow link.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

LAPTOP_PCIE = 12e9   # bytes/s: PCIe 4.0 x8 as a 4 GB laptop GPU gets it, in practice
GROUP = 128


def seven_b_config(layers: int | None = None, tiny: bool = False, vocab: int | None = None):
    """DeepSeek-R1-Distill-Qwen-7B's config (``layers`` to cut it), or with ``tiny`` a 4-layer toy of the same
    kind (hidden 256, 4 heads, 2 KV heads, head_dim 64) for CPU runs."""
    from transformers import Qwen2Config

    from flashguard.vram.plan import deepseek_7b_config

    if tiny:
        cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers or 4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=vocab or 152064,
                          max_position_embeddings=131072, tie_word_embeddings=False)
    else:
        cfg = deepseek_7b_config()
        if layers:
            cfg.num_hidden_layers = layers
        if vocab:
            cfg.vocab_size = vocab
    return cfg


def _random_bytes(shape, generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _int4_layer(n: int, k: int, packed: torch.Tensor, bias: torch.Tensor | None, scale: float):
    """An Int4Linear (``dequant`` backend, host RAM) over ``packed`` [n, k/2] codes, zero 8, a fixed scale."""
    from flashguard.quant.int4_linear import Int4Linear

    layer = Int4Linear(k, n, GROUP, "dequant")
    layer.register_buffer("packed", packed)
    layer.register_buffer("scales", torch.full((n, k // GROUP), scale, dtype=torch.float16))
    layer.register_buffer("zeros", torch.full((n, k // GROUP), 8, dtype=torch.uint8))
    if bias is not None:
        layer.bias = bias
    return layer


@torch.no_grad()
def make_model(cfg, dtype: torch.dtype = torch.float16, lm_head: str = "int4", seed: int = 0):
    """A Qwen2ForCausalLM of ``cfg`` with random int4 projections (``dequant`` Int4Linear layers in host RAM: the
    engine places them), built without any 16-bit copy of them: seconds for the 7B (~3.6 GB of codes)."""
    from transformers import Qwen2ForCausalLM

    from flashguard.quant.awq_load import rebuild_meta_buffers
    from flashguard.quant.int4_linear import set_module

    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    # weights of std ~0.02 (transformers' init): codes uniform in 0..15 around zero 8 have std ~4.6
    scale = 0.02 / 4.6
    base: dict[tuple, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        for name, module in list(layer.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            n, k = module.out_features, module.in_features
            if (n, k) not in base:
                base[(n, k)] = _random_bytes((n, k // 2), g)
            packed = torch.bitwise_xor(base[(n, k)], (i * 37 + len(name)) % 256)
            bias = None if module.bias is None else (torch.randn(n, generator=g) * 0.02).to(dtype)
            set_module(layer, name, _int4_layer(n, k, packed, bias, scale))
    rows = torch.randn(1024, cfg.hidden_size, generator=g).to(dtype)   # a real table's size, 1024 distinct rows
    table = rows[torch.arange(cfg.vocab_size) % 1024]
    model.model.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table, _freeze=True)
    if lm_head == "int4":
        model.lm_head = _int4_layer(cfg.vocab_size, cfg.hidden_size,
                                    _random_bytes((cfg.vocab_size, cfg.hidden_size // 2), g), None, scale * 4)
    else:
        model.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        model.lm_head.weight.copy_(rows.repeat(-(-cfg.vocab_size // 1024), 1)[:cfg.vocab_size] * 0.1)
    for module in model.modules():   # norms: ones
        for name, p in list(module.named_parameters(recurse=False)):
            if p.device.type == "meta":
                module._parameters[name] = torch.nn.Parameter(torch.ones(p.shape, dtype=dtype), requires_grad=False)
    rebuild_meta_buffers(model, torch.device("cpu"))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"make_model left tensors on the meta device: {left[:4]}")
    model.requires_grad_(False)
    return model.eval()


class _Sampler:
    """The process's peak GPU memory as NVML reports it, sampled in a thread (None without NVML)."""

    def __init__(self, index: int):
        from flashguard.vram.accounting import nvml_process_bytes

        self.read = lambda: nvml_process_bytes(index, os.getpid())
        self.peak = self.read()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.02):
            v = self.read()
            if v is not None:
                self.peak = max(self.peak or 0, v)

    def __enter__(self):
        if self.peak is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_context(engine, tok, context: int, steps: int, warmup_steps: int) -> dict:
    """Prefill a ``context``-token prompt and decode ``steps`` greedy tokens through the engine."""
    from benchmarks.e2e import conversation_text

    device = engine.device
    # the row's own first words: its first page differs from every other row's, so nothing is reused
    text = f"Row {context}: read this and answer.\n" + conversation_text(max(16, context - 32), tok)
    ids = engine.encode_messages([{"role": "user", "content": text}])
    target = context - steps - 8
    if len(ids) > target:   # keep the start and the generation prompt's last tokens
        ids = ids[:target - 8] + ids[-8:]
    row = {"context": context, "prompt_tokens": len(ids)}
    sampler = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        sampler = _Sampler(device.index if device.index is not None else torch.cuda.current_device())
    with (sampler or _Null()), engine.lock:
        _sync(device)
        t0 = time.perf_counter()
        logits, reused = engine.prefill(ids)
        token = int(logits.argmax())
        row["ttft_s"] = round(time.perf_counter() - t0, 3)
        row["reused"] = reused
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            token = int(engine.step(token).argmax())   # the argmax reads the logits: a sync
            times.append(time.perf_counter() - t)
    timed = times[warmup_steps:] or times
    row["decode_tok_s"] = round(len(timed) / sum(timed), 2)
    row["decode_ms_median"] = round(1000 * statistics.median(timed), 2)
    row["first_steps_ms"] = [round(1000 * t, 1) for t in times[:warmup_steps]]
    if device.type == "cuda":
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        row["peak_nvml_gib"] = round(sampler.peak / 2**30, 3) if sampler and sampler.peak else None
    info = engine.info()
    row["pool_tokens"] = (info.get("tiers") or {}).get("pool", {}).get("tokens")
    row["l2_pages"] = (info.get("tiers") or {}).get("l2", {}).get("pages_now")
    return row


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def pcie_layer_seconds(stream, reps: int = 5) -> float | None:
    """Median seconds for one streamed layer's weights to go from pinned host RAM into its device slot."""
    if stream is None or stream.side is None:
        return None
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream.side):
            a.record()
            stream._copy(0, stream.side)
            b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1000)
    return statistics.median(out)


@torch.no_grad()
def cpu_layer_seconds(cfg, threads: int | None = None, reps: int = 5) -> float | None:
    """Seconds the host's CPU takes for one decoder layer's seven int4 projections at one token (torch's CPU int4
    kernel, bf16): what computing a streamed layer on the CPU would cost instead of copying it."""
    from flashguard.quant.int4_linear import Int4Linear

    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    h, kv, inter = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    shapes = [(cfg.num_attention_heads * cfg.head_dim, h), (kv, h), (kv, h), (h, cfg.num_attention_heads * cfg.head_dim),
              (inter, h), (inter, h), (h, inter)]
    g = torch.Generator().manual_seed(1)
    layers = []
    for n, k in shapes:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        layers.append(Int4Linear.from_codes(codes, torch.full((n, k // GROUP), 8, dtype=torch.uint8),
                                            torch.full((n, k // GROUP), 0.004, dtype=torch.float16), GROUP, None,
                                            torch.device("cpu"), "cpu"))
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for _, k in shapes}
        out = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            for layer, (n, k) in zip(layers, shapes):
                layer(xs[k])
            out.append(time.perf_counter() - t)
        return statistics.median(out[1:])
    finally:
        torch.set_num_threads(before)


def build_engine(args, cfg, tok, chunk: str, workdir: str):
    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.engine.loader import ModelSource

    dtype = torch.float16 if args.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = make_model(cfg, dtype=dtype, lm_head=args.lm_head)
    made = time.perf_counter() - t0
    params = {"device": args.device, "dtype": str(dtype).replace("torch.", ""), "weights": "int4",
              "max_context": max(args.contexts) + args.steps + 256, "cuda_graphs": args.device == "cuda"}
    if args.device == "cuda":
        params["vram_budget"] = args.budget
    if chunk != "auto":
        params["prefill_chunk"] = int(chunk)
    config = EngineConfig.from_parameters(params)
    source = ModelSource(folder=workdir, gguf_file=None, label="DeepSeek-R1-Distill-Qwen-7B shape (random int4)"
                         if not args.tiny else "tiny Qwen2 (random int4)")
    t0 = time.perf_counter()
    # --force-streamed: a placement of our choosing (CPU runs, experiments); None: the planner's
    engine = Engine(config, source, model=model, tokenizer=tok, streamed_layers=args.force_streamed)
    engine.eos_ids = frozenset()   # random weights: decode the full count
    return engine, made, time.perf_counter() - t0


def run_variant(args, cfg, tok, chunk: str, workdir: str) -> dict:
    out: dict = {"chunk": chunk, "rows": []}
    try:
        engine, made, started = build_engine(args, cfg, tok, chunk, workdir)
    except Exception as exc:   # an engine that cannot start (out of memory, a budget too small) is the row
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return out
    place = engine.placement()
    out.update(model_made_s=round(made, 1), engine_start_s=round(started, 1), prefill_chunk=engine.prefill_chunk,
               layers_resident=len(place["layers_resident"]), layers_streamed=len(place["layers_streamed"]),
               placement=place, cuda_context_gib=round(engine.cuda_context / 2**30, 3),
               kernel=engine.info().get("int4_kernel"))
    try:   # warm-up: kernel compilation and graph capture, in the pool and past it
        warm = max(256, min(args.contexts) // 4)
        run_context(engine, tok, warm, 6, 0)
        out["warmup"] = "ok"
    except Exception as exc:
        out["warmup"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for context in args.contexts:
        try:
            row = run_context(engine, tok, context, args.steps, args.warmup_steps)
        except Exception as exc:
            row = {"context": context, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if engine.device.type == "cuda":
                torch.cuda.empty_cache()
        out["rows"].append(row)
        print(json.dumps({"chunk": chunk, **row}), flush=True)
    seconds = pcie_layer_seconds(engine.layer_stream)
    if seconds:
        nbytes = engine.layer_stream.layer_bytes
        n = len(place["layers_streamed"])
        out["pcie"] = {"layer_bytes": nbytes, "layer_ms": round(1000 * seconds, 3),
                       "gb_s": round(nbytes / seconds / 1e9, 1), "streamed_ms_per_token": round(1000 * n * seconds, 1),
                       "laptop_layer_ms": round(1000 * nbytes / LAPTOP_PCIE, 2),
                       "laptop_streamed_ms_per_token": round(1000 * n * nbytes / LAPTOP_PCIE, 1),
                       "laptop_tok_s_bound": round(LAPTOP_PCIE / (n * nbytes), 2) if n else None}
    out["info"] = engine.info()
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def render(result: dict) -> str:
    a = result["args"]
    lines = [f"# DeepSeek-R1-Distill-Qwen-7B shape in {a['budget']} ({result['device']})", "",
             f"random int4 weights (group {GROUP}, lm_head {a['lm_head']}), real tokenizer, torch {result['torch']}, "
             f"{a['steps']} greedy decode steps per row (the first {a['warmup_steps']} untimed), engine path "
             "(`Engine.prefill` / `Engine.step`: DecodeStep graphs, tiered cache, streamed layers)", "",
             "command: `python -m benchmarks.big " + " ".join(result["argv"]) + "`", "",
             "| chunk | layers resident / streamed | context | prompt | TTFT s | decode tok/s | step ms (median) "
             "| peak reserved GiB | peak NVML GiB | pool tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for v in result["variants"]:
        if "error" in v:
            lines.append(f"| {v['chunk']} | - | - | - | error: {v['error']} | | | | | |")
            continue
        for r in v["rows"]:
            lay = f"{v['layers_resident']} / {v['layers_streamed']}"
            if "error" in r:
                lines.append(f"| {v['prefill_chunk']} | {lay} | {r['context']} | | error: {r['error']} | | | | | |")
                continue
            lines.append(f"| {v['prefill_chunk']} | {lay} | {r['context']} | {r['prompt_tokens']} | {r['ttft_s']} | "
                         f"{r['decode_tok_s']} | {r['decode_ms_median']} | {r.get('peak_reserved_gib', '-')} | "
                         f"{r.get('peak_nvml_gib') or '-'} | {r['pool_tokens']} |")
    lines.append("")
    for v in result["variants"]:
        p = v.get("pcie")
        if p:
            lines.append(f"- chunk {v['prefill_chunk']}: one streamed layer ({p['layer_bytes'] / 2**20:.1f} MiB) "
                         f"crosses PCIe in {p['layer_ms']} ms ({p['gb_s']} GB/s); its {v['layers_streamed']} streamed "
                         f"layers cost {p['streamed_ms_per_token']} ms a token. On a ~12 GB/s PCIe 4.0 x8 laptop link "
                         f"a layer takes {p['laptop_layer_ms']} ms, the streamed layers {p['laptop_streamed_ms_per_token']}"
                         f" ms a token: at most {p['laptop_tok_s_bound']} tok/s from the copies alone.")
        if "placement" in v:
            pl = v["placement"]
            lines.append(f"- chunk {v['prefill_chunk']}: embedding {pl['embedding']}, lm_head {pl['lm_head']['device']} "
                         f"({pl['lm_head']['weights']}), layers {pl['layers_resident'][:1]}..{pl['layers_resident'][-1:]}"
                         f" resident, {pl['layers_streamed'][:1]}..{pl['layers_streamed'][-1:]} streamed from "
                         f"{pl['streamed_from']}; model made in {v['model_made_s']} s, engine started in "
                         f"{v['engine_start_s']} s; CUDA context {v['cuda_context_gib']} GiB")
    cpu = result.get("cpu_layer_ms")
    if cpu:
        lines.append(f"- the host CPU ({result['cpu_threads']} threads) computes one layer's seven int4 projections at "
                     f"one token in {cpu} ms (torch's CPU int4 kernel)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import sys

    from benchmarks import emit
    from benchmarks.e2e import tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=None, help="a saved DeepSeek-R1-Distill tokenizer folder")
    ap.add_argument("--budget", default="4GiB", help="vram_budget (CUDA context included)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--chunks", nargs="+", default=["auto"], help="prefill_chunk variants, one engine each")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup-steps", type=int, default=4)
    ap.add_argument("--lm-head", choices=("int4", "float"), default="int4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer toy of the same kind (CPU checks)")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many decoder layers")
    ap.add_argument("--force-streamed", type=int, default=None, help="stream this many layers whatever the plan")
    ap.add_argument("--cpu-layer", action="store_true", help="also time one layer's projections on the host CPU")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    tok = tokenizer(args.tokenizer)
    vocab = -(-len(tok) // 128) * 128 if args.tiny else None   # the 7B's own 152064 holds the tokenizer
    cfg = seven_b_config(args.layers, args.tiny, vocab)
    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "args": vars(args), "argv": argv, "variants": []}
    with tempfile.TemporaryDirectory(prefix="fg-big-") as workdir:
        for chunk in args.chunks:
            result["variants"].append(run_variant(args, cfg, tok, chunk, workdir))
    if args.cpu_layer:
        try:
            result["cpu_threads"] = torch.get_num_threads()
            seconds = cpu_layer_seconds(cfg)
            result["cpu_layer_ms"] = round(1000 * seconds, 2) if seconds else None
        except Exception as exc:
            result["cpu_layer_ms"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    emit(render(result), result, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
