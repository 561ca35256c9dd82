"""Output probes that also read the mean of the moderation suffix's states (``features: last+mean``, probe format 2;
issue 14, docs/moderation.md "Replies after long pastes"), on a tiny random model: the rail's verdict on a turn's
shared pages is the one computed by hand from the model's own forward over the turn and the suffix, the rail still
prefills only its suffix, and the probe file's version says what its mean is (version 1 files load as before)."""

import json
import math

import pytest
import torch

from flashguard.rails.lab.calibrate import collect
from flashguard.rails.moderation import ModerationSettings, answer_ids, moderate, moderation_suffix
from flashguard.rails.probe import FORMAT, FORMAT_2, ModelKey, Probe, ProbeError, answer_log_odds
from flashguard.rails.state import rail_state
from tests import tiny

LAYER = 1


def mean_probe(engine, seed: int = 0) -> Probe:
    key = ModelKey.of(engine)
    d = engine.model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    # the mean's weights larger than the last state's: a mean over other positions gives another verdict
    weight = tuple(float(w) for w in torch.randn(2 * d, generator=g) * torch.tensor([0.05] * d + [20.0] * d))
    return Probe(layer=LAYER, weight=weight, bias=0.1, answer_weight=0.2, threshold=0.5,
                 question=ModerationSettings().prompt, model_file=key.file, model_bytes=key.bytes,
                 model_identity=key.identity, weights=key.weights, rail="output", features="last+mean")


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def by_hand(engine, probe, ids, start) -> float:
    """p_unsafe from the model's own forward over all of ``ids`` (no cache): the last state and the mean over
    ``ids[start:]`` at the probe's layer, and the question's Yes/No log-odds."""
    with torch.no_grad():
        out = engine.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    h = out.hidden_states[probe.layer][0]
    x = torch.cat([h[-1], h[start:].mean(0)]).double()
    s = ModerationSettings()
    odds = answer_log_odds(torch.log_softmax(out.logits[0, -1].float(), -1), answer_ids(engine, s.unsafe_answer),
                           answer_ids(engine, s.safe_answer))
    z = float(x @ torch.tensor(probe.weight, dtype=torch.float64)) + probe.answer_weight * odds + probe.bias
    return 1 / (1 + math.exp(-z))


def test_a_last_plus_mean_output_probe_gives_the_verdict_computed_by_hand(tmp_path):
    engine = tiny.engine(tmp_path / "m", prefill_chunk=16)
    path = mean_probe(engine).save(tmp_path / "probe.json")
    saved = json.loads(path.read_text())
    assert saved["format"] == FORMAT_2 and saved["mean_over"] == "suffix" and saved["features"] == "last+mean"
    probe = Probe.load(path)
    settings = ModerationSettings(probe=str(path))
    suffix = len(moderation_suffix(engine, settings.prompt))
    for n, (user, bot) in enumerate([(tiny.text(30), tiny.text(50, 1)), (tiny.text(300, 2), tiny.text(20, 3))]):
        prompt = engine.encode_messages([{"role": "user", "content": user}])
        reply = engine.tokenizer(bot, add_special_tokens=False)["input_ids"]
        turn = engine.teacher_force(prompt, reply, bot)
        v = moderate(engine, bot, user, settings, use_memo=False)
        assert v.path == "shared" and v.method == "probe"
        assert v.prefilled_tokens <= suffix + 1   # the rail's cost: its suffix only, the mean read in that forward
        ids = list(turn.prompt_ids) + list(turn.output_ids) + moderation_suffix(engine, settings.prompt)
        start = len(ids) - suffix
        assert logit(v.p_unsafe) == pytest.approx(logit(by_hand(engine, probe, ids, start)), abs=1e-3), n
        # and a mean over one position more or less would show: the check reads the suffix's positions exactly
        assert min(abs(logit(v.p_unsafe) - logit(by_hand(engine, probe, ids, start + k))) for k in (-1, 1)) > 3e-3
    # calibration reads the same features through the rail's path (collect): last state and suffix mean
    rows = [{"user": tiny.text(30), "bot": tiny.text(50, 1), "block": False}]
    hidden, odds, pooled = collect(engine, rows)
    ids = engine.encode_messages([{"role": "user", "content": rows[0]["user"]}]) + \
        engine.tokenizer(rows[0]["bot"], add_special_tokens=False)["input_ids"] + \
        moderation_suffix(engine, settings.prompt)
    p = probe.p_unsafe(hidden[0], float(odds[0]), pooled[0, LAYER])
    assert logit(p) == pytest.approx(logit(by_hand(engine, probe, ids, len(ids) - suffix)), abs=1e-3)
    rail_state(engine).forget_probes()


def test_probe_file_versions_say_what_the_mean_is(tmp_path):
    engine = tiny.engine(tmp_path / "m")
    probe = mean_probe(engine)
    v2 = probe.to_json()
    # a version 1 file keeps its meaning: an output probe with a mean is refused, a last-state one loads as before
    bad = dict(v2, format=FORMAT)
    bad.pop("mean_over")
    (tmp_path / "v1-mean.json").write_text(json.dumps(bad))
    with pytest.raises(ProbeError, match="input probes only"):
        Probe.load(tmp_path / "v1-mean.json")
    last = dict(bad, features="last", weight=v2["weight"][:engine.model.config.hidden_size])
    (tmp_path / "v1.json").write_text(json.dumps(last))
    loaded = Probe.load(tmp_path / "v1.json")
    assert loaded.features == "last" and loaded.format == FORMAT and loaded.to_json()["format"] == FORMAT
    assert "mean_over" not in loaded.to_json()
    # version 2 is an output probe over the suffix, nothing else
    for change in ({"mean_over": "message"}, {"rail": "input"}, {"features": "last"}):
        (tmp_path / "v2-bad.json").write_text(json.dumps(dict(v2, **change)))
        with pytest.raises(ProbeError, match="flashguard-probe/2"):
            Probe.load(tmp_path / "v2-bad.json")
    (tmp_path / "v2.json").write_text(json.dumps(v2))
    loaded = Probe.load(tmp_path / "v2.json")
    assert (loaded.format, loaded.features, loaded.mean_over, loaded.rail) == (FORMAT_2, "last+mean", "suffix", "output")
