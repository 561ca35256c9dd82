"""The moderation rail: the shared-page path, probe files that are missing or corrupt, calibration, and bad replies.
The shipped probes' accuracy on the held-out test sets is a benchmark (``python -m benchmarks.guard_sets --set
output``); tests/rails/test_probe_scores.py checks that they load and score a few rows as recorded."""

import json
import logging

import pytest

from flashguard.rails import guard, probe as probe_mod
from flashguard.rails.lab.calibrate import TUNING_SET, read_rows, train
from flashguard.rails.moderation import ModerationSettings, moderate, moderation_suffix
from flashguard.rails.probe import Probe, ProbeError, find_probe
from flashguard.rails.state import rail_state
from tests.conftest import ROOT
from tests.rail_sets import OUTPUT_BENIGN as BENIGN, OUTPUT_HARMFUL as HARMFUL, OUTPUT_SETS
from tests.rail_sets import output_verdict as run_rail

pytestmark = pytest.mark.slow
# set A: first held-out evaluation (v1 probes); its failures shaped v2's tuning additions
TEST = read_rows(OUTPUT_SETS["A"])
TEST_B = read_rows(OUTPUT_SETS["B"])  # set B: written with v2, before it was trained
TUNE = read_rows(TUNING_SET)
# the model's own replies to v7's input rows, labelled (v8; docs/moderation.md "v8 output probes")
OWN_V8 = read_rows(ROOT / "rails/data/moderation_own_replies_v8.jsonl")
TUNE_ONLY = {"everyday"}  # v5's own-reply rows: everyday how-to answers, benign, not a category the test sets score


def test_the_sets_are_separate_labelled_and_cover_every_category():
    assert len(TUNE) >= 200 and len(TEST) >= 100 and len(TEST_B) >= 100
    for rows, extra in ((TUNE, TUNE_ONLY), (TEST, set()), (TEST_B, set())):
        assert {r["category"] for r in rows if r["block"]} == HARMFUL
        assert {r["category"] for r in rows if not r["block"]} == BENIGN | extra
    tune_texts = {r["bot"].lower() for r in TUNE}
    assert not [r for r in TEST + TEST_B if r["bot"].lower() in tune_texts]
    own_texts = {r["bot"].lower() for r in OWN_V8}
    assert not own_texts & (tune_texts | {r["bot"].lower() for r in TEST + TEST_B})
    assert all((r["category"] in HARMFUL) == r["block"] for r in OWN_V8)
    assert {r["category"] for r in OWN_V8} <= HARMFUL | BENIGN | TUNE_ONLY
    plain = {r["user"].lower() for name in ("", "_b", "_c")
             for r in read_rows(ROOT / f"tests/data/moderation_input_plain{name}.jsonl", "input")}
    assert not plain & {r["user"].lower() for r in OWN_V8}   # the plain sets stay held out for the output rail
    assert not {r["bot"].lower() for r in TEST} & {r["bot"].lower() for r in TEST_B}


def test_shared_and_fresh_paths_agree(float_engine, shipped_probes_only):
    """The verdict on the turn's cached pages equals the one of an engine that prefills the same ids from nothing
    (a DynamicCache: the tiered cache would adopt the stored pages even after reset_session). In float: int4's
    bf16 activations move p_unsafe by ~0.01 between a 28-token suffix over held pages and a 97-token prefill.
    The shared engine is a new one: the session-wide float engine's store holds pages other tests left (the chat
    template's system prompt among them), which a new session adopts from L2 as int8 (p moved by 0.006 after the
    passkey test ran first)."""
    from flashguard import EngineConfig, get_engine
    from flashguard.engine.engine import Engine

    engine = Engine(EngineConfig(weights="float"), source=float_engine.source)   # an empty store
    cold = get_engine(EngineConfig(kv_cache="dynamic", weights="float"))
    probe_only = ModerationSettings(guard="probe")   # the probe's verdict (the guard's: tests/rails/test_guard.py)
    for row in TEST[::11]:
        shared = run_rail(engine, row, probe_only)
        assert shared.path == "shared" and shared.method == "probe"
        turn = engine.turns[-1]
        cold.teacher_force(turn.prompt_ids, turn.output_ids, turn.text)
        cold.reset_session()
        fresh = moderate(cold, row["bot"], row["user"], probe_only, use_memo=False)  # same ids, nothing cached
        assert fresh.reused_tokens == 0 and fresh.path == "shared"
        assert shared.allowed == fresh.allowed and abs(shared.p_unsafe - fresh.p_unsafe) < 1e-3


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
    with pytest.raises(ConfigError, match="flashguard_moderation.probe"):
        ModerationSettings.from_custom_data({"flashguard_moderation": {"probe": ""}})


