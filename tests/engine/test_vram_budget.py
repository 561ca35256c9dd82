"""The GPU budget's recovery path, on CPU: an out-of-memory raised from inside a decoder layer (after the
layers before it have already written their KV) is recovered by cutting the cache back and running the tokens
in smaller chunks; the output is the same as without the fault. A step that cannot fit says what to change."""

from __future__ import annotations

import pytest
import torch

from flashguard import EngineConfig
from flashguard.engine.engine import Engine
from flashguard.engine.sampling import SamplingParams
from flashguard.errors import GpuMemoryError

pytestmark = pytest.mark.slow   # the real embedded model; the same paths on a tiny model: test_engine_states.py

QUESTION = [{"role": "user", "content": "Write two sentences about the sea and the wind, please."}]


def _oom_above(engine, limit: int, layer: int = 10):
    """Raise torch.OutOfMemoryError in ``layer`` whenever a forward carries more than ``limit`` tokens."""
    calls = {"oom": 0}

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] > limit:
            calls["oom"] += 1
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    handle = engine.model.model.layers[layer].register_forward_pre_hook(hook, with_kwargs=True)
    return handle, calls


@pytest.mark.parametrize("cache", ["dynamic", "tiered"])
def test_oom_in_prefill_is_recovered_with_the_same_output(cache):
    kv = {"page_size": 16, "l1_tokens": 32, "sink_tokens": 16, "l1_max_tokens": 64, "l3_tokens": 0}
    config = EngineConfig.from_parameters({"prefill_chunk": 256, "kv_cache": cache, "kv": kv, "max_tokens": 24})
    engine = Engine(config)
    long_q = [{"role": "user", "content": "Here is some context: " + "the tide rolls in and out. " * 30
               + "Now write one sentence about the sea."}]
    params = SamplingParams(max_tokens=24)
    ids = engine.encode_messages(long_q)
    assert len(ids) > 150
    expected = engine.generate(ids, params).text
    engine = Engine(config)  # a fresh engine: no pages of this prompt in its store
    handle, calls = _oom_above(engine, 40)
    try:
        got = engine.generate(ids, params).text
    finally:
        handle.remove()
    assert calls["oom"] >= 2 and engine.oom_retries >= 2
    assert engine.prefill_chunk <= 40
    assert got == expected


def test_a_step_that_never_fits_names_the_keys_to_change():
    engine = Engine(EngineConfig(prefill_chunk=64))
    handle, _ = _oom_above(engine, 0)
    try:
        with pytest.raises(GpuMemoryError) as err:
            engine.generate(engine.encode_messages(QUESTION), SamplingParams(max_tokens=4))
    finally:
        handle.remove()
    text = str(err.value)
    assert "weights: int4" in text and "prefill_chunk" in text and "kv.l1_tokens" in text
    assert err.value.status_code == 507
    # the engine is usable afterwards
    assert engine.generate(engine.encode_messages(QUESTION), SamplingParams(max_tokens=4)).text
