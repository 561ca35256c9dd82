"""``ChatFlashguard``: a LangChain ``BaseChatModel`` backed by the same process-wide flashguard Engine.

For LangChain apps (``ChatFlashguard(max_tokens=64).invoke("Hi")``, ``prompt | llm | parser``, ``.stream``) and for
NeMo Guardrails' ``langchain`` framework mode (``NEMOGUARDRAILS_LLM_FRAMEWORK=langchain``; ``engine: flashguard``
is registered as a LangChain chat provider too), or ``LLMRails(config, llm=ChatFlashguard())``.

LangChain's standard parameters: ``model`` (a label, reported as ``response_metadata["model_name"]``; the weights
come from ``model_path``), ``temperature``, ``max_tokens``, ``top_p``, ``seed``, ``stop``, ``streaming`` (``invoke``
streams through the callbacks), ``timeout`` (seconds a reply may take, checked between tokens: ``TimeoutError``
past it) and ``max_retries`` (accepted for drop-in use; a local call has nothing transient to retry, so it is not
retried). No tool calling, structured output or image input (langchain-tests' properties say so).

Any other keyword is a flashguard parameter (``model_path``, ``kv``, ``weights``, ...) and is validated by
``EngineConfig.from_parameters``; a bad one is a ``ValueError`` naming it. Models with the same parameters share one
Engine with the NeMo provider, so the moderation rail finds this model's turns and pages.
"""

from __future__ import annotations

import time
from contextlib import closing
from typing import Any, AsyncIterator, Iterator, List, Optional

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from ..config import EngineConfig
from ..engine import SamplingParams, get_engine
from ..errors import YAML_PREFIX, ConfigError
from .threads import iterate_in_thread

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "chat": "user"}


class ChatFlashguard(BaseChatModel):
    model: str = "flashguard"
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[List[str]] = None
    streaming: bool = False
    timeout: Optional[float] = None
    max_retries: int = 0
    parameters: dict = Field(default_factory=dict, description="flashguard EngineConfig parameters")
    model_config = ConfigDict(arbitrary_types_allowed=True)
    _engine: Any = PrivateAttr(default=None)
    _config: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _collect_parameters(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        known = set(cls.model_fields) | {"callbacks", "tags", "metadata", "verbose", "cache", "rate_limiter",
                                         "disable_streaming", "output_version", "callback_manager", "model_name",
                                         "name"}
        params = dict(values.get("parameters") or {})
        rest = {}
        for key, value in values.items():
            if key == "model_name":
                rest["model"] = value
            elif key in known:
                rest[key] = value
            else:
                params[key] = value
        rest["parameters"] = params
        return rest

    def model_post_init(self, __context: Any) -> None:
        try:
            self._config = EngineConfig.from_parameters(self.parameters)
        except ConfigError as exc:  # say it in LangChain's terms: a keyword argument, not a config.yml path
            message = str(exc).removeprefix(YAML_PREFIX + ".")
            if "unknown key" in message:
                message += ("; LangChain parameters: model, temperature, max_tokens, top_p, seed, stop, streaming, "
                            "timeout, max_retries")
            raise ValueError(f"ChatFlashguard parameter {message}") from None
        self._engine = get_engine(self._config)

    @property
    def engine(self):
        return self._engine

    @property
    def _llm_type(self) -> str:
        return "flashguard"

    @property
    def _identifying_params(self) -> dict:
        return {"model": self.model, **self.parameters}

    # ---- LangChain hooks ------------------------------------------------------------------
    # The async hooks run the engine on a worker thread that stops (and releases the engine) as soon as the
    # consumer stops; LangChain's default async path would leave a half-read generator holding the engine lock.
    def _generate(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        text, last = [], None
        for delta in self._deltas(messages, stop, kwargs):
            text.append(delta.text)
            if run_manager and delta.text:
                run_manager.on_llm_new_token(delta.text)
            last = delta
        return self._result("".join(text), last)

    async def _agenerate(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        text, last = [], None
        async for delta in iterate_in_thread(lambda: self._deltas(messages, stop, kwargs)):
            text.append(delta.text)
            if run_manager and delta.text:
                await run_manager.on_llm_new_token(delta.text)
            last = delta
        return self._result("".join(text), last)

    def _stream(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for delta in self._deltas(messages, stop, kwargs):
            chunk = self._chunk(delta)
            if run_manager and delta.text:
                run_manager.on_llm_new_token(delta.text, chunk=chunk)
            yield chunk

    async def _astream(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for delta in iterate_in_thread(lambda: self._deltas(messages, stop, kwargs)):
            chunk = self._chunk(delta)
            if run_manager and delta.text:
                await run_manager.on_llm_new_token(delta.text, chunk=chunk)
            yield chunk

    # ---- helpers ----------------------------------------------------------------------------
    def _metadata(self, last) -> dict:
        return {"finish_reason": last.finish_reason, "model_name": self.model, "model_provider": "flashguard"}

    def _result(self, text: str, last) -> ChatResult:
        message = AIMessage(content=text, usage_metadata=_usage(last), response_metadata=self._metadata(last))
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": last.finish_reason})])

    def _chunk(self, delta) -> ChatGenerationChunk:
        last = bool(delta.finish_reason)  # usage and metadata once, on the last chunk (chunks are summed)
        return ChatGenerationChunk(message=AIMessageChunk(
            content=delta.text, usage_metadata=_usage(delta) if last else None,
            response_metadata=self._metadata(delta) if last else {}, chunk_position="last" if last else None))

    def _deltas(self, messages, stop, kwargs):
        """The engine's Deltas for ``messages``; raises ``TimeoutError`` once ``timeout`` seconds have passed."""
        params = SamplingParams.from_config(
            self._config, max_tokens=kwargs.get("max_tokens") or self.max_tokens,
            temperature=_first(kwargs.get("temperature"), self.temperature),
            top_p=_first(kwargs.get("top_p"), self.top_p), seed=_first(kwargs.get("seed"), self.seed),
            stop=stop or self.stop)
        timeout = _first(kwargs.get("timeout"), self.timeout)
        deadline = time.monotonic() + timeout if timeout is not None else None
        ids = self._engine.encode_messages([_as_dict(m) for m in messages])
        with closing(self._engine.stream(ids, params)) as deltas:
            for delta in deltas:
                yield delta
                if deadline is not None and not delta.finish_reason and time.monotonic() > deadline:
                    raise TimeoutError(f"ChatFlashguard: no complete reply within timeout={timeout} s; "
                                       "raise timeout or lower max_tokens")


def _first(*values):
    return next((v for v in values if v is not None), None)


def _as_dict(message: BaseMessage) -> dict:
    role = getattr(message, "role", None) if message.type == "chat" else _ROLES.get(message.type, message.type)
    content = message.content if isinstance(message.content, str) else "".join(
        part.get("text", "") if isinstance(part, dict) else str(part) for part in message.content)
    return {"role": _ROLES.get(role, role), "content": content}


def _usage(delta) -> Optional[UsageMetadata]:
    if delta is None:
        return None
    return UsageMetadata(input_tokens=delta.prompt_tokens, output_tokens=delta.completion_tokens,
                         total_tokens=delta.prompt_tokens + delta.completion_tokens)
