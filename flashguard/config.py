"""Frozen configuration objects, built from a NeMo ``config.yml`` ``parameters:`` mapping.

``EngineConfig.from_parameters(params)`` is the one entry point. Unknown keys are errors
that name the key (``models[main].parameters.<key>``); values are type-checked here so
that nothing downstream validates input with asserts.

Example ``config.yml``::

    models:
      - type: main
        engine: flashguard
        model: flashguard            # a label; the weights are chosen by model_path
        parameters:
          model_path: /models/DeepSeek-R1-Distill-Qwen-1.5B   # HF folder or .gguf; omit for the embedded default
          max_tokens: 256
          kv:
            policy: sparse
            l1_tokens: 4096
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from .errors import ConfigError

POLICIES = ("exact", "sparse")
KV_CACHES = ("tiered", "dynamic")
_AUTO_SIZES = ("l1_tokens", "l2_tokens", "l1_max_tokens")   # kv keys that take ``auto``
INT4_KERNELS = ("auto", "triton", "cuda", "cpu", "dequant")   # "auto" + Int4Linear's backends
LM_HEADS = ("auto", "float", "int8", "int4")   # the lm_head key (quant/lm_head.py)
L1_CODECS = ("auto", "fp16", "int8")
L2_CODECS = ("int8", "fp16")
L3_CODECS = ("int4-zstd", "int8-zstd", "fp16-zstd")


@dataclass(frozen=True)
class CacheConfig:
    """The tiered, paged KV cache (YAML: ``parameters.kv``).

    page_size      tokens per page; the unit of GPU residency, hashing, transfer and compression.
    l1_tokens      the pool: tokens kept on the compute device in fp16/bf16 (the L1 tier: the attention sinks and
                   the recent window). None (YAML ``auto``, the default) sizes it at start: the whole context when
                   it fits the VRAM budget (then every page stays resident and attention is one fused kernel
                   call, as fast as a plain resident cache), else what the budget leaves after the weights.
    sink_tokens    first tokens always kept in L1 (attention sinks).
    l1_codec       how the pool holds K/V: "fp16" (the model's 16-bit dtype), "int8" (codes + a scale per 32
                   channels, as llama.cpp's q8_0: ~1.9x the tokens in the same memory, decoded inside the attention
                   kernel, slower per token), or "auto" (the default): int8 on a GPU where it makes the whole
                   context resident and a 16-bit pool would not, else fp16.
    l2_tokens      tokens kept in host RAM (int8 by default) before pages spill to disk. None (YAML ``auto``, the
                   default): the whole context, or what half of the host RAM available at start holds if less.
    l3_tokens      tokens kept on disk (int4 + zstd); 0 disables L3.
    l3_dir         folder for L3 pages; None means a private folder in the user's temp dir.
    policy         "exact": attend to every page; "sparse": Quest-style top pages within budget_tokens.
    budget_tokens  sparse policy: tokens of off-window pages each KV head picks per query (Quest); a query attends
                   their union topped up to kv_heads x budget_tokens (a fixed count).
    adaptive_l1    grow/shrink the L1 window with how far back recent queries reached.
    l1_max_tokens  upper bound of the adaptive L1 window; None (``auto``): l1_tokens plus the sparse hot set.
    l2_codec       "int8" (per-channel keys, per-token values, as KIVI) or "fp16" (lossless).
    l3_codec       "int4-zstd", "int8-zstd" or "fp16-zstd" (lossless).
    isolation_salt mixed into every page key; pages never cross salts (tenants, configs).
    l3_encrypt     seal L3 files with AES-256-GCM under a key held only in memory (else a BLAKE2b checksum).
    zero_copy      on CUDA, sparse decoding picks its pages on the GPU and reads them straight from pinned host
                   RAM (kv/uva.py, needs Triton); false uses the host gather and the hot set.
    peer_gpus      the peer-GPU tier (kv/peer.py): other GPUs of this host that hold the conversation's off-window
                   pages and attend them (exact policy, merged by log-sum-exp): a list of GPU indices (``[1]``) or a
                   count (the next GPUs after the engine's). None (the default): no peers. Checked against the host
                   at engine start.
    """

    page_size: int = 64
    l1_tokens: int | None = None
    sink_tokens: int = 64
    l1_codec: str = "auto"
    l2_tokens: int | None = None
    l3_tokens: int = 1 << 20
    l3_dir: str | None = None
    policy: str = "sparse"
    budget_tokens: int = 2048
    adaptive_l1: bool = True
    l1_max_tokens: int | None = None
    l2_codec: str = "int8"
    l3_codec: str = "int4-zstd"
    isolation_salt: str = ""
    l3_encrypt: bool = True
    zero_copy: bool = True
    peer_gpus: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.peer_gpus is not None:
            object.__setattr__(self, "peer_gpus", _peer_gpus(self.peer_gpus))
        _check_choice(self.policy, POLICIES, "kv.policy")
        _check_choice(self.l1_codec, L1_CODECS, "kv.l1_codec")
        _check_choice(self.l2_codec, L2_CODECS, "kv.l2_codec")
        _check_choice(self.l3_codec, L3_CODECS, "kv.l3_codec")
        for name in ("page_size", "l1_tokens", "budget_tokens", "l1_max_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"must be a positive integer, got {value!r}", key=f"kv.{name}")
        for name in ("sink_tokens", "l2_tokens", "l3_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"must be >= 0, got {value!r}", key=f"kv.{name}")
        if self.l1_tokens is not None and self.l1_tokens < self.page_size:
            raise ConfigError(
                f"must be at least kv.page_size ({self.page_size}), got {self.l1_tokens}", key="kv.l1_tokens"
            )
        if self.l1_max_tokens is not None and self.l1_max_tokens < (self.l1_tokens or 0):
            raise ConfigError(
                f"must be >= kv.l1_tokens ({self.l1_tokens}), got {self.l1_max_tokens}", key="kv.l1_max_tokens"
            )

    @property
    def sized(self) -> bool:
        """True when no size is left to ``auto`` (``kv.policy.size_tiers`` fills them in at engine start)."""
        return None not in (self.l1_tokens, self.l2_tokens, self.l1_max_tokens) and self.l1_codec != "auto"

    def replace(self, **changes: Any) -> "CacheConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class EngineConfig:
    """One loaded model and how it generates (YAML: ``models[main].parameters``).

    model_path     HF folder or GGUF file; None (default) = the embedded SmolLM2-135M-Instruct.
    gguf_file      GGUF file name inside model_path, when model_path is a folder with several.
    device         "auto" (CUDA when present, else CPU), "cpu", "cuda" or "cuda:N".
    dtype          "auto" (fp16/bf16 on GPU, fp32 on CPU), "float32", "float16", "bfloat16".
    max_tokens     default cap on generated tokens per call (the answer's; see reasoning_tokens).
    reasoning_tokens  room for a reasoning model's ``<think>...</think>`` block on top of max_tokens (the call's
                   cap is their sum); None (``auto``, default) = 2048 when the chat template writes ``<think>``
                   (DeepSeek-R1 distills), else 0.
    temperature    0 = greedy (default); > 0 samples.
    top_p          nucleus sampling mass when sampling.
    seed           sampling seed for reproducible sampled output; None = random.
    repetition_penalty  each token the reply already holds has its logit divided by this where positive, multiplied
                   where negative (transformers' and llama.cpp's definition, over the reply's own tokens, not the
                   prompt's); 1 = off. The default, 1.1, stops most of a small model's loops: of 40 everyday prompts
                   the embedded 135M model's greedy replies ran 16 into max_tokens repeating a 4-gram, 3 with
                   it, and read better or the same in 35 of the 40 (docs/benchmarks/replies.md; 1.2 looped in none but
                   broke code and lists). A request's ``repetition_penalty`` (the server's field, LLMRails'
                   ``llm_params``) overrides it; with ``backend: openai`` the server applies its own (llama-server's
                   ``repeat_penalty`` counts its last 64 tokens, the prompt's included).
    frequency_penalty  OpenAI's: subtracted from a token's logit once per time the reply holds it; 0 = off
                   (default); -2 to 2.
    presence_penalty   OpenAI's: subtracted from the logit of every token the reply holds; 0 = off (default); -2 to 2.
    no_repeat_ngram  a token that would repeat an n-gram of this many tokens the reply already holds is never chosen
                   (transformers' no_repeat_ngram_size); 0 = off (default).
    prefill_chunk  tokens per prefill forward pass (bounds activation memory). None (YAML ``auto``, the default):
                   2048 on a GPU (a 32K-token prompt then prefills at llama.cpp's rate, docs/benchmarks/e2e.md;
                   the budget planner halves it when memory is short), 512 on the CPU.
    max_context    cap on prompt + generation tokens; None = the model's own context length.
    kv_cache       "tiered" (default: flashguard's memory-aware TieredCache, resident on the device while the
                   context fits the budget, paged to host RAM and disk past it) or "dynamic" (transformers'
                   DynamicCache, every token on the device). Not ``cache``: NeMo Guardrails 0.24 rejects a model
                   parameter of that name.
    kv             CacheConfig for the tiered cache.
    vram_budget    bytes (or "4GiB") the engine may use on the GPU; "auto" (default) = the GPU's free memory at
                   start minus ``VRAM_MARGIN``; None = no cap. Ignored on the CPU.
    weights        "auto" (default), "float" (as stored) or "int4": a GGUF's Q4_0 / Q4_1 / Q4_K matrices load
                   straight into Int4Linear (seconds; quant/gguf_load.py); a float model is AWQ-quantized once
                   (group size 64) and cached in the user cache folder; an AWQ checkpoint is always loaded in int4.
                   auto = int4 for such a GGUF on the CPU (the faster decode, nothing converted), else as stored
                   (engine/loader.py ``choose_weights``; the start-up line and ``engine_info()`` say which).
    lm_head        "auto" (default), "float" (16-bit), "int8" or "int4": the output matrix, which every decoded token
                   reads whole (quant/lm_head.py). int8: llama.cpp's Q8_0 codes (a scale per 32), 0.6x the bytes of a
                   16-bit head; int4: int4 codes (0.3x), the top 1,024 logits a token recomputed from the head's own
                   rows, kept in host RAM (on a GPU it needs zero-copy reads, i.e. Triton; the greedy token is the
                   exact head's). auto = with an int4 decoder, the fastest of those the device can hold, timed at
                   start (or the fewest GPU bytes when the budget is tight), else 16-bit. A head the file holds in
                   Q4 keeps its codes; one in Q8_0 too, unless the model holds its matrix in float (a GGUF's tied
                   table), which int4 (or auto, where faster) reads. The start-up log, ``engine_info()`` and
                   ``flashguard smi`` say which and why.
    int4_kernel    "auto" (the fastest the device runs), "triton" (flashguard's Triton kernels, CUDA), "cuda"
                   (torch's tinygemm, compute capability >= 8.0), "cpu" (torch's CPU kernel) or "dequant" (any device).
    cuda_graphs    record one-token decode steps of Llama/Qwen2 models as CUDA graphs (engine/decode_step.py);
                   false runs the same steps eagerly.
    system_prompt  system message used when the conversation has none; None = the template's default.
    lora_path      a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) applied on top of the
                   float or int4 linears (engine/lora.py); None = the base model alone. Its content keys the KV pages.
    guard_adapter  the rails' guard: an activated LoRA folder (PEFT files with ``alora_invocation_tokens`` and
                   flashguard's ``guard.json``) that runs only on the rails' suffixes, over the conversation's own
                   pages (engine/alora.py, rails/guard.py). "auto" (default): the one made for this model if there is
                   one (shipped for the embedded SmolLM2; ``flashguard train-guard`` writes one to the user cache);
                   "off": none (the rails decide by probe or question); or a folder's path. A guard for another
                   model, or a corrupt one, is an error naming this key, never a silent fall back. With ``backend:
                   openai`` the server runs it: ``flashguard export-guard`` writes it as a GGUF for llama-server's
                   ``--lora-scaled guard.gguf:0``, and the rails name it per request (remote/guard.py); a folder the
                   server lacks is an error naming this key, ``auto`` says so once and runs without it.
    backend        "local" (default: this process runs the model) or "openai": an OpenAI-compatible server runs it
                   (llama-server, vLLM, SGLang; flashguard/remote/): the requests name the models entry's ``model``,
                   and the model's tokenizer and chat template (``model_path``) render the conversation here, so the
                   server's prefix cache serves the rails' requests from the conversation's own KV.
    base_url       the server's OpenAI API root, e.g. http://127.0.0.1:8080/v1 (backend: openai).
    api_key_env    the name of an environment variable holding the server's API key (never the key itself: it stays
                   out of config.yml and the logs); None sends no key.
    timeout_s      seconds a remote request may take before it fails with an error naming this key.
    slot_leases    "auto" (default): where the server reports its slots (llama-server), a turn's requests (the rails'
                   questions and the reply) keep one slot, so another conversation's request cannot swap the
                   conversation's KV out between them (flashguard/remote/slots.py); "off": the server picks a slot
                   for each request (e.g. a server other programs share).
    """

    model_path: str | None = None
    gguf_file: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_tokens: int = 256
    reasoning_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram: int = 0
    prefill_chunk: int | None = None
    max_context: int | None = None
    kv_cache: str = "tiered"
    kv: CacheConfig = field(default_factory=CacheConfig)
    vram_budget: int | str | None = "auto"
    weights: str = "auto"
    lm_head: str = "auto"
    int4_kernel: str = "auto"
    cuda_graphs: bool = True
    system_prompt: str | None = None
    lora_path: str | None = None
    guard_adapter: str = "auto"
    backend: str = "local"
    base_url: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 120.0
    slot_leases: str = "auto"

    def __post_init__(self) -> None:
        if self.model_path is not None:
            object.__setattr__(self, "model_path", os.path.expanduser(str(self.model_path)))
        if self.lora_path is not None:
            object.__setattr__(self, "lora_path", os.path.expanduser(str(self.lora_path)))
        if isinstance(self.guard_adapter, bool) or self.guard_adapter is None:   # YAML 1.1 reads a bare off as false
            object.__setattr__(self, "guard_adapter", "auto" if self.guard_adapter else "off")
        if self.guard_adapter not in ("auto", "off"):
            object.__setattr__(self, "guard_adapter", os.path.expanduser(str(self.guard_adapter)))
        _check_choice(self.dtype, ("auto", "float32", "float16", "bfloat16"), "dtype")
        _check_choice(self.kv_cache, KV_CACHES, "kv_cache")
        if isinstance(self.vram_budget, str) and self.vram_budget != "auto":
            object.__setattr__(self, "vram_budget", parse_bytes(self.vram_budget, key="vram_budget"))
        _check_choice(self.weights, ("auto", "float", "int4"), "weights")
        _check_choice(self.lm_head, LM_HEADS, "lm_head")
        _check_choice(self.int4_kernel, INT4_KERNELS, "int4_kernel")
        if not (self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:")):
            raise ConfigError(f"must be auto, cpu, cuda or cuda:N, got {self.device!r}", key="device")
        if self.max_tokens <= 0:
            raise ConfigError(f"must be a positive integer, got {self.max_tokens!r}", key="max_tokens")
        if self.reasoning_tokens is not None and self.reasoning_tokens < 0:
            raise ConfigError(f"must be auto or an integer >= 0, got {self.reasoning_tokens!r}", key="reasoning_tokens")
        if self.temperature < 0:
            raise ConfigError(f"must be >= 0, got {self.temperature!r}", key="temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.top_p!r}", key="top_p")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"must be > 0 (1 is off), got {self.repetition_penalty!r}", key="repetition_penalty")
        for key in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, key) <= 2:
                raise ConfigError(f"must be in [-2, 2] (0 is off), got {getattr(self, key)!r}", key=key)
        if self.no_repeat_ngram < 0:
            raise ConfigError(f"must be an integer >= 0 (0 is off), got {self.no_repeat_ngram!r}", key="no_repeat_ngram")
        if self.prefill_chunk is not None and self.prefill_chunk <= 0:
            raise ConfigError(f"must be a positive integer, got {self.prefill_chunk!r}", key="prefill_chunk")
        if self.max_context is not None and self.max_context <= 0:
            raise ConfigError(f"must be a positive integer, got {self.max_context!r}", key="max_context")
        _check_choice(self.backend, ("local", "openai"), "backend")
        if self.backend == "openai":
            if not self.base_url or not str(self.base_url).startswith(("http://", "https://")):
                raise ConfigError(f"backend: openai needs the server's URL, e.g. http://127.0.0.1:8080/v1; got "
                                  f"{self.base_url!r}", key="base_url")
            object.__setattr__(self, "base_url", str(self.base_url).rstrip("/"))
        _check_choice(self.slot_leases, ("auto", "off"), "slot_leases")
        if self.timeout_s <= 0:
            raise ConfigError(f"must be a positive number of seconds, got {self.timeout_s!r}", key="timeout_s")

    # The provider receives NeMo's own kwargs beside the user's parameters.
    _NEMO_KEYS = frozenset({"mode", "api_key"})

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any] | None) -> "EngineConfig":
        """Build from a ``parameters:`` mapping; unknown keys and wrong types are ConfigErrors."""
        params = {k: v for k, v in dict(params or {}).items() if k not in cls._NEMO_KEYS}
        if "cache" in params:
            raise ConfigError("renamed to kv_cache (NeMo Guardrails rejects a model parameter named cache)",
                              key="cache")
        kv = params.pop("kv", None)
        if params.get("reasoning_tokens") == "auto":
            params["reasoning_tokens"] = None
        if params.get("prefill_chunk") == "auto":
            params["prefill_chunk"] = None
        for key in ("slot_leases", "guard_adapter"):   # YAML 1.1 reads a bare off / on as a boolean
            if isinstance(params.get(key), bool):
                params[key] = "auto" if params[key] else "off"
        if params.get("vram_budget") not in (None, "auto"):
            params["vram_budget"] = parse_bytes(params["vram_budget"], key="vram_budget")
        values = _typed_values(cls, params, prefix="", skip={"kv"})
        if kv is not None:
            if not isinstance(kv, Mapping):
                raise ConfigError(f"must be a mapping, got {type(kv).__name__}", key="kv")
            kv = {k: (None if v == "auto" and k in _AUTO_SIZES else v) for k, v in kv.items()}
            values["kv"] = CacheConfig(**_typed_values(CacheConfig, kv, prefix="kv."))
        return cls(**values)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def main_parameters(doc: Any) -> dict:
    """``models[type: main].parameters`` of a loaded config.yml document (``{}`` where it has none)."""
    models = doc.get("models") if isinstance(doc, Mapping) else None
    main = next((m for m in models or [] if isinstance(m, Mapping) and m.get("type") == "main"), {})
    return dict(main.get("parameters") or {})


def _check_choice(value: Any, choices: tuple, key: str) -> None:
    if value not in choices:
        raise ConfigError(f"must be one of {', '.join(map(str, choices))}; got {value!r}", key=key)


def _peer_gpus(value: Any, key: str = "kv.peer_gpus") -> int | tuple[int, ...]:
    """A count (a positive integer) or GPU indices (a non-empty list of distinct integers >= 0), as a tuple."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"must be a positive count or a list of GPU indices, got {value!r}", key=key)
        return value
    if isinstance(value, (list, tuple)) and value and \
            all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        if len(set(value)) != len(value):
            raise ConfigError(f"lists a GPU twice: {list(value)}", key=key)
        return tuple(value)
    raise ConfigError(f"must be a count or a list of GPU indices like [1], got {value!r}", key=key)


def _typed_values(cls: type, params: Mapping[str, Any], *, prefix: str, skip: frozenset | set = frozenset()) -> dict:
    known = {f.name: f for f in fields(cls) if not f.name.startswith("_") and f.name not in skip}
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in known:
            hint = ", ".join(sorted([*known, *skip]))
            raise ConfigError(f"unknown key {key!r}; known keys are: {hint}", key=f"{prefix}{key}")
        out[key] = _coerce(value, known[key], f"{prefix}{key}")
    return out


def _coerce(value: Any, f: dataclasses.Field, key: str) -> Any:
    default = f.default if f.default is not dataclasses.MISSING else None
    kind = type(default) if default is not None else None
    if f.name == "vram_budget" and (value is None or value == "auto"):
        return value   # None: no cap; "auto": sized from the GPU's free memory at start
    if value is None:
        if default is None:
            return None
        raise ConfigError("must not be empty", key=key)
    if f.name == "peer_gpus":
        return _peer_gpus(value, key)
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"must be true or false, got {value!r}", key=key)
    if kind is int and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"must be an integer, got {value!r}", key=key)
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"must be a number, got {value!r}", key=key)
        return float(value)
    if f.name in ("seed", "max_context", "vram_budget", "prefill_chunk", "reasoning_tokens", *_AUTO_SIZES):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"must be an integer, got {value!r}", key=key)
        return value
    if not isinstance(value, str):
        raise ConfigError(f"must be a string, got {value!r}", key=key)
    return value


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: Any, *, key: str = "vram_budget") -> int:
    """``4GiB`` / ``3.5 GB`` / ``4294967296`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"must be a size like 4GiB, got {value!r}", key=key)
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    if unit not in _UNITS or not num:
        raise ConfigError(f"must be a size like 4GiB or 3.5GB, got {value!r}", key=key)
    try:
        return int(float(num) * _UNITS[unit])
    except ValueError:
        raise ConfigError(f"must be a size like 4GiB or 3.5GB, got {value!r}", key=key) from None
