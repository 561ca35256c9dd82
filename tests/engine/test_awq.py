"""AWQ int4: the gemm format against AutoAWQ's own packer, torch's int4 kernels against the reference
dequantization, a checkpoint written by AutoAWQ's code loading in flashguard, and the quality of
``flashguard quantize`` on the embedded SmolLM2 (held-out perplexity vs float and round-to-nearest)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

from flashguard.errors import ModelLoadError
from flashguard.quant import awq_format, awq_search
from flashguard.quant.awq_load import load_awq
from flashguard.quant.int4_linear import Int4Linear

CPU = torch.device("cpu")


@pytest.mark.parametrize("group", [32, 64, 128])
def test_pack_unpack_roundtrip_and_rtn_bounds(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(96, 256, generator=g) * 0.05
    codes, zeros, scales = awq_format.quantize_rtn(w, group)
    qweight, qzeros = awq_format.pack(codes, zeros)
    assert qweight.shape == (256, 12) and qweight.dtype == torch.int32 and qzeros.shape == (256 // group, 12)
    back_codes, back_zeros = awq_format.unpack(qweight, qzeros, group)
    assert torch.equal(back_codes, codes) and torch.equal(back_zeros, zeros)
    err = (awq_format.dequantize(codes, zeros, scales, group) - w).abs()
    step = scales.float().repeat_interleave(group, 1)
    assert (err <= step + 1e-6).all()  # the integer zero point can move the range's ends by half a step
    assert err.mean() <= 0.3 * step.mean()  # rounding to nearest: a quarter step on average


def test_packing_is_byte_identical_to_autoawq():
    gemm = pytest.importorskip("awq.modules.linear.gemm")
    packing = pytest.importorskip("awq.utils.packing_utils")
    w = torch.randn(192, 576, generator=torch.Generator().manual_seed(0)) * 0.05
    codes, zeros, scales = awq_format.quantize_rtn(w, 64)
    ref_w = awq_format.dequantize(codes, zeros, scales, 64)
    linear = nn.Linear(576, 192)
    linear.weight.data = ref_w.clone()
    theirs = gemm.WQLinear_GEMM.from_linear(linear, 4, 64, scales=scales.t().contiguous(),
                                            zeros=zeros.t().contiguous().to(torch.int32))
    qweight, qzeros = awq_format.pack(codes, zeros)
    assert torch.equal(theirs.qweight, qweight) and torch.equal(theirs.qzeros, qzeros)
    their_dequant = packing.dequantize_gemm(theirs.qweight, theirs.qzeros, theirs.scales, 4, 64).float().t()
    assert torch.allclose(their_dequant, ref_w, atol=2e-4)


@pytest.mark.parametrize("backend", ["cpu", "dequant"])
@pytest.mark.parametrize("zero_point", [True, False])
def test_int4_linear_matches_reference_dequantization(backend, zero_point):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * 0.05
    bias = torch.randn(256, generator=g)
    codes, zeros, scales = awq_format.quantize_rtn(w, 128)
    qweight, qzeros = awq_format.pack(codes, zeros)
    codes, zeros = awq_format.unpack(qweight, qzeros if zero_point else None, 128)  # no qzeros: zero point 8
    layer = Int4Linear.from_codes(codes, zeros, scales, 128, bias, CPU, backend)
    assert layer.backend == backend
    x = torch.randn(2, 7, 512, generator=g)
    expected = x @ awq_format.dequantize(codes, zeros, scales, 128).t() + bias
    got = layer(x)
    assert got.shape == expected.shape
    tol = 1e-5 if backend == "dequant" else 0.02 * expected.abs().max().item()  # the cpu kernel runs in bf16
    assert (got - expected).abs().max().item() <= tol
    assert layer.weight_bytes() < w.numel() * 4 / 6  # int4 codes + scales, never the float weight


def _write_checkpoint(tmp_path, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"bits": 8}, "bits is 8"), ({"version": "gemv"}, "'gemv'"), ({"group_size": 256}, "group_size is 256")])
def test_unsupported_awq_settings_name_the_key(tmp_path, change, message):
    from transformers import AutoConfig, LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128).to_dict()
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                                  "zero_point": True, **change}
    folder = _write_checkpoint(tmp_path, cfg, {"x": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match=message) as err:
        load_awq(folder, AutoConfig.from_pretrained(folder), CPU, torch.float32)
    assert "quantization_config" in str(err.value)


@pytest.fixture(scope="module")
def float_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashguard.engine import loader

    folder = loader.materialize(loader.resolve_model(None))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model, AutoTokenizer.from_pretrained(folder)


@pytest.mark.slow
def test_checkpoint_written_by_autoawq_loads_with_the_same_outputs(tmp_path, float_model):
    """AutoAWQ's quantizer (round-to-nearest) and its WQLinear_GEMM packer write the checkpoint, the way its
    ``save_quantized`` lays it out; flashguard must compute what AutoAWQ's own dequantization says."""
    gemm = pytest.importorskip("awq.modules.linear.gemm")
    packing = pytest.importorskip("awq.utils.packing_utils")
    quantizer = pytest.importorskip("awq.quantize.quantizer")
    from types import SimpleNamespace

    from transformers import AutoConfig

    folder, model, tokenizer = float_model
    settings = SimpleNamespace(group_size=64, w_bit=4, zero_point=True)
    reference = copy.deepcopy(model)
    tensors = {}
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) and name.startswith("model.layers.")):
            continue
        fq, scales, zeros = quantizer.AwqQuantizer.pseudo_quantize_tensor(settings, module.weight.data.clone())
        lin = nn.Linear(module.in_features, module.out_features, bias=False)
        lin.weight.data = fq
        q = gemm.WQLinear_GEMM.from_linear(lin, 4, 64, False, scales.t().contiguous(), zeros.t().contiguous())
        tensors.update({f"{name}.qweight": q.qweight, f"{name}.qzeros": q.qzeros, f"{name}.scales": q.scales})
        reference.get_submodule(name).weight.data = packing.dequantize_gemm(
            q.qweight, q.qzeros, q.scales, 4, 64).float().t().contiguous()
    for name, tensor in model.state_dict().items():
        if name.rsplit(".", 1)[0] + ".qweight" not in tensors and name != "lm_head.weight":
            tensors[name] = tensor.half()
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "awq", "zero_point": True, "group_size": 64, "bits": 4,
                                     "version": "gemm", "modules_to_not_convert": None}
    ckpt = _write_checkpoint(tmp_path, config, tensors)
    ids = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        exact = load_awq(ckpt, AutoConfig.from_pretrained(ckpt), CPU, torch.float32, backend="dequant")
        got = exact(input_ids=ids).logits
        assert (got - expected).abs().max().item() < 0.05  # fp16 embeddings/norms in the checkpoint
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        kernel = load_awq(ckpt, AutoConfig.from_pretrained(ckpt), CPU, torch.float32, backend="cpu")
        kl = torch.nn.functional.kl_div(kernel(input_ids=ids).logits.log_softmax(-1), expected.log_softmax(-1),
                                        log_target=True, reduction="none").sum(-1).mean().item()
        assert kl < 0.02


