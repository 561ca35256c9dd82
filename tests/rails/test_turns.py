"""Any turn (issue 47): the input rail judges a message the same whether it opens the conversation or follows an
ordinary exchange. On the project's own hand-written rows (rails/data/moderation_input_tune.jsonl, a fixed
sample), configs/flash's default guard gives each message the same verdict, and p_unsafe within 0.1, as the first
message and as the second, after "What is the capital of France?" / "The capital of France is Paris."."""

from __future__ import annotations

import json

import pytest

from flashguard.rails.moderation import ModerationSettings, moderate_input
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

BEFORE = [{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "The capital of France is Paris."}]


def project_rows(every: int = 12) -> list[dict]:
    rows = [json.loads(line) for line in (ROOT / "rails/data/moderation_input_tune.jsonl").read_text(
        encoding="utf-8").splitlines() if line.strip()]
    return [r for r in rows if not r.get("after") and len(r["user"]) < 500][::every]


def test_a_message_gets_the_same_verdict_first_and_after_an_ordinary_exchange(engine):
    settings = ModerationSettings()
    rows = project_rows()
    assert len(rows) >= 40 and sum(r["block"] for r in rows) >= 10 and sum(not r["block"] for r in rows) >= 10
    parted = []
    for r in rows:
        first = moderate_input(engine, [{"role": "user", "content": r["user"]}], settings)
        later = moderate_input(engine, BEFORE + [{"role": "user", "content": r["user"]}], settings)
        assert first.method == later.method == "adapter"
        if first.allowed != later.allowed or abs(first.p_unsafe - later.p_unsafe) > 0.1:
            parted.append(f"{first.p_unsafe:.3f} / {later.p_unsafe:.3f}: {r['user'][:60]!r}")
    assert not parted, f"{len(parted)} of {len(rows)} messages judged differently as a later message:\n" + \
        "\n".join(parted)
