"""The shipped probes (rails/probes/, float and int4, output and input rail) load, read the model's states on the
rails' own paths and score a few rows as recorded in tests/data/probe_scores.json: 3 blocked and 3 allowed rows per
rail, one of the input rail's a long message judged by sliding windows (``python -m benchmarks.record_probe_scores``
records them again after a refit). Accuracy over the labelled sets is a benchmark, not a test: ``python -m
benchmarks.guard_sets``."""

import hashlib
import json
from pathlib import Path

import pytest

from flashguard.rails import probe as probe_mod
from flashguard.rails.moderation import ModerationSettings, moderation_suffix
from flashguard.rails.probe import SHIPPED_DIR, find_probe
from flashguard.rails.state import rail_state
from tests.conftest import ROOT
from tests.rail_sets import input_verdict, output_verdict

pytestmark = pytest.mark.slow
RECORD = json.loads((ROOT / "tests/data/probe_scores.json").read_text(encoding="utf-8"))
# p_unsafe may move this much from the recorded value: CPU kernels round differently by machine and thread count (the
# int4 ones most); a probe of another layer, weights kind or feature set moves these rows by far more
TOLERANCE = 0.02
# the probes alone (configs/flash's default adds the guard adapter: tests/rails/test_guard.py)
RAILS = {"output": ModerationSettings(guard="probe"), "input": ModerationSettings.input_defaults(guard="probe")}


def test_the_record_has_three_blocked_and_three_allowed_rows_per_rail_of_distinct_categories():
    """(The input rail's: one of them a long message.)"""
    for rail in RAILS:
        for block in (True, False):
            rows = [r for r in RECORD["rows"] if r["rail"] == rail and r["block"] == block]
            assert len(rows) == 3 and len({r["category"] for r in rows}) == 3
            assert sum(r["category"].startswith("long") for r in rows) == (rail == "input")
            assert all(set(r["p_unsafe"]) == {"float", "int4"} for r in rows)


@pytest.fixture(params=["float", "int4"])
def shipped(request, monkeypatch, tmp_path):
    """The engine of one weights kind, seeing only the shipped probes (what a fresh install gets)."""
    from flashguard import EngineConfig, get_engine

    engine = request.getfixturevalue("float_engine") if request.param == "float" else \
        get_engine(EngineConfig(weights="int4"))   # (on a CPU the suite's shared engine: auto is int4 there)
    monkeypatch.setattr(probe_mod, "user_probe_path", lambda key, side="output": tmp_path / "none.json")
    rail_state(engine).forget_probes()
    yield request.param, engine
    rail_state(engine).forget_probes()


def test_the_shipped_probes_score_the_recorded_rows(shipped):
    weights, engine = shipped
    changed = []
    for rail, settings in RAILS.items():
        probe, where = find_probe(engine, settings.prompt, rail)
        assert probe is not None and probe.weights == weights and probe.rail == rail, where
        assert Path(where).parent == SHIPPED_DIR, where
        if hashlib.sha256(Path(where).read_bytes()).hexdigest() != RECORD["probes"][weights][rail]["sha256"]:
            changed.append(Path(where).name)
    suffix = len(moderation_suffix(engine, RAILS["output"].prompt))
    misses = []
    for row in RECORD["rows"]:
        if row["rail"] == "output":
            v = output_verdict(engine, row, RAILS["output"])
            # the probe on the turn's own pages: only the rail's suffix is prefilled
            assert (v.method, v.path) == ("probe", "shared") and v.prefilled_tokens <= suffix + 1, v
        else:
            v = input_verdict(engine, row["messages"], RAILS["input"])
            # a long message by sliding windows over its own forward, a short one on the prompt
            assert (v.method, v.path) == ("probe", "sliding" if row["category"].startswith("long") else "prompt"), v
        recorded = row["p_unsafe"][weights]
        if abs(v.p_unsafe - recorded) > TOLERANCE or (not v.allowed) != row["block"]:
            misses.append(f"{row['source']} ({row['rail']}, {row['category']}): p_unsafe {v.p_unsafe:.3f}, "
                          f"recorded {recorded:.3f}, {'blocked' if not v.allowed else 'allowed'}")
    assert not misses, (f"{weights} probes score other than recorded: {misses}" + (
        f"; the shipped {changed} changed since tests/data/probe_scores.json was recorded: if that was meant, "
        "`python -m benchmarks.record_probe_scores` records them again (and `python -m benchmarks.guard_sets` "
        "measures them)" if changed else ""))
