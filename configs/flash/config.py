"""Registers the flashguard engine and the moderation action with NeMo Guardrails."""

from flashguard.guardrails.provider import register
from flashguard.rails.actions import flashguard_moderate_input, flashguard_moderate_output

register()  # at import: NeMo builds the models right after it loads this file


def init(app):
    app.register_action(flashguard_moderate_output, "flashguard_moderate_output")
    app.register_action(flashguard_moderate_input, "flashguard_moderate_input")
