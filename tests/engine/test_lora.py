"""LoRA adapters (``lora_path``, engine/lora.py) against PEFT itself on tiny random Llama / Qwen2 models: the wrapped
float model equals PEFT's adapter merged into the float base; on an int4 base it equals PEFT applied on the
dequantized int4 weights; the Engine generates what the merged model generates, and its moderation calls run
through the adapter too; a bad adapter is a ConfigError naming lora_path and what is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from flashguard.engine import lora
from flashguard.engine.sampling import SamplingParams
from flashguard.errors import ConfigError
from flashguard.quant.int4_linear import Int4Linear, quantize_linears_rtn

from tests import tiny

peft = pytest.importorskip("peft")

ALL = list(lora.TARGETS)


def save_adapter(folder, net, targets=ALL, r=4, alpha=8, seed=1, **extra):
    """A PEFT adapter on ``net`` (modified in place: pass a copy) with random, non-zero A and B, saved to ``folder``."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra)
    model = peft.get_peft_model(net, config)
    with torch.no_grad():   # a visible change of the outputs, far above float rounding
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(str(folder))
    return folder


def merged(net, folder):
    """PEFT's own answer: the adapter at ``folder`` loaded onto ``net`` and merged into its weights."""
    return peft.PeftModel.from_pretrained(net, str(folder)).merge_and_unload().eval()


def logits(net, ids):
    with torch.no_grad():
        return net(torch.tensor([ids])).logits[0].float()


IDS = list(range(5, 45))


@pytest.mark.parametrize("arch, targets, extra", [
    ("llama", ALL, {}),
    ("qwen2", ALL, {"use_rslora": True}),
    ("qwen2", ["q_proj", "v_proj"], {}),     # the design's adapter: q and v only
])
def test_float_base_equals_peft_merged(tmp_path, arch, targets, extra):
    folder = save_adapter(tmp_path / "adapter", tiny.model(arch), targets, **extra)
    reference = merged(tiny.model(arch), folder)
    mine = tiny.model(arch)
    base = logits(mine, IDS)
    assert lora.apply_adapter(mine, lora.read_adapter(str(folder), mine), torch.float32) == 2 * len(targets)
    got, want = logits(mine, IDS), logits(reference, IDS)
    assert (want - base).abs().max() > 0.5            # the adapter matters ...
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)   # ... and is applied as PEFT applies it


def dequantized_float_copy(arch, int4_net):
    """The float model whose linears hold exactly the int4 model's dequantized weights (PEFT's base)."""
    net = tiny.model(arch)
    with torch.no_grad():
        for name, module in int4_net.named_modules():
            if isinstance(module, Int4Linear):
                net.get_submodule(name).weight.copy_(module.dequantized_weight(torch.float32))
    return net


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_base_equals_peft_on_the_dequantized_base(tmp_path, arch):
    folder = save_adapter(tmp_path / "adapter", tiny.model(arch), ALL)
    int4 = tiny.model(arch)
    quantize_linears_rtn(int4, group_size=32, backend="dequant")
    base_error = (logits(int4, IDS) - logits(tiny.model(arch), IDS)).abs().mean()   # int4's own error
    reference = merged(dequantized_float_copy(arch, int4), folder)
    lora.apply_adapter(int4, lora.read_adapter(str(folder), int4), torch.float32)
    torch.testing.assert_close(logits(int4, IDS), logits(reference, IDS), atol=5e-4, rtol=1e-4)
    # against the float base's merged adapter: the int4 tolerance, i.e. about the base's own int4 error
    error = (logits(int4, IDS) - logits(merged(tiny.model(arch), folder), IDS)).abs().mean()
    assert error < 1.5 * base_error


