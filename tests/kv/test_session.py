"""The forward protocol (kv/session.py): ``KVSession.forward(tokens)`` is the one way K/V reaches a cache, and
``Engine.read`` the rails' one call. Tiny random models: fast."""

from __future__ import annotations

import pytest
import torch

from flashguard import CacheConfig
from flashguard.kv.session import DynamicSession, TieredSession
from flashguard.kv.store import PageStore
from tests import tiny

KV = CacheConfig(page_size=16, l1_tokens=64, sink_tokens=16, l1_max_tokens=96, l2_tokens=4096, l3_tokens=0,
                 policy="sparse", budget_tokens=32)


def _sessions(model):
    return {"tiered": TieredSession(model, KV, PageStore(KV), "session-test", preallocate=False),
            "dynamic": DynamicSession(model.config)}


def _forward(model, session, ids):
    with torch.inference_mode(), session.forward(ids) as cache:
        return model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]


@pytest.mark.parametrize("kind", ["tiered", "dynamic"])
def test_a_failed_forward_leaves_the_session_as_it_was(kind):
    """A forward that raises part-way (here inside the model, after some layers appended the new tokens) leaves
    every layer at the tokens before it, and the next forward computes what it would have."""
    model = tiny.model("qwen2")
    session = _sessions(model)[kind]
    ids = [3 + i % 90 for i in range(100)]
    _forward(model, session, ids[:80])
    layer = model.model.layers[1]
    boom = layer.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        _forward(model, session, ids[80:])
    boom.remove()
    assert session.ids == ids[:80] and session.cache.get_seq_length() == 80
    got = _forward(model, session, ids[80:])
    want = _forward(model, _sessions(model)[kind], ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pages_settle_when_the_forward_ends():
    """The pages a forward fills are keyed by their ids when it ends (not at the next forward), and stats() changes
    nothing; a second session on the same store reuses them by content."""
    model = tiny.model("qwen2")
    store = PageStore(KV)
    first = TieredSession(model, KV, store, "session-test", preallocate=False)
    ids = [3 + i % 90 for i in range(200)]
    _forward(model, first, ids)
    assert len(first.cache.page_keys) == 200 // 16
    before = first.cache.stats()
    assert first.cache.stats() == before and len(first.cache.page_keys) == 200 // 16
    first.cache.check_integrity()
    first.release(keep_pages=True)
    second = TieredSession(model, KV, store, "session-test", preallocate=False)
    assert second.adopt(ids, torch.float32, torch.device("cpu")) == 192


def test_a_forward_at_the_wrong_position_is_refused():
    """A TieredCache told of a forward from a position it does not hold raises (K/V at the wrong positions would be
    attended silently)."""
    from flashguard.kv.cache import TieredCache

    model = tiny.model("qwen2")
    cache = TieredCache(model.config, KV).attach(model)
    with pytest.raises(ValueError, match="position 5 on a cache holding 0 tokens"):
        cache.begin([1, 2], start=5)


def test_the_rails_read_leaves_no_hook_and_crops_to_keep(tmp_path):
    """``Engine.read``: the states it was asked for, from hooks that live for one forward only; ``keep`` brings the
    session back to a branch point; ``mean_from`` runs the span again even when the session held it."""
    engine = tiny.engine(tmp_path / "m", "qwen2")
    ids = engine.encode_messages([{"role": "user", "content": tiny.text(120)}])
    first = engine.read(ids, hidden=True, layers=(1, 2), mean_from=10, keep_states=True)
    n = engine.model.config.num_hidden_layers
    assert first.hidden.shape == (n + 1, engine.model.config.hidden_size) and first.reused == 0
    assert first.mean.shape == (2, engine.model.config.hidden_size)
    assert first.states.shape == (2, len(ids) - 10, engine.model.config.hidden_size)
    torch.testing.assert_close(first.states.mean(1), first.mean, atol=1e-5, rtol=1e-5)
    assert all(not m._forward_hooks for m in engine.model.modules())
    again = engine.read(ids, hidden=True, layers=(1, 2), mean_from=10, keep=30)
    assert again.reused == 10 and engine.session_ids == ids[:30]   # the span ran again; then back to 30
    torch.testing.assert_close(again.mean, first.mean, atol=1e-4, rtol=1e-4)
    plain = engine.read(ids)
    assert plain.reused == 30 and plain.hidden is None and plain.mean is None
    torch.testing.assert_close(plain.logprobs, first.logprobs, atol=1e-4, rtol=1e-4)
