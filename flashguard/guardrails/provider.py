"""The NeMo Guardrails provider: ``engine: flashguard`` in ``config.yml``.

``FlashGuardModel`` meets NeMo's ``LLMModel`` protocol (``nemoguardrails.types``): ``generate_async``,
``stream_async`` (an async generator of ``LLMResponseChunk``), ``model_name``, ``provider_name``,
``provider_url``. NeMo builds it as ``FlashGuardModel(model=<name>, mode=..., **parameters)``.

The request's model name is only a label: the weights come from ``parameters.model_path``, and one
Engine per model is shared by every provider object in the process.

Work runs on a worker thread (the engine's decode loop is synchronous); the event loop stays free.

A reasoning model's ``<think>...</think>`` block is split off as it streams (``flashguard/reasoning.py``): NeMo
gets it as ``LLMResponse.reasoning`` / ``LLMResponseChunk.delta_reasoning`` and the answer as the content, and
the call may generate ``reasoning_tokens`` more than ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, AsyncIterator, List, Optional, Union

from ..config import EngineConfig
from ..engine import Engine, SamplingParams, get_engine
from ..errors import FlashguardError, PromptError
from ..reasoning import ThinkSplitter, prompt_opens_think, reasoning_budget, reasoning_sink, writes_reasoning
from ..engine.encoding import as_message
from .threads import iterate_in_thread
from .usage import record_call, record_error

log = logging.getLogger("flashguard")

PROVIDER_NAME = "flashguard"
_IGNORED_PARAMS = frozenset({"n", "user", "logprobs", "tools", "tool_choice", "parallel_tool_calls"})
# a call's sampling keys (NeMo's ``llm_params``, the server's request fields): SamplingParams.from_config's
SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "seed", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "no_repeat_ngram")


class FlashGuardModel:
    """A NeMo ``LLMModel`` backed by the process-wide flashguard Engine."""

    def __init__(self, model: str = "flashguard", **parameters: Any):
        self.config = EngineConfig.from_parameters(parameters)
        self._model_name = model or "flashguard"
        self.engine: Engine = get_engine(self.config, self._model_name)   # (a RemoteEngine with backend: openai)

    # -- LLMModel protocol ------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def provider_name(self) -> Optional[str]:
        return PROVIDER_NAME

    @property
    def provider_url(self) -> Optional[str]:
        return None

    async def generate_async(self, prompt, *, stop: Optional[List[str]] = None, **kwargs):
        from nemoguardrails.types import LLMResponse, UsageInfo

        parts, thoughts, last = [], [], None
        async for reasoning, answer, d in self._deltas(prompt, stop, kwargs):
            parts.append(answer)
            thoughts.append(reasoning)
            last = d
        usage = UsageInfo(input_tokens=last.prompt_tokens, output_tokens=last.completion_tokens,
                          total_tokens=last.prompt_tokens + last.completion_tokens)
        return LLMResponse(content="".join(parts), reasoning="".join(thoughts).strip() or None, model=self._model_name,
                           finish_reason=last.finish_reason, usage=usage)

    async def stream_async(self, prompt, *, stop: Optional[List[str]] = None, **kwargs) -> AsyncIterator:
        from nemoguardrails.types import LLMResponseChunk, UsageInfo

        async for reasoning, answer, d in self._deltas(prompt, stop, kwargs):
            usage = None
            if d.finish_reason:
                usage = UsageInfo(input_tokens=d.prompt_tokens, output_tokens=d.completion_tokens,
                                  total_tokens=d.prompt_tokens + d.completion_tokens)
            if answer or reasoning or d.finish_reason:
                yield LLMResponseChunk(delta_content=answer, delta_reasoning=reasoning or None,
                                       model=self._model_name, finish_reason=d.finish_reason, usage=usage)

    # -- helpers ----------------------------------------------------------------------------
    def prompt_ids(self, prompt: Union[str, list]) -> list[int]:
        """Token ids for a NeMo prompt: a string (sent as one user message) or a list of chat messages."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("the prompt is empty; send a message with text")
            return self.engine.encode_messages([{"role": "user", "content": prompt}])
        if not isinstance(prompt, list):
            raise PromptError(f"the prompt must be a string or a list of messages, got {type(prompt).__name__}")
        return self.engine.encode_messages([as_message(m) for m in prompt])

    def sampling(self, stop: Optional[List[str]], kwargs: dict) -> SamplingParams:
        unknown = set(kwargs) - {*SAMPLING_KEYS, "stop"} - _IGNORED_PARAMS
        if unknown:
            log.debug("flashguard: ignoring generation parameters %s", sorted(unknown))
        stop = kwargs.get("stop", stop)
        if isinstance(stop, str):
            stop = [stop]
        return SamplingParams.from_config(self.config, stop=stop, **{k: kwargs.get(k) for k in SAMPLING_KEYS})

    async def _deltas(self, prompt, stop, kwargs):
        """``(reasoning, answer, delta)`` per engine Delta: a reasoning model's ``<think>`` text apart from the
        answer (both "" for a model that does not reason)."""
        params = self.sampling(stop, kwargs)
        reasons = writes_reasoning(self.engine.tokenizer)
        budget = reasoning_budget(self.config, self.engine.tokenizer)
        if budget:
            params = dataclasses.replace(params, max_tokens=params.max_tokens + budget)
        sink = reasoning_sink.get()
        try:
            ids = await asyncio.to_thread(self.prompt_ids, prompt)
            splitter = ThinkSplitter(inside=prompt_opens_think(self.engine.tokenizer, ids)) if reasons else None
            async for d in iterate_in_thread(lambda: self.engine.stream(ids, params)):
                if d.finish_reason:  # the call's last Delta: count it toward the server request, if any
                    record_call(d.prompt_tokens, d.completion_tokens, d.finish_reason)
                if splitter is None:
                    yield "", d.text, d
                    continue
                reasoning, answer = splitter.feed(d.text)
                if d.finish_reason:
                    more_reasoning, more_answer = splitter.finish()
                    reasoning, answer = reasoning + more_reasoning, answer + more_answer
                if reasoning and sink is not None:
                    sink(reasoning)
                yield reasoning, answer, d
        except FlashguardError as exc:  # NeMo's streaming turns it into a bare error frame: keep it for the server
            record_error(exc)
            raise


USAGE_STATS = "NEMO_GUARDRAILS_NO_USAGE_STATS"


def register() -> None:
    """Register ``engine: flashguard`` with NeMo Guardrails (idempotent). NeMo Guardrails 0.24 reports usage to
    NVIDIA over HTTPS when ``LLMRails`` starts and every 10 minutes after (``nemoguardrails/telemetry.py``); a
    local chatbot sends nothing anywhere, so registering sets ``NEMO_GUARDRAILS_NO_USAGE_STATS=1`` unless the
    variable is set already (``=0`` keeps NeMo's reports). configs/flash registers in its config.py, which NeMo
    loads before it reports."""
    import os

    os.environ.setdefault(USAGE_STATS, "1")
    from nemoguardrails.llm.frameworks.registry import get_default_framework
    from nemoguardrails.llm.providers import register_provider

    if get_default_framework() == "langchain":  # NEMOGUARDRAILS_LLM_FRAMEWORK=langchain: a LangChain chat model
        try:
            from .langchain_chat import ChatFlashguard
        except ImportError as exc:
            raise ImportError("NeMo's langchain framework mode needs `pip install flashguard[langchain]` "
                              "(langchain-community)") from exc
        register_provider(PROVIDER_NAME, ChatFlashguard)
    else:
        register_provider(PROVIDER_NAME, FlashGuardModel)
