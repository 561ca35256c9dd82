"""The moderation rail (installed as ``flashguard.rails``): moderation logic and the NeMo action."""
