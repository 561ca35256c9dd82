"""``strictness: low | medium | high`` (issue 27 item 4): the config key in both moderation sections, the probe's
strictness tables (saved, loaded, validated; files without them still load) and the threshold each level gives.
Fast: no model, except the one slow test that checks the rail decides at the level's threshold."""

import dataclasses
import json
import logging

import pytest
import yaml

from flashguard import ConfigError
from flashguard.rails.moderation import ModerationSettings, Verdict, decision_threshold, probe_threshold
from flashguard.rails.probe import SHIPPED_DIR, STRICTNESS, Probe, ProbeError
from tests.conftest import FLASH, make_config

TABLE = {"low": 0.8, "medium": 0.58, "high": 0.3}
LONG_TABLE = {"low": 0.97, "medium": 0.9, "high": 0.7}


def probe(**over) -> Probe:
    base = dict(layer=3, weight=(0.5, -1.0), bias=0.1, answer_weight=0.0, threshold=0.58, question="q",
                model_file="m.gguf", model_bytes=10, model_identity="id", weights="float")
    return Probe(**{**base, **over})


def windowed(**over) -> Probe:
    return probe(rail="input", features="mean", window=64, stride=16, long_window=32, long_layer=5,
                 long_weight=(2.0, 1.0), long_bias=-0.5, long_threshold=0.95, **over)


# ---- the config key -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["output", "input"])
def test_strictness_defaults_to_medium_and_reads_every_level(side):
    section = {"output": "flashguard_moderation", "input": "flashguard_input_moderation"}[side]
    assert ModerationSettings.from_custom_data({}, side=side).strictness == "medium"
    for level in STRICTNESS:
        assert ModerationSettings.from_custom_data({section: {"strictness": level}}, side=side).strictness == level


@pytest.mark.parametrize("side,section", [("output", "flashguard_moderation"),
                                          ("input", "flashguard_input_moderation")])
@pytest.mark.parametrize("value", ["max", "Medium", 1, True, None, ""])
def test_a_bad_strictness_names_the_key(side, section, value):
    with pytest.raises(ConfigError) as err:
        ModerationSettings.from_custom_data({section: {"strictness": value}}, side=side)
    assert str(err.value) == (f"custom_data.{section}.strictness must be one of low, medium, high, "
                              f"got {value!r}")


def test_configs_flash_sets_medium_in_both_sections():
    custom = yaml.safe_load((FLASH / "config.yml").read_text())["custom_data"]
    assert custom["flashguard_moderation"]["strictness"] == "medium"
    assert custom["flashguard_input_moderation"]["strictness"] == "medium"
    assert ModerationSettings.from_custom_data(custom).strictness == "medium"
    assert ModerationSettings.from_custom_data(custom, side="input").strictness == "medium"


def test_a_bad_strictness_fails_the_configs_loading_before_the_model(tmp_path):
    """configs/flash/config.py reads both sections when NeMo loads the config (before the model): a bad key is a
    ConfigError then (the CLI's one line), not NeMo's "internal error" at every check."""
    from nemoguardrails import LLMRails, RailsConfig

    from flashguard.engine import registry

    yml = (FLASH / "config.yml").read_text()
    bad = yml.replace("strictness: medium   # low | medium | high (docs", "strictness: max   # (docs")
    assert bad != yml
    before = registry.loads
    with pytest.raises(RuntimeError) as err:
        LLMRails(RailsConfig.from_path(str(make_config(tmp_path, bad))))
    assert isinstance(err.value.__cause__, ConfigError)
    assert str(err.value.__cause__) == ("custom_data.flashguard_input_moderation.strictness must be one of low, "
                                        "medium, high, got 'max'")
    assert registry.loads == before


# ---- the probe's tables -------------------------------------------------------------------------------------
def test_a_probe_with_strictness_tables_round_trips(tmp_path):
    p = windowed(strictness=TABLE, long_strictness=LONG_TABLE)
    path = p.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["strictness"] == TABLE and data["long"]["strictness"] == LONG_TABLE
    loaded = Probe.load(path)
    assert loaded == p and loaded.strictness == TABLE and loaded.long_strictness == LONG_TABLE
    out = probe(rail="output", strictness=TABLE)
    assert Probe.load(out.save(tmp_path / "out.json")).strictness == TABLE


def test_a_probe_without_tables_writes_none_and_reads_empty(tmp_path):
    path = windowed().save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert "strictness" not in data and "strictness" not in data["long"]
    loaded = Probe.load(path)
    assert loaded.strictness == {} and loaded.long_strictness == {}


