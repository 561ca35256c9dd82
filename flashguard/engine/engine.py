"""The Engine: one loaded model, its decode loop, and the conversation's KV cache.

Contract:
- One Engine per model identity per process (see ``registry.get_engine``); every provider,
  ``LLMRails`` and server request shares it.
- Calls are serialised by ``self.lock``: ``stream()`` holds it from its first ``next()`` until it
  is exhausted or closed, so two requests never interleave on the cache.
- The engine keeps the KV cache of the last sequence it ran (the *session*). A new call that
  starts with the same token ids reuses that prefix and prefills only the rest; this is what
  makes the next chat turn and the moderation call cheap. ``session_ids`` are exactly the
  tokens whose K/V are in the cache.
- Prefill runs in chunks of ``prefill_chunk`` tokens with ``logits_to_keep=1``, so activation
  memory does not grow with the prompt.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..config import EngineConfig
from ..errors import GpuMemoryError, PromptError
from . import loader
from .decode_step import DecodeStep
from .sampling import SamplingParams, StopMatcher, choose
from .stats import EngineStats

log = logging.getLogger("flashguard")


@dataclass(frozen=True)
class Delta:
    """A piece of streamed output. The last Delta of a call has ``finish_reason`` set."""

    text: str
    finish_reason: str | None = None  # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Turn:
    """What the engine ran for one generation: the ids it attended to and the ids it produced."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str


def cache_kwarg(model) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (older): the forward argument for the Cache."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError  # torch < 2.5: cuda's


def apply_vram_budget(budget: int | None, device: torch.device) -> float | None:
    """Cap this process's CUDA allocator at ``budget`` bytes (``vram_budget``); returns the fraction set."""
    if budget is None or device.type != "cuda":
        return None
    import warnings

    try:  # grow segments in place instead of caching whole blocks: less reserved-but-unused memory
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError):  # older torch, or a platform without expandable segments
        pass
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, budget / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("flashguard: GPU allocator capped at %.2f GiB (vram_budget) of %.2f GiB", budget / 2**30, total / 2**30)
    return fraction


