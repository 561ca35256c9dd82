"""LangChain's own standard suites (``langchain-tests``) against ``ChatFlashguard`` on the embedded model.

What ChatFlashguard lacks (tool calling, structured output, JSON mode, image/PDF/audio input) is declared through
the suites' properties, so those tests skip instead of failing.
"""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from flashguard.guardrails.langchain_chat import ChatFlashguard  # noqa: E402

pytestmark = pytest.mark.slow


class _Declared:
    @property
    def chat_model_class(self):
        return ChatFlashguard

    @property
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": 16}  # short replies: quick on a CPU

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # `model` is a label; the weights come from model_path


class TestChatFlashguardUnit(_Declared, ChatModelUnitTests):
    @property
    def standard_chat_model_params(self) -> dict:
        params = dict(super().standard_chat_model_params)
        params.pop("api_key")  # a local model has no key (an unknown keyword is an error naming it)
        return params


class TestChatFlashguardIntegration(_Declared, ChatModelIntegrationTests):
    pass
