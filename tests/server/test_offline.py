"""Offline completeness: the shipped config never builds an embedding model (which would start a download of
all-MiniLM-L6-v2 through FastEmbed), so a guarded chat works with no network at all."""

from __future__ import annotations

import pytest

from tests.conftest import FLASH, run_all

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


def test_the_flash_config_sends_no_usage_report(tmp_path):
    """NeMo Guardrails 0.24 POSTs usage reports to NVIDIA when LLMRails starts, unless told not to (it stays quiet
    under pytest and CI by itself, so this runs in a clean process): registering flashguard tells it not to, and an
    explicit NEMO_GUARDRAILS_NO_USAGE_STATS=0 still keeps NeMo's reports."""
    import os
    import sys

    from flashguard.engine.loader import user_cache_dir

    code = ("import nemoguardrails.telemetry as t\n"
            "sent = []\n"
            "t._start_daemon_thread = lambda target, args, msg: sent.append(target.__name__) or True\n"
            "from nemoguardrails import LLMRails, RailsConfig\n"
            f"LLMRails(RailsConfig.from_path({str(FLASH)!r}))\n"
            "print('SENT', sent)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "PYTEST_CURRENT_TEST", "DO_NOT_TRACK", "NEMO_GUARDRAILS_NO_USAGE_STATS")}
    env["HOME"] = env["USERPROFILE"] = str(tmp_path)   # (no do_not_track file of this machine's user)
    # LLMRails loads the model: from the suite's cache folder (a new HOME's would convert the GGUF again, twice)
    env["FLASHGUARD_CACHE_DIR"] = str(user_cache_dir())
    runs = run_all({"quiet": ([sys.executable, "-c", code], {"env": env}),   # both at once
                    "loud": ([sys.executable, "-c", code], {"env": {**env, "NEMO_GUARDRAILS_NO_USAGE_STATS": "0"}})},
                   timeout=300)
    quiet, loud = runs["quiet"], runs["loud"]
    assert "SENT []" in quiet.stdout, quiet.stdout + quiet.stderr[-2000:]
    assert "SENT ['_send_one_event'" in loud.stdout, loud.stdout + loud.stderr[-2000:]
