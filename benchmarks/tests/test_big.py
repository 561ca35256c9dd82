"""The 7B-in-4-GiB benchmark's parts on the CPU: ``benchmarks.big``'s int4 model maker (no 16-bit copy; the
bytes the planner counts), the whole benchmark in its tiny mode with streamed layers, and ``benchmarks.gguf_random``'s
Q4_K_M file, read back with gguf-py (llama.cpp's side of the comparison)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import big, gguf_random
from flashguard.quant.int4_linear import Int4Linear
from flashguard.vram import plan as planner
from tests import tiny


def test_make_model_is_int4_in_host_ram_and_runs():
    cfg = big.seven_b_config(tiny=True, vocab=128)
    model = big.make_model(cfg, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 4 * 7 + 1 and all(m.backend == "dequant" for m in linears)   # lm_head too
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers.modules())
    layer = model.model.layers[0]
    w = layer.self_attn.q_proj.dequantized_weight()
    assert 0.01 < w.std().item() < 0.04   # transformers' init scale
    assert not torch.equal(model.model.layers[1].mlp.up_proj.packed, layer.mlp.up_proj.packed)
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert out.shape == (1, 4, 128) and torch.isfinite(out).all()


@pytest.mark.slow
def test_make_model_of_the_7b_shape_counts_what_the_planner_counts():
    """Two layers of the real 7B shape: each layer holds the bytes ``planner.layer_bytes`` says (group 128), less
    a byte per group: the planner counts a 16-bit zero, the Triton layout keeps it in one byte."""
    cfg = big.seven_b_config(layers=2)
    model = big.make_model(cfg)
    shape = planner.Shape.from_config(big.seven_b_config())
    per_layer = sum(m.weight_bytes() - (m.bias.numel() * 2 if m.bias is not None else 0)
                    for m in model.model.layers[0].modules() if isinstance(m, Int4Linear))
    groups = 233_046_016 // 128
    assert per_layer == planner.layer_bytes(shape, "int4", 128) - groups
    assert model.lm_head.weight_bytes() == planner.int4_bytes(152064 * 3584, 128) - 152064 * 3584 // 128


@pytest.mark.slow   # (a benchmark run end to end)
def test_the_tiny_benchmark_streams_and_reports(tmp_path, capsys):
    folder = tmp_path / "tok"
    tiny.tokenizer().save_pretrained(folder)
    out = tmp_path / "big.json"
    assert big.main(["--tiny", "--device", "cpu", "--tokenizer", str(folder), "--contexts", "200", "--steps", "3",
                     "--warmup-steps", "1", "--force-streamed", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| chunk | layers resident / streamed |" in printed and "| 512 | 1 / 3 | 200 |" in printed
    result = json.loads(out.read_text())
    variant = result["variants"][0]
    assert variant["layers_streamed"] == 3 and variant["placement"]["layers_resident"] == [0]
    row = variant["rows"][0]
    assert "error" not in row and row["decode_tok_s"] > 0 and row["ttft_s"] > 0


def _vocab_gguf(path, hidden=256, inter=512, heads=4, kv_heads=2, layers=3, tokens=40):
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_context_length(4096)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(tokens)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def test_a_random_q4_k_m_gguf(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    _vocab_gguf(tmp_path / "vocab.gguf", layers=8)
    info = gguf_random.write(str(tmp_path / "vocab.gguf"), str(tmp_path / "m.gguf"), layers=3)
    assert info == {"arch": "qwen2", "layers": 3, "hidden": 256, "vocab": 40, "path": str(tmp_path / "m.gguf")}
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["qwen2.block_count"] == 3 and fields["general.file_type"] == 15   # MOSTLY_Q4_K_M
    assert fields["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 1 + 3 * 12
    kinds = {name: t.tensor_type.name for name, t in tensors.items()}
    assert kinds["token_embd.weight"] == "Q4_K" and kinds["output.weight"] == "Q6_K"
    assert kinds["blk.2.attn_v.weight"] == "Q6_K" and kinds["blk.1.ffn_down.weight"] == "Q4_K"   # use_more_bits
    assert kinds["blk.0.attn_q.bias"] == "F32"
    assert [int(v) for v in tensors["blk.0.ffn_down.weight"].shape] == [512, 256]   # innermost first
    for name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "output.weight"):
        w = dequantize(tensors[name].data, tensors[name].tensor_type)
        assert np.isfinite(w).all() and 0.005 < w.std() < 0.05, name
    a = dequantize(tensors["blk.1.ffn_up.weight"].data, tensors["blk.1.ffn_up.weight"].tensor_type)
    b = dequantize(tensors["blk.2.ffn_up.weight"].data, tensors["blk.2.ffn_up.weight"].tensor_type)
    assert not np.array_equal(a, b)   # each layer its own codes
