"""The NeMo Guardrails action of the moderation rail: ``flashguard_moderate_output``.

Registered by ``configs/flash/config.py``; used by the ``flashguard moderate output`` flow.
It needs the main model to be the flashguard provider (it moderates with the same engine).
"""

from __future__ import annotations

import asyncio
from typing import Optional

from nemoguardrails.actions import action
from nemoguardrails.actions.rail_outcome import RailOutcome

from .moderation import ModerationSettings, moderate


@action(name="flashguard_moderate_output", is_system_action=True)
async def flashguard_moderate_output(llm=None, config=None, context: Optional[dict] = None,
                                     bot_message: Optional[str] = None, user_message: Optional[str] = None,
                                     **kwargs) -> RailOutcome:
    engine = getattr(llm, "engine", None)
    if engine is None:  # NeMo's langchain framework wraps the model: ChatFlashguard is its raw_llm
        engine = getattr(getattr(llm, "raw_llm", None), "engine", None)
    if engine is None:
        raise RuntimeError("flashguard_moderate_output needs the main model to use `engine: flashguard` "
                           "(models[main].engine in config.yml)")
    context = context or {}
    bot = bot_message if bot_message is not None else context.get("bot_message")
    user = user_message if user_message is not None else context.get("user_message")
    if not bot:
        return RailOutcome.allow(reason="empty reply")
    settings = ModerationSettings.from_custom_data(getattr(config, "custom_data", None))
    verdict = await asyncio.to_thread(moderate, engine, bot, user, settings)
    meta = {"p_unsafe": verdict.p_unsafe, "method": verdict.method, "threshold": verdict.threshold,
            "path": verdict.path, "prefilled_tokens": verdict.prefilled_tokens, "reused_tokens": verdict.reused_tokens}
    if verdict.allowed:
        return RailOutcome.allow(reason=verdict.reason, metadata=meta)
    return RailOutcome.block(reason=verdict.reason, metadata=meta)
