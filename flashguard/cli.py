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

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

# Before torch loads (libgomp reads it then; the user's own setting wins): OpenMP threads that sleep at once after a
# parallel region instead of spinning. Left spinning (the default), on cores that other work shares they keep their
# partner from running and every region waits for the scheduler: 48 decoded tokens took a median 12.6 s instead of
# 1.0 s on 2 cores at load 5, the rails' first check 5-8 s instead of 0.2 s (docs/benchmarks/startup.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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


def load_rails(config_dir: str, check=None, status: bool = True):
    """``LLMRails`` for ``config_dir``, with a status line while the model loads (``status``); ``check(rails_config)``
    runs on NeMo's config before the model loads (a command's own checks of the config)."""
    import contextlib

    from nemoguardrails import LLMRails
    from rich.console import Console

    console = Console(stderr=True)
    if not Path(config_dir, "config.yml").is_file():
        raise SystemExit(f"flashguard: no config.yml in {config_dir!r}; pass --config DIR")
    with console.status(f"Loading the model of {config_dir} ...") if status else contextlib.nullcontext():
        config = _rails_config(config_dir)
        if check is not None:
            check(config)
        rails = LLMRails(config)
    return rails


class RailsLoading:
    """``load_rails`` on a thread, so that ``flashguard chat`` prompts while the weights load (the reply waits for
    them): ``started()`` returns once the model's loading line is out (``notice.say``; with FLASHGUARD_QUIET, once
    loaded), with the status line meanwhile, raising what failed before it; ``rails()`` waits for the rest (the
    status line again) and raises what failed; ``close()`` waits for a load still running (no thread left at exit)."""

    def __init__(self, config_dir: str):
        import threading

        self.config_dir = config_dir
        self._begun, self._done = threading.Event(), threading.Event()
        self._rails = self._error = None
        self._notice = logging.getLogger("flashguard.notice")
        self._notice.addFilter(self._first_line)
        threading.Thread(target=self._load, name="flashguard-load", daemon=True).start()

    def _first_line(self, record) -> bool:
        self._begun.set()
        return True

    def _load(self) -> None:
        try:
            self._rails = load_rails(self.config_dir, status=False)
        except BaseException as exc:   # noqa: BLE001 - raised again in the main thread
            self._error = exc
        finally:
            self._notice.removeFilter(self._first_line)
            self._done.set()
            self._begun.set()

    def _wait(self, event) -> None:
        if not event.is_set():
            from rich.console import Console

            with Console(stderr=True).status(f"Loading the model of {self.config_dir} ..."):
                event.wait()
        if self._done.is_set() and self._error is not None:
            raise self._error

    def started(self) -> None:
        self._wait(self._begun)

    def rails(self):
        self._wait(self._done)
        return self._rails

    def close(self) -> None:
        try:
            self._done.wait()
        except KeyboardInterrupt:
            pass


def _rails_config(config_dir: str):
    """NeMo's ``RailsConfig`` of ``config_dir``; bad YAML or a bad field is a ConfigError of one line naming it."""
    import pydantic
    import yaml
    from nemoguardrails import RailsConfig

    from .errors import ConfigError

    try:
        return RailsConfig.from_path(config_dir)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{config_dir}: a config file is not valid YAML{where}: "
                          f"{getattr(exc, 'problem', None) or exc}") from None
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{config_dir}: config.yml: {key}: {first['msg']}") from None
    except (TypeError, KeyError, AttributeError) as exc:  # NeMo's loader trips over a value of the wrong shape
        raise ConfigError(f"{config_dir}: NeMo Guardrails cannot read this config ({type(exc).__name__}: {exc}); "
                          "compare config.yml's structure with configs/flash/config.yml") from None


DIM, PLAIN = "\x1b[2m", "\x1b[0m"


