"""``ChatFlashguard``: a LangChain ``BaseChatModel`` backed by the same process-wide flashguard Engine.

For LangChain apps (``ChatFlashguard(max_tokens=64).invoke("Hi")``, ``prompt | llm | parser``, ``.stream``) and for
NeMo Guardrails' ``langchain`` framework mode (``NEMOGUARDRAILS_LLM_FRAMEWORK=langchain``; ``engine: flashguard``
is registered as a LangChain chat provider too), or ``LLMRails(config, llm=ChatFlashguard())``.

Any keyword that is not a LangChain field is a flashguard parameter (``model_path``, ``kv``, ``weights``, ...)
and is validated by ``EngineConfig.from_parameters`` (errors name the key). Models with the same parameters
share one Engine with the NeMo provider, so the moderation rail finds this model's turns and pages.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from ..config import EngineConfig
from ..engine import SamplingParams, get_engine

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "chat": "user"}


class ChatFlashguard(BaseChatModel):
    model: str = "flashguard"
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[List[str]] = None
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
        self._config = EngineConfig.from_parameters(self.parameters)
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
    def _generate(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        text, last = [], None
        for delta in self._deltas(messages, stop, kwargs):
            text.append(delta.text)
            if run_manager and delta.text:
                run_manager.on_llm_new_token(delta.text)
            last = delta
        message = AIMessage(content="".join(text), usage_metadata=_usage(last),
                            response_metadata={"finish_reason": last.finish_reason, "model_name": self.model})
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": last.finish_reason})])

    def _stream(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for delta in self._deltas(messages, stop, kwargs):
            chunk = AIMessageChunk(content=delta.text,
                                   usage_metadata=_usage(delta) if delta.finish_reason else None,
                                   response_metadata={"finish_reason": delta.finish_reason} if delta.finish_reason
                                   else {})
            if run_manager and delta.text:
                run_manager.on_llm_new_token(delta.text, chunk=ChatGenerationChunk(message=chunk))
            yield ChatGenerationChunk(message=chunk)

    # ---- helpers ----------------------------------------------------------------------------
    def _deltas(self, messages, stop, kwargs):
        params = SamplingParams.from_config(
            self._config, max_tokens=kwargs.get("max_tokens") or self.max_tokens,
            temperature=_first(kwargs.get("temperature"), self.temperature),
            top_p=_first(kwargs.get("top_p"), self.top_p), seed=_first(kwargs.get("seed"), self.seed),
            stop=stop or self.stop)
        ids = self._engine.encode_messages([_as_dict(m) for m in messages])
        return self._engine.stream(ids, params)


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
