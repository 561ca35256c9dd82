"""Where a long conversation's time goes on a GPU: the profiler over one prefill chunk past the pool and over a few
decode steps off it, through the engine as configured (the default cache under a budget).

    python -m benchmarks.profile --model DIR --budget 4GiB --context 65536 --out profile.txt

``DIR`` is an int4 checkpoint (``bench.e2e.make_checkpoints``'s ``ds15b-int4``). The engine prefills ``--context``
random tokens (untimed), then the profiler records (1) one more ``prefill_chunk`` of tokens, which attends the
pages that left the pool, and (2) ``--steps`` decode steps (the one-graph sparse step). For each: the wall time,
and the top CUDA kernels and CPU operators by time. What it answers: what dominates a 128K conversation's
prefill past the pool and its sparse decode step. ``--whole`` profiles the first prefill too (GPU time against wall
time for a prompt that fits the pool: what a short prompt's first token waits for). ``--times N`` first times N
prompts of ``--context`` new tokens, each in a new session, without the profiler (the process's first prompt against
the later ones).
"""

from __future__ import annotations

import argparse
import time

import torch


def _table(prof, sort: str, rows: int) -> str:
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--whole", action="store_true", help="profile the whole prefill of --context tokens too (GPU "
                    "time against wall time where the context fits the pool: what a short prompt's first token waits for)")
    ap.add_argument("--times", type=int, default=0, help="first time this many prompts of --context new tokens, "
                    "each in a new session, without the profiler")
    args = ap.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.engine.sampling import SamplingParams

    engine = Engine(EngineConfig.from_parameters({"model_path": args.model, "device": args.device,
                                                  "vram_budget": args.budget if args.device == "cuda" else None}))
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    chunk = engine.prefill_chunk
    low = 1000 if vocab > 2000 else 3   # (ordinary tokens, not the specials at the start of a vocabulary)
    ids = torch.randint(low, min(vocab, 100000), (args.context + chunk,), generator=gen).tolist()
    one = SamplingParams(max_tokens=1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    timed = []
    for i in range(args.times):   # (other ids each time: nothing is reused)
        other = torch.randint(low, min(vocab, 100000), (args.context,), generator=gen).tolist()
        engine.reset_session()
        sync()
        t0 = time.perf_counter()
        engine.generate(other, one)
        sync()
        timed.append(f"prompt {i + 1} of {args.context} new tokens (new session): {time.perf_counter() - t0:.3f} s")
    engine.reset_session()
    whole = []
    if args.whole:   # (the wall time is taken before the profiler's tables are built: they take seconds)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.generate(ids[:args.context], one)
            sync()
            prefill_s = time.perf_counter() - t0
        whole = [f"## the whole prefill of {args.context} tokens: {prefill_s * 1e3:.1f} ms wall (under the profiler)",
                 "", "by CUDA time:", _table(prof, "cuda_time_total", args.rows),
                 "by CPU time (self):", _table(prof, "self_cpu_time_total", args.rows)]
    else:
        t0 = time.perf_counter()
        engine.generate(ids[:args.context], one)
        sync()
        prefill_s = time.perf_counter() - t0
    lines = [f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}: {args.model}, vram_budget {args.budget}, prefill_chunk {chunk}, "
             f"pool {engine.kv.l1_tokens} tokens ({engine.kv.l1_codec}); {args.context} tokens prefilled in "
             f"{prefill_s:.2f} s" + (" (under the profiler)" if args.whole else ""), ""] + timed + [""] + whole
    for label, run in (("prefill chunk past the pool", lambda: engine.generate(ids, one)),
                       (f"{args.steps} decode steps", lambda: engine.generate(ids, SamplingParams(
                           max_tokens=args.steps + 1)))):
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            run()
            sync()
            wall = time.perf_counter() - t0
        lines += [f"## {label}: {wall * 1e3:.1f} ms wall", "", "by CUDA time:", _table(prof, "cuda_time_total", args.rows),
                  "by CPU time (self):", _table(prof, "self_cpu_time_total", args.rows)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