async def _stream_reply(rails, messages: list[dict], show_reasoning: bool = False, prefix: str = "",
                        llm_params: dict | None = None) -> str:
    """Stream the guarded answer to stdout after ``prefix``, printed with the first text (so a rail's notice on
    stderr comes on its own line, not after it); a reasoning model's ``<think>`` text (never part of the answer) is
    shown dimmed before it when ``show_reasoning``. ``llm_params``: the command line's sampling (``llm_params``)."""
    from .reasoning import reasoning_sink

    thinking, started = [], []

    def out(text: str) -> None:
        if not started:
            started.append(True)
            text = prefix + text
        print(text, end="", flush=True)

    def dimmed(text: str) -> None:
        out(DIM + text + PLAIN)
        thinking.append(text)

    reasoning_sink.set(dimmed if show_reasoning else None)
    parts = []
    async for chunk in rails.stream_async(messages=messages, options={"llm_params": llm_params or {}}):
        if thinking and not parts:
            out("\n")
        text = chunk if isinstance(chunk, str) else json.dumps(chunk)
        if text.startswith('{"error"'):
            err = json.loads(text)["error"]
            out(f"\n[blocked: {err.get('message', err)}]")
            return ""
        parts.append(text)
        out(text)
    out("\n")
    return "".join(parts)


def llm_params(args) -> dict:
    """The sampling ``--max-tokens``, ``--temperature`` and ``--seed`` set (NeMo's ``llm_params``); the rest, and
    what they leave unset, come from the config's ``parameters:``."""
    return {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                              ("seed", args.seed)) if v is not None}


def cut_note(usage) -> str | None:
    """The line that says a reply stopped at max_tokens (``usage``: the call's ``server.usage_scope``)."""
    if usage.finish_reason != "length":
        return None
    return f"[cut at {usage.completion_tokens} tokens: raise --max-tokens]"


PASTE_FENCE = '"""'   # flashguard chat: the lines between two of these are one message


def cmd_chat(args) -> int:
    loading = RailsLoading(args.config)   # the prompt comes once the loading line is out; the weights load on
    try:
        return _chat(args, loading)
    finally:
        loading.close()


def _chat(args, loading: RailsLoading) -> int:
    loading.started()
    if not args.verbose:  # keep per-call stats lines out of the conversation (see /stats)
        logging.getLogger("flashguard").setLevel(logging.WARNING)
    print('flashguard chat: type a message (one line; for several, e.g. a paste, put them between two lines of '
          '"""); /reset clears the conversation, /stats shows counters, /think shows or hides a reasoning model\'s '
          'thinking (dimmed), /quit exits.')
    messages: list[dict] = []
    show_reasoning = args.show_reasoning
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line == PASTE_FENCE:   # a message of several lines, up to the next fence
            block = []
            more_prompt = "... " if sys.stdin.isatty() else ""   # (a piped paste: no prompt a line)
            try:
                while (more := input(more_prompt)).strip() != PASTE_FENCE:
                    block.append(more)
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            line = "\n".join(block).strip()
            if not line:
                continue
        elif line in ("/quit", "/exit"):
            return 0
        elif line == "/reset":
            messages.clear()
            continue
        elif line == "/think":
            show_reasoning = not show_reasoning
            print(f"reasoning {'shown (dimmed)' if show_reasoning else 'hidden'}")
            continue
        elif line == "/stats":
            from flashguard import engine_stats

            print(json.dumps(engine_stats(), indent=2))
            continue
        messages.append({"role": "user", "content": line})
        from .guardrails.server import usage_scope

        with usage_scope() as usage:
            reply = asyncio.run(_stream_reply(loading.rails(), messages, show_reasoning, prefix="bot> ",
                                              llm_params=llm_params(args)))
        note = cut_note(usage) if reply else None
        if note:
            print(note, flush=True)
        if reply:
            messages.append({"role": "assistant", "content": reply})
        else:
            messages.pop()


BLOCKED_EXIT = 3   # flashguard generate: a rail blocked the prompt or the reply (the refusal is printed)


