"""NeMo Guardrails integration: the ``flashguard`` provider and the LangChain adapter."""
