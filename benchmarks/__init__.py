"""flashguard's benchmarks: scripts run from the repository root as ``python -m benchmarks.NAME``, each with its
command in its header. pytest collects only benchmarks/tests/ here (each benchmark's own check on the CPU); tests/
never imports benchmarks, and what both need (the labelled rail sets, the rail harness) lives in tests/."""

import json
import time


def emit(table: str, data, out: str | None, json_path: str | None) -> None:
    """Print ``table`` and write it (``--out``) and ``data`` (``--json``) where asked."""
    print(table)
    save(table, data, out, json_path)


def save(table: str, data, out: str | None, json_path: str | None) -> None:
    """Write ``table`` (``--out``) and ``data`` (``--json``) where asked (a benchmark's results so far)."""
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, default=str)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(table)


def timed_steps(model, cache, token, step, kwarg: str, warmup: int, steps: int):
    """``warmup`` untimed then ``steps`` timed greedy decode steps (``decode_step.greedy_step``) on a GPU;
    returns (the last token, seconds of the timed steps)."""
    import torch

    from flashguard.engine.decode_step import greedy_step

    for _ in range(warmup):
        token = greedy_step(model, cache, token, step, kwarg)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        token = greedy_step(model, cache, token, step, kwarg)
    torch.cuda.synchronize()
    return token, time.perf_counter() - t0
