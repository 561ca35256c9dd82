"""Errors a user can act on.

Every error here says what to change. Errors about configuration name the YAML key
(``models[main].parameters.<key>``). ``status_code`` is read by NeMo Guardrails'
server (``llm_call`` copies it into ``LLMCallException.status``), so bad input is
answered as a 4xx instead of a 500.
"""

from __future__ import annotations

YAML_PREFIX = "models[main].parameters"


class FlashguardError(ValueError):
    """Base class. A ``ValueError`` so that NeMo's config loading reports it as a 400."""

    status_code = 400

    def __init__(self, message: str, *, key: str | None = None):
        self.key = key
        if key:
            message = f"{YAML_PREFIX}.{key}: {message}"
        super().__init__(message)


class ConfigError(FlashguardError):
    """A `parameters:` value is unknown, of the wrong type or out of range."""


class ModelLoadError(FlashguardError):
    """The model could not be found, read, or is not a causal language model."""


class PromptError(FlashguardError):
    """The prompt cannot be served: empty, malformed, or longer than the model's context."""


class GpuMemoryError(FlashguardError):
    """The step does not fit the GPU memory budget even after shrinking the prefill chunk."""

    status_code = 507
