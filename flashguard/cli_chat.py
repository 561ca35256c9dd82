"""The commands that run the config's rails: ``flashguard chat``, ``generate``, ``serve`` and ``eval-guard``.

Contract:
- ``load_rails(config_dir, check)``: NeMo's ``LLMRails`` of a config folder (a bad YAML file or field is one
  ConfigError naming it; ``check(rails_config)`` runs before the model loads). ``RailsLoading``: the same on a
  thread, so that ``chat`` prompts while the weights load.
- ``cmd_chat`` / ``cmd_generate`` / ``cmd_serve`` / ``cmd_eval_guard(args)``: the commands as cli.py parses them;
  each returns the exit status (``generate``: ``BLOCKED_EXIT`` when a rail blocked the prompt or the reply).
- ``llm_params(args)``: the command line's sampling as NeMo's ``llm_params``; ``cut_note(usage)``: the line that
  says a reply stopped at max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path


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
    """The line that says a reply stopped at max_tokens (``usage``: the call's ``guardrails.usage.usage_scope``)."""
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
        from .guardrails.usage import usage_scope

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

    from .guardrails.usage import usage_scope

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


def cmd_eval_guard(args) -> int:
    """The labelled file is read and checked whole, and the config's rails and moderation keys, before the model
    loads (rails/lab/evaluate.py); a bad row or key is one line, exit status 2."""
    from .rails.lab import evaluate as ev

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
