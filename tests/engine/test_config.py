import pytest

from flashguard import CacheConfig, ConfigError, EngineConfig
from flashguard.config import parse_bytes


def test_defaults_are_the_embedded_model_and_greedy():
    c = EngineConfig.from_parameters({})
    assert c.model_path is None and c.temperature == 0.0
    assert c.kv_cache == "tiered" and c.vram_budget == "auto" and not c.kv.sized   # sized at engine start


def test_the_old_cache_key_says_its_new_name():
    with pytest.raises(ConfigError, match=r"parameters\.cache: renamed to kv_cache"):
        EngineConfig.from_parameters({"cache": "tiered"})


def test_auto_sizes_and_budget():
    c = EngineConfig.from_parameters({"kv": {"l1_tokens": "auto", "l2_tokens": 4096}, "vram_budget": "auto"})
    assert c.kv.l1_tokens is None and c.kv.l2_tokens == 4096 and c.vram_budget == "auto"
    assert EngineConfig.from_parameters({"vram_budget": None}).vram_budget is None
    with pytest.raises(ConfigError, match=r"parameters\.kv\.l2_tokens"):
        EngineConfig.from_parameters({"kv": {"l2_tokens": "many"}})


def test_nemo_kwargs_are_accepted():
    EngineConfig.from_parameters({"mode": "chat", "api_key": None})


def test_unknown_key_names_the_yaml_key():
    with pytest.raises(ConfigError, match=r"models\[main\]\.parameters\.max_tokenz.*known keys"):
        EngineConfig.from_parameters({"max_tokenz": 10})


def test_unknown_kv_key_names_the_nested_key():
    with pytest.raises(ConfigError, match=r"parameters\.kv\.pagesize"):
        EngineConfig.from_parameters({"kv": {"pagesize": 64}})


@pytest.mark.parametrize("params,key", [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"device": "tpu"}, "device"),
    ({"dtype": "int3"}, "dtype"),
    ({"kv": {"policy": "magic"}}, "kv.policy"),
    ({"kv": {"page_size": 64, "l1_tokens": 32}}, "kv.l1_tokens"),
    ({"kv": "big"}, "kv"),
    ({"vram_budget": "lots"}, "vram_budget"),
    ({"kv_cache": "static"}, "kv_cache"),
])
def test_bad_values_name_their_key(params, key):
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_parameters(params)
    assert f"parameters.{key}: " in str(err.value)


def test_config_is_frozen():
    c = EngineConfig()
    with pytest.raises(Exception):
        c.max_tokens = 3  # type: ignore[misc]
    with pytest.raises(Exception):
        CacheConfig().page_size = 3  # type: ignore[misc]


def test_nested_kv_and_sizes():
    c = EngineConfig.from_parameters({"kv": {"page_size": 32, "l1_tokens": 256, "policy": "exact"},
                                      "vram_budget": "4GiB"})
    assert c.kv.page_size == 32 and c.kv.policy == "exact" and c.vram_budget == 4 * 2**30
    assert parse_bytes("3.5 GB") == 3_500_000_000 and parse_bytes(1024) == 1024