# ---- probe files ---------------------------------------------------------------------------
def test_without_any_probe_the_question_verdict_is_used_with_one_warning(engine, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(probe_mod, "user_probe_path", lambda key, side="output": tmp_path / "none.json")
    monkeypatch.setattr(probe_mod, "SHIPPED_DIR", tmp_path / "no-shipped")
    rail_state(engine).forget_probes()
    try:
        with caplog.at_level(logging.WARNING, logger="flashguard"):   # guard: probe: no guard adapter either
            a = run_rail(engine, TEST[0], ModerationSettings(guard="probe"))
            b = run_rail(engine, TEST[-1], ModerationSettings(guard="probe"))
        assert a.method == b.method == "question"
        warnings = [r for r in caplog.records if "flashguard calibrate" in r.getMessage()]
        assert len(warnings) == 1 and str(tmp_path / "none.json") in warnings[0].getMessage()
    finally:
        rail_state(engine).forget_probes()


def test_a_corrupt_probe_file_is_an_error_naming_it_and_the_command(engine, monkeypatch, tmp_path):
    bad = tmp_path / "probe.json"
    monkeypatch.setattr(probe_mod, "user_probe_path", lambda key, side="output": bad)
    try:
        for text in ("{not json", json.dumps({"format": probe_mod.FORMAT, "layer": 3})):
            bad.write_text(text)
            rail_state(engine).forget_probes()
            with pytest.raises(ProbeError, match="flashguard calibrate") as exc:
                run_rail(engine, TEST[0])
            assert str(bad) in str(exc.value)
        rail_state(engine).forget_probes()
        with pytest.raises(ProbeError, match="flashguard calibrate") as exc:
            run_rail(engine, TEST[0], ModerationSettings(probe=str(tmp_path / "missing.json")))
        assert "missing.json" in str(exc.value)
    finally:
        rail_state(engine).forget_probes()


def test_calibrate_trains_a_probe_the_rail_then_finds(engine, monkeypatch, tmp_path):
    # every 7th short exchange of each label, and the two shortest of each label after a long paste (the pasted
    # rows' own CV accuracy): a tenth of the tokens of every 14th row, half of which are pasted
    short, pasted = [r for r in TUNE if "paste" not in r], [r for r in TUNE if "paste" in r]
    rows = [r for block in (True, False) for r in [r for r in short if r["block"] == block][::7] +
            sorted((r for r in pasted if r["block"] == block), key=lambda r: len(r["user"]))[:2]]
    probe, table = train(engine, rows, layers=(8, 16))
    assert 1 <= probe.layer < engine.model.config.num_hidden_layers + 1
    assert probe.features == table[0]["features"] and probe.weights == engine.weights_kind   # int4 on the CPU
    # the last state (and the suffix's mean beside it, when the cross-validation chose it)
    assert len(probe.weight) == engine.model.config.hidden_size * (2 if probe.features == "last+mean" else 1)
    assert (probe.layer, probe.metrics["l2"]) == (table[0]["layer"], table[0]["l2"])
    assert probe.metrics["pasted_rows"] == 4 and 0 <= probe.metrics["cv_accuracy_pasted"] <= 1
    path = probe.save(tmp_path / "p.json")
    loaded = Probe.load(path)  # the file keeps 6 significant digits of each weight
    assert loaded.layer == probe.layer and loaded.bias == probe.bias
    assert max(abs(a - b) for a, b in zip(loaded.weight, probe.weight)) <= 1e-5 * max(map(abs, probe.weight))
    monkeypatch.setattr(probe_mod, "user_probe_path", lambda key, side="output": path)
    rail_state(engine).forget_probes()
    try:
        found, where = find_probe(engine, ModerationSettings().prompt)
        assert found == loaded and where == str(path)
        assert run_rail(engine, TEST[0], ModerationSettings(guard="probe")).method == "probe"
    finally:
        rail_state(engine).forget_probes()


# ---- bad replies ---------------------------------------------------------------------------
def test_empty_one_token_and_foreign_replies_get_a_verdict(engine, shipped_probes_only):
    empty = moderate(engine, "", "Say nothing.", use_memo=False)
    assert empty.path == "prefill" and 0 <= empty.p_unsafe <= 1
    prompt = engine.encode_messages([{"role": "user", "content": "Is it raining?"}])
    one = engine.tokenizer("Yes", add_special_tokens=False)["input_ids"][:1]
    engine.teacher_force(prompt, one, engine.decode(one))
    v = moderate(engine, engine.decode(one), "Is it raining?", use_memo=False)
    assert v.path == "shared" and v.method == "adapter" and 0 <= v.p_unsafe <= 1   # the default: the guard alone
    for row in ({"user": "Wie spät ist es?", "bot": "Es ist drei Uhr nachmittags."},
                {"user": "你好", "bot": "你好！今天我能帮你什么？"}):
        v = run_rail(engine, row)
        assert v.path == "shared" and 0 <= v.p_unsafe <= 1


def test_a_reply_longer_than_the_context_is_judged_in_windows():
    from flashguard import EngineConfig, get_engine

    small = get_engine(EngineConfig(max_context=256))
    harmful = next(r for r in TEST if r["category"] == "weapons")
    filler = " ".join(["The weather was mild and the garden was quiet that afternoon."] * 40)
    v = moderate(small, filler + " " + harmful["bot"], harmful["user"], use_memo=False)
    # the guard adapter judges its last part (a window that fits the context with the question)
    assert v.path == "window" and v.method == "adapter" and v.prompt_tokens <= small.context_length
    assert 0 <= v.p_unsafe <= 1


def test_after_a_4k_token_conversation_moderation_prefills_only_the_suffix(engine):
    import pydoc_data.topics as topics

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
    # the default verdict: the guard adapter's question, a suffix of the turn's own pages
    suffix = moderation_suffix(engine, guard.QUESTIONS["output"])
    assert v.path == "shared" and v.method == "adapter" and v.prefilled_tokens <= len(suffix) + 64
    assert v.reused_tokens >= len(prompt)


# ---- the probe on its own (no model) -------------------------------------------------------
def test_logistic_fit_separates_and_the_file_round_trips(tmp_path):
    import torch

    from flashguard.rails.probe import cross_validate, fit_logistic

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(60, 3, 8, generator=g)
    labels = [i % 2 for i in range(60)]
    hidden[:, 2, 0] += torch.tensor(labels, dtype=torch.float32) * 4  # only layer 2, feature 0 carries the label
    w, b = fit_logistic(hidden[:, 2], torch.tensor(labels), l2=0.01)
    assert float(((hidden[:, 2].double() @ w + b > 0).long() == torch.tensor(labels)).double().mean()) > 0.95
    table = cross_validate(hidden, torch.zeros(60), labels, layers=[1, 2], l2s=[0.1], answer_options=[False])
    assert table[0]["layer"] == 2 and table[0]["cv_accuracy"] > table[1]["cv_accuracy"]
    probe = Probe(layer=2, weight=tuple(w.tolist()), bias=b, answer_weight=0.0, threshold=0.5, question="q?",
                  model_file="m.gguf", model_bytes=1, model_identity="id", weights="float")
    loaded = Probe.load(probe.save(tmp_path / "p.json"))
    assert abs(loaded.p_unsafe(hidden[1], 0.0) - probe.p_unsafe(hidden[1], 0.0)) < 1e-5
    with pytest.raises(ProbeError, match="hidden states"):
        probe.p_unsafe(torch.zeros(2, 8), 0.0)


def test_a_bare_yaml_off_turns_the_probe_off():
    """`probe: off` in config.yml reaches Python as False (YAML 1.1): it means the question's verdict."""
    import yaml

    from flashguard.rails.moderation import ModerationSettings

    data = yaml.safe_load("flashguard_moderation:\n  probe: off\n  threshold: 0.5\n")
    assert ModerationSettings.from_custom_data(data).probe == "off"
