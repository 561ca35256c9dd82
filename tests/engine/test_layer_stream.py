"""Decoder layers streamed from host RAM (engine/layer_stream.py) on tiny random models: the outputs are the resident
model's, bit for bit, through transformers' forward, the engine's decode step and prefix reuse, for float and int4
layers (a LoRA adapter included); the streamed layers compute from two shared slots that the host copies refill."""

from __future__ import annotations

import pytest
import torch

from flashguard.engine.layer_stream import PROJECTIONS, LayerStream
from flashguard.engine.sampling import SamplingParams
from flashguard.quant.int4_linear import quantize_linears_rtn

from tests import tiny

IDS = list(range(5, 37))


def logits(net, ids=IDS):
    with torch.no_grad():
        return net(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch, streamed", [("llama", [1, 2, 3]), ("qwen2", [0, 1, 2, 3]), ("qwen2", [2])])
def test_streamed_equals_resident(arch, streamed):
    resident = logits(tiny.model(arch, layers=4))
    net = tiny.model(arch, layers=4)
    stream = LayerStream(net, streamed, torch.device("cpu"))
    copies = []
    for _ in range(2):   # and again: the slots are refilled as the layers come round
        assert torch.equal(logits(net), resident)
        copies.append(stream.stats()["copies"])
    weights = {net.model.layers[i].get_submodule(PROJECTIONS[0]).weight.data_ptr() for i in streamed}
    assert len(weights) == min(2, len(streamed))   # every streamed layer computes from one of two slots
    assert copies[0] >= len(streamed)
    # the second pass copies again only where more layers than slots share them
    assert (copies[1] > copies[0]) == (len(streamed) > 2)


def test_the_weights_come_from_the_host_copies():
    net = tiny.model("llama", layers=4)
    stream = LayerStream(net, [1, 2, 3], torch.device("cpu"))
    before = logits(net)
    saved = [t.clone() for t in stream.host[3]]   # layers 1 and 3 take turns in one slot: it is refilled each pass
    for t in stream.host[3]:
        t.mul_(0.5)
    assert not torch.allclose(logits(net), before)
    for t, s in zip(stream.host[3], saved):
        t.copy_(s)
    assert torch.equal(logits(net), before)


@pytest.mark.parametrize("backend", ["dequant", "cpu"])
def test_int4_layers_with_an_adapter(tmp_path, backend):
    if backend == "cpu" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch has no CPU int4 kernel")
    peft = pytest.importorskip("peft")
    from flashguard.engine import lora

    torch.manual_seed(1)
    adapter = peft.get_peft_model(tiny.model("qwen2", layers=4), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    adapter.save_pretrained(str(tmp_path))
    nets = []
    for _ in range(2):
        net = tiny.model("qwen2", layers=4)
        quantize_linears_rtn(net, group_size=32, backend=backend)
        lora.apply_adapter(net, lora.read_adapter(str(tmp_path), net), torch.float32)
        nets.append(net)
    LayerStream(nets[1], [0, 1, 3], torch.device("cpu"))
    assert torch.equal(logits(nets[1]), logits(nets[0]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_decode_steps_equal_the_resident_engine(tmp_path, arch):
    """The engine's decode step (DecodeStep, eager on the CPU) and its prefix reuse on a streamed model."""
    resident = tiny.engine(tmp_path / "a", arch, net=tiny.model(arch, layers=4))
    net = tiny.model(arch, layers=4)
    LayerStream(net, [1, 2, 3], torch.device("cpu"))
    streamed = tiny.engine(tmp_path / "b", arch, net=net)
    assert streamed.decode_step is not None   # the decode step runs the streamed layers
    ids = resident.encode_messages([{"role": "user", "content": tiny.text(80)}])
    out = []
    for engine in (resident, streamed):
        engine.generate(ids, SamplingParams(max_tokens=20))
        turn = list(engine.turns[-1].output_ids)
        follow = ids + turn + [5, 6, 7]
        logprobs, reused = engine.next_token_logprobs(follow)   # reuses the turn's cache: only 3 tokens prefilled
        assert reused > len(ids)
        out.append((turn, logprobs))
    assert out[0][0] == out[1][0] and len(out[0][0]) > 0
    assert torch.equal(out[0][1], out[1][1])


def test_layers_of_different_shapes_are_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    net = tiny.model("llama", layers=3)
    other = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=99))
    net.model.layers[2].mlp = other.model.layers[0].mlp
    with pytest.raises(ValueError, match="layer 2's projections differ"):
        LayerStream(net, [0, 1, 2], torch.device("cpu"))


def test_which_layers_a_budget_streams():
    from flashguard.engine.layer_stream import layers_to_stream

    mib = 2**20
    assert layers_to_stream(28, 100 * mib, 2800 * mib) == []                     # all fit
    assert layers_to_stream(28, 100 * mib, 2000 * mib) == list(range(18, 28))    # 18 resident + 2 slots
    assert layers_to_stream(28, 100 * mib, 2750 * mib) == list(range(25, 28))    # at least 3, or nothing is saved
    assert layers_to_stream(28, 100 * mib, 200 * mib) == list(range(0, 28))      # all streamed through 2 slots
    with pytest.raises(ValueError, match="less than the two streamed layers' slots"):
        layers_to_stream(28, 100 * mib, 150 * mib)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_engine_places_streamed_layers(tmp_path, monkeypatch, arch):
    """The engine's placement path (``Placement.place`` -> ``layer_stream.place``) with the plan's decision
    forced (on the CPU there is no vram_budget): the last layers stream through two slots from host copies, the
    engine's generations, its prefix reuse and a second conversation equal the resident engine's, and
    ``engine_info()``'s placement says where each part lives."""
    from flashguard.engine.budget import Budget

    resident = tiny.engine(tmp_path / "a", arch, net=tiny.model(arch, layers=4))
    plan = Budget.plan
    monkeypatch.setattr(Budget, "plan", lambda self, placement, context, streamed_layers=None:
                        plan(self, placement, context, 3))
    streamed = tiny.engine(tmp_path / "b", arch, net=tiny.model(arch, layers=4))
    assert streamed.plan.streamed == 3
    place = streamed.info()["placement"]
    assert place["layers_resident"] == [0] and place["layers_streamed"] == [1, 2, 3]
    assert place["streamed_from"] == "host RAM" and place["slot_bytes"] == 2 * place["streamed_layer_bytes"] > 0
    assert resident.info()["placement"]["layers_streamed"] == [] and resident.layer_stream is None
    slots = {slot[0].data_ptr() for slot in streamed.layer_stream.slots}
    assert {streamed.model.model.layers[i].self_attn.q_proj.weight.data_ptr() for i in (1, 2, 3)} == slots
    out = []
    for engine in (resident, streamed):
        texts = []
        for seed in (0, 1):
            ids = engine.encode_messages([{"role": "user", "content": tiny.text(60, seed)}])
            engine.generate(ids, SamplingParams(max_tokens=16))
            turn = list(engine.turns[-1].output_ids)
            logprobs, reused = engine.next_token_logprobs(ids + turn + [5, 6])
            assert reused > len(ids)
            texts.append((turn, logprobs))
        out.append(texts)
    for (t0, l0), (t1, l1) in zip(*out):
        assert t0 == t1 and len(t0) > 0
        assert torch.equal(l0, l1)
    assert streamed.info()["placement"]["layer_copies"] > 3


def test_a_model_built_in_host_ram_is_placed(tmp_path, monkeypatch):
    """int4 layers built in host RAM with the ``dequant`` backend (what the loader and bench.big build when layers
    will stream) run placed, streamed ones included, and give the unplaced model's logits."""
    from flashguard.engine.layer_stream import place

    nets = []
    for _ in range(2):
        net = tiny.model("qwen2", layers=4)
        quantize_linears_rtn(net, group_size=32, backend="dequant")
        nets.append(net)
    ref = logits(nets[0])
    stream = place(nets[1], torch.device("cpu"), [1, 2, 3])
    assert stream.stats()["layers"] == [1, 2, 3]
    assert torch.equal(logits(nets[1]), ref)
