"""RemoteEngine: the model runs on an OpenAI-compatible server (``backend: openai``); this object renders the
conversation with the model's own tokenizer and chat template (``model_path``, the embedded model by default),
streams the reply and asks the rails' questions.

Contract (the public surface of the local ``Engine`` that the provider and the server use; the rails see
``engine/interface.py``'s ``EngineInterface``, which both implement):
- ``encode_messages`` / ``decode`` / ``tokenizer`` / ``context_length`` / ``eos_ids``: as the local engine's,
  from the same tokenizer (``encoding.MessageEncoder``); the interface's text methods over it.
- ``stream(ids, params)`` / ``generate``: one streamed completions request over ``ids``; each reply is kept in
  ``turns`` (its prompt ids, the reply's ids re-tokenized, its text) so the output rail finds it (``recent_turns``). The last Delta's
  ``prompt_tokens`` is the server's own count of the prompt it ran (``usage.prompt_tokens``; ``len(ids)`` where it
  gives none), so a reply's usage says what the server answered, not what was sent.
- ``read(ids)``: one completions request over ``ids`` with ``max_tokens: 1`` and the top ``TOP_LOGPROBS``
  log-probabilities of the next token: a ``Reading`` whose ``logprobs`` holds those (every other token at the
  lowest one listed: an upper bound, so a Yes/No verdict whose answer is not listed errs towards blocking).
  ``reused`` is what the server says it took from its prefix cache (``usage.prompt_tokens_details.cached_tokens``,
  or llama-server's ``timings.cache_n``). No hidden states: ``returns_states`` is False and the rails decide by the
  question's Yes/No log-odds (a probe needs the model's states).
- ``read(ids, adapter_from=k)``: the guard's question (rails/guard.py) with the guard adapter on from ``ids[k]`` (the
  invocation's first token): the request names the server's guard adapter (``lora``), which llama-server runs from
  there on and reuses the conversation before it from the slot's cache. ``guard`` is the ``remote.guard.RemoteGuard``
  of ``guard_adapter`` (None: no guard); every request of a conversation names it (remote/guard.py says why).
- ``keep_exact(token_ids)``: nothing to do (the server's log-probabilities are its own head's).
- ``exclusive()`` holds nothing: each call is its own request, and the server batches concurrent ones.
- Where the server reports its slots (llama-server's ``GET /props`` ``total_slots``) and ``slot_leases`` is auto,
  every request names its slot (``id_slot``) from ``slots.SlotLeases``: a turn's requests keep one slot, so the
  conversation's KV is not swapped out between them; a request waits (in this process, in arrival order, at most
  ``timeout_s``) while every slot is busy or leased.
- At start: the server must answer ``GET /models``, serve the models entry's ``model``, and return logprobs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Sequence

import numpy as np
import torch

from ..config import EngineConfig
from ..engine import loader
from ..engine.encoding import MessageEncoder
from ..engine.engine import PLAIN_CHAT_TEMPLATE, Delta, Turn, checked_prompt, context_length, joined
from ..engine.interface import EngineInterface, layers_of
from ..engine.reading import Reading
from ..engine.sampling import SamplingParams
from ..engine.stats import EngineStats
from ..errors import FlashguardError
from .. import notice
from .client import Client, RemoteError, RemoteTimeout
from . import guard as remote_guard
from . import slots

log = logging.getLogger("flashguard")


class RemoteEngine(EngineInterface):
    returns_states = False
    MISSES = 3          # rail requests in a row that reuse under half of a long prompt before the log says so
    TOP_LOGPROBS = 20   # the most llama-server, vLLM (--max-logprobs) and SGLang return by default
    RESAMPLES = 3       # reads sampled again where the server held the sampled token back (read's comment)

    def __init__(self, config: EngineConfig, model: str, source: loader.ModelSource | None = None):
        self.config, self.model_name = config, model
        self.source = source or loader.resolve_model(config.model_path, config.gguf_file)
        self.label = f"{self.source.label} @ {config.base_url}"   # (engine_stats: apart from a local engine's)
        notice.say("flashguard: %s serves %s; loading its tokenizer (%s) here", config.base_url, model,
                   self.source.label)
        self.tokenizer, self.model_config = loader.load_tokenizer(self.source)
        if getattr(self.tokenizer, "chat_template", None) is None:
            self.tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
        self.messages = MessageEncoder(self.tokenizer, config.system_prompt)
        self.context_length = context_length(self.model_config, config.max_context)
        self.eos_ids = frozenset(i for i in (self.tokenizer.eos_token_id,) if isinstance(i, int))
        self.lock = contextlib.nullcontext()   # (exclusive(): nothing to hold)
        self.adapter = None   # (lora_path is the server's business)
        self.stats = EngineStats()
        self.turns: list[Turn] = []
        self.client = Client(config.base_url, config.api_key_env, config.timeout_s)
        self._prefix_misses = 0   # long rail requests in a row that reused under half (a warning at MISSES)
        self.leases: slots.SlotLeases | None = None
        self.guard: remote_guard.RemoteGuard | None = None
        self._check_server()

    # ---- start ---------------------------------------------------------------------------
    def _check_server(self) -> None:
        served = self.client.models()
        if served and self.model_name not in served:
            raise FlashguardError(f"models[main].model: the server at {self.config.base_url} serves "
                                  f"{', '.join(repr(m) for m in served)}, not {self.model_name!r}; set model to "
                                  "one of them")
        # guard_adapter: the rails' activated LoRA, loaded by the server (--lora) and named per request (before the
        # first completions request: a server holding several activated LoRAs refuses one that names none of them)
        self.guard = remote_guard.attach(self.config, self.source, self.client)
        probe = self.tokenizer("Hello", add_special_tokens=False)["input_ids"]
        answer = self.client.complete(self._body(probe, 1, SamplingParams(max_tokens=1), logprobs=True),
                                      "a logprobs request at start")
        if not self._top_logprobs(answer):
            raise RemoteError(f"the server at {self.config.base_url} returned no logprobs for a completions "
                              f"request with logprobs: {self.TOP_LOGPROBS} (it answered {str(answer)[:200]}); the "
                              "rails read the next token's log-probabilities: use a server that returns them")
        count = self.client.slot_count() if self.config.slot_leases == "auto" else None
        if count:
            self.leases = slots.for_server(self.config.base_url, count)
            log.info("flashguard: the server has %d slots; each turn keeps one from its first request to its last "
                     "(slot_leases: auto; start llama-server with --no-cache-idle-slots, else it copies the idle "
                     "slots' KV to host RAM at every request: docs/remote.md)", count)

    @contextlib.contextmanager
    def _slot(self, ids: list[int]):
        """The slot a request over ``ids`` goes to (None: the server picks), released when the request ends."""
        if self.leases is None:
            yield None
            return
        try:
            slot = self.leases.acquire(ids, timeout=self.config.timeout_s)
        except TimeoutError as exc:
            raise RemoteTimeout(f"{exc} (this process's other requests held them); raise timeout_s or the server's "
                                "--parallel", key="timeout_s") from exc
        try:
            yield slot
        finally:
            self.leases.release(slot, ids)

    # ---- prompts -------------------------------------------------------------------------
    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        return self.messages.encode(messages)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _check_prompt(self, ids: Sequence[int]) -> list[int]:
        return checked_prompt(ids, self.context_length, len(self.tokenizer))

    def _body(self, ids: list[int], max_tokens: int, params: SamplingParams, logprobs: bool = False,
              slot: int | None = None, adapter: bool = False) -> dict:
        body = {"model": self.model_name, "prompt": ids, "max_tokens": max_tokens,
                "temperature": params.temperature, "top_p": params.top_p}
        if self.guard is not None:   # (remote/guard.py: the guard named on every request, on only where asked)
            lora = self.guard.lora(adapter or remote_guard.lacks_invocation(self.guard, ids))
            if lora is not None:
                body["lora"] = lora
        if slot is not None:
            body["id_slot"] = slot
        seed = params.seed if params.seed is not None else self.config.seed
        if seed is not None:
            body["seed"] = seed
        if params.stop:
            body["stop"] = list(params.stop)
        for key in ("frequency_penalty", "presence_penalty"):   # OpenAI's own fields
            if getattr(params, key):
                body[key] = getattr(params, key)
        if params.repetition_penalty != 1:   # vLLM's and SGLang's name, and llama-server's (over its last 64 tokens)
            body["repetition_penalty"] = body["repeat_penalty"] = params.repetition_penalty
        if logprobs:
            body["logprobs"] = self.TOP_LOGPROBS
        return body

    # ---- generation ----------------------------------------------------------------------
    def generate(self, ids: Sequence[int], params: SamplingParams, task: str = "generation") -> Delta:
        return joined(self.stream(ids, params, task=task))

    def stream(self, ids: Sequence[int], params: SamplingParams, task: str = "generation") -> Iterator[Delta]:
        ids = self._check_prompt(ids)
        max_new = min(params.max_tokens, self.context_length - len(ids))
        t0, first, parts, finish, usage = time.perf_counter(), None, [], "length", {}
        timings: dict = {}
        with self._slot(ids) as slot:
            for event in self.client.stream(self._body(ids, max_new, params, slot=slot), "the reply"):
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
                for choice in event.get("choices") or []:
                    text = choice.get("text") or ""
                    if text:
                        first = first or time.perf_counter() - t0
                        parts.append(text)
                        yield Delta(text)
                    if choice.get("finish_reason"):
                        finish = "stop" if choice["finish_reason"] == "stop" else "length"
        final = "".join(parts)
        out = self.tokenizer(final, add_special_tokens=False)["input_ids"] if final else []
        completion = int(usage.get("completion_tokens") or len(out))
        reused = self._cached(usage, timings) or 0
        yield Delta("", finish, int(usage.get("prompt_tokens") or len(ids)), completion)
        self._remember(Turn(tuple(ids), tuple(out), final))
        self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused, generated=completion,
                          seconds=time.perf_counter() - t0, first_token_s=first,
                          server_seconds=self._server_s({"timings": timings}))

    # ---- the rails' call -----------------------------------------------------------------
    def exclusive(self):
        """Nothing to hold: each request is its own, the server batches concurrent ones."""
        return contextlib.nullcontext()

    @property
    def layer_count(self) -> int:
        return layers_of(self.model_config)

    @property
    def weights_kind(self) -> str:
        """``server``: the weights are the server's (no probe is keyed by them: ``returns_states`` is False)."""
        return "server"

    def keep_exact(self, token_ids: Sequence[int]) -> None:
        """Nothing to do: the server's log-probabilities are its own head's."""

    # ---- reading --------------------------------------------------------------------------
    def read(self, ids: Sequence[int], task: str = "moderation", *, hidden: bool = False, layers=(),
             mean_from: int | None = None, keep_states: bool = False, keep: int | None = None,
             adapter_from: int | None = None, then: Sequence[int] | None = None) -> Reading:
        """The next token's log-probabilities after ``ids`` (see the module docstring); with ``adapter_from`` the
        guard adapter runs from ``ids[adapter_from]`` on. ``keep`` and ``then`` are the server's business (its prefix
        cache keeps what it keeps); hidden states cannot be read remotely."""
        if hidden or layers or mean_from is not None:
            raise FlashguardError("the openai backend returns no hidden states: the rails use the question's "
                                  "verdict there (probe: off)", key="backend")
        ids = self._check_prompt(ids)
        if adapter_from is not None:
            remote_guard.check_start(self.guard, ids, adapter_from)
        t0 = time.perf_counter()
        # temperature 1, top_p 1: the log-probabilities as the model gives them (a greedy or top-p request can come
        # back renormalised after the sampler's cut, the other answer at -inf); the sampled token is not used
        with self._slot(ids) as slot:
            body = self._body(ids, 1, SamplingParams(max_tokens=1, temperature=1.0), logprobs=True, slot=slot,
                              adapter=adapter_from is not None)
            for retry in range(self.RESAMPLES + 1):
                answer = self.client.complete(body, f"the {task} question")
                if retry == 0:   # (its cache counts are the read's: a second try finds the prompt cached)
                    first = answer
                top = self._top_logprobs(answer)
                if top or not self._held_back(answer):
                    break
                # llama-server sends no log-probabilities where the sampled token is part of a UTF-8 character (it
                # holds the text back for the next token): sample again (the prompt is in its cache by now)
                body["seed"] = int(body.get("seed") or 0) + 7919 * (retry + 1)
        if not top:
            raise RemoteError(f"the server returned no logprobs for the {task} question: {str(answer)[:200]}")
        floor = min(top.values())
        # (numpy's fill: torch's splits a vocabulary-sized fill over its threads, ~15 ms on a busy 2-core host)
        logprobs = torch.from_numpy(np.full(len(self.tokenizer), floor, dtype=np.float32))
        for token, lp in top.items():
            if 0 <= token < logprobs.numel():
                logprobs[token] = lp
        cached = self._cached(first.get("usage") or {}, first.get("timings") or {})
        reused = cached or 0
        # the output rail's request follows the turn the server just generated: a long one mostly cached, if the
        # cache is on (a server that does not report it says nothing here; the input rail's first request of a
        # conversation has nothing to reuse yet). One miss is ordinary (a streamed reply's chunk check while the
        # reply still holds its slot, a slot another conversation took over); MISSES in a row are a cache that is off
        if task == "moderation" and cached is not None and len(ids) > 256:
            self._prefix_misses = self._prefix_misses + 1 if reused < len(ids) // 2 else 0
            if self._prefix_misses == self.MISSES:
                log.warning("flashguard: the server at %s reused under half of %d rail requests' prompts in a row "
                            "(the last: %d of %d tokens): its prefix cache is not being hit (llama-server: the slots' "
                            "prompt cache, on unless --no-cache-prompt; vLLM: --enable-prefix-caching; SGLang: the "
                            "radix cache, on unless --disable-radix-cache); each rail then prefills the whole "
                            "conversation", self.config.base_url, self.MISSES, reused, len(ids))
        seconds = time.perf_counter() - t0
        self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused, generated=0,
                          seconds=seconds, first_token_s=seconds, server_seconds=self._server_s(answer))
        return Reading(logprobs=logprobs, hidden=None, mean=None, states=None, reused=reused,
                       prefilled=len(ids) - reused)

    @staticmethod
    def _held_back(answer: dict) -> bool:
        """An answer whose one token was held back as part of a UTF-8 character: no log-probabilities, no text or
        a replacement character."""
        choice = (answer.get("choices") or [{}])[0]
        return not choice.get("logprobs") and "\ufffd" in str(choice.get("text") or "\ufffd")

    @staticmethod
    def _server_s(answer: dict) -> float:
        """The server's own time for a request (llama-server's ``timings``: prompt and generation ms); 0 if none."""
        t = answer.get("timings") or {}
        try:
            return (float(t.get("prompt_ms") or 0) + float(t.get("predicted_ms") or 0)) / 1000
        except (TypeError, ValueError):
            return 0.0

    def _top_logprobs(self, answer: dict) -> dict[int, float]:
        """``{token id: logprob}`` of the first generated token's top alternatives: llama-server's form
        (``logprobs.content[0].top_logprobs``: id, token, logprob) or OpenAI's (``logprobs.top_logprobs[0]``:
        token text -> logprob; a text maps to its id where it is one token)."""
        choice = (answer.get("choices") or [{}])[0]
        lp = choice.get("logprobs") or {}
        out: dict[int, float] = {}
        content = lp.get("content") if isinstance(lp, dict) else None
        if content:
            for item in content[0].get("top_logprobs") or []:
                if isinstance(item.get("id"), int) and item.get("logprob") is not None:
                    out[item["id"]] = float(item["logprob"])
            return out
        tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
        if tops and isinstance(tops[0], dict):
            for text, value in tops[0].items():
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(ids) == 1:
                    out[ids[0]] = max(out.get(ids[0], -1e9), float(value))
        return out

    @staticmethod
    def _cached(usage: dict, timings: dict) -> int | None:
        """Prompt tokens the server took from its cache; None where it does not say (vLLM without
        --enable-prompt-tokens-details, SGLang without --enable-cache-report)."""
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if cached is None:
            cached = timings.get("cache_n")
        return None if cached is None else int(cached)

    # ---- state ---------------------------------------------------------------------------
    def reset_session(self) -> None:
        """Nothing is held here (the server's cache is its own)."""

    @property
    def session_ids(self) -> list[int]:
        return []

    def info(self) -> dict:
        return {"model": self.source.label, "backend": "openai", "base_url": self.config.base_url,
                "served_model": self.model_name, "device": "remote", "weights": "on the server",
                "context": self.context_length, "guard": None if self.guard is None else self.guard.info()}