@pytest.fixture(scope="module")
def awq_embedded():
    """``weights: int4`` of the embedded model: AWQ-quantized once into the user cache folder."""
    from flashguard.engine import loader

    return loader.quantized_folder(loader.resolve_model(None))


@pytest.mark.slow
def test_flashguard_quantize_beats_round_to_nearest_within_1_2x_of_float(float_model, awq_embedded):
    from transformers import AutoConfig

    folder, model, tokenizer = float_model
    heldout = awq_search.token_blocks(tokenizer, awq_search.heldout_text(), 8, 512)
    assert not set(map(tuple, heldout.tolist())) & set(
        map(tuple, awq_search.token_blocks(tokenizer, awq_search.calibration_text(), 32, 512).tolist()))
    ppl_float = awq_search.perplexity(model, heldout)
    rtn = copy.deepcopy(model)
    for name, module in rtn.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers."):
            module.weight.data = awq_format.fake_quantize(module.weight.data, 64)
    ppl_rtn = awq_search.perplexity(rtn, heldout)
    int4 = load_awq(awq_embedded, AutoConfig.from_pretrained(awq_embedded), CPU, torch.float32)
    ppl_awq = awq_search.perplexity(int4, heldout)
    print(f"\nheld-out perplexity: float {ppl_float:.3f}  rtn-int4 {ppl_rtn:.3f}  awq-int4 {ppl_awq:.3f} "
          f"(x{ppl_awq / ppl_float:.3f} of float)")
    assert ppl_awq <= 1.20 * ppl_float
    assert ppl_awq <= ppl_rtn
    config = json.loads(open(os.path.join(awq_embedded, "config.json")).read())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                             "version": "gemm", "modules_to_not_convert": None}


@pytest.mark.slow
def test_int4_engine_answers_sensibly(awq_embedded):
    from flashguard.config import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.engine.sampling import SamplingParams

    engine = Engine(EngineConfig(weights="int4", max_tokens=24))
    assert any(isinstance(m, Int4Linear) for m in engine.model.modules())
    # The float 135M model gets these right too (it says a week has "approximately 7 days"; int4 says 31).
    for question, answer in [("What is the capital of France?", "paris"), ("What is 2 + 2?", "four"),
                             ("What color is the sky on a clear day?", "blue"),
                             ("What language is spoken in Spain?", "spanish")]:
        ids = engine.encode_messages([{"role": "user", "content": question}])
        text = engine.generate(ids, SamplingParams(max_tokens=24)).text
        assert answer in text.lower().replace(" 4", " four"), text


@pytest.mark.slow
def test_transformers_with_gptqmodel_loads_a_flashguard_checkpoint(awq_embedded):
    """Where gptqmodel is installed (not in CI: a 1.6 GB environment whose pypcre dependency compiles C),
    transformers loads ``flashguard quantize`` output through it: every linear dequantizes to flashguard's weights
    (up to gptqmodel's fp16 arithmetic) and the model predicts the same tokens."""
    pytest.importorskip("gptqmodel")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from flashguard.quant.awq_load import load_awq

    theirs = AutoModelForCausalLM.from_pretrained(awq_embedded, device_map="cpu", dtype=torch.float32).eval()
    ours = load_awq(awq_embedded, AutoConfig.from_pretrained(awq_embedded), torch.device("cpu"), torch.float32,
                    "dequant").eval()
    worst, linears = 0.0, 0
    for name, module in ours.named_modules():
        if hasattr(module, "dequantized_weight"):
            w = module.dequantized_weight(torch.float32)
            g = theirs.get_submodule(name).awq_weight_dequantize(device=torch.device("cpu"), dtype=torch.float32).T
            worst = max(worst, ((w - g).abs().max() / w.abs().max()).item())
            linears += 1
    assert linears == 7 * ours.config.num_hidden_layers and worst < 2e-3
    ids = AutoTokenizer.from_pretrained(awq_embedded)("The capital of France is a city called",
                                                      return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits.argmax(-1), theirs(ids).logits.argmax(-1))
