"""Start-up to a first answer, as a user meets it: three commands timed as fresh processes.

    python -m benchmarks.startup --repeats 5
    python -m benchmarks.startup --repeats 5 --root /tmp/before --root .     # two checkouts, interleaved

- ``generate``: ``flashguard generate "hi"`` from launch to its answer on stdout (and to its exit);
- ``chat``: ``flashguard chat`` from launch to its ``you> `` prompt (then ``/quit``);
- ``LLMRails``: ``python -c "from nemoguardrails import LLMRails, RailsConfig;
  LLMRails(RailsConfig.from_path('configs/flash'))"`` from launch to its exit;
- ``imports`` (for reference, not a target): ``python -c "import torch, transformers.models.llama.modeling_llama;
  from nemoguardrails import LLMRails"``, launch to exit: the libraries every command above imports, and their
  teardown at exit, which flashguard does not choose.

``--wait-policy`` measures instead what OpenMP's wait policy does to a first answer (the CLI sets PASSIVE, cli.py):
a fresh process per policy (libgomp reads it as torch loads) decodes 48 greedy tokens of the embedded model 5 times,
each on a thread of its own as the rails' calls run, with the policy unset (libgomp spins after each parallel
region) and PASSIVE (its threads sleep): the median seconds each.

``--phases`` splits one ``generate`` into its steps instead, in one process per root: the imports (torch,
transformers, its auto classes, the llama model's module, NeMo Guardrails, flashguard's), ``RailsConfig``,
``LLMRails`` (NeMo's set-up and the model's load) and the guarded answer to "hi", wall and CPU seconds each.

Each command runs once *cold* (an empty ``FLASHGUARD_CACHE_DIR``: the GGUF's tokenizer and int4 model are made
and kept) and ``--repeats`` times *warm* (the same folder, now filled), with a warm OS page cache (one untimed run
first). A ``--root`` is a checkout: its folder is the working folder and goes first on ``PYTHONPATH``, so that
an older commit's ``flashguard`` (a ``git worktree``) runs with the same virtual environment; several roots are
interleaved run by run, so a load that comes and goes falls on each alike. Printed: the median wall seconds, the
median CPU seconds of the process (user + system: what the run would take on an idle core, roughly, for work that
is single-threaded; POSIX only), the machine's load average before and after, and the environment that matters
(CPU count, ``PYTHONDONTWRITEBYTECODE``: without bytecode files every flashguard module is compiled each start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "you> "
LLMRAILS = "from nemoguardrails import LLMRails, RailsConfig; LLMRails(RailsConfig.from_path('configs/flash'))"
IMPORTS = "import torch, transformers.models.llama.modeling_llama; from nemoguardrails import LLMRails"


def flashguard_command() -> list[str]:
    """The ``flashguard`` console script beside this Python (as a user runs it), else ``python -m flashguard.cli``."""
    folder = Path(sys.executable).parent
    for name in ("flashguard", "flashguard.exe"):
        if (folder / name).is_file():
            return [str(folder / name)]
    return [sys.executable, "-m", "flashguard.cli"]


COMMANDS = {
    "generate": lambda: [*flashguard_command(), "generate", "hi"],
    "chat": lambda: [*flashguard_command(), "chat"],
    "LLMRails": lambda: [sys.executable, "-c", LLMRAILS],
    "imports": lambda: [sys.executable, "-c", IMPORTS],
}
LABELS = {"generate": 'flashguard generate "hi"', "chat": "flashguard chat (to its prompt)",
          "LLMRails": "LLMRails(RailsConfig.from_path('configs/flash'))", "imports": "imports only (reference)"}


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except (AttributeError, OSError):   # Windows
        return "n/a"


def _children_cpu() -> float:
    try:
        import resource
    except ImportError:   # Windows
        return float("nan")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(kind: str, root: Path, cache: Path, timeout: float) -> dict:
    """One process: ``{"wall": s to the answer / prompt / exit, "exit": s to exit, "cpu": s, "output": tail}``."""
    env = dict(os.environ, FLASHGUARD_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")   # (the answer when printed)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(COMMANDS[kind](), cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    out = b""
    seen = None
    try:
        if kind in ("LLMRails", "imports"):
            out, err = proc.communicate(timeout=timeout)
        else:
            want = PROMPT.encode() if kind == "chat" else b"\n"
            fd = proc.stdout.fileno()
            while seen is None:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                out += chunk
                if want in out:
                    seen = time.perf_counter() - t0
                    if kind == "chat":
                        proc.stdin.write(b"/quit\n")
                        proc.stdin.flush()
            rest, err = proc.communicate(timeout=timeout)
            out += rest
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise SystemExit(f"{kind} in {root}: no answer in {timeout} s; stderr: {err.decode(errors='replace')[-2000:]}")
    end = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{kind} in {root} exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    if kind in ("generate", "chat") and seen is None:
        raise SystemExit(f"{kind} in {root}: no {'prompt' if kind == 'chat' else 'answer'} in its output: {out!r}")
    return {"wall": seen if seen is not None else end, "exit": end, "cpu": _children_cpu() - cpu0,
            "output": out.decode(errors="replace").strip()[-200:]}


DECODE = """
import statistics, threading, time
from flashguard import EngineConfig
from flashguard.engine.engine import Engine
from flashguard.engine.sampling import SamplingParams
engine = Engine(EngineConfig(device="cpu"))
ids = engine.encode_messages([{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
times = []
def one():
    t = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=48))
    times.append(time.perf_counter() - t)
for _ in range(5):
    thread = threading.Thread(target=one)
    thread.start()
    thread.join()
print(statistics.median(times), " ".join(f"{t:.2f}" for t in times))
"""


PHASES = """
import sys, time
marks = [("start", time.perf_counter(), time.process_time())]
def mark(name):
    marks.append((name, time.perf_counter(), time.process_time()))
import torch; mark("import torch")
import transformers; mark("import transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer; mark("transformers' auto classes")
import transformers.models.llama.modeling_llama; mark("transformers' llama model")
from nemoguardrails import LLMRails, RailsConfig; mark("import nemoguardrails")
import flashguard.cli, flashguard.engine.engine, flashguard.guardrails.provider, flashguard.rails.actions
mark("import flashguard")
config = RailsConfig.from_path("configs/flash"); mark("RailsConfig.from_path")
rails = LLMRails(config); mark("LLMRails(config): NeMo's set-up, the model's load")
rails.generate(messages=[{"role": "user", "content": "hi"}], options={"log": {"activated_rails": True}})
mark("the guarded answer to 'hi'")
for (_, t0, c0), (name, t1, c1) in zip(marks, marks[1:]):
    print(f"{name}|{t1 - t0:.2f}|{c1 - c0:.2f}")
print(f"total|{marks[-1][1] - marks[0][1]:.2f}|{marks[-1][2] - marks[0][2]:.2f}")
"""


def phases(roots: list[Path], rounds: int) -> None:
    """One ``generate`` split into steps per root (the CLI's environment: OMP_WAIT_POLICY as cli.py sets it where
    the root's cli.py does)."""
    for _ in range(rounds):
        for root in roots:
            env = dict(os.environ, FLASHGUARD_QUIET="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
            sets_policy = "OMP_WAIT_POLICY" in (root / "flashguard" / "cli.py").read_text(encoding="utf-8")
            if sets_policy:
                env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            out = subprocess.run([sys.executable, "-c", PHASES], cwd=root, env=env, capture_output=True, text=True,
                                 check=True).stdout
            print(f"\n{root} (load average {load_average()}; OMP_WAIT_POLICY "
                  f"{env.get('OMP_WAIT_POLICY', 'unset')})\n\n| step | wall s | CPU s |\n|---|---|---|")
            for line in out.strip().splitlines():
                print("| " + " | ".join(line.split("|")) + " |", flush=True)


def wait_policies(root: Path, rounds: int) -> None:
    print("| OMP_WAIT_POLICY | 48 tokens, median s (5 runs a process) | runs |")
    print("|---|---|---|")
    for _ in range(rounds):
        for policy in ("", "PASSIVE"):   # (unset: libgomp's default, spinning)
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            env.update(FLASHGUARD_QUIET="1", PYTHONPATH=os.pathsep.join(filter(None, [str(root),
                                                                                       env.get("PYTHONPATH")])))
            out = subprocess.run([sys.executable, "-c", DECODE], cwd=root, env=env, capture_output=True, text=True,
                                 check=True).stdout.split()
            print(f"| {policy or 'unset (spin)'} | {float(out[0]):.2f} | {' '.join(out[1:])} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="warm runs of each command and root (default 5)")
    parser.add_argument("--root", action="append", default=None, help="a checkout to run (repeatable; default .)")
    parser.add_argument("--commands", default="generate,chat,LLMRails,imports", help="comma-separated, of "
                        + ", ".join(COMMANDS))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default=None, help="write every run's numbers here too")
    parser.add_argument("--phases", action="store_true", help="split one generate into its steps instead "
                        "(--repeats rounds over the roots)")
    parser.add_argument("--wait-policy", action="store_true", help="measure OpenMP's wait policy on decoding instead "
                        "(--repeats rounds of both policies, in the first --root)")
    args = parser.parse_args(argv)
    if args.phases:
        phases([Path(r).resolve() for r in (args.root or ["."])], args.repeats)
        return 0
    if args.wait_policy:
        print(f"# load average before: {load_average()}")
        wait_policies(Path((args.root or ["."])[0]).resolve(), args.repeats)
        print(f"# load average after: {load_average()}")
        return 0
    roots = [Path(r).resolve() for r in (args.root or ["."])]
    kinds = [k.strip() for k in args.commands.split(",") if k.strip()]
    for kind in kinds:
        if kind not in COMMANDS:
            raise SystemExit(f"unknown command {kind!r}; one of {', '.join(COMMANDS)}")
    print(f"# {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}")
    print(f"# load average before: {load_average()}")
    work = Path(tempfile.mkdtemp(prefix="flashguard-startup-"))
    runs: dict = {}
    try:
        for kind in kinds:   # one untimed run each: the OS page cache holds the files every later run reads
            for root in roots:
                run_once(kind, root, work / "page-cache", args.timeout)
        for kind in kinds:
            for i, root in enumerate(roots):
                cache = work / f"{kind}-{i}"
                runs[(kind, str(root), "cold")] = [run_once(kind, root, cache, args.timeout)]
                print(f"  {kind:9s} cold  {root}: {runs[(kind, str(root), 'cold')][0]['wall']:.2f} s", flush=True)
            for _ in range(args.repeats):
                for i, root in enumerate(roots):
                    r = run_once(kind, root, work / f"{kind}-{i}", args.timeout)
                    runs.setdefault((kind, str(root), "warm"), []).append(r)
                    print(f"  {kind:9s} warm  {root}: {r['wall']:.2f} s (cpu {r['cpu']:.2f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"# load average after: {load_average()}")
    print()
    print("| command | checkout | cold s | warm median s | warm min-max s | warm median to exit s | "
          "warm median CPU s |")
    print("|---|---|---|---|---|---|---|")
    for kind in kinds:
        for root in roots:
            cold = runs[(kind, str(root), "cold")][0]
            warm = runs[(kind, str(root), "warm")]
            walls = [r["wall"] for r in warm]
            print(f"| {LABELS[kind]} | {root} | {cold['wall']:.2f} | {statistics.median(walls):.2f} | "
                  f"{min(walls):.2f}-{max(walls):.2f} | {statistics.median(r['exit'] for r in warm):.2f} | "
                  f"{statistics.median(r['cpu'] for r in warm):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_average_after": load_average(), "runs": [
            {"command": k, "root": r, "cache": c, **{key: v for key, v in x.items() if key != "output"}}
            for (k, r, c), xs in runs.items() for x in xs]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
