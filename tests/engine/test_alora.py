"""The guard's activated LoRA (engine/alora.py, ``guard_adapter``) against PEFT's own aLoRA on tiny random models:
``Engine.read(adapter_from=...)`` gives the logits PEFT gives for the whole sequence with the adapter on from the
invocation, while the conversation's pages stay the base model's (reused, never recomputed) and nothing the adapter
computed stays in the session or can be adopted by another sequence; a guard for another model, or a corrupt one, is
a ConfigError naming guard_adapter."""

from __future__ import annotations

import json

import pytest
import torch

from flashguard.engine import alora
from flashguard.engine.sampling import SamplingParams
from flashguard.errors import ConfigError

from tests import tiny

peft = pytest.importorskip("peft")

TAG = "<|im_start|>user\n[g]"


def invocation() -> list[int]:
    return tiny.tokenizer().encode(TAG, add_special_tokens=False)


def make_guard(folder, arch="qwen2", targets=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"), model_dir=None,
               weights=("float", "int4"), seed=3):
    """A guard folder for the tiny model: random, non-zero deltas (far above float rounding), its guard.json made
    for ``model_dir`` (the tiny engine's folder)."""
    net = tiny.model(arch)
    trainable = alora.TrainableLora(net, targets, r=4, alpha=8, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in trainable.b:
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    trainable.save(folder, invocation(), base_model="tiny", dtype=torch.float32)
    meta = {"format": alora.FORMAT, "model_file": model_dir.name, "model_bytes": 0, "weights": list(weights),
            "questions": {"input": "[g] in?", "output": "[g] out?"}, "answers": {"unsafe": "No", "safe": "Yes"}}
    (folder / alora.META_FILE).write_text(json.dumps(meta))
    return folder


def peft_logits(arch, folder, ids):
    model = peft.PeftModel.from_pretrained(tiny.model(arch), str(folder)).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def base_logits(arch, ids):
    with torch.no_grad():
        return tiny.model(arch)(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("arch, cache", [("qwen2", "tiered"), ("llama", "dynamic")])
def test_guarded_read_is_pefts_alora_on_shared_pages(tmp_path, arch, cache):
    model_dir = tmp_path / "model"
    folder = make_guard(tmp_path / "guard", arch, model_dir=model_dir)
    engine = tiny.engine(model_dir, arch, guard_adapter=str(folder), kv_cache=cache)
    assert engine.guard is not None and engine.info()["guard"]["modules"] == 5 * 2
    conv = engine.encode_messages([{"role": "user", "content": tiny.text(150)}])
    engine.generate(conv, SamplingParams(max_tokens=12))
    turn = engine.turns[-1]
    start = len(turn.prompt_ids) + len(turn.output_ids) + 2          # the reply, then "<|im_end|>\n"
    ids = list(turn.prompt_ids) + list(turn.output_ids) + tiny.tokenizer().encode("<|im_end|>\n") + \
        invocation() + tiny.tokenizer().encode(" is it safe?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[start:start + len(invocation())] == invocation()
    r = engine.read(ids, adapter_from=start)
    # the conversation's pages were reused (only the end of turn and the suffix ran) ...
    assert r.reused >= len(turn.prompt_ids) + len(turn.output_ids) - 1 and r.prefilled <= len(ids) - start + 3
    # ... and the verdict's logits are PEFT's aLoRA over the whole sequence
    want = peft_logits(arch, folder, ids)
    torch.testing.assert_close(r.logprobs, torch.log_softmax(want, -1), atol=2e-4, rtol=1e-4)
    assert (want - base_logits(arch, ids)).abs().max() > 0.1       # the adapter matters
    # afterwards the session holds the base conversation only: the next read of the same ids without the adapter
    # runs the suffix again and gives the base model's logits
    assert engine.session_ids == ids[:start]
    plain = engine.read(ids)
    assert plain.reused == start
    torch.testing.assert_close(plain.logprobs, torch.log_softmax(base_logits(arch, ids), -1), atol=2e-4, rtol=1e-4)


def test_guard_pages_are_never_adopted(tmp_path):
    """A suffix long enough to fill pages: after the guarded read those pages are not in the store under the
    conversation's chain, so a new session adopting the same ids reuses the base part only."""
    model_dir = tmp_path / "model"
    folder = make_guard(tmp_path / "guard", model_dir=model_dir)
    engine = tiny.engine(model_dir, "qwen2", guard_adapter=str(folder), kv={"page_size": 16})
    conv = engine.encode_messages([{"role": "user", "content": tiny.text(100)}])
    start = len(conv)
    ids = conv + invocation() + tiny.tokenizer().encode(" " + tiny.text(70, seed=2) + "?<|im_end|>\n")
    engine.read(ids, adapter_from=start)
    engine.read(ids, adapter_from=start)   # the second: the same pages reused, the same private suffix again
    engine.reset_session(keep_pages=True)
    r = engine.read(ids)
    assert r.reused <= start - start % 16
    # the base model's answer, within the int8 rounding of the adopted (stored) pages, far from the adapter's
    base, guarded = (torch.log_softmax(x, -1) for x in (base_logits("qwen2", ids), peft_logits("qwen2", folder, ids)))
    assert (r.logprobs - base).abs().max() < 0.01 < (guarded - base).abs().max()


def test_no_guard_loaded_is_an_error_naming_the_key(tmp_path):
    engine = tiny.engine(tmp_path / "model", "qwen2", guard_adapter="off")
    assert engine.guard is None
    ids = engine.encode_messages([{"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError, match="guard_adapter"):
        engine.read(ids, adapter_from=3)


def error_of(tmp_path, folder, **parameters):
    with pytest.raises(ConfigError) as info:
        tiny.engine(tmp_path / "model", "qwen2", guard_adapter=str(folder), **parameters)
    message = str(info.value)
    assert "models[main].parameters.guard_adapter" in message and "flashguard train-guard" in message
    return message


def test_a_guard_for_another_model(tmp_path):
    folder = make_guard(tmp_path / "guard", model_dir=tmp_path / "other-model")
    assert "made for other-model" in error_of(tmp_path, folder)
    wider = make_guard(tmp_path / "llama-guard", "llama", model_dir=tmp_path / "model")   # names fit, shapes too:
    meta = json.loads((wider / alora.META_FILE).read_text())                            # the base differs in k/v
    assert meta["model_file"] == "model"
    folder = make_guard(tmp_path / "float-only", model_dir=tmp_path / "model", weights=("int4",))
    assert "made and validated for int4 weights, not float" in error_of(tmp_path, folder)


def test_a_corrupt_guard(tmp_path):
    folder = make_guard(tmp_path / "guard", model_dir=tmp_path / "model")
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert "not a readable safetensors file" in error_of(tmp_path, folder)
    (folder / alora.META_FILE).write_text("{")
    assert "guard.json is not readable JSON" in error_of(tmp_path, folder)
    (folder / alora.META_FILE).unlink()
    assert "no guard.json" in error_of(tmp_path, folder)


def test_a_plain_lora_is_not_a_guard_and_a_guard_is_not_a_lora(tmp_path):
    folder = make_guard(tmp_path / "guard", model_dir=tmp_path / "model")
    with pytest.raises(ConfigError, match="lora_path: .* is an activated LoRA"):
        tiny.engine(tmp_path / "model", "qwen2", lora_path=str(folder))
    config = json.loads((folder / "adapter_config.json").read_text())
    del config["alora_invocation_tokens"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert "has no alora_invocation_tokens" in error_of(tmp_path, folder)


def test_the_shipped_guards_are_found_from_a_source_tree_and_a_missing_rails_package_is_a_clear_error(monkeypatch):
    """issue 48: a copy of the tree run without installing has no ``flashguard.rails`` spec; the tree's rails/guards
    is used, and where there is none either, the error names guard_adapter (it was an AttributeError)."""
    import importlib.util
    from pathlib import Path

    from flashguard.engine import alora
    from flashguard.errors import ConfigError

    installed = alora.shipped_dir()
    assert (installed / "SmolLM2-135M-Instruct.Q4_1" / "guard.json").is_file()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashguard.rails" else real(name, *a))
    tree = Path(alora.__file__).resolve().parents[2] / "rails" / "guards"
    assert alora.shipped_dir() == tree
    monkeypatch.setattr(alora, "__file__", "/nowhere/flashguard/engine/alora.py")
    with pytest.raises(ConfigError) as e:
        alora.shipped_dir()
    assert "guard_adapter" in str(e.value) and "pip install" in str(e.value)


def test_deltas_from_a_position_leave_the_tokens_before_it_the_base_models():
    """The guard's branch runs the question's opening (base) and the question (adapter) in one forward: the
    positions before the offset get no delta, the rest the whole delta; split in two (retry's halves), the same."""
    from flashguard.engine.alora import Deltas
    from flashguard.engine.retry import _halves

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 6)
    d = Deltas({"lin": (torch.randn(2, 8), torch.randn(6, 2))})
    x = torch.randn(1, 5, 8)
    h = lin.register_forward_hook(d.hook("lin"))
    full = lin(x)
    h.remove()
    base = lin(x)
    late = d.from_position(3)
    h = lin.register_forward_hook(late.hook("lin"))
    mixed = lin(x)
    h.remove()
    assert torch.equal(mixed[:, :3], base[:, :3]) and torch.allclose(mixed[:, 3:], full[:, 3:])
    first, rest = _halves(late, 2)
    assert (first.offset, rest.offset) == (2, 1)
    parts = []
    for dd, xx in ((first, x[:, :2]), (rest, x[:, 2:])):
        h = lin.register_forward_hook(dd.hook("lin"))
        parts.append(lin(xx))
        h.remove()
    assert torch.allclose(torch.cat(parts, 1), mixed)
