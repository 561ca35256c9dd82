"""Offline completeness: the shipped config never builds an embedding model (which would start a download of
all-MiniLM-L6-v2 through FastEmbed), so a guarded chat works with no network at all."""

from __future__ import annotations

import pytest

from tests.conftest import FLASH

pytestmark = pytest.mark.slow


def test_flash_config_builds_no_embedding_model(monkeypatch, engine):
    import nemoguardrails.embeddings.providers.fastembed as fastembed
    from nemoguardrails import LLMRails, RailsConfig

    def refuse(*args, **kwargs):
        raise AssertionError("configs/flash built an embedding model: that would download all-MiniLM-L6-v2")

    monkeypatch.setattr(fastembed.FastEmbedEmbeddingModel, "__init__", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rails = LLMRails(RailsConfig.from_path(str(FLASH)))
    res = rails.generate(messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in res["content"]