def cmd_generate(args) -> int:
    rails = load_rails(args.config)
    from .reasoning import split_answer

    from .guardrails.server import usage_scope

    with usage_scope() as usage:
        res = rails.generate(messages=[{"role": "user", "content": args.prompt}],
                             options={"log": {"activated_rails": True}, "llm_params": llm_params(args)})
    content = res.response[-1]["content"] if res.response else ""
    # with options NeMo 0.24 hands a reasoning model's trace apart; a <think> block left in front goes too
    reasoning, answer = split_answer(content)
    reasoning = reasoning or getattr(res, "reasoning_content", None) or ""
    if reasoning and args.show_reasoning:
        print(DIM + reasoning + PLAIN, file=sys.stderr)
    print(answer, flush=True)
    stopped = [r for r in (res.log.activated_rails if res.log else []) if r.stop]
    blocked = any(r.type in ("input", "output") for r in stopped)
    note = None if blocked else cut_note(usage)
    if note:
        print(note, file=sys.stderr)
    return BLOCKED_EXIT if blocked else 0


def cmd_serve(args) -> int:
    if not args.verbose:  # NeMo's server module warns about its chat UI at import; flashguard serve has its own
        logging.getLogger("nemoguardrails").setLevel(logging.ERROR)
    from nemoguardrails.server import api

    config = os.path.abspath(args.config.rstrip("/\\"))
    if not Path(config, "config.yml").is_file():
        raise SystemExit(f"flashguard: no config.yml in {config!r}; pass --config DIR")
    api.app.rails_config_path = config
    api.set_default_config_id(os.path.basename(config))  # requests need no guardrails.config_id
    # Load the weights before the first request, so a bad model_path fails here with its message.
    rails = load_rails(config)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"flashguard: serving on {args.host}: anyone who can reach this address can use the model; "
              "put an authenticating reverse proxy in front for a LAN", file=sys.stderr)
    from .guardrails.server import serve

    serve(rails, api.app, args.host, args.port, verbose=args.verbose, open_page=args.open)
    return 0


def cmd_quantize(args) -> int:
    from .engine import loader
    from .quant import awq_search

    source = loader.resolve_model(None if args.src == "embedded" else args.src)
    if Path(args.dst).exists() and not args.force:
        raise SystemExit(f"flashguard: {args.dst!r} exists; choose another DST or pass --force to replace it")
    folder = loader.materialize(source)
    result = awq_search.quantize_folder(folder, args.dst, args.group_size, method=args.method, clip=not args.no_clip,
                                        samples=args.samples, seqlen=args.seqlen, label=source.label)
    print(f"flashguard: wrote {args.dst} ({args.method}, group size {args.group_size}, "
          f"{result['calibration_tokens']} calibration tokens) in {result['seconds']:.0f} s")
    if args.eval:
        from .quant.awq_eval import compare

        print(compare(folder, args.dst))
    return 0


def plan_model(args) -> tuple[str, str, dict]:
    """``(model, where it came from, the config's parameters)`` for ``flashguard plan``: ``--model`` where given,
    else the config's ``model_path`` (the embedded model when it has none)."""
    import yaml

    from .config import main_parameters

    if args.model is not None:
        return args.model, "--model", {}
    path = Path(args.config, "config.yml")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"flashguard: cannot read {path}: {exc}; pass --config DIR or --model") from exc
    params = main_parameters(doc)
    if not params.get("model_path"):
        return "embedded", f"the embedded model: {path} sets no model_path", params
    from .engine import loader

    source = loader.resolve_model(params["model_path"], params.get("gguf_file"))
    model = os.path.join(source.folder, source.gguf_file) if source.gguf_file else source.folder
    return model, f"models[main].parameters.model_path of {path}", params


