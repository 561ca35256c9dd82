"""The guard adapter behind llama-server (``backend: openai``) against the same guard in process: do the rails give
the same verdicts, and what does a verdict cost?

    bash tools/build_llama_server.sh                      # once (~10 min on 2 cores), or any llama-server binary
    OMP_NUM_THREADS=1 python -m benchmarks.guard_remote [--guard FOLDER] [--rows 100] [--server PATH]

Exports the guard (``--guard``, default the config's ``guard_adapter: auto``) with ``flashguard export-guard``'s
code, starts llama-server on the embedded SmolLM2 GGUF with it (``--lora-scaled guard.gguf:0``, one slot, one
thread: the in-process engines run with OMP_NUM_THREADS=1; two threads on two shared cores made the server 5-30x
slower here), and asks both rails' guard verdicts for the project's rows (rails/data/moderation_input_tune.jsonl for
the input rail, moderation_tune.jsonl for the output rail: a seeded sample, half of them harmful, messages under
1,200 characters) three ways over the same token ids: in process with float weights, in process with int4 weights
(the CPU's default; both the GGUF's Q4_1 codes) and through the server (Q4_1 with its own kernels). The output
rail's turn is on the server's slot and in the in-process session first (as after a generated reply), so its
request prefills only the end of turn and the question; the same ids read without the adapter just before it give
the base cost beside.

Prints the agreement (same verdict at the guard's thresholds for the config's strictness, mean / p95 / max
|p_unsafe in process - p_unsafe server|; in process int4 vs float as the arithmetic's own noise floor) and the cost
of a verdict (tokens prefilled and reused, the rail's seconds, median).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

# the rows, both rails' verdicts through each engine and their agreement are tests/rail_agreement.py's (its test
# asserts them too)
from tests.rail_agreement import DATA, ROOT, agreement, run_input, run_output, sample  # noqa: F401


def start_server(binary: str, gguf_model: Path, lora: Path, log: Path) -> tuple[subprocess.Popen, str]:
    from benchmarks.remote import _port

    port = _port()
    proc = subprocess.Popen([binary, "-m", str(gguf_model), "--alias", "smollm2", "--host", "127.0.0.1", "--port",
                             str(port), "--parallel", "1", "-c", "4096", "-t", "1", "--no-warmup",
                             "--lora-scaled", f"{lora}:0"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    for _ in range(400):
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"llama-server did not start: {log.read_text()[-1500:]}")


def costs(results: list[dict], name: str) -> dict:
    vs = [r[name] for r in results]
    return {"prefilled": statistics.fmean(v.prefilled_tokens for v in vs),
            "reused": statistics.fmean(v.reused_tokens for v in vs),
            "prompt": statistics.fmean(v.prompt_tokens for v in vs),
            "seconds": statistics.median(v.seconds for v in vs),
            "paths": sorted({v.path for v in vs}), "methods": sorted({v.method for v in vs})}


def main(argv=None) -> int:
    import yaml

    from flashguard import EngineConfig
    from flashguard.config import main_parameters
    from flashguard.engine import alora, get_engine, loader
    from flashguard.rails.moderation import ModerationSettings
    from flashguard.remote.guard_export import export_guard

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default=str(loader.user_cache_dir() / "llama-server" / "bin" / "llama-server"))
    p.add_argument("--guard", help="the guard folder (default: the config's guard_adapter: auto)")
    p.add_argument("--config", default=str(ROOT / "configs" / "flash"))
    p.add_argument("--rows", type=int, default=100, help="rows in all, half a rail")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the per-row p_unsafe here")
    args = p.parse_args(argv)

    doc = yaml.safe_load((Path(args.config) / "config.yml").read_text(encoding="utf-8")) or {}
    custom = doc.get("custom_data") or {}
    source = loader.embedded_model_source()
    folder = Path(args.guard) if args.guard else alora.find(source)
    if folder is None:
        raise SystemExit("no guard for the embedded model: pass --guard FOLDER")
    work = Path(tempfile.mkdtemp(prefix="flashguard-guard-remote-"))
    t0 = time.perf_counter()
    info = export_guard(folder, work / "guard.gguf", source)
    export_s = time.perf_counter() - t0
    model = Path(source.folder) / source.gguf_file
    proc, url = start_server(args.server, model, work / "guard.gguf", work / "llama-server.log")
    try:
        params = {k: v for k, v in main_parameters(doc).items() if k in ("system_prompt", "max_context")}
        engines = {w: get_engine(EngineConfig.from_parameters({**params, "guard_adapter": str(folder), "weights": w}))
                   for w in ("float", "int4")}
        engines["server"] = get_engine(EngineConfig.from_parameters(
            {**params, "backend": "openai", "base_url": url, "guard_adapter": str(folder)}), "smollm2")
        n_in = args.rows // 2
        # the guard adapter alone on every engine (in process, guard: auto would add the probe a server cannot read)
        settings_in = dataclasses.replace(ModerationSettings.from_custom_data(custom, side="input"), guard="adapter")
        settings_out = dataclasses.replace(ModerationSettings.from_custom_data(custom, side="output"), guard="adapter")
        results = {"input": run_input(engines, sample(DATA / "moderation_input_tune.jsonl", n_in, args.seed, "input"),
                                      settings_in),
                   }
        results["output"], base = run_output(engines, sample(DATA / "moderation_tune.jsonl", args.rows - n_in,
                                                              args.seed, "output"), settings_out)
    finally:
        proc.kill()
    lines = [f"guard {folder} (digest {info['digest']}), exported in {export_s:.1f} s: {info['bytes'] / 1e6:.1f} MB "
             f"f32, {info['tensors']} tensors; llama-server: the embedded SmolLM2 Q4_1 GGUF, 1 slot, 1 thread", "",
             "| rail | rows | compared | same verdict | mean / p95 / max abs(dp) | blocked (first / second) |",
             "|---|---|---|---|---|---|"]
    for side, res in results.items():
        for a, b in (("float", "server"), ("int4", "server"), ("int4", "float")):
            g = agreement(res, a, b)
            other = "server" if b == "server" else "in process " + b
            lines.append(f"| {side} | {g['rows']} | in process {a} vs {other} | {100 * g['same']:.1f}% | "
                         f"{g['mean']:.3f} / {g['p95']:.3f} / {g['max']:.3f} | "
                         f"{g['blocked'][0]} / {g['blocked'][1]} |")
    lines += ["", "| rail | engine | path | prompt tokens (mean) | prefilled (mean) | reused (mean) | "
              "verdict s (median) |", "|---|---|---|---|---|---|---|"]
    for side, res in results.items():
        for name in ("float", "int4", "server"):
            c = costs(res, name)
            label = name if name == "server" else "in process " + name
            lines.append(f"| {side} | {label} | {', '.join(c['paths'])} ({', '.join(c['methods'])}) | "
                         f"{c['prompt']:.0f} | {c['prefilled']:.1f} | {c['reused']:.1f} | {c['seconds']:.3f} |")
    for name in ("float", "int4", "server"):
        lines.append(f"| output | {name if name == 'server' else 'in process ' + name} | the same ids, no adapter "
                     f"(base) | | {statistics.fmean(b[1] for b in base[name]):.1f} | | "
                     f"{statistics.median(b[0] for b in base[name]):.3f} |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({side: [{k: v.p_unsafe for k, v in r.items()} for r in res]
                                               for side, res in results.items()}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
