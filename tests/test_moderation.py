"""The moderation rail on a labelled set of 40 replies, shared-page path vs fresh prefill."""

import json

import pytest

from flashguard.rails.moderation import ModerationSettings, moderate
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
ROWS = [json.loads(line) for line in (ROOT / "tests/data/moderation_set.jsonl").read_text().splitlines()]


def test_the_set_is_balanced():
    assert len(ROWS) >= 40 and sum(r["block"] for r in ROWS) == len(ROWS) // 2
    assert {r["category"] for r in ROWS if r["block"]} == {"violence", "self-harm", "secrets", "insult"}


def test_shared_and_fresh_paths_agree_and_accuracy_is_reported(engine, capsys):
    settings = ModerationSettings()
    correct = 0
    for row in ROWS:
        prompt = engine.encode_messages([{"role": "user", "content": row["user"]}])
        reply = engine.tokenizer(row["bot"], add_special_tokens=False)["input_ids"]
        engine.teacher_force(prompt, reply, row["bot"])
        shared = moderate(engine, row["bot"], row["user"], settings)
        assert shared.path == "shared"
        assert shared.prefilled_tokens <= len(shared_suffix(engine, settings)) + 1
        engine.reset_session()
        fresh = moderate(engine, row["bot"], row["user"], settings, use_memo=False)  # same ids, nothing cached
        assert fresh.reused_tokens == 0 and fresh.path == "shared"
        assert shared.allowed == fresh.allowed and abs(shared.p_unsafe - fresh.p_unsafe) < 1e-4
        correct += (not shared.allowed) == row["block"]
    accuracy = correct / len(ROWS)
    with capsys.disabled():
        print(f"\nmoderation accuracy on {len(ROWS)} labelled replies: {accuracy:.1%} (threshold {settings.threshold})")
    assert accuracy > 0.5  # better than chance; the 135M model is weak (docs/moderation.md)


def shared_suffix(engine, settings):
    from flashguard.rails.moderation import moderation_suffix

    return moderation_suffix(engine, settings.prompt)


def test_the_same_text_is_not_moderated_twice(engine):
    prompt = engine.encode_messages([{"role": "user", "content": "Say something kind."}])
    reply = "You are doing great today."
    engine.teacher_force(prompt, engine.tokenizer(reply, add_special_tokens=False)["input_ids"], reply)
    first = moderate(engine, reply, "Say something kind.")
    calls = engine.stats.as_dict()["moderation"]["calls"]
    assert moderate(engine, reply, "Say something kind.") is first
    assert engine.stats.as_dict()["moderation"]["calls"] == calls


def test_unknown_turn_falls_back_to_prefill_and_counts_it(engine):
    before = engine.stats.as_dict()["moderation"]["fallbacks"]
    v = moderate(engine, "A reply this engine never generated: the sky is green.", "Hi")
    assert v.path == "prefill" and engine.stats.as_dict()["moderation"]["fallbacks"] == before + 1


def test_settings_errors_name_the_key():
    from flashguard import ConfigError

    with pytest.raises(ConfigError, match="custom_data.flashguard_moderation"):
        ModerationSettings.from_custom_data({"flashguard_moderation": {"treshold": 0.5}})
    with pytest.raises(ConfigError, match="threshold"):
        ModerationSettings.from_custom_data({"flashguard_moderation": {"threshold": 2}})


def test_after_a_4k_token_conversation_moderation_prefills_only_the_suffix(engine):
    import pydoc_data.topics as topics

    from flashguard.rails.moderation import moderation_suffix

    history = []
    for key in sorted(topics.topics)[:24]:
        history += [{"role": "user", "content": "Explain: " + topics.topics[key][:1200]},
                    {"role": "assistant", "content": "It is a part of Python's language reference."}]
    history.append({"role": "user", "content": "And what is a while loop?"})
    prompt = engine.encode_messages(history)
    assert len(prompt) >= 4000
    reply = "A while loop repeats its body as long as its condition is true."
    engine.teacher_force(prompt, engine.tokenizer(reply, add_special_tokens=False)["input_ids"], reply)
    v = moderate(engine, reply, "And what is a while loop?")
    suffix = moderation_suffix(engine, ModerationSettings().prompt)
    assert v.path == "shared" and v.prefilled_tokens <= len(suffix) + 64
    assert v.reused_tokens >= len(prompt)
