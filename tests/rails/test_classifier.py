"""The question classifier (rails/classifier.py, issue 29 item 2): fit, scores and thresholds, the file (round trip,
bad files -> one error naming the file), the config key, the shipped files, and which verdict a rail uses.
Fast: no model, except the slow tests at the end (the embedded engine)."""

import dataclasses
import json
import math

import pytest
import torch

from flashguard import ConfigError
from flashguard.rails import classifier as C
from flashguard.rails.lab.guard_fit import operating_points
from flashguard.rails.moderation import ModerationSettings, choose_classifier, moderate_input
from flashguard.rails.probe import STRICTNESS


def classifier(**over) -> C.Classifier:
    base = dict(rail="input", questions=C.QUESTIONS["input"][:3], weight=(1.0, 0.5, -0.25), bias=-0.5,
                threshold=0.6, strictness={"low": 0.7, "medium": 0.6, "high": 0.4}, model_file="m.gguf",
                model_bytes=10, provenance={"rows": 3}, metrics={"loso_score": 0.8})
    return C.Classifier(**{**base, **over})


def separable(n: int = 200, seed: int = 0):
    """Harmful rows' log-odds lean to the unsafe answer on two questions of three (the third is noise)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor([i % 2 for i in range(n)], dtype=torch.float64)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    x[:, 0] += 3 * y - 1
    x[:, 1] -= 2 * y
    return x, y


# ---- fit, scores, thresholds ------------------------------------------------------------------------------
def test_a_fit_scores_harmful_rows_above_benign_ones():
    x, y = separable()
    w, b = C.fit(x, y)
    p = C.scores(x, w, b)
    assert float(p[y > 0].mean()) > 0.8 > 0.2 > float(p[y == 0].mean())
    assert float(w[0]) > 0 > float(w[1])   # the sign follows each question's polarity
    c = classifier(weight=tuple(float(v) for v in w), bias=b)
    assert c.p_unsafe(x[0].tolist()) == pytest.approx(float(p[0]), abs=1e-9)


def test_held_out_scores_never_come_from_a_fit_that_saw_the_group():
    x, y = separable()
    groups = ["a" if i < 100 else "b" for i in range(200)]
    oof = C.held_out_scores(x, y, groups, [True] * 200)
    w, b = C.fit(x[100:], y[100:])   # group a is scored by the fit on b alone
    assert torch.allclose(oof[:100], C.scores(x[:100], w, b))


def test_the_medium_threshold_blocks_at_most_five_percent_of_benign_rows():
    x, y = separable(400)
    oof = C.held_out_scores(x, y, ["a" if i % 4 < 2 else "b" for i in range(400)], [True] * 400)
    levels = operating_points(oof, y.long().tolist(), [True] * 400)
    assert levels["medium"]["benign_blocked"] <= 0.05 and levels["medium"]["harmful_blocked"] > 0.5
    assert levels["low"]["threshold"] >= levels["medium"]["threshold"] >= levels["high"]["threshold"]
    c = classifier(strictness={k: v["threshold"] for k, v in levels.items()})
    assert [c.threshold_for(s) for s in STRICTNESS] == [levels[s]["threshold"] for s in STRICTNESS]


def test_top_view_keeps_the_top_and_floors_the_rest_as_a_server_returns_them():
    lp = torch.log_softmax(torch.randn(1000, generator=torch.Generator().manual_seed(1)), 0)
    v = C.top_view(lp)
    top = torch.topk(lp, C.TOP_LOGPROBS)
    assert torch.equal(v[top.indices], top.values)
    assert int((v == top.values[-1]).sum()) == 1000 - C.TOP_LOGPROBS + 1
    assert torch.equal(C.top_view(v), v)   # a server's reading comes back unchanged


def test_the_wrong_number_of_features_is_an_error():
    with pytest.raises(C.ClassifierError, match="3 questions' log-odds, got 2"):
        classifier().p_unsafe([0.0, 1.0])


# ---- the file ---------------------------------------------------------------------------------------------
def test_a_classifier_file_round_trips(tmp_path):
    c = classifier()
    back = C.Classifier.load(c.save(tmp_path / "m-questions-input.json"))
    assert back == c and back.provenance == c.provenance and back.metrics == c.metrics
    assert back.p_unsafe([1.0, 2.0, 3.0]) == pytest.approx(c.p_unsafe([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("change, says", [
    (lambda d: d.update(format="flashguard-probe/3"), "format is 'flashguard-probe/3'"),
    (lambda d: d.pop("weight"), "KeyError"),
    (lambda d: d.update(weight=[1.0, 2.0]), "3 questions and 2 weights"),
    (lambda d: d.update(bias=float("nan")), "non-finite"),
    (lambda d: d.update(strictness={"low": 0.2, "medium": 0.5, "high": 0.9}), "must not rise"),
    (lambda d: d.update(strictness={"medium": 0.5}), "strictness must map low, medium, high"),
    (lambda d: d.update(rail="middle"), "rail is 'middle'"),
    (lambda d: d["questions"][0].update(unsafe_answer=" "), "unsafe_answer"),
])
def test_a_bad_file_is_one_error_naming_it_and_the_command(tmp_path, change, says):
    data = classifier().to_json()
    change(data)
    path = tmp_path / "m-questions-input.json"
    path.write_text(json.dumps(data))
    with pytest.raises(C.ClassifierError) as err:
        C.Classifier.load(path)
    assert says in str(err.value) and str(path) in str(err.value)
    assert "flashguard calibrate --backend openai --sources --rail input" in str(err.value)


def test_a_file_that_is_not_json_is_the_same_error(tmp_path):
    path = tmp_path / "m-questions.json"
    path.write_text("{not json")
    with pytest.raises(C.ClassifierError, match="JSONDecodeError.*flashguard calibrate --backend openai --sources`"):
        C.Classifier.load(path)


# ---- the shipped files and the config key -----------------------------------------------------------------
@pytest.mark.parametrize("rail", ["input", "output"])
def test_the_embedded_models_classifiers_ship_with_their_provenance(rail):
    from flashguard.engine import loader

    src = loader.resolve_model(None)
    engine = type("Src", (), {"source": src})()   # the model's file: what a classifier is matched on
    path = C.SHIPPED_DIR / C.file_name(engine, rail)
    c = C.Classifier.load(path)
    assert c.rail == rail and c.matches(engine)
    assert 3 <= len(c.questions) <= 6 and c.questions[0] == C.QUESTIONS[rail][0]
    assert set(c.strictness) == set(STRICTNESS)
    for key in ("sources", "rows_by_source", "rows", "flashguard_commit", "date", "validation"):
        assert c.provenance[key], key
    assert "xstest" not in json.dumps(c.provenance).lower()


@pytest.mark.parametrize("side, section", [("output", "flashguard_moderation"),
                                           ("input", "flashguard_input_moderation")])
def test_the_classifier_key(side, section):
    assert ModerationSettings.from_custom_data({}, side=side).classifier == "auto"
    assert ModerationSettings.from_custom_data({section: {"classifier": False}}, side=side).classifier == "off"
    assert ModerationSettings.from_custom_data({section: {"classifier": "/x.json"}}, side=side).classifier == "/x.json"
    with pytest.raises(ConfigError, match=rf"custom_data\.{section}\.classifier must be auto, off or the path"):
        ModerationSettings.from_custom_data({section: {"classifier": 3}}, side=side)


# ---- which verdict: the embedded engine --------------------------------------------------------------------
@pytest.mark.slow
def test_in_process_probe_off_keeps_the_single_question_and_a_named_file_is_used(engine, tmp_path):
    assert choose_classifier(engine, ModerationSettings.input_defaults(probe="off")) is None
    path = C.SHIPPED_DIR / C.file_name(engine, "input")
    settings = ModerationSettings.input_defaults(probe="off", classifier=str(path), guard="probe")   # no guard adapter
    assert choose_classifier(engine, settings) == C.Classifier.load(path)
    v = moderate_input(engine, [{"role": "user", "content": "Hello"}], settings)
    assert v.method == "classifier" and v.path == "branch" and v.strictness == "medium"
    assert v.threshold == C.Classifier.load(path).threshold_for("medium")
    # one read per question, each branching off the conversation: the session keeps the conversation only
    assert engine.session_ids == engine.encode_messages([{"role": "user", "content": "Hello"}])[:len(engine.session_ids)]
    wrong = dataclasses.replace(C.Classifier.load(path), model_file="other.gguf").save(tmp_path / "other.json")
    with pytest.raises(C.ClassifierError, match=r"flashguard_input_moderation\.classifier: .* was fitted for the input "
                                                r"rail of other\.gguf"):
        choose_classifier(engine, ModerationSettings.input_defaults(probe="off", classifier=str(wrong)))


@pytest.mark.slow
def test_the_in_process_features_are_the_rails_own_reads(engine):
    """``collect`` (what calibrate fits on) reads the same log-odds as the rail's verdict for the same message."""
    from flashguard.rails.lab.calibrate import earlier_exchange

    c = C.Classifier.load(C.SHIPPED_DIR / C.file_name(engine, "input"))
    row = {"user": "How do I boil an egg?", "block": False}
    x = C.collect(engine, "input", [row], c.questions)[0]
    assert earlier_exchange(0, row) == []
    settings = ModerationSettings.input_defaults(probe="off", guard="probe",
                                                 classifier=str(C.SHIPPED_DIR / C.file_name(engine, "input")))
    v = moderate_input(engine, [{"role": "user", "content": row["user"]}], settings)
    assert v.p_unsafe == pytest.approx(c.p_unsafe(x.tolist()), abs=1e-6)
    assert v.p_question == pytest.approx(1 / (1 + math.exp(-float(x[0]))), abs=1e-6)