def test_int4_cpu_kernel_with_adapter(tmp_path):
    """torch's CPU int4 kernel (bf16 activations inside) under the adapter: within bf16 rounding of PEFT's answer."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch has no CPU int4 kernel")
    folder = save_adapter(tmp_path / "adapter", tiny.model("qwen2"), ALL)
    nibbles = tiny.model("qwen2")
    quantize_linears_rtn(nibbles, group_size=32, backend="dequant")
    reference = logits(merged(dequantized_float_copy("qwen2", nibbles), folder), IDS)
    kernel = tiny.model("qwen2")
    quantize_linears_rtn(kernel, group_size=32, backend="cpu")
    lora.apply_adapter(kernel, lora.read_adapter(str(folder), kernel), torch.float32)
    assert (logits(kernel, IDS) - reference).abs().max() < 0.02 * reference.abs().max()


def hf_greedy(net, ids, n, eos):
    inp = torch.tensor([ids])
    out = net.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False,
                       eos_token_id=sorted(eos), pad_token_id=tiny.tokenizer().pad_token_id)
    return [t for t in out[0, len(ids):].tolist() if t not in eos]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_generates_what_the_merged_model_generates(tmp_path, arch):
    folder = save_adapter(tmp_path / "adapter", tiny.model(arch), ["q_proj", "v_proj", "o_proj", "down_proj"])
    engine = tiny.engine(tmp_path / "model", arch, lora_path=str(folder))
    base = tiny.engine(tmp_path / "model", arch)
    reference = merged(tiny.model(arch), folder)
    ids = engine.encode_messages([{"role": "user", "content": tiny.text(60)}])
    engine.generate(ids, SamplingParams(max_tokens=24))
    mine = list(engine.turns[-1].output_ids)
    assert mine == hf_greedy(reference, ids, 24, engine.eos_ids)[:len(mine)] and len(mine) > 0
    base.generate(ids, SamplingParams(max_tokens=24))
    assert list(base.turns[-1].output_ids) != mine     # the adapter changed the answer
    # a moderation call on the same engine (the rail's path: the turn's pages reused, one suffix prefilled) runs
    # through the adapter as well
    follow = ids + mine + tiny.tokenizer().encode("<|im_end|>\nok?")
    logprobs, reused = engine.next_token_logprobs(follow)
    assert reused > len(ids)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits(reference, follow)[-1], -1), atol=2e-4, rtol=1e-4)
    # the adapter's pages are its own: another namespace than the base model's
    info = engine.info()["lora"]
    assert info == {"path": str(folder), "rank": 4, "modules": 8}
    assert engine.model_identity != base.model_identity and engine.adapter.digest in engine.model_identity
    assert engine.session.cache.namespace != base.session.cache.namespace
    # and the rail's probe of the base model is not taken for the adapted one (its hidden states differ)
    from flashguard.rails.probe import ModelKey

    assert ModelKey.of(base).weights == "float" and ModelKey.of(engine).weights.startswith("float+lora-")


# ---- bad adapters ----------------------------------------------------------------------------------------------

def error_of(folder, net=None):
    net = net if net is not None else tiny.model("llama")
    with pytest.raises(ConfigError) as info:
        lora.read_adapter(str(folder), net)
    assert "models[main].parameters.lora_path" in str(info.value)
    return str(info.value)


@pytest.fixture
def good(tmp_path):
    return save_adapter(tmp_path / "good", tiny.model("llama"), ["q_proj", "v_proj"])


def test_missing_folder_and_files(tmp_path, good):
    assert "is not a folder" in error_of(tmp_path / "nowhere")
    (good / "adapter_model.safetensors").rename(tmp_path / "moved.safetensors")
    assert "has no adapter_model.safetensors" in error_of(good)
    (good / "adapter_config.json").unlink()
    assert "has no adapter_config.json" in error_of(good)


def test_corrupt_files(good):
    (good / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    assert "adapter_config.json is not valid JSON" in error_of(good)
    (good / "adapter_config.json").write_text("[4, 8]")
    assert "must hold a JSON object" in error_of(good)


def test_corrupt_weights(good):
    (good / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert "not a readable safetensors file" in error_of(good)


def test_adapter_for_another_base(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         vocab_size=len(tiny.tokenizer())))
    folder = save_adapter(tmp_path / "wide", wider, ["down_proj"])
    message = error_of(folder)
    assert "down_proj" in message and "(4, 256)" in message and "trained for another base" in message
    deeper = save_adapter(tmp_path / "deep", tiny.model("llama", layers=3), ["q_proj"])
    message = error_of(deeper)
    assert "model.layers.2.self_attn.q_proj" in message and "does not have" in message


def test_unknown_or_unsupported_targets(tmp_path, good):
    config = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "c_attn"]}))
    assert "unknown target module(s) c_attn" in error_of(good)
    head = save_adapter(tmp_path / "head", tiny.model("llama"), ["lm_head"])
    assert "unknown target module(s) lm_head" in error_of(head)
    config = json.loads((head / "adapter_config.json").read_text())   # a regex, as PEFT also writes: the weights say
    (head / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ".*lm_head"}))
    message = error_of(head)
    assert "lm_head" in message and "only lora_A / lora_B weights of q_proj" in message
    dora = save_adapter(tmp_path / "dora", tiny.model("llama"), ["q_proj"], use_dora=True)
    assert "use_dora is not supported" in error_of(dora)


def test_rank_disagreeing_with_the_config(good):
    config = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    assert "rank 4, adapter_config.json says r = 8" in error_of(good)


def test_engine_start_names_lora_path(tmp_path):
    with pytest.raises(ConfigError, match=r"parameters\.lora_path: .* is not a folder"):
        tiny.engine(tmp_path / "model", lora_path=str(tmp_path / "missing"))
