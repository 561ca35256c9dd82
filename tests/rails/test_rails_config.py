"""config.yml -> LLMRails: every EngineConfig and CacheConfig key passes NeMo Guardrails' own checks."""

import dataclasses
import textwrap

import pytest
import yaml

from flashguard.config import CacheConfig, EngineConfig

# NeMo Guardrails 0.24 rejects these model parameter names for the default framework (its migration check).
NEMO_REJECTS = {"streaming", "disable_streaming", "verbose", "cache", "callbacks", "tags", "metadata", "name",
                "model_kwargs"}
NEMO_REJECTED_SUFFIXES = ("_api_key", "_base_url", "_api_base", "_endpoint")

EVERY_KEY = {
    "model_path": None, "gguf_file": None, "device": "cpu", "dtype": "float32", "max_tokens": 24,
    "reasoning_tokens": 512, "temperature": 0.0, "top_p": 1.0, "seed": 7, "repetition_penalty": 1.1,
    "frequency_penalty": 0.1, "presence_penalty": 0.0, "no_repeat_ngram": 0, "prefill_chunk": 256, "max_context": 4096,
    "kv_cache": "tiered", "vram_budget": "auto", "weights": "float", "lm_head": "auto", "int4_kernel": "auto", "cuda_graphs": True,
    "system_prompt": "You are a helpful assistant.", "lora_path": None, "guard_adapter": "off",
    "backend": "local", "base_url": None, "api_key_env": None, "timeout_s": 60.0, "slot_leases": "auto",
    "kv": {"page_size": 32, "l1_tokens": 512, "sink_tokens": 32, "l2_tokens": 2048, "l3_tokens": 65536,
           "l3_dir": None, "policy": "sparse", "budget_tokens": 256, "adaptive_l1": True, "l1_max_tokens": 1024,
           "l1_codec": "fp16", "l2_codec": "int8", "l3_codec": "int4-zstd", "isolation_salt": "tenant-a", "l3_encrypt": True,
           "zero_copy": True, "peer_gpus": None},
}


def test_every_key_is_covered_and_none_is_a_name_nemo_rejects():
    engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
    cache_keys = {f.name for f in dataclasses.fields(CacheConfig)}
    assert engine_keys == set(EVERY_KEY)
    assert cache_keys == set(EVERY_KEY["kv"])
    for key in engine_keys:
        assert key not in NEMO_REJECTS and not key.endswith(NEMO_REJECTED_SUFFIXES), key
    config = EngineConfig.from_parameters(EVERY_KEY)
    assert config.kv.isolation_salt == "tenant-a" and config.kv_cache == "tiered"


@pytest.mark.slow
def test_llmrails_from_a_config_yml_with_every_key(tmp_path):
    from nemoguardrails import LLMRails, RailsConfig

    import flashguard.engine.registry as registry

    params = yaml.safe_dump({"models": [{"type": "main", "engine": "flashguard", "model": "flashguard",
                                         "parameters": EVERY_KEY}]})
    (tmp_path / "config.yml").write_text(params + "passthrough: true\n")
    (tmp_path / "config.py").write_text(textwrap.dedent("""
        import flashguard
        flashguard.register()
    """))
    rails = LLMRails(RailsConfig.from_path(str(tmp_path)))
    reply = rails.generate(messages=[{"role": "user", "content": "hi"}])
    assert isinstance(reply, dict) and reply["content"].strip()
    info = [i for i in registry.engine_info() if i["prefill_chunk"] == 256]
    assert info and info[0]["cache"] == "tiered"
    assert info[0]["tiers"]["l1"]["tokens"] == 512 and info[0]["tiers"]["l2"]["tokens"] == 2048