class Engine:
    def __init__(self, config: EngineConfig, source: loader.ModelSource | None = None, *, model=None,
                 tokenizer=None):
        """Loads the model of ``config``; benchmarks pass an already built ``model`` and ``tokenizer``."""
        self.config = config
        self.source = source or loader.resolve_model(config.model_path, config.gguf_file)
        self.device = loader.resolve_device(config.device)
        self.dtype = loader.resolve_dtype(config.dtype, self.device)
        self.budget_fraction = apply_vram_budget(config.vram_budget, self.device)
        t0 = time.perf_counter()
        if model is not None:
            self.model, self.tokenizer = model, tokenizer
            self.dtype = next(model.parameters()).dtype
        else:
            self.model, self.tokenizer = loader.load(self.source, self.device, self.dtype, config.weights,
                                                     config.int4_kernel)
        log.info("flashguard: loaded %s on %s (%s) in %.1fs", self.source.label, self.device,
                 str(self.dtype).replace("torch.", ""), time.perf_counter() - t0)
        self.lock = threading.RLock()
        self.stats = EngineStats()
        self.context_length = self._context_length()
        self.eos_ids = self._eos_ids()
        self._cache_kwarg = cache_kwarg(self.model)
        self._use_causal_sdpa()
        self._step = DecodeStep(self.model, graphs=config.cuda_graphs and self.device.type == "cuda") \
            if DecodeStep.supports(self.model) else None
        self.session_ids: list[int] = []
        self._cache = None
        self.store = None  # the tiered cache's PageStore (cache: tiered)
        self.turns: list[Turn] = []  # recent generations, newest last (bounded)
        self.prefill_chunk = config.prefill_chunk  # halves (for good) when a chunk does not fit the GPU budget
        self.kv = config.kv                        # the tiered cache's settings, fitted to vram_budget below
        self.oom_retries = 0
        if self.budget_fraction is not None:
            self._fit_to_budget()

    # ---- prompts -------------------------------------------------------------------------
    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat (list of {role, content}) with the generation prompt appended."""
        if not messages:
            raise PromptError("the message list is empty; send at least one user message")
        msgs = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "user", "assistant", "tool"):
                raise PromptError(f"messages[{i}].role must be system, user or assistant; got {role!r}")
            if not isinstance(content, str):
                raise PromptError(f"messages[{i}].content must be a string")
            msgs.append({"role": role, "content": content})
        if self.config.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.config.system_prompt})
        if self.tokenizer.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
            return self.tokenizer(text, add_special_tokens=True)["input_ids"]
        out = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- generation ----------------------------------------------------------------------
    def generate(self, ids: Sequence[int], params: SamplingParams, task: str = "generation") -> Delta:
        """Run to completion; returns one Delta with the whole text."""
        parts, last = [], None
        for d in self.stream(ids, params, task=task):
            parts.append(d.text)
            last = d
        return Delta("".join(parts), last.finish_reason, last.prompt_tokens, last.completion_tokens)

    def stream(self, ids: Sequence[int], params: SamplingParams, task: str = "generation") -> Iterator[Delta]:
        ids = self._check_prompt(ids)
        max_new = min(params.max_tokens, self.context_length - len(ids))
        generator = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else self.config.seed
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
        stopper = StopMatcher(params.stop)
        with self.lock:
            t0 = time.perf_counter()
            logits, reused = self._prefill(ids)
            out: list[int] = []
            emitted, finish = 0, "length"
            try:
                while len(out) < max_new:
                    token = choose(logits, params, generator)
                    if token in self.eos_ids:
                        finish = "stop"
                        break
                    out.append(token)
                    text = self.decode(out)
                    cut = stopper.find(text)
                    if cut is not None:
                        finish = "stop"
                        if cut > emitted:
                            yield Delta(text[emitted:cut])
                        emitted = cut
                        break
                    safe = stopper.safe_length(text)
                    if safe > emitted:
                        yield Delta(text[emitted:safe])
                        emitted = safe
                    if len(out) < max_new:
                        logits = self._forward([token])
                text = self.decode(out)
                end = stopper.find(text)
                final = text[:end] if end is not None else text
                yield Delta(final[emitted:] if len(final) > emitted else "", finish, len(ids), len(out))
                self._remember(Turn(tuple(ids), tuple(out), final))
            finally:
                self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused,
                                  generated=len(out), seconds=time.perf_counter() - t0)

    def next_token_logprobs(self, ids: Sequence[int], task: str = "moderation") -> tuple[torch.Tensor, int]:
        """Log-probabilities of the token after ``ids`` (one forward over the unseen suffix).

        Returns ``(logprobs[vocab], reused_tokens)``.
        """
        ids = self._check_prompt(ids)
        with self.lock:
            t0 = time.perf_counter()
            logits, reused = self._prefill(ids)
            self.stats.record(task, prompt=len(ids), prefilled=len(ids) - reused, reused=reused, generated=0,
                              seconds=time.perf_counter() - t0)
            return torch.log_softmax(logits.float(), dim=-1), reused

    def teacher_force(self, prompt_ids: Sequence[int], output_ids: Sequence[int], text: str | None = None) -> Turn:
        """Run ``prompt_ids + output_ids`` through the model as if it had generated ``output_ids``.

        Records the Turn (so moderation finds its pages). Used for replayed conversations and tests.
        """
        ids = list(prompt_ids) + list(output_ids)
        self.next_token_logprobs(ids, task="generation")
        turn = Turn(tuple(prompt_ids), tuple(output_ids), text if text is not None else self.decode(output_ids))
        with self.lock:
            self._remember(turn)
        return turn

    # ---- the session cache ---------------------------------------------------------------
    def _check_prompt(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if not ids:
            raise PromptError("the prompt is empty; send at least one message with text")
        if len(ids) >= self.context_length:
            raise PromptError(
                f"the prompt is {len(ids)} tokens but the model's context is {self.context_length} tokens; "
                "shorten the conversation or raise models[main].parameters.max_context "
                "(up to the model's own limit)")
        return ids

    def _fit_to_budget(self) -> None:
        """Size the prefill chunk and the tiered window from the plan for the full context within vram_budget."""
        from ..quant.int4_linear import Int4Linear
        from ..vram import plan as planner

        weights = "int4" if any(isinstance(m, Int4Linear) for m in self.model.modules()) else "fp16"
        shape = planner.Shape.from_config(self.model.config, self.source.label)
        self.kv, self.prefill_chunk, notes = planner.fit_to_budget(
            shape, budget=self.config.vram_budget, context=self.context_length, weights=weights,
            cache=self.config.cache, prefill_chunk=self.prefill_chunk, kv=self.kv)
        for note in notes:
            log.warning("flashguard: vram_budget %.2f GiB: %s", self.config.vram_budget / 2**30, note)

    def _use_causal_sdpa(self) -> None:
        """Plain causal models run flashguard's attention function even with a DynamicCache: SDPA with a
        lower-right causal bias instead of a materialised mask (prefill chunks after the first, the
        moderation suffix)."""
        from ..kv import attention

        if attention.plain_causal(self.model.config):
            attention.register()
            self.model.set_attn_implementation(attention.NAME)

    def _new_cache(self):
        from transformers import DynamicCache

        if self.config.cache == "tiered":
            from ..kv.cache import TieredCache
            from ..kv.store import PageStore

            if self.store is None:  # one store per engine: sessions share pages by content hash
                self.store = PageStore(self.kv, pin_memory=self.device.type == "cuda")
            return TieredCache(self.model.config, self.kv, store=self.store,
                               model_id=self.source.identity).attach(self.model)
        return DynamicCache(config=self.model.config)

    def _prefill(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Bring the cache to ``ids[:-1]`` + feed the rest; returns (last logits row, reused count)."""
        reused = self._reuse_prefix(ids)
        rest = ids[reused:]
        logits = None
        a = 0
        while a < len(rest):
            chunk = self.prefill_chunk  # may shrink inside _forward after an out-of-memory
            logits = self._forward(rest[a:a + chunk])
            a += chunk
        return logits, reused

    def _reuse_prefix(self, ids: list[int]) -> int:
        common = 0
        limit = min(len(ids) - 1, len(self.session_ids))  # always feed at least one token
        while common < limit and self.session_ids[common] == ids[common]:
            common += 1
        if self._cache is None or common == 0:
            if self._cache is not None and hasattr(self._cache, "reset"):
                self._cache.reset()  # give its pages back to the store
            self._cache = self._new_cache()
            self.session_ids = []
            adopt = getattr(self._cache, "adopt_prefix", None)
            reused = adopt(ids[:-1], self.dtype, self.device) if adopt else 0
            self.session_ids = list(ids[:reused])
            return reused
        if common < len(self.session_ids):
            self._cache.crop(common - len(self.session_ids))  # negative = tokens to drop (transformers 5.17+)
            del self.session_ids[common:]
        return common

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        from ..kv.cache import PageLost

        try:
            return self._forward_fitting(tokens)
        except PageLost as exc:
            # A page failed verification (or could not be kept) and was dropped, never used: recompute the
            # whole sequence; pages before the lost one are adopted again from the store.
            ids = self.session_ids + list(tokens)
            for _ in range(3):  # pages adopted during the recompute can be found bad too; each try drops them
                log.warning("flashguard: %s; recomputing %d tokens by prefill", exc, len(ids))
                self._cache, self.session_ids = None, []
                try:
                    reused = self._adopt_all(ids)
                    logits = None
                    for a in range(reused, len(ids), self.prefill_chunk):
                        logits = self._forward_fitting(ids[a:a + self.prefill_chunk])
                    return logits
                except PageLost as again:
                    exc = again
            raise exc

    def _adopt_all(self, ids: list[int]) -> int:
        """Start a new cache for ``ids`` and adopt as many of its stored pages as exist (all of ids may match)."""
        return self._reuse_prefix(ids + [0])  # _reuse_prefix keeps one token to feed; the extra one is that token

    MIN_CHUNK = 16

    def _forward_fitting(self, tokens: list[int], retried: bool = False) -> torch.Tensor:
        """``_forward_once``, but a CUDA out-of-memory is recovered: the cache is brought back to the tokens
        before this call, the allocator's cached blocks are released, and the tokens run again in halves; the
        engine keeps the smaller prefill chunk afterwards. Only a step that does not fit at ``MIN_CHUNK`` tokens
        (or a single decode token) raises ``GpuMemoryError``, which says what to change."""
        try:
            return self._forward_once(tokens)
        except OUT_OF_MEMORY as exc:
            self.oom_retries += 1
            self._undo_partial_step()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(tokens) <= self.MIN_CHUNK:
                if len(tokens) == 1 and not retried:  # one more try after releasing the cached blocks
                    return self._forward_fitting(tokens, retried=True)
                raise GpuMemoryError(
                    f"out of GPU memory for a {len(tokens)}-token step"
                    + (f" within vram_budget {self.config.vram_budget / 2**30:.2f} GiB" if self.config.vram_budget
                       else "") + "; set models[main].parameters.weights: int4, cache: tiered with a smaller "
                    "kv.l1_tokens / kv.l1_max_tokens, a smaller prefill_chunk, or a larger vram_budget "
                    "(`flashguard plan` shows what fits)") from exc
            half = len(tokens) // 2
            self.prefill_chunk = max(self.MIN_CHUNK, min(self.prefill_chunk, half))
            log.warning("flashguard: out of GPU memory on %d tokens; retrying in chunks of %d", len(tokens), half)
            self._forward_fitting(tokens[:half])
            return self._forward_fitting(tokens[half:])

    def _undo_partial_step(self) -> None:
        """After a failed forward some layers may hold the new tokens' KV: cut every layer back to the
        tokens the engine recorded (a DynamicCache crops; a tiered cache, whose pages are keyed by content,
        restarts from its stored pages and recomputes the rest)."""
        if self._cache is None:
            return
        if hasattr(self._cache, "feed"):  # a TieredCache
            before = list(self.session_ids)
            self._cache.reset()
            self._cache, self.session_ids = None, []
            reused = self._adopt_all(before) if before else 0
            if self._cache is None:
                self._cache = self._new_cache()
            if before:
                for a in range(reused, len(before), self.MIN_CHUNK):
                    self._forward_once(before[a:a + self.MIN_CHUNK])
        elif not self.session_ids:
            self._cache = self._new_cache()
        else:  # layers before the failing one hold extra tokens: cut each layer to the recorded length
            keep = len(self.session_ids)
            for layer in getattr(self._cache, "layers", []):
                keys = getattr(layer, "keys", None)
                if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[-2] > keep:
                    layer.keys, layer.values = keys[..., :keep, :], layer.values[..., :keep, :]

    def _forward_once(self, tokens: list[int]) -> torch.Tensor:
        if hasattr(self._cache, "feed"):
            self._cache.feed(tokens)
        if len(tokens) == 1 and self._step is not None:  # a decode step: graphs (CUDA) or the lean eager path
            logits = self._step.step(tokens[0], self._cache)
            self.session_ids.extend(tokens)
            return logits
        inp = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=inp, **{self._cache_kwarg: self._cache}, use_cache=True, logits_to_keep=1)
        self.session_ids.extend(tokens)
        return out.logits[0, -1]

    def reset_session(self) -> None:
        """Drop the cached conversation (the next call prefills from scratch)."""
        with self.lock:
            self._cache, self.session_ids = None, []

    def _remember(self, turn: Turn) -> None:
        self.turns.append(turn)
        del self.turns[:-64]

    # ---- model facts ---------------------------------------------------------------------
    def _context_length(self) -> int:
        cfg = self.model.config
        n = getattr(cfg, "max_position_embeddings", None) or 2048
        if self.config.max_context:
            n = min(n, self.config.max_context)
        return int(n)

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(src)
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<end_of_turn>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return frozenset(ids)
