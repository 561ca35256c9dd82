"""``flashguard`` command line: chat, generate, serve. ``-v`` (before or after the command): flashguard's own log
lines (the rails' verdicts, timings); ``-vv``: NeMo Guardrails' too.

    flashguard chat       [--config DIR] [--max-tokens N] [--temperature T] [--seed S]   interactive, streaming, guarded
    flashguard generate   "question" [--config DIR] [--max-tokens N] [--temperature T] [--seed S]   one guarded answer
    flashguard serve      [--config DIR] [--host 127.0.0.1] [--port 8000] [--open]   (chat page at /)
    flashguard quantize   SRC DST [--group-size 64]       AWQ int4 checkpoint (gemm format) of a float model
    flashguard plan       [--model M] [--gpu-mem 4GiB] [--context 131072]   will it fit (default: this machine)
    flashguard smi        [--url URL] [--watch S] [--json]            GPU/host memory by category
    flashguard stress     --context 131072 [--vram-budget 4GiB]       drive the tiered KV cache, measure it
    flashguard calibrate  [--config DIR] [--weights int4] [--rail input]  train a moderation probe for the model
    flashguard train-guard [--config DIR] [--sources FOLDER]  train the rails' guard adapter for the model
                          [--backend openai --sources]                   or the server's question classifier
    flashguard eval-guard FILE [--config DIR] [--rail input|output|both] [--limit N] [--json OUT]
                          a labelled JSONL / CSV through the rails: blocked rates, precision, recall, F1
    flashguard export-guard --gguf OUT [--guard FOLDER] [--llama-cpp DIR]   the guard adapter for llama-server
"""
# This module parses the command line and runs the command; the commands that run the rails (chat, generate, serve,
# eval-guard) are cli_chat.py's, those about a model's weights and memory (quantize, plan, smi, stress) cli_plan.py's,
# the training commands their own modules' (rails/lab/calibrate.py, rails/lab/guard_command.py, remote/guard_export.py).

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# Before torch loads (libgomp reads it then; the user's own setting wins): OpenMP threads that sleep at once after a
# parallel region instead of spinning. Left spinning (the default), on cores that other work shares they keep their
# partner from running and every region waits for the scheduler: 48 decoded tokens took a median 12.6 s instead of
# 1.0 s on 2 cores at load 5, the rails' first check 5-8 s instead of 0.2 s (docs/benchmarks/startup.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# the commands, by area (each module imports its heavy parts inside the command)
from .cli_chat import (BLOCKED_EXIT, RailsLoading, cmd_chat, cmd_eval_guard, cmd_generate,  # noqa: E402,F401
                       cmd_serve, cut_note, llm_params, load_rails)
from .cli_plan import cmd_plan, cmd_quantize, cmd_smi, cmd_stress  # noqa: E402


def default_config_dir() -> str:
    """``configs/flash`` in the working folder, else the one beside the installed package (editable install)."""
    here = Path("configs/flash")
    if (here / "config.yml").is_file():
        return str(here)
    beside = Path(__file__).resolve().parent.parent / "configs" / "flash"
    return str(beside)


