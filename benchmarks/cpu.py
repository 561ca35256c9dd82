"""The default cache against DynamicCache on the CPU, through the engine, on the embedded model.

    python -m benchmarks.cpu --prompt-tokens 512 2048 --decode 64 --repeats 3 --out docs/benchmarks/cpu_cache.md

Two engines on one loaded model (the default ``kv_cache: tiered``, sized at start, and ``kv_cache: dynamic``) run
the same prompt (a fresh session each time: prefill of every token) and the same greedy decode, alternating
row after row ``--repeats`` times so that both see the same machine state. Reported: medians of prefill tok/s and
decode tok/s and the tiered / dynamic ratios (> 1: the default is faster).
"""

from __future__ import annotations

import argparse
import statistics


def measure(engine, ids, decode: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one generation from a fresh session and an empty store."""
    from flashguard.engine.sampling import SamplingParams

    engine.reset_session(keep_pages=False)   # no page of an earlier repeat may be adopted: every row prefills every token
    engine.generate(ids, SamplingParams(max_tokens=decode))
    last = engine.stats.last["generation"]
    decode_s = last["seconds"] - last["first_token_s"]
    return len(ids) / last["first_token_s"], max(1, last["generated"] - 1) / max(1e-9, decode_s)


def main(argv=None) -> int:
    import pydoc_data.topics as topics
    import torch

    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from benchmarks import emit

    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tiered = Engine(EngineConfig(device="cpu"))
    dynamic = Engine(EngineConfig(device="cpu", kv_cache="dynamic"), source=tiered.source, model=tiered.model,
                     tokenizer=tiered.tokenizer)
    text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    all_ids = tiered.tokenizer(text)["input_ids"]
    rows = []
    for n in args.prompt_tokens:
        ids = all_ids[:n]
        got: dict = {"tiered": [], "dynamic": []}
        measure(tiered, ids[:64], 4)   # warm-up of both paths
        measure(dynamic, ids[:64], 4)
        for _ in range(args.repeats):
            for name, engine in (("tiered", tiered), ("dynamic", dynamic)):
                got[name].append(measure(engine, ids, args.decode))
        med = {k: (statistics.median(v[0] for v in got[k]), statistics.median(v[1] for v in got[k])) for k in got}
        rows.append({"prompt_tokens": n, "decode_steps": args.decode, "tiered_prefill_tok_s": med["tiered"][0],
                     "dynamic_prefill_tok_s": med["dynamic"][0], "tiered_decode_tok_s": med["tiered"][1],
                     "dynamic_decode_tok_s": med["dynamic"][1], "runs": got})
    lines = [f"torch threads: {torch.get_num_threads()}, model: {tiered.source.label}, medians of {args.repeats}",
             "", "| prompt tokens | prefill tok/s tiered / dynamic | ratio | decode tok/s tiered / dynamic | ratio |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']} | {r['tiered_prefill_tok_s']:.0f} / {r['dynamic_prefill_tok_s']:.0f} | "
                     f"{r['tiered_prefill_tok_s'] / r['dynamic_prefill_tok_s']:.3f} | "
                     f"{r['tiered_decode_tok_s']:.1f} / {r['dynamic_decode_tok_s']:.1f} | "
                     f"{r['tiered_decode_tok_s'] / r['dynamic_decode_tok_s']:.3f} |")
    emit("\n".join(lines) + "\n", rows, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
