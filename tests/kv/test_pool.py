"""kv/pool.py: the pool's buffers pass from one session's cache to the next (the same device memory, so the step
graphs recorded over it stay valid), the next session computes what a fresh cache computes, and buffers that do
not fit the next cache are not used."""

import torch

from flashguard import CacheConfig, TieredCache
from flashguard.kv.pool import PoolBuffers
from flashguard.kv.store import PageStore

from tests import tiny
from tests.tiny import forwarding

KV = CacheConfig(page_size=16, l1_tokens=64, sink_tokens=16, l1_max_tokens=96, l2_tokens=4096, l3_tokens=0,
                 policy="sparse", budget_tokens=32)


def _run(model, cache, ids):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


def _cache(model, store, pool, kv=KV):
    return TieredCache(model.config, kv, store=store, model_id="pool-test", preallocate=True, pool=pool).attach(model)


def test_the_next_session_runs_on_the_last_sessions_buffers_and_computes_the_same():
    model = tiny.model("qwen2")
    store, pool = PageStore(KV), PoolBuffers()
    ids = torch.randint(3, 90, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    first = _cache(model, store, pool)
    with forwarding(first, ids[:120]):
        _run(model, first, ids[:120])
    ptrs = [(layer.l1_k.data_ptr(), layer.l1_v.data_ptr(), layer.bounds.data_ptr()) for layer in first.layers]
    first.release(keep_pages=False)
    assert pool.holds()
    second = _cache(model, store, pool)
    other = ids[70:190]   # another sequence (one chunk within the buffer): nothing of the first one's may show
    with forwarding(second, other):
        got = _run(model, second, other)
    assert [(layer.l1_k.data_ptr(), layer.l1_v.data_ptr(), layer.bounds.data_ptr()) for layer in second.layers] == ptrs
    assert not pool.holds()   # taken: a third cache at the same time would make its own
    fresh = _cache(model, PageStore(KV), None)
    with forwarding(fresh, other):
        torch.testing.assert_close(got, _run(model, fresh, other), rtol=1e-5, atol=1e-5)
    for t in ids[:40]:   # decode past the window: pages leave it, the sparse picks read their bounds
        with forwarding(second, [t]):
            a = _run(model, second, [t])
        with forwarding(fresh, [t]):
            b = _run(model, fresh, [t])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert second.layers[0].win_start > second.sink_tokens
    second.check_integrity()


def test_buffers_that_do_not_fit_the_next_cache_are_not_used():
    model = tiny.model("qwen2")
    store, pool = PageStore(KV), PoolBuffers()
    first = _cache(model, store, pool)
    with forwarding(first, list(range(3, 43))):
        _run(model, first, list(range(3, 43)))
    first.release(keep_pages=False)
    bigger = CacheConfig(**{**KV.__dict__, "l1_max_tokens": 160})   # a larger window: a larger buffer
    second = _cache(model, store, pool, bigger)
    with forwarding(second, list(range(3, 43))):
        _run(model, second, list(range(3, 43)))
    layer = second.layers[0]
    assert layer.l1_k.shape[1] == layer._full() == 16 + 160 + 2 * 16
    assert not pool.holds()


def test_step_graphs_over_buffers_the_pool_does_not_hold_are_forgotten():
    from flashguard.engine.decode_step import DecodeStep
    from flashguard.kv.static import GraphKey

    model = tiny.model("qwen2")
    step = DecodeStep(model, graphs=False)
    store, pool = PageStore(KV), PoolBuffers()
    cache = _cache(model, store, pool)
    with forwarding(cache, list(range(3, 43))):
        _run(model, cache, list(range(3, 43)))
    view = cache.static_view()
    cache.release(keep_pages=False)
    other = torch.zeros(4)
    sparse_kept = GraphKey("sparse", tuple((layer.k.data_ptr(), layer.v.data_ptr(), layer.bounds.data_ptr(), 64)
                                           for layer in (pool._layers[i] for i in sorted(pool._layers))),
                           tables=(1, 2, 3, 4, 5))
    step.step_graphs = {view.key: "static", sparse_kept: "sparse",
                        GraphKey("static", ((other.data_ptr(),) * 2,) * 2, variant=(64, ())): "elsewhere"}
    step.forget_steps(keep=pool.ptrs())
    assert set(step.step_graphs.values()) == {"static", "sparse"}
    step.forget_steps(keep=set())
    assert not step.step_graphs