def utf8_output() -> None:
    """Write UTF-8 to stdout and stderr whatever the console's code page: on Windows, output that is not a console
    window (PowerShell pipes, redirects, some terminals) is encoded in the ANSI code page (cp1252, cp437, ...), and a
    reply holding a character outside it would raise UnicodeEncodeError mid-answer."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if encoding != "utf8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors="replace")


def _setup_logging(verbose: int) -> None:
    """Quiet by default: warnings, the start-up line and one line per blocked turn (flashguard/notice.py), and the
    server's one line per request. ``-v`` (before or after the command) adds flashguard's own INFO lines (the rails'
    verdicts, plans, timings); ``-vv`` adds every library's, NeMo Guardrails' event dumps among them."""
    level = logging.INFO if verbose >= 2 else logging.WARNING
    logging.basicConfig(level=level,
                        format="%(levelname)s %(name)s: %(message)s" if verbose else "%(levelname)s: %(message)s")
    logging.getLogger().setLevel(level)   # (basicConfig leaves a configured root alone)
    logging.getLogger("flashguard").setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("flashguard.server").setLevel(logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cmd_train_guard(args) -> int:
    from .rails.lab.guard_command import main as train_guard

    return train_guard(args)


def cmd_calibrate(args) -> int:
    from .rails.lab.calibrate import main as calibrate

    return calibrate(args)


def cmd_export_guard(args) -> int:
    from .remote.guard_export import main as export_guard

    return export_guard(args)


VERBOSE_HELP = ("-v: flashguard's own log lines (the rails' verdicts, timings; serve: prompts and replies); -vv: "
                "NeMo Guardrails' and other libraries' too")


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0 is greedy), got {text}")
    return value


def add_sampling_arguments(p) -> None:
    p.add_argument("--max-tokens", type=_positive_tokens, default=None, metavar="N",
                   help="the reply's length cap in tokens (default: the config's max_tokens, 256); a reply cut "
                   "there ends with a [cut at N tokens] line")
    p.add_argument("--temperature", type=_non_negative, default=None, metavar="T",
                   help="0 is greedy; > 0 samples (default: the config's temperature)")
    p.add_argument("--seed", type=int, default=None, help="the sampling seed: the same question, the same reply "
                   "(default: the config's seed)")


def _positive_tokens(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of tokens, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of rows, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashguard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    # the stress, train-guard and export-guard arguments come from their modules, imported only for that command
    # (train-guard's pulls in the engine and triton: 0.4 s of every other command's start)
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    chosen = words[0] if words else None
    p = sub.add_parser("chat", help="interactive guarded chat")
    p.add_argument("--config", default=default_config_dir())
    p.add_argument("--show-reasoning", action="store_true", help="show a reasoning model's thinking, dimmed")
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("generate", help="one guarded answer (exit status 3 when a rail blocks it)")
    p.add_argument("prompt")
    p.add_argument("--show-reasoning", action="store_true", help="print a reasoning model's thinking (dimmed, stderr)")
    p.add_argument("--config", default=default_config_dir())
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("serve", help="the NeMo Guardrails server, bound to 127.0.0.1 by default")
    p.add_argument("--config", default=default_config_dir())
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--open", action="store_true", help="open the chat page (/) in the default browser once it is up")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("quantize", help="AWQ int4 (gemm format) checkpoint of a float HF folder or GGUF file")
    p.add_argument("src", help="HF model folder, .gguf file, or 'embedded' for the embedded SmolLM2")
    p.add_argument("dst", help="output folder (written atomically)")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=64)
    p.add_argument("--method", choices=("awq", "rtn"), default="awq", help="rtn: plain round-to-nearest baseline")
    p.add_argument("--no-clip", action="store_true", help="skip the per-group clipping search")
    p.add_argument("--samples", type=int, default=32, help="calibration blocks (Python's pydoc topics)")
    p.add_argument("--seqlen", type=int, default=512, help="tokens per calibration block")
    p.add_argument("--eval", action="store_true", help="print held-out perplexity, float vs int4")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.set_defaults(func=cmd_quantize)
    p = sub.add_parser("plan", help="will a model, cache and context fit a GPU; what to change if not")
    p.add_argument("--model", default=None,
                   help="deepseek-r1-distill-qwen-1.5b, deepseek-r1-distill-qwen-7b, embedded, an HF folder or a .gguf "
                   "file (never downloaded); default: the model of --config")
    p.add_argument("--config", default=default_config_dir(), help="the config whose model and weights are planned")
    p.add_argument("--gpu-mem", "--vram-budget", dest="gpu_mem", default=None,
                   help="plan a GPU of this much memory for the process (vram_budget), CUDA context included, e.g. "
                   "4GiB (default: this machine: its GPU's free memory as vram_budget: auto does, or without a "
                   "CUDA GPU its CPU and RAM)")
    p.add_argument("--context", type=int, default=None,
                   help="prompt + generation tokens (default: the model's own context length)")
    p.add_argument("--lm-head", choices=("auto", "float", "int8", "int4"), default=None,
                   help="the lm_head key (default: the config's): int8 = Q8_0 codes, int4 = int4 codes with the top "
                        "rows recomputed (or a GGUF's own Q4 output matrix); auto plans int8 with int4 weights")
    p.add_argument("--weights", choices=("int4", "float", "fp16"), default=None,
                   help="the weights key's values (fp16: the old name of float); default: the config's, auto "
                        "resolved as on a GPU (int4 for a named shape)")
    p.add_argument("--kv-cache", choices=("tiered", "dynamic"), default="tiered", help="the kv_cache key")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="tokens per prefill pass (default: the engine's auto on a GPU, 2048, or down to 512 where "
                        "that keeps more streamed layers resident)")
    p.add_argument("--l1-tokens", type=int, default=None, help="kv.l1_tokens (default auto: the largest pool)")
    p.add_argument("--peer-gpus", type=int, default=None,
                   help="kv.peer_gpus as a count: GPUs beside the first that hold the off-pool pages")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("smi", help="GPU and host memory by category (of a running flashguard server if any)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--watch", type=float, default=0, help="refresh every S seconds")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_smi)
    p = sub.add_parser("stress", help="drive the tiered KV cache at a context and measure it")
    if chosen == "stress":
        from .vram.stress import add_arguments

        add_arguments(p)
    p.set_defaults(func=cmd_stress)
    p = sub.add_parser("calibrate", help="train the moderation rail's probe for the config's model (once per model)")
    p.add_argument("--config", default=default_config_dir())
    p.add_argument("--weights", choices=("float", "int4"), default=None, help="override the config's weights")
    p.add_argument("--rail", choices=("output", "input"), default="output", help="which rail's probe to train")
    p.add_argument("--data", default=None, help="labelled JSONL (default: the project's tuning set)")
    p.add_argument("--sources", nargs="?", const="download", default=None, metavar="FOLDER",
                   help="fit on the public sources of rails/data/SOURCES.md (and the project's rows), validated "
                   "leave-one-source-out: read from FOLDER/<owner>/<name>/<path>, or without FOLDER downloaded into "
                   "the user cache at the pinned commits and checked against their sha256")
    p.add_argument("--report", default=None, metavar="FILE", help="with --sources: write the validation tables "
                   "(per source and category, each strictness level) to this JSON file")
    p.add_argument("--thresholds", choices=("loso", "cv"), default="loso", help="with --sources: the strictness "
                   "levels' thresholds from the leave-one-source-out scores (default) or from 5-fold scores over all "
                   "sources (the shipped input probe: docs/moderation.md says why)")
    p.add_argument("--max-rows", type=int, default=None, metavar="N", help="with --sources: the first N rows only "
                   "(taken in turn from every source, so each keeps its share; a quicker, rougher fit)")
    p.add_argument("--out", default=None, help="probe file (default: the user cache folder, where the rail looks)")
    p.add_argument("--features", default=None, help="keep the tuning rows' hidden states (either rail) in this .pt "
                   "file and read them from it (same model and weights): only rows added since run through the model")
    p.add_argument("--float-states", action="store_true", help="with --weights int4: fit on the float "
                   "model's states kept in --features (the int4 states agree with them to cosine 0.9999 on the "
                   "embedded model; the int4 prefill of the long tuning messages takes hours on a CPU)")
    p.add_argument("--probe-features", default=None, help="the candidate features, comma-separated, chosen among by "
                   "cross-validation (output rail: last, last+mean; input rail: mean, last+mean, last; default: all "
                   "of the rail's)")
    p.add_argument("--keep-window-probe", default=None, metavar="FILE", help="--rail input: fit as usual, then keep "
                   "the window probe (long messages) of this input probe file instead (same model and weights)")
    p.add_argument("--min-per-class", type=int, default=None, metavar="N", help="--backend openai: after the "
                   "first --max-rows rows, add rows so that every source with both classes has N of each (default 30)")
    p.add_argument("--backend", choices=("openai",), default=None, help="fit the verdict a serving engine "
                   "(backend: openai) uses: a classifier over a few questions' Yes/No log-odds (needs --sources; "
                   "--max-rows default 1200; --features FILE keeps the log-odds). The log-odds are read by the "
                   "config's engine: in process (the same numbers, faster) or through its server")
    p.set_defaults(func=cmd_calibrate)
    p = sub.add_parser("train-guard", help="train the rails' guard adapter for the config's model (once per model)")
    if chosen == "train-guard":
        from .rails.lab.guard_command import add_arguments as guard_arguments

        guard_arguments(p, default_config_dir())
    p.set_defaults(func=cmd_train_guard)
    p = sub.add_parser("export-guard", help="write the guard adapter as a llama.cpp LoRA GGUF (llama-server's --lora, "
                       "backend: openai)")
    if chosen == "export-guard":
        from .remote.guard_export import add_arguments as export_arguments

        export_arguments(p, default_config_dir())
    p.set_defaults(func=cmd_export_guard)
    p = sub.add_parser("eval-guard", help="a labelled JSONL or CSV file through the config's rails: blocked rates, "
                       "precision, recall and F1 per rail and category")
    p.add_argument("file", help="JSONL (.jsonl, .json) or CSV (.csv): columns user and/or bot (or text: the user's "
                   "message), label (true/false, 1/0, unsafe/safe, harmful/benign or harmless, block/allow, yes/no), "
                   "optional category")
    p.add_argument("--config", default=default_config_dir())
    p.add_argument("--rail", choices=("input", "output", "both"), default=None,
                   help="default: the input rail for rows without bot, the output rail for rows with it; both: rows "
                   "with user and bot also go to the input rail (on the user's message), each rail reported apart")
    p.add_argument("--limit", type=_positive, default=None, metavar="N", help="the first N rows only")
    p.add_argument("--json", default=None, metavar="OUT", help="write the report and every row's verdict "
                   "(p_unsafe, blocked) to this JSON file")
    p.set_defaults(func=cmd_eval_guard)
    for p in set(sub.choices.values()):   # -v after the command as well as before it (they add up)
        p.add_argument("-v", "--verbose", action="count", default=0, dest="verbose_after", help=VERBOSE_HELP)
    utf8_output()
    args = parser.parse_args(argv)
    args.verbose += args.verbose_after
    _setup_logging(args.verbose)
    from .errors import FlashguardError

    try:
        return args.func(args)
    except FlashguardError as exc:
        print(f"flashguard: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # NeMo wraps config.py failures; show the cause
        cause = exc.__cause__
        if isinstance(cause, FlashguardError):
            print(f"flashguard: {cause}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
