"""Training on kept states (rails/lab/guard_cache.py) on tiny random models: ``replay`` from the kept upper-layer states
gives the logits of the whole prompt run with the adapter on (``guard_train.forward_batch``), for both rails and
both architectures; an upper-layer guard trained there and written to a folder is what the engine's rails read,
with the same p_unsafe."""

from __future__ import annotations

import json

import pytest
import torch

from flashguard.engine.alora import TrainableLora
from flashguard.engine.loader import ModelSource
from flashguard.rails import guard
from flashguard.rails.lab import guard_cache as gc, guard_train as gt
from flashguard.rails.moderation import ModerationSettings, moderate_input

from tests import tiny
from tests.rails.test_guard import rows


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_replay_is_the_whole_prompt_with_the_adapter(arch):
    net, tok = tiny.model(arch, layers=4), tiny.tokenizer()
    net.requires_grad_(False)
    exs = gt.examples(rows(12), tok, 256, log=lambda *_: None)
    first = gc.upper_layers(net)
    assert first == 3
    lora = TrainableLora(net, gt.TARGETS, 4, 8, 0.0, seed=1, first_layer=first)
    with torch.no_grad():
        for b in lora.b:
            b.normal_(0, 0.3)
    kept = gc.keep(net, exs, first, log=lambda *_: None)
    for side in ("input", "output"):
        idx = [i for i, e in enumerate(exs) if e.side == side]
        with torch.no_grad():
            got = gc.replay(net, kept, idx, lora.deltas())
            want = gt.forward_batch(net, [exs[i] for i in idx], lora.deltas())
            base = gt.forward_batch(net, [exs[i] for i in idx], None)
        assert (want - base).abs().max() > 0.1                                  # the adapter matters
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)            # (kept in float16)


def test_an_upper_layer_guard_is_what_the_rails_read(tmp_path):
    net, tok = tiny.model("qwen2", layers=4), tiny.tokenizer()
    net.requires_grad_(False)
    data = rows(64)
    exs = gt.examples(data, tok, 256, log=lambda *_: None)
    kept = gc.keep(net, exs, gc.upper_layers(net), log=lambda *_: None)
    cfg = gt.TrainConfig(rank=8, alpha=16, lr=1e-2, epochs=4, max_batch=16, dropout=0.0)
    answers = guard.answer_tokens(tok)
    lora = gc.train(net, kept, list(range(len(exs))), answers, cfg, log=lambda *_: None)
    p = gc.score(net, kept, list(range(len(exs))), lora, answers)
    model_dir = tmp_path / "model"
    levels = {s: {"low": 0.5, "medium": 0.5, "high": 0.5} for s in ("input", "output")}
    gt.write_guard(tmp_path / "guard", lora, ModelSource(str(model_dir), None, "tiny"), tok, ["float"], levels, {},
                   cfg, "tiny")
    config = json.loads((tmp_path / "guard" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [3] and config["alora_invocation_tokens"] == guard.invocation(tok)
    engine = tiny.engine(model_dir, "qwen2", net=tiny.model("qwen2", layers=4), guard_adapter=str(tmp_path / "guard"))
    assert engine.info()["guard"]["modules"] == 7
    for i, r in enumerate(data[:8]):
        if r["side"] == "input":
            v = moderate_input(engine, r["messages"], ModerationSettings.input_defaults())
            assert v.method == "adapter" and abs(v.p_unsafe - p[i]) < 2e-3, (i, v.p_unsafe, p[i])
