"""The planner's arithmetic against hand-computed cases, and ``flashguard smi`` / ``plan`` on a machine with no GPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
import subprocess
import sys

import pytest

from flashguard.config import CacheConfig
from flashguard.vram import plan as planner


def deepseek():
    return planner.resolve_shape("deepseek-r1-distill-qwen-1.5b")


def test_weight_bytes_of_the_1_5b_shape_by_hand():
    s = deepseek()
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab, s.tied) == (
        1536, 28, 12, 2, 128, 8960, 151936, False)
    # per layer: q 1536x1536, k/v 1536x256 each, o 1536x1536, gate/up/down 1536x8960 each
    linear = 28 * (1536 * 1536 + 2 * 1536 * 256 + 1536 * 1536 + 3 * 1536 * 8960)
    assert linear == 28 * 46_792_704 == 1_310_195_712
    fp16 = planner.weight_bytes(s, "float")
    assert fp16["decoder linears"] == 2 * linear
    assert fp16["embeddings + lm_head"] == 2 * 151936 * 1536 * 2
    int4 = planner.weight_bytes(s, "int4", group=128)
    assert int4["decoder linears"] == linear // 2 + (linear // 128) * 4   # codes + bf16 scale and zero per group
    total_int4 = sum(int4.values())
    assert total_int4 / 2**30 < 1.7   # the target: <= 1.7 GiB with embeddings and lm_head


def test_kv_bytes_dynamic_and_tiered_by_hand():
    s = deepseek()
    per_token = 28 * 2 * 256 * 2   # layers x (K,V) x kv_heads*head_dim x fp16
    dyn = planner.plan(s, gpu_mem=4 << 30, context=131072, weights="float", cache="dynamic", prefill_chunk=4096)
    assert dyn.parts["kv cache"] == 131072 * per_token == 3_758_096_384
    assert not dyn.fits
    kv = CacheConfig(page_size=64, l1_tokens=2048, l1_max_tokens=4096, sink_tokens=64, l2_tokens=65536)
    tiered = planner.plan(s, gpu_mem=4 << 30, context=131072, weights="int4", cache="tiered", prefill_chunk=2048,
                          kv=kv)
    window = 64 + 4096 + 2048 + 64
    summaries = (131072 // 64) * 28 * 2 * 2 * 128 * 2
    fetch = 32768 * 2 * 256 * 2 * 2   # kv.FETCH_BLOCK_TOKENS of pages, decoded + encoded bytes in flight
    assert tiered.parts["kv cache"] == window * per_token + summaries + fetch
    assert tiered.fits and tiered.peak_reserved < 3 * 2**30
    assert tiered.host["L2 (host RAM)"] == 65536 * 28 * 2 * 256 * 1          # int8
    assert tiered.host["L3 (disk, before zstd)"] == (131072 - window - 65536) * 28 * 2 * 256 // 2   # int4


def test_suggest_names_the_keys_that_make_it_fit():
    s = deepseek()
    changes = planner.suggest(s, gpu_mem=4 << 30, context=131072, weights="float", cache="dynamic", prefill_chunk=4096)
    assert changes == {"weights": "int4", "kv_cache": "tiered"}
    assert "error" in planner.suggest(s, gpu_mem=1 << 30, context=131072, weights="float", cache="dynamic",
                                      prefill_chunk=4096)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "flashguard.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_plan_cli_says_what_to_set():
    one_five = ("--model", "deepseek-r1-distill-qwen-1.5b")
    out = _cli("plan", *one_five, "--weights", "float", "--kv-cache", "dynamic", "--gpu-mem", "4GiB",
               "--context", "131072")
    assert out.returncode == 1
    assert "does NOT fit" in out.stdout and "weights: int4, kv_cache: tiered, vram_budget: 4GiB" in out.stdout
    out = _cli("plan", *one_five, "--gpu-mem", "4GiB", "--context", "131072")   # int4, the tiered cache, auto
    assert out.returncode == 0 and "kv.l1_tokens (the pool on the GPU)" in out.stdout and "off the pool" in out.stdout


@pytest.mark.slow
def test_plan_without_a_model_plans_the_configs(tmp_path):
    """No --model: the config's model (configs/flash names none: the embedded SmolLM2) and its weights key, auto
    resolved as the engine does on a GPU; a config naming another GGUF and weights: int4 plans that."""
    out = _cli("plan", "--gpu-mem", "4GiB", "--context", "8192")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("model: SmolLM2-135M-Instruct (the embedded model") and "weights: float (auto:" in first
    assert "plan: SmolLM2-135M-Instruct, float weights" in out.stdout
    from flashguard.engine import loader

    source = loader.resolve_model(None)
    gguf = Path(source.folder, source.gguf_file)
    (tmp_path / "config.yml").write_text(f"models:\n  - type: main\n    engine: flashguard\n    model: x\n"
                                         f"    parameters:\n      model_path: {gguf.as_posix()}\n"
                                         f"      weights: int4\n", encoding="utf-8")
    out = _cli("plan", "--config", str(tmp_path), "--gpu-mem", "4GiB", "--context", "8192")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith(f"model: {gguf.name} (models[main].parameters.model_path") and \
        "weights: int4 (weights: int4 in the config)" in first


@pytest.mark.slow
def test_smi_without_a_gpu_or_server():
    out = _cli("smi", "--url", "http://127.0.0.1:9", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["gpus"] == [] and report["host"]["total"] > 0
    text = _cli("smi", "--url", "http://127.0.0.1:9").stdout
    assert "no GPU visible" in text and "host RAM" in text


def test_fit_to_budget_shrinks_chunk_and_window_then_names_keys():
    s = deepseek()
    kv = CacheConfig(page_size=64, l1_tokens=4096, l1_max_tokens=8192, sink_tokens=64, l2_tokens=65536)
    budget = 2816 << 20   # the process's whole GPU memory (2.75 GiB)
    assert not planner.plan(s, gpu_mem=planner.planned(budget), context=131072, weights="int4", cache="tiered",
                            prefill_chunk=4096, kv=kv).fits
    new_kv, chunk, final, notes = planner.fit_to_budget(s, budget=budget, context=131072, weights="int4",
                                                        cache="tiered", prefill_chunk=4096, kv=kv)
    assert chunk < 4096 or new_kv.l1_max_tokens < 8192
    assert final.fits and planner.plan(s, gpu_mem=planner.planned(budget), context=131072, weights="int4",
                                       cache="tiered", prefill_chunk=chunk, kv=new_kv).fits
    assert notes and not any("still exceeds" in n for n in notes)
    _, _, final, notes = planner.fit_to_budget(s, budget=4 << 30, context=131072, weights="float", cache="dynamic",
                                               prefill_chunk=4096, kv=kv)
    assert not final.fits and "set weights: int4, kv_cache: tiered" in notes[-1]


def test_the_pool_is_the_whole_context_when_it_fits_and_the_budget_otherwise():
    s = deepseek()
    auto = CacheConfig()
    for context in (8192, 32768):
        kv, _, final, _ = planner.fit_to_budget(s, budget=4 << 30, context=context, weights="int4", cache="tiered",
                                                prefill_chunk=512, kv=auto)
        assert kv.l1_tokens >= context and final.fits          # every token resident
    kv, _, final, _ = planner.fit_to_budget(s, budget=4 << 30, context=131072, weights="int4", cache="tiered",
                                            prefill_chunk=512, kv=auto)
    assert 8192 < kv.l1_tokens <= kv.l1_max_tokens < 131072 and final.fits
    assert final.total <= planner.planned(4 << 30)              # NVML figure: weights, pool, context, slack
    bigger, _, _, _ = planner.fit_to_budget(s, budget=6 << 30, context=131072, weights="int4", cache="tiered",
                                            prefill_chunk=512, kv=auto)
    assert bigger.l1_max_tokens > kv.l1_max_tokens              # more memory, a larger pool
    _, _, final, notes = planner.fit_to_budget(s, budget=1 << 30, context=131072, weights="int4", cache="tiered",
                                               prefill_chunk=512, kv=auto)
    assert not final.fits and "still exceeds" in notes[-1]     # the engine turns this into an error naming the key


def test_bytes_per_decoded_token_of_the_1_5b_beside_llamacpps():
    """decode_bytes: the int4 linears, the 16-bit lm_head and every K/V value of a resident context; past the pool,
    the sparse policy's attended tokens only. llama.cpp's Q4_K_M estimate: ~0.99 GB of weights a token (its file's
    1.04 GiB less the embedding table), as the issue measured."""
    s = deepseek()
    kv8k = planner.sized_kv(s, budget=4 << 30, context=8192, weights="int4", prefill_chunk=2048, kv=CacheConfig())
    read = planner.decode_bytes(s, weights="int4", context=8192, kv=kv8k)
    assert read["lm_head"] == s.vocab * s.hidden * 2
    assert read["kv attended"] == 8192 * s.layers * 2 * s.kv_heads * s.head_dim * 2   # fp16, all resident
    assert 0.70e9 < read["decoder linears"] < 0.76e9 and read["total"] == sum(v for k, v in read.items() if k != "total")
    long = planner.sized_kv(s, budget=4 << 30, context=131072, weights="int4", prefill_chunk=2048, kv=CacheConfig())
    far = planner.decode_bytes(s, weights="int4", context=131072, kv=long)
    assert long.l1_tokens < 131072 and far["kv attended"] < 131072 * s.layers * 2 * s.kv_heads * s.head_dim * 2
    llama = planner.llamacpp_decode_bytes(s, context=8192, kv_type="q8_0")
    assert 0.95e9 < llama["decoder linears"] + llama["lm_head"] < 1.02e9
    assert llama["kv attended"] == int(8192 * s.layers * 2 * s.kv_heads * s.head_dim * 34 / 32)


def test_the_int4_head_and_the_int8_pool_read_fewer_bytes_than_llamacpp_at_8k(capsys):
    """``lm_head: int4`` plans its codes and the top rows a token reads from host RAM; with the int8 pool the 1.5B
    at 8K reads fewer bytes than llama.cpp's Q4_K_M with a q8_0 cache, which ``flashguard plan`` says."""
    from flashguard import cli
    from flashguard.quant.lm_head import TOP

    s = dataclasses.replace(deepseek(), lm_head="int4")
    assert planner.head_bytes(s) == s.vocab * s.hidden // 2 + (s.vocab * s.hidden // 32) * 4 + TOP * s.hidden * 2
    kv = planner.sized_kv(s, budget=4 << 30, context=8192, weights="int4", prefill_chunk=2048,
                          kv=CacheConfig(l1_codec="int8"))
    ours = planner.decode_bytes(s, weights="int4", context=8192, kv=kv)["total"]
    assert ours < planner.llamacpp_decode_bytes(s, context=8192)["total"]
    assert cli.main(["plan", "--model", "deepseek-r1-distill-qwen-1.5b", "--context", "8192", "--gpu-mem", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "x llama.cpp's Q4_K_M with a q8_0 cache" in out
    assert f"lm_head: int4 and kv: {{l1_codec: int8}} read {ours / 1e9:.3f} GB" in out