def plan_weights(args, model: str, params: dict, device: str = "cuda") -> tuple[str, str]:
    """``(weights, why)``: ``--weights`` where given, else the config's ``weights`` key, ``auto`` resolved as the
    engine resolves it on ``device`` (engine/loader.py ``choose_weights``: int4 for a Q4 GGUF on the CPU, as chat
    loads the embedded model there); a named shape is planned in int4."""
    import torch

    from .config import EngineConfig
    from .engine import loader

    if args.weights is not None:
        return ("float" if args.weights == "fp16" else args.weights), "--weights"   # fp16: the old name
    weights = EngineConfig.from_parameters({"weights": params.get("weights", "auto")}).weights
    if weights != "auto":
        return weights, "weights: " + weights + " in the config"
    if model.lower() in ("deepseek-r1-distill-qwen-1.5b", "deepseek-r1-distill-qwen-7b"):
        return "int4", "a named shape is planned in int4; --weights float to compare"
    source = loader.resolve_model(None if model == "embedded" else model)
    return loader.choose_weights("auto", source, torch.device(device))


def plan_on_cpu(args, shape, model: str, where: str, why: str, context_note: str) -> int:
    """``flashguard plan`` where the machine has no CUDA GPU and no ``--gpu-mem`` was given: the engine on this
    CPU, in host RAM (``vram/plan.py`` ``plan_cpu``), against the RAM available now."""
    import psutil

    from .quant import AWQ_GROUP_SIZE
    from .vram import plan as planner

    gguf = model == "embedded" or model.lower().endswith(".gguf")   # a GGUF's Q4 blocks: groups of 32
    parts = planner.plan_cpu(shape, context=args.context, weights=args.weights,
                             prefill_chunk=args.prefill_chunk or 512, group=32 if gguf else AWQ_GROUP_SIZE,
                             guard=planner.guard_bytes(shape, itemsize=4))
    total, available = sum(parts.values()), psutil.virtual_memory().available
    fits = total <= available
    if args.json:
        print(json.dumps({"device": "cpu", "fits": fits, "weights": args.weights, "context": args.context,
                          "host": parts, "total": total, "available": available}, indent=1))
        return 0 if fits else 1
    g = 2**30
    print(f"model: {shape.name} ({where}); weights: {args.weights} ({why}); lm_head: {shape.lm_head}")
    print(f"planned for this machine's CPU ({os.cpu_count()} cores, no CUDA GPU; --gpu-mem 4GiB plans a GPU "
          f"instead) and a context of {args.context} tokens ({context_note})")
    print()
    print("| host RAM | GiB |")
    print("|---|---|")
    for name, size in parts.items():
        print(f"| {name} | {size / g:.3f} |")
    print(f"| **total** | **{total / g:.3f}** |")
    print()
    print(f"fits: {total / g:.2f} GiB of the {available / g:.2f} GiB of RAM available now" if fits else
          f"does NOT fit: {total / g:.2f} GiB, and {available / g:.2f} GiB of RAM is available now; a smaller "
          "--context (max_context in the config) needs less")
    return 0 if fits else 1


