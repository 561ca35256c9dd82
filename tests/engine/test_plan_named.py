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
    # int4 decoder layers (3.4 GiB) and a 16-bit lm_head (1.0 GiB; 0.6 GiB as Q8_0) do not all fit 4 GiB: the last layers stream
    # from pinned host RAM (issue 18, item 1), the rest stay resident; 8 GiB holds every layer
    assert cli.main(["plan", "--model", "deepseek-r1-distill-qwen-7b", "--context", "32768",
                     "--vram-budget", "4GiB", "--lm-head", "float"]) == 0
    out = capsys.readouterr().out
    assert "plan: deepseek-r1-distill-qwen-7b, int4 weights" in out and "fits" in out
    # (prefill_chunk auto: 512 where a smaller chunk keeps more layers resident)
    assert "placement: embedding host RAM, lm_head GPU (float), decoder layers 11 resident + 17 streamed" in out
    assert "streamed decoder layers (pinned RAM)" in out
    # lm_head auto with int4 weights: Q8_0 codes (1.25 bytes a weight, not 2) leave room for 3 more resident layers
    assert cli.main(["plan", "--model", "deepseek-r1-distill-qwen-7b", "--context", "32768",
                     "--vram-budget", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "lm_head: int8" in out and "fits" in out
    assert "placement: embedding host RAM, lm_head GPU (int8), decoder layers 14 resident + 14 streamed" in out
    assert cli.main(["plan", "--model", "deepseek-r1-distill-qwen-7b", "--context", "32768", "--gpu-mem", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "every token resident" in out and "decoder layers 28 resident\n" in out


def test_the_7b_placement(no_network):
    """The planner streams the fewest layers (at least 3: two are slots) that let the smallest KV window fit;
    an int4 lm_head leaves room for more resident layers; the plan of the placement fits and one layer fewer
    streamed does not."""
    import dataclasses

    from flashguard.config import CacheConfig

    seven = planner.resolve_shape("deepseek-r1-distill-qwen-7b")
    args = dict(budget=4 * 2**30, context=32768, weights="int4", cache="tiered", prefill_chunk=2048,
                kv=CacheConfig(), cuda_context=900 * 2**20, group=128)
    streamed, chunk = planner.layer_placement(seven, **args)
    head4, _ = planner.layer_placement(dataclasses.replace(seven, lm_head="int4"), **args)
    assert (streamed, chunk) == (24, 2048) and head4 == 18
    # prefill_chunk auto: a smaller chunk where it keeps more layers resident (4 of them here)
    assert planner.layer_placement(seven, shrink_chunk=True, **args) == (20, 512)
    one = planner.layer_bytes(seven, "int4", 128)
    assert one == 28 * 0 + (233_046_016 // 2 + 233_046_016 // 128 * 4)   # a layer's codes, scales and zeros
    kv = planner.sized_kv(seven, budget=args["budget"], context=32768, weights="int4", prefill_chunk=2048,
                          kv=CacheConfig(), cuda_context=900 * 2**20, group=128, streamed=streamed)
    p = planner.plan(seven, gpu_mem=planner.planned(args["budget"]), context=32768, weights="int4",
                     prefill_chunk=2048, kv=kv, group=128, cuda_context=900 * 2**20, streamed=streamed)
    assert p.fits and p.host["streamed decoder layers (pinned RAM)"] == streamed * one
    assert p.parts["weights"] == sum(planner.weight_bytes(seven, "int4", 128).values()) - (streamed - 2) * one
    assert not planner.plan(seven, gpu_mem=planner.planned(args["budget"]), context=32768, weights="int4",
                            prefill_chunk=2048, kv=kv.replace(l1_tokens=576, l1_max_tokens=576), group=128,
                            cuda_context=900 * 2**20, streamed=streamed - 1).fits
    assert planner.layer_placement(seven, **{**args, "budget": 16 * 2**30}) == (0, 2048)   # every layer resident
    assert planner.layer_placement(seven, **{**args, "weights": "float"}) == (0, 2048)     # float: int4 first


def test_a_budget_too_small_to_stream_names_the_smallest(no_network):
    from flashguard.config import CacheConfig
    from flashguard.errors import ConfigError

    seven = planner.resolve_shape("deepseek-r1-distill-qwen-7b")
    args = dict(context=8192, weights="int4", cache="tiered", prefill_chunk=2048, kv=CacheConfig())
    with pytest.raises(ConfigError) as err:
        planner.layer_placement(seven, budget=2**30, **args)
    message = str(err.value)
    assert "vram_budget" in message and "the smallest vram_budget that works is 2.12 GiB" in message
    streamed, chunk = planner.layer_placement(seven, budget=int(2.125 * 2**30), **args)   # that budget works
    assert streamed == 28 and chunk == 256
    with pytest.raises(ConfigError, match="smallest vram_budget that works is 2.12 GiB"):   # and less does not
        planner.layer_placement(seven, budget=int(2.125 * 2**30) - 2**25, **args)


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
