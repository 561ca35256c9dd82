"""``weights: auto`` (the default): int4 for a GGUF with Q4 matrices on the CPU, as stored everywhere else; the
choice and its reason are what the start-up line, ``engine_info()`` and ``flashguard plan`` say."""

import torch

from flashguard.config import ConfigError, EngineConfig
from flashguard.engine import loader
from flashguard.engine.registry import engine_key

import pytest


def test_auto_is_the_default_and_a_bad_value_names_the_key():
    assert EngineConfig().weights == "auto"
    with pytest.raises(ConfigError, match="weights") as err:
        EngineConfig.from_parameters({"weights": "int8"})
    assert "auto, float, int4" in str(err.value)


def test_auto_runs_the_embedded_gguf_in_int4_on_the_cpu_and_as_stored_on_a_gpu():
    source = loader.resolve_model(None)
    kind, why = loader.choose_weights("auto", source, torch.device("cpu"))
    assert kind == "int4" and why.startswith("auto: the GGUF's own Q4 codes on the CPU")
    kind, why = loader.choose_weights("auto", source, torch.device("cuda"))
    assert kind == "float" and "weights: int4" in why
    assert loader.choose_weights("float", source, torch.device("cpu")) == ("float", "weights: float")


def test_auto_keeps_an_hf_folder_as_stored(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    source = loader.resolve_model(str(tmp_path))
    kind, why = loader.choose_weights("auto", source, torch.device("cpu"))
    assert kind == "float" and "AWQ" in why


def test_auto_and_its_choice_share_one_engine_on_the_cpu():
    """The registry keys engines by the resolved weights: ``auto`` and ``int4`` load the embedded model once."""
    source = loader.resolve_model(None)
    cpu = {"device": "cpu"}
    assert engine_key(EngineConfig(**cpu), source) == engine_key(EngineConfig(weights="int4", **cpu), source)
    assert engine_key(EngineConfig(**cpu), source) != engine_key(EngineConfig(weights="float", **cpu), source)
    # a config with lm_head: int8 is another engine (it was served the 16-bit head's engine); sampling defaults are not
    assert engine_key(EngineConfig(**cpu), source) != engine_key(EngineConfig(lm_head="int8", **cpu), source)
    assert engine_key(EngineConfig(**cpu), source) == engine_key(EngineConfig(temperature=0.7, max_tokens=9, **cpu),
                                                                  source)


def test_a_model_without_a_chat_template_gets_the_plain_one_for_the_chat_and_the_rails(tmp_path):
    """A base model (Gemma 3 270M's GGUF has no template): the engine, the rails' question suffix and calibrate
    render conversations the same way, with "role: text" lines, where apply_chat_template used to raise."""
    import copy

    from flashguard.rails.moderation import moderation_suffix
    from tests import tiny

    tok = copy.deepcopy(tiny.tokenizer())
    tok.chat_template = None
    engine = tiny.engine(tmp_path, tok=tok)
    ids = engine.encode_messages([{"role": "user", "content": "hi"}])
    assert engine.tokenizer.decode(ids) == "user: hi\nassistant:"
    assert engine.tokenizer.decode(moderation_suffix(engine, "Safe?")) == "\nuser: Safe?\nassistant:"


def test_auto_reads_an_awq_checkpoint_as_int4(tmp_path):
    """An AWQ folder loads in int4 whatever the key says: auto says so (the start-up line, plan, the registry)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    kind, why = loader.choose_weights("auto", loader.resolve_model(str(tmp_path)), torch.device("cuda"))
    assert kind == "int4" and "AWQ checkpoint" in why


def test_a_prompt_answers_the_same_after_other_prompts(tmp_path):
    """The last prompt token runs alone after the prefill, as a held prompt's does: greedy replies do not depend on
    what the session held (fresh, asked again, and after another prompt)."""
    from flashguard.engine import SamplingParams
    from tests import tiny

    engine = tiny.engine(tmp_path, prefill_chunk=7)
    ids = engine.encode_messages([{"role": "user", "content": tiny.text(90)}])
    other = engine.encode_messages([{"role": "user", "content": tiny.text(60, seed=1)}])
    p = SamplingParams(max_tokens=24)
    engine.reset_session()
    first = engine.generate(ids, p).text
    assert engine.generate(ids, p).text == first
    engine.generate(other, p)
    assert engine.generate(ids, p).text == first