def cmd_plan(args) -> int:
    import dataclasses

    import torch

    from .config import CacheConfig, EngineConfig, parse_bytes
    from .quant import lm_head
    from .vram import plan as planner

    model, where, params = plan_model(args)
    shape = planner.resolve_shape(model)   # an unknown model: one line
    on_cpu = args.gpu_mem is None and not torch.cuda.is_available()   # unless told otherwise: this machine
    args.weights, why = plan_weights(args, model, params, "cpu" if on_cpu else "cuda")
    head_key = args.lm_head or EngineConfig.from_parameters({"lm_head": params.get("lm_head", "auto")}).lm_head
    shape = dataclasses.replace(shape, lm_head=lm_head.planned(head_key, args.weights))
    context_note = "--context"
    if args.context is None:
        args.context, context_note = shape.context or 131072, "the model's own; --context to change"
    elif shape.context and args.context > shape.context:
        context_note = f"--context {args.context} is past the model's own {shape.context}, which the engine caps at"
        args.context = shape.context
    if on_cpu:
        return plan_on_cpu(args, shape, model, where, why, context_note)
    gpu_note = "--gpu-mem: the process's share, CUDA context included"
    if args.gpu_mem is None:   # this machine's GPU, as vram_budget: auto sizes it
        from .engine.budget import VRAM_MARGIN, resolve_vram_budget

        args.gpu_mem = f"{resolve_vram_budget('auto', torch.device('cuda')) / 2**30:.2f}GiB"
        gpu_note = (f"this machine's {torch.cuda.get_device_name(0)}: its free memory less {VRAM_MARGIN / 2**30:.1f} "
                    "GiB, as vram_budget: auto; --gpu-mem to plan another")
    if not args.json:
        print(f"model: {shape.name} ({where}); weights: {args.weights} ({why}); lm_head: {shape.lm_head}")
        print(f"planned for a GPU of {args.gpu_mem} ({gpu_note}) and a context of {args.context} tokens "
              f"({context_note})")
        if not torch.cuda.is_available():
            print("(this machine has no CUDA GPU: without --gpu-mem, plan plans its CPU)")
    # auto (None): the largest pool that fits, as the engine sizes it
    kv = CacheConfig(l1_tokens=args.l1_tokens, peer_gpus=args.peer_gpus)
    gpu = parse_bytes(args.gpu_mem, key="--gpu-mem")
    # int4 decoder layers that do not fit stream from host RAM, as the engine places them (a ConfigError naming
    # vram_budget and the smallest budget when not even that fits)
    streamed, args.prefill_chunk = planner.layer_placement(
        shape, budget=gpu, context=args.context, weights=args.weights, cache=args.kv_cache,
        prefill_chunk=args.prefill_chunk or 2048, kv=kv, shrink_chunk=args.prefill_chunk is None)
    p = planner.plan(shape, gpu_mem=gpu, context=args.context, weights=args.weights, cache=args.kv_cache,
                     prefill_chunk=args.prefill_chunk, kv=kv, streamed=streamed,
                     guard=planner.guard_bytes(shape) if params.get("guard_adapter", "auto") != "off" else 0)
    if args.kv_cache == "tiered" and not args.json:
        sized = planner.sized_kv(shape, budget=gpu, context=args.context, weights=args.weights,
                                 prefill_chunk=args.prefill_chunk, kv=kv, streamed=streamed)
        where = "every token resident" if sized.l1_tokens >= args.context else \
            f"{args.context - sized.l1_tokens} tokens off the pool, in L2 (host RAM) / L3 (disk)"
        print(f"kv.l1_tokens (the pool on the GPU): {sized.l1_tokens} tokens in {sized.l1_codec}, {where}")
        read = planner.decode_bytes(shape, weights=args.weights, context=args.context, kv=sized)
        ref = planner.llamacpp_decode_bytes(shape, context=args.context)["total"]
        print("read per decoded token at this context: " + ", ".join(
            f"{k} {v / 1e9:.3f} GB" for k, v in read.items() if k != "total") + f"; {read['total'] / 1e9:.3f} GB in "
            f"all ({read['total'] / ref:.2f}x llama.cpp's Q4_K_M with a q8_0 cache), at least "
            f"{read['total'] / 1e6 / planner.LAPTOP_GB_S:.1f} ms a token on a {planner.LAPTOP_GB_S} GB/s laptop GPU")
        if args.weights == "int4" and (shape.lm_head != "int4" or sized.l1_codec != "int8"):
            few = dataclasses.replace(shape, lm_head="int4")
            few_kv = planner.sized_kv(few, budget=gpu, context=args.context, weights=args.weights,
                                      prefill_chunk=args.prefill_chunk,
                                      kv=dataclasses.replace(kv, l1_codec="int8"), streamed=streamed)
            least = planner.decode_bytes(few, weights=args.weights, context=args.context, kv=few_kv)["total"]
            print(f"fewest bytes (a bandwidth-bound laptop GPU; on a fast one they cost time): lm_head: int4 and kv: "
                  f"{{l1_codec: int8}} read {least / 1e9:.3f} GB ({least / ref:.2f}x), at least "
                  f"{least / 1e6 / planner.LAPTOP_GB_S:.1f} ms a token")
        print()
    if args.json:
        print(json.dumps({"fits": p.fits, "gpu": p.parts, "host": p.host, "peak_reserved": p.peak_reserved,
                          "total": p.total, "peers": p.peers, "prefill_chunk": p.prefill_chunk,
                          "layers": {"resident": shape.layers - streamed, "streamed": streamed}}, indent=1))
        return 0 if p.fits else 1
    print(p.table())
    if not p.fits:
        changes = planner.suggest(shape, gpu_mem=gpu, context=args.context, weights=args.weights,
                                  cache=args.kv_cache, prefill_chunk=args.prefill_chunk, kv=kv)
        if "error" in changes:
            print(changes["error"])
        else:
            print("set in models[main].parameters: " + ", ".join(f"{k}: {v}" for k, v in changes.items())
                  + f", vram_budget: {args.gpu_mem}")
    return 0 if p.fits else 1