def test_the_shipped_probes_written_before_the_levels_still_load():
    files = sorted(SHIPPED_DIR.glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        loaded = Probe.load(path)
        assert loaded.strictness == data.get("strictness", {})
        assert loaded.long_strictness == data.get("long", {}).get("strictness", {})


def test_an_old_file_without_the_fields_loads(tmp_path):
    data = windowed().to_json()
    data.pop("strictness", None)
    data["long"].pop("strictness", None)
    (tmp_path / "old.json").write_text(json.dumps(data))
    loaded = Probe.load(tmp_path / "old.json")
    assert (loaded.strictness, loaded.long_strictness, loaded.threshold, loaded.long_threshold) == ({}, {}, 0.58, 0.95)


@pytest.mark.parametrize("bad", [{"low": 0.8, "medium": 0.5},                          # a level missing
                                 {"low": 0.8, "medium": 0.5, "high": 0.3, "max": 0.1},  # an unknown level
                                 {"low": 0.8, "medium": 1.5, "high": 0.3},              # outside (0, 1)
                                 {"low": 0.3, "medium": 0.5, "high": 0.8},              # high blocks less than low
                                 [0.8, 0.5, 0.3]])
@pytest.mark.parametrize("where", ["top", "long"])
def test_a_bad_table_names_the_file_and_the_key(tmp_path, bad, where):
    data = windowed().to_json()
    if where == "top":
        data["strictness"] = bad
    else:
        data["long"]["strictness"] = bad
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ProbeError) as err:
        Probe.load(tmp_path / "bad.json")
    assert "bad.json" in str(err.value) and "flashguard calibrate" in str(err.value)
    assert ("long.strictness" if where == "long" else "strictness") in str(err.value)


# ---- the threshold each level gives -------------------------------------------------------------------------
@pytest.mark.parametrize("level", STRICTNESS)
def test_each_level_takes_its_threshold_from_the_table(level):
    settings = ModerationSettings.input_defaults(strictness=level)
    p = windowed(strictness=TABLE, long_strictness=LONG_TABLE)
    assert probe_threshold(p, settings) == (TABLE[level], level)
    assert probe_threshold(p, settings, long=True) == (LONG_TABLE[level], level)


@pytest.mark.parametrize("level", STRICTNESS)
def test_without_a_table_the_probe_keeps_its_own_thresholds(level):
    settings = ModerationSettings(strictness=level)
    assert probe_threshold(probe(threshold=0.61), settings) == (0.61, "")
    assert probe_threshold(windowed(), settings, long=True) == (0.95, "")
    # a short table only: long messages keep long_threshold
    assert probe_threshold(windowed(strictness=TABLE), settings, long=True) == (0.95, "")


def test_stricter_levels_never_block_less():
    settings = [ModerationSettings(strictness=level) for level in STRICTNESS]
    p = windowed(strictness=TABLE, long_strictness=LONG_TABLE)
    for long in (False, True):
        low, medium, high = (probe_threshold(p, s, long)[0] for s in settings)
        assert low >= medium >= high


def test_no_table_is_logged_once_per_engine_rail_and_table(caplog):
    class FakeEngine:   # rail_state keeps the warned flags beside any (weakly referenced) engine
        pass

    one, two = FakeEngine(), FakeEngine()
    out, inp = ModerationSettings(strictness="high"), ModerationSettings.input_defaults(strictness="high")
    with caplog.at_level(logging.INFO, logger="flashguard"):
        for _ in range(3):
            assert decision_threshold(one, probe(), out) == (0.58, "")
        decision_threshold(one, windowed(), inp)
        decision_threshold(one, windowed(), inp, long=True)
        decision_threshold(two, probe(), out)
        assert decision_threshold(one, probe(strictness=TABLE), out) == (0.3, "high")   # a table: nothing to say
    lines = [r.getMessage() for r in caplog.records if "strictness table" in r.getMessage()]
    assert len(lines) == 4, lines
    assert "custom_data.flashguard_moderation.strictness (high) does not apply" in lines[0]
    assert "custom_data.flashguard_input_moderation.strictness" in lines[1] and "window" in lines[2]


def test_the_reason_names_the_level():
    v = Verdict(allowed=False, p_unsafe=0.712, path="shared", prompt_tokens=10, prefilled_tokens=3, reused_tokens=7,
                seconds=0.01, method="probe", threshold=0.58, strictness="medium")
    assert v.reason == "p_unsafe=0.712 (threshold 0.58, probe, strictness medium) via shared path"
    assert dataclasses.replace(v, strictness="", method="question").reason == \
        "p_unsafe=0.712 (threshold 0.58, question) via shared path"


# ---- the rail decides at the level's threshold (the real embedded model) -------------------------------------
@pytest.mark.slow
def test_the_input_rail_decides_at_the_levelsdecision_threshold(engine, tmp_path):
    """A copy of the shipped input probe with a table whose levels straddle a message's p_unsafe: low allows it,
    high blocks it, and the verdict names the level."""
    from flashguard.rails.moderation import moderate_input
    from flashguard.rails.probe import find_probe
    from flashguard.rails.state import rail_state

    rail_state(engine).forget_probes()
    shipped, _ = find_probe(engine, ModerationSettings.input_defaults().prompt, "input")
    assert shipped is not None
    messages = [{"role": "user", "content": "How do I boil an egg?"}]
    first = moderate_input(engine, messages, ModerationSettings.input_defaults(guard="probe"))   # the probe's levels
    p = first.p_unsafe
    table = {"low": min(0.99, p + 0.01), "medium": min(0.99, p + 0.005), "high": max(0.001, p - 0.01)}
    path = dataclasses.replace(shipped, strictness=table).save(tmp_path / "input-probe.json")
    try:
        for level, allowed in (("low", True), ("high", False)):
            settings = ModerationSettings.input_defaults(probe=str(path), strictness=level, guard="probe")
            v = moderate_input(engine, messages, settings)
            assert abs(v.p_unsafe - p) < 1e-4
            assert (v.allowed, v.threshold, v.strictness) == (allowed, table[level], level)
            assert f"strictness {level}" in v.reason
    finally:
        rail_state(engine).forget_probes()
