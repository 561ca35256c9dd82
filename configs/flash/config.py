"""Registers the flashguard engine and the moderation action with NeMo Guardrails."""

from flashguard.guardrails.provider import register
from flashguard.rails.actions import flashguard_moderate_input, flashguard_moderate_output
from flashguard.rails.moderation import ModerationSettings

register()  # at import: NeMo builds the models right after it loads this file


def init(app):
    # the rails read their custom_data sections at every check; read them once here too, so that a bad key fails the
    # config's loading (before the model loads) with its name, not every request with NeMo's "internal error"
    for side in ("output", "input"):
        ModerationSettings.from_custom_data(app.config.custom_data, side=side)
    app.register_action(flashguard_moderate_output, "flashguard_moderate_output")
    app.register_action(flashguard_moderate_input, "flashguard_moderate_input")