def cmd_smi(args) -> int:
    import time
    import urllib.request

    from .vram.accounting import machine_memory, render

    def snapshot() -> dict:
        url = args.url.rstrip("/") + "/v1/flashguard/memory"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                report = json.loads(resp.read())
            report["source"] = url
        except OSError:
            report = {"source": "this machine (no flashguard server at " + args.url + ")"}
        # the L3 folders of the server's processes (and this one's), not every flashguard process's on the machine
        report.update(machine_memory({e.get("pid") for e in report.get("engines", [])} | {os.getpid()}))
        return report

    while True:
        report = snapshot()
        if args.json:
            print(json.dumps(report, indent=1, default=str))
        else:
            from rich.console import Console

            if args.watch:
                print("\033[2J\033[H", end="")
            Console().print(f"[bold]flashguard smi[/bold] ({report['source']})")
            print(render(report))
        if not args.watch:
            return 0
        time.sleep(args.watch)


def cmd_stress(args) -> int:
    from .vram import stress

    result = stress.run(args)
    print(stress.render(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0


def cmd_train_guard(args) -> int:
    from .rails.guard_command import main as train_guard

    return train_guard(args)


def cmd_calibrate(args) -> int:
    from .rails.calibrate import main as calibrate

    return calibrate(args)


def cmd_export_guard(args) -> int:
    from .remote.guard_export import main as export_guard

    return export_guard(args)


def cmd_eval_guard(args) -> int:
    """The labelled file is read and checked whole, and the config's rails and moderation keys, before the model
    loads (rails/evaluate.py); a bad row or key is one line, exit status 2."""
    from .rails import evaluate as ev

    rows = ev.read_labelled(args.file)
    checks, _ = ev.plan(rows[:args.limit], args.rail, args.file)
    if not args.verbose:   # one log line per verdict would bury the table (-v shows them)
        logging.getLogger("flashguard").setLevel(logging.WARNING)
    rails = load_rails(args.config, check=lambda config: ev.check_config(config, sorted({r for _, r in checks}),
                                                                         args.config))
    live = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if live:
            print(f"\rjudged {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    report = ev.evaluate(rows, rails, args.rail, limit=args.limit, file=args.file, progress=progress)
    print(ev.format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(ev.report_json(report), indent=1))
        print(f"wrote {args.json} ({len(report.judged)} verdicts)")
    return 0


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
    from .vram.stress import add_arguments

    p = sub.add_parser("stress", help="drive the tiered KV cache at a context and measure it")
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
    from .rails.guard_command import add_arguments as guard_arguments

    p = sub.add_parser("train-guard", help="train the rails' guard adapter for the config's model (once per model)")
    guard_arguments(p, default_config_dir())
    p.set_defaults(func=cmd_train_guard)
    from .remote.guard_export import add_arguments as export_arguments

    p = sub.add_parser("export-guard", help="write the guard adapter as a llama.cpp LoRA GGUF (llama-server's --lora, "
                       "backend: openai)")
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
