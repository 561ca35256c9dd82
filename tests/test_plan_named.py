"""``flashguard plan --model NAME``: the DeepSeek-R1-Distill-Qwen-7B shape known by name (its bytes by hand), and a
name it does not know is one line listing the names, with no network request (a socket that connects fails the
test)."""

from __future__ import annotations

import socket

import pytest

from flashguard import cli
from flashguard.errors import ModelLoadError
from flashguard.vram import plan as planner


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a network request was made: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_the_7b_distill_shape_by_name(no_network):
    s = planner.resolve_shape("DeepSeek-R1-Distill-Qwen-7B")   # any case
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab, s.tied, s.qkv_bias) == (
        3584, 28, 28, 4, 128, 18944, 152064, False, True)
    # per layer: q and o 3584x3584, k and v 3584x512, gate/up/down 3584x18944
    linear = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    assert linear == 28 * 233_046_016 == 6_525_288_448
    int4 = planner.weight_bytes(s, "int4", group=64)
    assert int4["decoder linears"] == linear // 2 + (linear // 64) * 4       # the issue's ~3.5 GB
    fp16 = planner.weight_bytes(s, "float")
    assert fp16["embeddings + lm_head"] == 2 * 152064 * 3584 * 2              # the issue's ~2.2 GB, untied


def test_the_7b_plan(no_network, capsys):
    # int4 decoder layers (3.4 GiB) and a 16-bit lm_head (1.0 GiB) on the GPU: more than 4 GiB until decoder
    # layers can live in host RAM (issue 18, item 1); 8 GiB holds it with a 10K-token pool at 32K
    assert cli.main(["plan", "--model", "deepseek-r1-distill-qwen-7b", "--context", "32768", "--gpu-mem", "4GiB"]) == 1
    out = capsys.readouterr().out
    assert "plan: deepseek-r1-distill-qwen-7b, int4 weights" in out and "does NOT fit" in out
    assert cli.main(["plan", "--model", "deepseek-r1-distill-qwen-7b", "--context", "32768", "--gpu-mem", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "off the pool, in L2" in out


@pytest.mark.parametrize("name", ["deepseek-r1-distill-qwen-8b", "Qwen/Qwen2.5-7B-Instruct"])
def test_an_unknown_name_is_one_line_and_no_download(no_network, capsys, name):
    assert cli.main(["plan", "--model", name]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"unknown model {name!r}" in err
    assert "deepseek-r1-distill-qwen-1.5b, deepseek-r1-distill-qwen-7b, embedded" in err
    assert "HF model folder" in err and ".gguf file" in err


def test_a_folder_is_read_locally(no_network, tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model"):   # a folder without config.json: not a model
        planner.resolve_shape(str(tmp_path))
    planner.deepseek_7b_config().save_pretrained(tmp_path / "seven")
    shape = planner.resolve_shape(str(tmp_path / "seven"))
    assert (shape.name, shape.hidden, shape.kv_heads) == ("seven", 3584, 4)
