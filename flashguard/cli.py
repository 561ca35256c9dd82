"""``flashguard`` command line: chat, generate, serve.

    flashguard chat       [--config DIR]                 interactive, streaming, through the rails
    flashguard generate   "question" [--config DIR]      one guarded answer
    flashguard serve      [--config DIR] [--host 127.0.0.1] [--port 8000]
    flashguard quantize   SRC DST [--group-size 64]       AWQ int4 checkpoint (gemm format) of a float model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path


def default_config_dir() -> str:
    """``configs/flash`` in the working folder, else the one beside the installed package (editable install)."""
    here = Path("configs/flash")
    if (here / "config.yml").is_file():
        return str(here)
    beside = Path(__file__).resolve().parent.parent / "configs" / "flash"
    return str(beside)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("flashguard").setLevel(logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_rails(config_dir: str):
    """``LLMRails`` for ``config_dir``, with a status line while the model loads."""
    from nemoguardrails import LLMRails, RailsConfig
    from rich.console import Console

    console = Console(stderr=True)
    if not Path(config_dir, "config.yml").is_file():
        raise SystemExit(f"flashguard: no config.yml in {config_dir!r}; pass --config DIR")
    with console.status(f"Loading the model of {config_dir} ..."):
        rails = LLMRails(RailsConfig.from_path(config_dir))
    return rails


async def _stream_reply(rails, messages: list[dict]) -> str:
    parts = []
    async for chunk in rails.stream_async(messages=messages):
        text = chunk if isinstance(chunk, str) else json.dumps(chunk)
        if text.startswith('{"error"'):
            err = json.loads(text)["error"]
            print(f"\n[blocked: {err.get('message', err)}]", end="", flush=True)
            return ""
        parts.append(text)
        print(text, end="", flush=True)
    print()
    return "".join(parts)


def cmd_chat(args) -> int:
    rails = load_rails(args.config)
    if not args.verbose:  # keep per-call stats lines out of the conversation (see /stats)
        logging.getLogger("flashguard").setLevel(logging.WARNING)
    print("flashguard chat: type a message; /reset clears the conversation, /stats shows counters, /quit exits.")
    messages: list[dict] = []
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            messages.clear()
            continue
        if line == "/stats":
            from flashguard import engine_stats

            print(json.dumps(engine_stats(), indent=2))
            continue
        messages.append({"role": "user", "content": line})
        print("bot> ", end="", flush=True)
        reply = asyncio.run(_stream_reply(rails, messages))
        if reply:
            messages.append({"role": "assistant", "content": reply})
        else:
            messages.pop()


def cmd_generate(args) -> int:
    rails = load_rails(args.config)
    res = rails.generate(messages=[{"role": "user", "content": args.prompt}])
    print(res["content"] if isinstance(res, dict) else res)
    return 0


def cmd_serve(args) -> int:
    import uvicorn
    from nemoguardrails.server import api

    config = os.path.abspath(args.config.rstrip("/\\"))
    if not Path(config, "config.yml").is_file():
        raise SystemExit(f"flashguard: no config.yml in {config!r}; pass --config DIR")
    api.app.rails_config_path = config
    api.set_default_config_id(os.path.basename(config))  # requests need no guardrails.config_id
    # Load the weights before the first request, so a bad model_path fails here with its message.
    load_rails(config)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"flashguard: serving on {args.host}: anyone who can reach this address can use the model; "
              "put an authenticating reverse proxy in front for a LAN", file=sys.stderr)
    from .guardrails.server import RequestBounds

    uvicorn.run(RequestBounds(api.app), host=args.host, port=args.port, log_level="info")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashguard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log NeMo Guardrails' steps too")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("chat", help="interactive guarded chat")
    p.add_argument("--config", default=default_config_dir())
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("generate", help="one guarded answer")
    p.add_argument("prompt")
    p.add_argument("--config", default=default_config_dir())
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("serve", help="the NeMo Guardrails server, bound to 127.0.0.1 by default")
    p.add_argument("--config", default=default_config_dir())
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
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
    args = parser.parse_args(argv)
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
