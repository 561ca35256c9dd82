"""One Engine per loaded model per process.

NeMo's server builds a new ``LLMRails`` (and new provider objects) for each distinct request
``model`` name; every one of them must share the weights. Engines are keyed by what identifies
the weights and how they are run (file identity, device, dtype, every key of the config but a request's sampling
defaults), never by the request's model name.
"""

from __future__ import annotations

import dataclasses
import threading

from ..config import EngineConfig
from . import loader
from .engine import Engine

_lock = threading.Lock()
_engines: dict[tuple, Engine] = {}
loads = 0  # how many times weights were loaded in this process (tests read it)


# EngineConfig keys that are each request's defaults, not how the engine is built: engines differing only there are
# one engine. Every other key is part of the engine's identity (a key added later is too, without a change here).
REQUEST_KEYS = frozenset({"max_tokens", "reasoning_tokens", "temperature", "top_p", "seed", "repetition_penalty",
                          "frequency_penalty", "presence_penalty", "no_repeat_ngram"})


def engine_key(config: EngineConfig, source: loader.ModelSource) -> tuple:
    device = loader.resolve_device(config.device)
    resolved = {"model_path": source.identity, "gguf_file": None, "device": str(device),
                "dtype": str(loader.resolve_dtype(config.dtype, device)),
                "weights": loader.choose_weights(config.weights, source, device)[0]}
    return tuple((f.name, resolved[f.name] if f.name in resolved else getattr(config, f.name))
                 for f in dataclasses.fields(config) if f.name not in REQUEST_KEYS)


_remotes: dict[tuple, object] = {}


def get_engine(config: EngineConfig, model: str = "flashguard"):
    """The process's engine for ``config``: a local ``Engine`` (one per weights and how they run), or with
    ``backend: openai`` a ``remote.engine.RemoteEngine`` (one per server, served ``model`` and tokenizer)."""
    global loads
    if config.backend == "openai":
        return _remote(config, model)
    source = loader.resolve_model(config.model_path, config.gguf_file)
    key = engine_key(config, source)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = Engine(config, source)
            loads += 1
            _engines[key] = engine
        return engine


def _remote(config: EngineConfig, model: str):
    from ..remote.engine import RemoteEngine

    key = (config.base_url, model, config.model_path, config.gguf_file, config.api_key_env, config.timeout_s,
           config.max_context, config.system_prompt, config.seed, config.slot_leases, config.guard_adapter)
    with _lock:
        engine = _remotes.get(key)
        if engine is None:
            engine = _remotes[key] = RemoteEngine(config, model)
        return engine


def all_engines() -> list[Engine]:
    """The local engines (what holds memory in this process)."""
    with _lock:
        return list(_engines.values())


def all_backends() -> list:
    """Every engine, local and remote (their task counters: ``flashguard.engine_stats``)."""
    with _lock:
        return list(_engines.values()) + list(_remotes.values())


def engine_info() -> list[dict]:
    """One dict per loaded engine: model label, device, weights and kernel, the cache kind, the VRAM budget and
    the tiers' sizes in tokens and bytes (``Engine.info``). ``flashguard.engine_info()``."""
    return [engine.info() for engine in all_engines()]
