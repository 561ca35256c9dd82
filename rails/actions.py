"""The NeMo Guardrails actions of the moderation rails: ``flashguard_moderate_output`` and
``flashguard_moderate_input``.

Registered by ``configs/flash/config.py``; used by the ``flashguard moderate output`` / ``flashguard moderate
input`` flows. They need the main model to be the flashguard provider (they moderate with the same engine). Each
verdict is published to ``listeners.py`` (the server's request accounting subscribes there: the rails import no
server).
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Callable, Optional

from nemoguardrails.actions import action
from nemoguardrails.actions.rail_outcome import RailOutcome

from flashguard import notice
from flashguard.errors import ConfigError

from . import listeners
from .moderation import ModerationSettings, Verdict, moderate, moderate_input

# Who wants each verdict besides NeMo (``flashguard eval-guard``: rails/lab/evaluate.py reads p_unsafe, which NeMo's
# ``LLMRails.check`` does not return): a callable ``(rail, verdict)`` set in the caller's context, which NeMo's tasks
# and ``asyncio.to_thread`` copy. Unset (None) everywhere else.
verdict_sink: contextvars.ContextVar[Optional[Callable[[str, Verdict], None]]] = contextvars.ContextVar(
    "flashguard_verdict_sink", default=None)


@action(name="flashguard_moderate_output", is_system_action=True)
async def flashguard_moderate_output(llm=None, config=None, context: Optional[dict] = None,
                                     bot_message: Optional[str] = None, user_message: Optional[str] = None,
                                     **kwargs) -> RailOutcome:
    engine = _engine_of(llm, "flashguard_moderate_output")
    context = context or {}
    bot = bot_message if bot_message is not None else context.get("bot_message")
    user = user_message if user_message is not None else context.get("user_message")
    if not bot:
        return RailOutcome.allow(reason="empty reply")
    refusals = (getattr(config, "bot_messages", None) or {}).get("refuse to respond") or ()
    if bot.strip() in {str(r).strip() for r in refusals}:   # the rails' own refusal (after an input block)
        return RailOutcome.allow(reason="the rails' own refusal")
    settings = ModerationSettings.from_custom_data(getattr(config, "custom_data", None))
    verdict = await asyncio.to_thread(moderate, engine, bot, user, settings)
    return _outcome("output", verdict)


@action(name="flashguard_moderate_input", is_system_action=True)
async def flashguard_moderate_input(llm=None, config=None, context: Optional[dict] = None,
                                    user_message: Optional[str] = None, **kwargs) -> RailOutcome:
    """Judge the user's last message on the conversation's pages (``moderate_input``). The conversation is the
    message list of the request (NeMo's ``raw_llm_request``, as passthrough generation sends it), with its last
    user message set to ``user_message``; without one, the user's message alone."""
    engine = _engine_of(llm, "flashguard_moderate_input")
    context = context or {}
    user = user_message if user_message is not None else context.get("user_message")
    settings = ModerationSettings.from_custom_data(getattr(config, "custom_data", None), side="input")
    messages = conversation(user)
    verdict = await asyncio.to_thread(moderate_input, engine, messages, settings)
    return _outcome("input", verdict)


def conversation(user: Optional[str]) -> list[dict]:
    """The request's messages as the provider will encode them (NeMo's passthrough generation sends
    ``raw_llm_request`` with its last user message replaced by the context's ``user_message``)."""
    from nemoguardrails.context import raw_llm_request

    from flashguard.engine.encoding import as_message

    raw = raw_llm_request.get()
    messages = [as_message(m) for m in raw] if isinstance(raw, list) and raw else []
    messages = [m for m in messages if isinstance(m.get("content"), str)] if messages else []
    for m in reversed(messages):
        if m["role"] == "user":
            if user is not None:
                m["content"] = user
            return messages
    return [{"role": "user", "content": user or ""}]


def _engine_of(llm, name: str):
    engine = getattr(llm, "engine", None)
    if engine is None:  # NeMo's langchain framework wraps the model: ChatFlashguard is its raw_llm
        engine = getattr(getattr(llm, "raw_llm", None), "engine", None)
    if engine is None:
        raise ConfigError(f"{name} needs the main model to use `engine: flashguard` "
                          "(models[main].engine in config.yml)")
    return engine


def _outcome(rail: str, verdict) -> RailOutcome:
    sink = verdict_sink.get()
    if sink is not None:
        sink(rail, verdict)
    meta = {"p_unsafe": verdict.p_unsafe, "method": verdict.method, "threshold": verdict.threshold,
            "strictness": verdict.strictness, "path": verdict.path, "prefilled_tokens": verdict.prefilled_tokens,
            "reused_tokens": verdict.reused_tokens}
    # flashguard serve reports it (guardrails/usage.py listens): the response's field, a blocked request's usage
    listeners.publish(rail, verdict.allowed, {**meta, "reason": verdict.reason})
    if verdict.allowed:
        return RailOutcome.allow(reason=verdict.reason, metadata=meta)
    if sink is None:   # one line a blocked turn (eval-guard's table counts them instead)
        notice.say("flashguard: the %s rail blocked %s (p_unsafe %.3f >= %.2f, %s)", rail,
                   "the reply" if rail == "output" else "the message", verdict.p_unsafe, verdict.threshold,
                   verdict.decided_by)
    return RailOutcome.block(reason=verdict.reason, metadata=meta)
