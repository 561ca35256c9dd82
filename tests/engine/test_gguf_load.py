"""``weights: int4`` on a GGUF: the model is built straight from its Q4_0 / Q4_1 / Q4_K matrices (no float conversion,
no AWQ search) and computes the logits of gguf-py's own dequantization of the file, which transformers' GGUF loader
uses (its reverse permutation of llama's q/k rows is an independent reference for ours). Small GGUF files are
written here with gguf-py; Q4_K / Q6_K blocks, which gguf-py cannot quantize, are random bytes with sane scales."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES, quants  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from flashguard import ModelLoadError  # noqa: E402
from flashguard.engine import loader  # noqa: E402
from flashguard.quant import gguf_load  # noqa: E402
from flashguard.quant.gguf_int4 import Int4PairLinear  # noqa: E402
from flashguard.quant.int4_linear import Int4Linear  # noqa: E402

CPU = torch.device("cpu")
H, FF, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
# byte-level tokens (the GPT-2 alphabet), then control tokens: a vocabulary tokenizer_from_header can build
_BYTES = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(ord("¡"), ord("¬") + 1)] + \
    [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]
_BYTES += [chr(256 + i) for i in range(256 - len(_BYTES))]
_WORDS = ["he"] + [f"<unused{i}>" for i in range(12)]   # one merge (h e); 272 tokens: rows a multiple of 16
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = _BYTES + _WORDS + CONTROL
EOS = VOCAB.index("<|im_end|>")


def random_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Valid blocks of a k-quant: random codes and sub-block scales, fp16 super-scales in [1e-5, 1e-4]."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    supers = rng.uniform(1e-5, 1e-4, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)   # 4 bytes
    if qtype == T.Q4_K:
        raw[..., 0:4] = supers         # d, dmin first
    elif qtype == T.Q6_K:
        raw[..., 208:210] = supers[..., :2]   # d last
    else:
        raise ValueError(qtype)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path, arch: str = "llama", seed: int = 0, output_type=None, odd_type=None, v_type=T.Q6_K,
                    down_type=T.Q8_0) -> None:
    """A 2-layer ``arch`` model whose matrices are Q4_K (q, gate), Q4_0 (k, up), Q4_1 (o), Q6_K (v), Q8_0
    (down, embeddings); ``output_type``: an untied output.weight of that type; ``odd_type``: ffn_down's type (zero
    blocks; ``down_type`` is then unused); ``v_type`` / ``down_type``: attn_v's / ffn_down's type, quantized from
    random weights."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * 0.05).astype(np.float32)  # noqa: E731
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(VOCAB))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(VOCAB)
    w.add_token_types([1] * (len(_BYTES) + len(_WORDS)) + [3] * len(CONTROL))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(VOCAB.index("<|endoftext|>"))
    w.add_eos_token_id(EOS)

    def quant(name, array, qtype):
        w.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)

    quant("token_embd.weight", normal(len(VOCAB), H), T.Q8_0)
    w.add_tensor("output_norm.weight", (1 + normal(H)).astype(np.float32))
    if output_type in (T.Q4_K, T.Q6_K):
        w.add_tensor("output.weight", random_blocks(rng, len(VOCAB), H, output_type), raw_dtype=output_type)
    elif output_type is not None:
        quant("output.weight", normal(len(VOCAB), H), output_type)
    kv = H // HEADS * KV_HEADS
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", (1 + normal(H)).astype(np.float32))
        w.add_tensor(b + "ffn_norm.weight", (1 + normal(H)).astype(np.float32))
        w.add_tensor(b + "attn_q.weight", random_blocks(rng, H, H, T.Q4_K), raw_dtype=T.Q4_K)
        quant(b + "attn_k.weight", normal(kv, H), T.Q4_0)
        if v_type == T.Q6_K:
            w.add_tensor(b + "attn_v.weight", random_blocks(rng, kv, H, T.Q6_K), raw_dtype=T.Q6_K)
        else:
            quant(b + "attn_v.weight", normal(kv, H), v_type)
        quant(b + "attn_output.weight", normal(H, H), T.Q4_1)
        w.add_tensor(b + "ffn_gate.weight", random_blocks(rng, FF, H, T.Q4_K), raw_dtype=T.Q4_K)
        quant(b + "ffn_up.weight", normal(FF, H), T.Q4_1)
        if odd_type is not None:
            block, nbytes = GGML_QUANT_SIZES[odd_type]
            w.add_tensor(b + "ffn_down.weight", np.zeros((H, FF // block * nbytes), np.uint8), raw_dtype=odd_type)
        else:
            quant(b + "ffn_down.weight", normal(H, FF), down_type)
        if arch == "qwen2":
            for proj, n in (("attn_q", H), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(b + proj + ".bias", normal(n))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference(folder, name):
    """transformers' GGUF loader: gguf-py's dequantization of every tensor, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch,output_type", [("llama", None), ("qwen2", T.Q4_K), ("llama", T.Q6_K)])
@pytest.mark.parametrize("backend,tol", [("dequant", 1e-3), ("cpu", 2e-2)])   # fp16 scales; bf16 activations
def test_logits_are_gguf_pys_dequantization(tmp_path, arch, output_type, backend, tol, caplog):
    from transformers import AutoConfig

    if backend == "cpu" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("torch has no CPU int4 kernel")
    write_tiny_gguf(tmp_path / "tiny.gguf", arch, output_type=output_type)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    with caplog.at_level(logging.INFO, logger="flashguard"):
        ours = gguf_load.load_int4(str(tmp_path / "tiny.gguf"), config, CPU, torch.float32, backend)
    theirs = reference(tmp_path, "tiny.gguf")
    kinds = {n.rsplit(".", 1)[-1]: type(m).__name__ for n, m in ours.named_modules()
             if isinstance(m, (Int4Linear, Int4PairLinear)) and not n.endswith(".inner")}
    assert kinds == {"q_proj": "Int4Linear", "k_proj": "Int4Linear", "o_proj": "Int4Linear", "gate_proj": "Int4Linear",
                     "up_proj": "Int4Linear", "down_proj": "Int4PairLinear",   # Q8_0
                     **({} if output_type == T.Q6_K else
                        {"lm_head": "Int4Linear" if output_type == T.Q4_K else "Int4PairLinear"})}
    assert isinstance(ours.model.layers[0].self_attn.v_proj, torch.nn.Linear)   # Q6_K: float
    ids = torch.randint(0, len(VOCAB), (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got, expected = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())
    line = next(r.getMessage() for r in caplog.records if "int4 straight from" in r.getMessage())
    pairs = 2 if output_type is not None else 3
    assert f"{10 + (output_type == T.Q4_K)} matrices int4 straight from Q4_0/Q4_1/Q4_K, {pairs} Q8_0 matrices as " \
        "exact int4 pairs" in line, line
    assert "2 attn_v (Q6_K)" in line and "1 token_embd (Q8_0)" in line
    assert ("1 output (Q6_K)" in line) == (output_type == T.Q6_K), line


def test_a_type_gguf_py_cannot_read_is_named_with_what_is_supported(tmp_path):
    from transformers import AutoConfig

    write_tiny_gguf(tmp_path / "odd.gguf", odd_type=T.Q8_K)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="odd.gguf")
    with pytest.raises(ValueError, match=r"odd.gguf: tensor blk.0.ffn_down.weight is Q8_K.*takes Q4_0, Q4_1, Q4_K"):
        gguf_load.load_int4(str(tmp_path / "odd.gguf"), config, CPU, torch.float32)


def test_the_loader_builds_int4_without_a_float_conversion(tmp_path, monkeypatch):
    """``weights: int4`` through the loader: int4 layers, no converted or AWQ folder, the config and tokenizer cached
    under the file's content (a copy elsewhere finds them), the same logits as gguf-py's dequantization."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHGUARD_CACHE_DIR", str(cache))
    (tmp_path / "a").mkdir()
    write_tiny_gguf(tmp_path / "a" / "tiny.gguf", "qwen2")
    source = loader.resolve_model(str(tmp_path / "a" / "tiny.gguf"))
    model, tokenizer = loader.load(source, CPU, torch.float32, "int4", "cpu")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 13   # 10 Q4 + 2 Q8_0 ffn_down + lm_head
    assert sorted(p.name for p in cache.iterdir()) == ["gguf-int4", "gguf-meta"]   # (int4: the model as built)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == EOS and tokenizer.eos_token == "<|im_end|>"
    ids = torch.tensor([tokenizer("hello")["input_ids"]])
    theirs = reference(tmp_path / "a", "tiny.gguf")
    with torch.inference_mode():
        expected = theirs(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=2e-2,
                                   atol=2e-2 * expected.abs().max().item())
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "tiny.gguf", tmp_path / "b" / "renamed.gguf")
    moved = loader.resolve_model(str(tmp_path / "b" / "renamed.gguf"))
    assert loader.content_key(moved) == loader.content_key(source)
    assert loader.gguf_meta_folder(moved) == loader.gguf_meta_folder(source)
    assert len(list((cache / "gguf-meta").iterdir())) == 1


def test_a_gguf_without_4_bit_matrices_is_not_loaded_directly(tmp_path):
    path = tmp_path / "f32.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((H, H), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_load.int4_arch(str(path)) is None
    write_tiny_gguf(tmp_path / "q4.gguf", "llama")
    assert gguf_load.int4_arch(str(tmp_path / "q4.gguf")) == "llama"


def test_a_truncated_gguf_is_an_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGUARD_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "cut.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    for keep in (len(data) - 1000, 200):   # inside the tensor data; inside the header
        path.write_bytes(data[:keep])
        with pytest.raises(ValueError, match=r"cut.gguf.*truncated"):
            gguf_load.read_tensors(str(path))
        with pytest.raises(ModelLoadError, match=r"model_path: cannot load cut.gguf.*cut.gguf.*truncated"):
            loader.load(loader.resolve_model(str(path)), CPU, torch.float32, "int4")


@pytest.mark.slow
def test_the_embedded_model_starts_in_int4_from_its_q4_1_weights(tmp_path, monkeypatch, caplog):
    """The embedded SmolLM2 (Q4_1): ``weights: int4`` runs the file's own codes (no AWQ checkpoint is made), its
    next-token logits are the float model's (the same Q4_1 dequantized) up to bf16 rounding (its 1,024 likeliest
    tokens: an int4 lm_head computes the rest in int4), and it answers."""
    from flashguard import EngineConfig, get_engine
    from flashguard.engine.engine import Engine
    from flashguard.engine.sampling import SamplingParams
    from flashguard.quant.lm_head import TOP

    # the shared cache folder: converted once for the suite; on a CPU machine the suite's own float engine
    float_engine = get_engine(EngineConfig(device="cpu", weights="float"))
    monkeypatch.setenv("FLASHGUARD_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="flashguard"):
        engine = Engine(EngineConfig(device="cpu", weights="int4"))
    assert sum(isinstance(m, Int4Linear) for m in engine.model.modules()) == 211   # + lm_head from Q8_0 embeddings
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["gguf-int4", "gguf-meta"]   # no AWQ, no float
    assert any("210 matrices int4 straight from Q4_1, 1 Q8_0 matrices as exact int4 pairs" in r.getMessage() and
               "1 token_embd (Q8_0)" in r.getMessage() for r in caplog.records)
    ids = engine.encode_messages([{"role": "user", "content": "What is the capital of France?"}])
    assert ids == float_engine.encode_messages([{"role": "user", "content": "What is the capital of France?"}])
    with torch.inference_mode():
        got = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
        expected = float_engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert got.argmax() == expected.argmax()
    top = expected.topk(TOP).indices   # where an int4 lm_head (auto's pick where it times faster) is exact too
    torch.testing.assert_close(got[top], expected[top], rtol=0.05, atol=0.05 * expected.abs().max().item())
    assert "paris" in engine.generate(ids, SamplingParams(max_tokens=16)).text.lower()


@pytest.mark.slow   # a real AWQ search (of a tiny model: ~8 s)
def test_int4_on_a_float_model_says_how_long_the_awq_search_takes_first(tmp_path, monkeypatch, caplog):
    """An HF float folder has no int4 codes to take: ``weights: int4`` runs AWQ, after a warning with the estimate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("FLASHGUARD_CACHE_DIR", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tok.gguf", "qwen2")
    folder = tmp_path / "float"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=len(VOCAB))).save_pretrained(folder)
    loader.gguf_tokenizer(loader.resolve_model(str(tmp_path / "tok.gguf"))).save_pretrained(folder)
    with caplog.at_level(logging.INFO, logger="flashguard"):
        model, _ = loader.load(loader.resolve_model(str(folder)), CPU, torch.float32, "int4", "cpu")
    warning = [r for r in caplog.records if "with AWQ once, about" in r.getMessage()]
    assert warning and warning[0].levelno == logging.WARNING and "seconds on this machine" in warning[0].getMessage()
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 14
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["awq"]
