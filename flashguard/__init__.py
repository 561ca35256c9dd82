"""flashguard: a guarded local chatbot (NeMo Guardrails) on a small GPU.

Public names:
    EngineConfig, CacheConfig   frozen configuration (built from config.yml ``parameters:``)
    get_engine(config)          the process-wide Engine for a model
    engine_stats()              cumulative counters by task for every loaded engine
    engine_info()               per loaded engine: model, device, weights, cache kind, budget, tier sizes
    TieredCache                 the tiered, paged KV cache (a transformers Cache)
    ChatFlashguard              the engine as a LangChain chat model (the ``[langchain]`` extra)
    register()                  register the ``flashguard`` engine with NeMo Guardrails
"""

import os

# OpenMP threads that sleep when idle instead of spinning (set before torch loads, where flashguard is imported
# first: LLMRails with configs/flash, the server); a user's own setting wins. Spinning threads on cores other work
# shares made decoding and the rails' checks several times slower (docs/benchmarks/startup.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .config import CacheConfig, EngineConfig  # noqa: E402
from .errors import ConfigError, FlashguardError, ModelLoadError, PromptError  # noqa: E402

__version__ = "0.1.0"


def get_engine(config: EngineConfig | None = None):
    from .engine.registry import get_engine as _get

    return _get(config or EngineConfig())


def engine_stats() -> dict:
    """``{model label: {task: counters}}`` for every engine loaded in this process."""
    from .engine.registry import all_backends

    return {e.label: e.stats.as_dict() for e in all_backends()}


def engine_info() -> list[dict]:
    """Per loaded engine: model label, device, weights and kernel, cache kind, VRAM budget, and the pool / L1 /
    L2 / L3 sizes in tokens and bytes."""
    from .engine.registry import engine_info as _info

    return _info()


def register() -> None:
    from .guardrails.provider import register as _register

    _register()


def __getattr__(name):
    if name == "TieredCache":
        from .kv.cache import TieredCache

        return TieredCache
    if name == "ChatFlashguard":
        try:
            from .guardrails.langchain_chat import ChatFlashguard
        except ImportError as exc:
            raise ImportError("ChatFlashguard needs langchain-core: pip install 'flashguard[langchain]'") from exc
        return ChatFlashguard
    raise AttributeError(name)


__all__ = ["CacheConfig", "EngineConfig", "ConfigError", "FlashguardError", "ModelLoadError", "PromptError",
           "get_engine", "engine_stats", "engine_info", "register", "TieredCache", "ChatFlashguard"]
