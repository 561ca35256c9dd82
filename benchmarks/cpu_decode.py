"""Float against int4 weights on the CPU, through the engine, on the embedded model, beside llama.cpp on its GGUF.

    python -m benchmarks.cpu_decode --threads 2 --llamacpp llamacpp.md --out docs/benchmarks/cpu_decode.md

``llamacpp.md`` is the output of ``../shared/anchors/llamacpp/bench_cpu.sh`` (llama-bench pp512 / tg128 on the same
GGUF and threads). Each row is an Engine with the default cache (``kv_cache: tiered``): ``float`` (the GGUF
dequantized to fp32) and ``int4`` (``weights: int4``: the file's Q4_1 codes in Int4Linear, the Q8_0 lm_head as an
int4 pair). Prefill: a ``--prompt-tokens`` prompt from a fresh session (every token prefilled, llama-bench's pp512).
Decode: ``--decode`` greedy tokens after a short prompt, as the engine streams them (sampling and detokenization
included, which llama-bench's tg128 does not have). Medians of ``--repeats`` runs, rows alternating.

``--generic-layer`` adds an int4 row whose resident step runs the generic layer (``DecodeStep._run``, as before
``CpuOps.resident_step``; the same logits). ``--python-loop`` adds one whose resident step runs its loop in Python
instead of TorchScript (engine/cpu_loop.py; the same logits). The warm-up waits for the script.

``--breakdown`` adds two lines for the int4 row. In place (with the loop in Python, which a clock around each
kernel needs): the decode step with a clock around each of its int4 layer calls and around the final norm + lm_head (``CpuOps.finish``), the rest being the host work between them.
Ablated: the step with its int4 layers skipped (each returns zeros of its output shape; the model is restored
after), which runs the host work from warm caches and so reads it lower than in place.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

PROMPT = "Write a long story about a cat who travels around the world, one country after another."


def llamacpp_numbers(path: str) -> dict:
    """``{"pp512": tok/s, "tg128": tok/s}`` from llama-bench's markdown table."""
    out = {}
    for line in open(path, encoding="utf-8"):
        m = re.search(r"\|\s*(pp\d+|tg\d+)\s*\|\s*([\d.]+)", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def measure(engine, prompt_ids, story_ids, decode: int) -> tuple[float, float, int]:
    """(prefill tok/s of ``prompt_ids`` from nothing, decode tok/s after ``story_ids``, tokens decoded)."""
    from flashguard.engine.sampling import SamplingParams

    engine.reset_session(keep_pages=False)   # nothing of an earlier run may be adopted
    engine.generate(prompt_ids, SamplingParams(max_tokens=1))
    prefill = len(prompt_ids) / engine.stats.last["generation"]["first_token_s"]
    engine.reset_session(keep_pages=False)
    engine.generate(story_ids, SamplingParams(max_tokens=decode + 1))
    last = engine.stats.last["generation"]
    steps = max(1, last["generated"] - 1)
    return prefill, steps / max(1e-9, last["seconds"] - last["first_token_s"]), steps


def in_place(engine, cpu, ids, decode: int) -> tuple[float, float, float]:
    """``(step, int4 layer calls, final norm + lm_head)`` in ms a token, a clock around each call of ``engine``'s
    CPU step ``cpu`` (``CpuOps.mm``, ``cpu_loop.int4_mm`` with the loop run as Python, and ``CpuOps.finish``)
    while it decodes ``decode`` tokens after ``ids``."""
    from flashguard.engine.sampling import SamplingParams

    from flashguard.engine import cpu_loop

    clock = {"mm": 0.0, "finish": 0.0}
    mm, finish, loop_mm, script = cpu.mm, cpu.finish, cpu_loop.int4_mm, cpu.use_script

    def timed(key, fn):
        def call(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                clock[key] += time.perf_counter() - t
        return call

    engine.reset_session(keep_pages=False)
    engine.generate(ids[:-1], SamplingParams(max_tokens=1))   # then every token of the next call is a step
    # the clock goes around the kernel of the generic layer (CpuOps.mm) and of the loop run as Python
    cpu.mm, cpu.finish = timed("mm", mm), timed("finish", finish)
    cpu_loop.int4_mm, cpu.use_script = timed("mm", loop_mm), False
    try:
        t0 = time.perf_counter()
        engine.generate(ids, SamplingParams(max_tokens=decode + 1))
        total = time.perf_counter() - t0
    finally:
        del cpu.mm, cpu.finish   # the class's again
        cpu_loop.int4_mm, cpu.use_script = loop_mm, script
    steps = engine.stats.last["generation"]["generated"]
    return total / steps * 1e3, clock["mm"] / steps * 1e3, clock["finish"] / steps * 1e3


def main(argv=None) -> int:
    import pydoc_data.topics as topics
    import torch

    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from benchmarks import emit

    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--weights", nargs="+", default=["float", "int4"])
    p.add_argument("--lm-head", nargs="+", default=["auto"],
                   help="lm_head keys to run each int4 row with (a row per key; auto: the engine's timed pick)")
    p.add_argument("--breakdown", action="store_true",
                   help="int4: the step's ms timed in place by call, and with its int4 layers skipped")
    p.add_argument("--generic-layer", action="store_true",
                   help="a row more: int4 with the resident step on the generic layer (CpuOps.layer_args None), as "
                        "before CpuOps.resident_step")
    p.add_argument("--python-loop", action="store_true",
                   help="a row more: int4 with the resident step's loop in Python (CpuOps.script None), as where "
                        "TorchScript is not there and before engine/cpu_loop.py")
    p.add_argument("--llamacpp", help="llama-bench's markdown output (bench_cpu.sh) on the same GGUF and threads")
    p.add_argument("--out")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {}
    for w in args.weights:
        for head in (args.lm_head if w == "int4" else ["auto"]):
            name = w if head == "auto" else f"{w}, lm_head {head}"
            t0 = time.perf_counter()
            engines[name] = Engine(EngineConfig(device="cpu", weights=w, lm_head=head))
            engines[name].load_seconds = time.perf_counter() - t0
    if args.generic_layer:
        t0 = time.perf_counter()
        e = engines["int4, generic layer"] = Engine(EngineConfig(device="cpu", weights="int4"))
        e.load_seconds = time.perf_counter() - t0
        cpu = e.decode_step.cpu if e.decode_step is not None else None
        if cpu is None or cpu.layer_args is None:
            raise SystemExit("--generic-layer: this model's int4 step has no resident_step loop to compare with")
        cpu.layer_args = None   # CpuOps.resident_step then runs DecodeStep._run: the same arithmetic
    if args.python_loop:
        t0 = time.perf_counter()
        e = engines["int4, Python loop"] = Engine(EngineConfig(device="cpu", weights="int4"))
        e.load_seconds = time.perf_counter() - t0
        cpu = e.decode_step.cpu if e.decode_step is not None else None
        from flashguard.engine import cpu_loop

        if cpu is None or not cpu.use_script or cpu_loop.scripted() is None:
            raise SystemExit("--python-loop: this model's int4 step has no scripted loop to compare with")
        cpu.use_script = False   # CpuOps.resident_step then runs its loop in Python: the same calls
    first = next(iter(engines.values()))
    text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    prompt_ids = first.tokenizer(text)["input_ids"][:args.prompt_tokens]
    story_ids = first.encode_messages([{"role": "user", "content": PROMPT}])
    got: dict = {w: [] for w in engines}
    from flashguard.engine import cpu_loop

    cpu_loop.scripted()   # (the scripted loop, made on a thread as an engine loads: ready before any timing)
    for e in engines.values():
        measure(e, prompt_ids[:64], story_ids, 8)   # warm-up
    for _ in range(args.repeats):
        for w, e in engines.items():
            got[w].append(measure(e, prompt_ids, story_ids, args.decode))
    ref = llamacpp_numbers(args.llamacpp) if args.llamacpp else {}
    pp, tg = ref.get(f"pp{args.prompt_tokens}"), ref.get(f"tg{args.decode}")
    lines = [f"torch threads: {torch.get_num_threads()}, model: {first.source.label}, medians of {args.repeats}, "
             f"prompt {len(prompt_ids)} tokens, decode {args.decode} tokens after a {len(story_ids)}-token prompt", "",
             "| weights | lm_head | load s | prefill tok/s | decode tok/s | tokens decoded | prefill / llama.cpp | "
             "decode / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for w, runs in got.items():
        prefill, decode = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        steps = min(r[2] for r in runs)
        head = engines[w].lm_head_kind
        rows.append({"weights": w, "lm_head": head, "lm_head_why": engines[w].lm_head_reason,
                     "load_s": engines[w].load_seconds, "prefill_tok_s": prefill, "decode_tok_s": decode,
                     "decoded": steps, "runs": runs})
        ratios = f"{prefill / pp:.2f}x | {decode / tg:.2f}x" if pp and tg else " | "
        lines.append(f"| {w} | {head} | {engines[w].load_seconds:.1f} | {prefill:.0f} | {decode:.1f} | {steps} | "
                     f"{ratios} |")
    if pp and tg:
        lines.append(f"| llama.cpp (llama-bench) | | | {pp:.0f} | {tg:.1f} | {args.decode} | 1.00x | 1.00x |")
    lines += ["", *(f"- {w}: lm_head {e.lm_head_kind} ({e.lm_head_reason})" for w, e in engines.items())]
    if args.breakdown and "int4" in engines:
        from flashguard.quant.int4_linear import Int4Linear

        real = 1e3 / statistics.median(r[1] for r in got["int4"])
        step = engines["int4"].decode_step   # its CpuOps (engine/step_ops.py) call the kernel themselves
        cpu = step.cpu if step is not None else None
        if cpu is not None:
            runs = [in_place(engines["int4"], cpu, story_ids, args.decode) for _ in range(args.repeats)]
            step_ms, mm_ms, head_ms = (statistics.median(r[i] for r in runs) for i in range(3))
            lines += ["", f"int4 decode step in place: {step_ms:.1f} ms a token, of which the int4 layer calls "
                          f"{mm_ms:.1f} ms, the final norm + lm_head {head_ms:.1f} ms, the rest (host work, "
                          f"attention, sampling) {step_ms - mm_ms - head_ms:.1f} ms"]
            rows.append({"in_place_step_ms": step_ms, "in_place_int4_layers_ms": mm_ms,
                         "in_place_final_norm_lm_head_ms": head_ms})
        forward = Int4Linear.forward
        Int4Linear.forward = lambda self, x: x.new_zeros(*x.shape[:-1], self.out_features)
        from flashguard.engine import cpu_loop

        loop_mm, script = cpu_loop.int4_mm, cpu.use_script if cpu is not None else False
        if cpu is not None:   # the cpu backend's packed codes are [N, K / 2]; the loop runs as Python to skip them
            cpu.mm = cpu_loop.int4_mm = lambda x, packed, group, scale_zeros: x.new_zeros(x.shape[0], packed.shape[0])
            cpu.use_script = False
        try:
            skipped = statistics.median(1e3 / measure(engines["int4"], prompt_ids[:64], story_ids, args.decode)[1]
                                        for _ in range(args.repeats))
        finally:
            Int4Linear.forward = forward
            if cpu is not None:
                del cpu.mm   # the class's kernel again
                cpu_loop.int4_mm, cpu.use_script = loop_mm, script
        lines += ["", f"int4 decode step ablated: {real:.1f} ms a token; with the int4 layers skipped "
                      f"{skipped:.1f} ms (outside the int4 kernels); the int4 layers {real - skipped:.1f} ms"]
        rows.append({"int4_step_ms": real, "without_int4_layers_ms": skipped})
    emit("\n".join(lines) + "\n", rows, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
