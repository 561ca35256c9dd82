"""The guard end to end on a tiny random model: ``guard_train`` learns a made-up rule on the rails' own prompts,
writes a guard folder, the engine loads it (``guard_adapter``), and both rails decide by it (``method="adapter"``)
with the same p_unsafe the training's scorer gives for the same conversation, on the conversation's own pages."""

from __future__ import annotations

import pytest
import torch

from flashguard.engine.loader import ModelSource
from flashguard.errors import ConfigError
from flashguard.rails import guard
from flashguard.rails.lab import guard_train as gt
from flashguard.rails.moderation import ModerationSettings, moderate, moderate_input

from tests import tiny

WORDS = ["sea", "wind", "tide", "salt", "rope", "sail", "stone", "light"]


def rows(n: int, seed: int = 0) -> list[dict]:
    """Made-up rows: a message (or reply) with the word "zebra" is unsafe, others safe; both rails."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        words = [WORDS[int(j)] for j in torch.randint(len(WORDS), (6,), generator=g)]
        block = i % 2 == 0
        if block:
            words[int(torch.randint(6, (1,), generator=g))] = "zebra"
        text = " ".join(words)
        side = "input" if i % 4 < 2 else "output"
        msgs = [{"role": "user", "content": text}] if side == "input" else \
            [{"role": "user", "content": "say"}, {"role": "assistant", "content": text}]
        out.append({"messages": msgs, "side": side, "block": block, "category": "general_harm" if block else "everyday",
                    "source": f"s{i % 3}", "train": True})
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guard")
    model_dir = tmp_path_factory.mktemp("model")
    net, tok = tiny.model("qwen2"), tiny.tokenizer()
    net.requires_grad_(False)
    exs = gt.examples(rows(96), tok, 256, log=lambda *_: None)
    cfg = gt.TrainConfig(rank=8, alpha=16, lr=1e-2, epochs=30, max_batch=32, dropout=0.0, warmup=0.1)
    answers = guard.answer_tokens(tok)
    lora = gt.train(net, exs, list(range(len(exs))), answers, cfg, log=lambda *_: None)
    source = ModelSource(folder=str(model_dir), gguf_file=None, label="tiny")
    p = gt.score(net, lora, exs, list(range(len(exs))), answers, cfg)
    levels = {s: {"low": 0.5, "medium": 0.5, "high": 0.5} for s in ("input", "output")}
    gt.write_guard(folder, lora, source, tok, ["float"], levels, {}, cfg, "tiny")
    return folder, model_dir, exs, p


def test_training_learns_the_rule(trained):
    _, _, exs, p = trained
    harmful = [p[i] for i, e in enumerate(exs) if e.block]
    benign = [p[i] for i, e in enumerate(exs) if not e.block]
    assert sum(harmful) / len(harmful) > sum(benign) / len(benign) + 0.3


def test_the_rails_read_what_training_scored(trained):
    folder, model_dir, exs, p = trained
    engine = tiny.engine(model_dir, "qwen2", guard_adapter=str(folder))
    settings = ModerationSettings.input_defaults()
    for i, e in enumerate(exs[:8]):
        messages = rows(96)[i]["messages"]
        if e.side == "input":
            v = moderate_input(engine, messages, settings)
            assert v.path == "branch"
        else:
            engine.teacher_force(engine.encode_messages(messages[:1]),
                                 tiny.tokenizer().encode(messages[1]["content"]), messages[1]["content"])
            v = moderate(engine, messages[1]["content"], messages[0]["content"], ModerationSettings())
            # only the end of turn, the next turn's header ("<|im_end|>\n<|im_start|>user\n": 8 characters here) and
            # the question ran
            assert v.path == "shared" and v.prefilled_tokens <= len(e.ids) - e.start + 8, (v, len(e.ids), e.start)
        assert v.method == "adapter" and v.decided_by == "adapter, strictness medium"
        assert abs(v.p_unsafe - p[i]) < 1e-3, (i, e.side)


def test_the_generation_never_sees_the_adapter(trained):
    from flashguard.engine.sampling import SamplingParams

    folder, model_dir, _, _ = trained
    guarded = tiny.engine(model_dir, "qwen2", guard_adapter=str(folder))
    plain = tiny.engine(model_dir, "qwen2", guard_adapter="off")
    messages = [{"role": "user", "content": "sea wind zebra tide"}]
    moderate_input(guarded, messages, ModerationSettings.input_defaults())
    ids = guarded.encode_messages(messages)
    assert guarded.generate(ids, SamplingParams(max_tokens=16)).text == plain.generate(ids, SamplingParams(
        max_tokens=16)).text


def test_guard_modes(trained, tmp_path):
    folder, model_dir, _, _ = trained
    messages = [{"role": "user", "content": "sea wind tide"}]
    engine = tiny.engine(model_dir, "qwen2", guard_adapter=str(folder))
    assert moderate_input(engine, messages, ModerationSettings.input_defaults(guard="question")).method == "question"
    off = tiny.engine(tmp_path / "other", "qwen2", guard_adapter="off")
    with pytest.raises(ConfigError, match=r"flashguard_input_moderation\.guard is adapter"):
        moderate_input(off, messages, ModerationSettings.input_defaults(guard="adapter"))
    with pytest.raises(ConfigError, match=r"guard must be one of auto, adapter, probe, question"):
        ModerationSettings.from_custom_data({"flashguard_moderation": {"guard": "lora"}})


def _probe(engine, rail: str, seed: int):
    from flashguard.rails.probe import ModelKey, Probe

    key = ModelKey.of(engine)
    d = engine.model.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    return Probe(layer=1, weight=tuple(float(w) for w in torch.randn(d, generator=g) * 0.5), bias=0.1,
                 answer_weight=0.0, threshold=0.5,
                 question=(ModerationSettings() if rail == "output" else ModerationSettings.input_defaults()).prompt,
                 model_file=key.file, model_bytes=key.bytes, model_identity=key.identity, weights=key.weights,
                 rail=rail)


def test_the_adapter_and_the_probe_it_was_measured_with_decide_together(trained, tmp_path):
    """``guard: auto`` with a probe named in guard.json's ``with_probe``: one verdict from both (the logits
    averaged at the table's weight, blocked at the pair's threshold), the same as each alone combined by hand;
    a probe the guard was not measured with leaves the adapter alone; ``guard: adapter`` is the adapter alone."""
    import json
    import math
    import shutil

    folder, model_dir, _, _ = trained
    paired_folder = tmp_path / "guard"
    shutil.copytree(folder, paired_folder)
    engine = tiny.engine(model_dir, "qwen2", guard_adapter="off")
    files = {}
    for rail, seed in (("input", 1), ("output", 2)):
        files[rail] = _probe(engine, rail, seed).save(tmp_path / f"probe-{rail}.json")
    from flashguard.rails.probe import Probe

    meta = json.loads((paired_folder / "guard.json").read_text())
    meta["with_probe"] = {"weight": 0.25, "probes": {r: [Probe.load(f).digest] for r, f in files.items()},
                          "strictness": {r: {"low": 0.9, "medium": 0.6, "high": 0.3} for r in files}}
    (paired_folder / "guard.json").write_text(json.dumps(meta))
    engine = tiny.engine(model_dir, "qwen2", guard_adapter=str(paired_folder))

    def logit(p):
        return math.log(p / (1 - p))

    messages = [{"role": "user", "content": "sea wind zebra tide"}]
    inp = lambda mode, **kw: ModerationSettings.input_defaults(probe=str(files["input"]), guard=mode, **kw)  # noqa
    a = moderate_input(engine, messages, inp("adapter"))
    b = moderate_input(engine, messages, inp("probe"))
    v = moderate_input(engine, messages, inp("auto", strictness="high"))
    assert (a.method, b.method, v.method) == ("adapter", "probe", "adapter+probe")
    assert logit(v.p_unsafe) == pytest.approx(0.25 * logit(a.p_unsafe) + 0.75 * logit(b.p_unsafe), abs=1e-4)
    assert v.threshold == 0.3 and v.allowed == (v.p_unsafe < 0.3) and v.decided_by == "adapter+probe, strictness high"

    # the output rail on the turn's own pages: both suffixes only
    reply = "salt rope zebra"
    engine.teacher_force(engine.encode_messages([{"role": "user", "content": "say"}]),
                         tiny.tokenizer().encode(reply), reply)
    out = lambda mode: ModerationSettings(probe=str(files["output"]), guard=mode)  # noqa: E731
    a, b = (moderate(engine, reply, "say", out(m), use_memo=False) for m in ("adapter", "probe"))
    v = moderate(engine, reply, "say", out("auto"), use_memo=False)
    assert v.method == "adapter+probe" and v.threshold == 0.6
    assert logit(v.p_unsafe) == pytest.approx(0.25 * logit(a.p_unsafe) + 0.75 * logit(b.p_unsafe), abs=1e-4)
    assert v.path == "shared" and v.prefilled_tokens <= a.prefilled_tokens + b.prefilled_tokens

    # a probe it was not measured with: the adapter alone
    other = _probe(engine, "input", 7).save(tmp_path / "other.json")
    v = moderate_input(engine, messages, ModerationSettings.input_defaults(probe=str(other)))
    assert v.method == "adapter"


def test_a_pairing_table_without_its_levels_leaves_the_adapter_alone_and_says_so(trained, tmp_path, caplog):
    """guard.json's with_probe naming the probe but lacking a rail's levels: never a silent 0.5 cut; the adapter
    decides alone and one warning names the file and the tool that writes them."""
    import json
    import logging
    import shutil

    from flashguard.rails.probe import Probe

    folder, model_dir, _, _ = trained
    broken = tmp_path / "guard"
    shutil.copytree(folder, broken)
    engine = tiny.engine(model_dir, "qwen2", guard_adapter="off")
    path = _probe(engine, "input", 1).save(tmp_path / "probe-input.json")
    meta = json.loads((broken / "guard.json").read_text())
    meta["with_probe"] = {"weight": {"input": 0.7}, "probes": {"input": [Probe.load(path).digest]},
                          "strictness": {"input": {"low": 0.9, "medium": 0.6}}}   # no "high"
    (broken / "guard.json").write_text(json.dumps(meta))
    engine = tiny.engine(model_dir, "qwen2", guard_adapter=str(broken))
    settings = ModerationSettings.input_defaults(probe=str(path))
    with caplog.at_level(logging.WARNING, logger="flashguard"):
        for _ in range(2):
            v = moderate_input(engine, [{"role": "user", "content": "sea wind tide"}], settings)
            assert v.method == "adapter"
    warnings = [r.getMessage() for r in caplog.records if "with_probe" in r.getMessage()]
    assert len(warnings) == 1 and "guard.json" in warnings[0] and "tools/guard_levels.py" in warnings[0]
