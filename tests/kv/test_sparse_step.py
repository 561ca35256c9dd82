"""The one-graph sparse step (kv/sparse_step.py) against the layer-by-layer sparse path, on a tiny random Qwen2
whose context is longer than its pool (fast: run eagerly here, the same kernels a CUDA graph records)."""

import pytest
import torch

from flashguard import CacheConfig
from flashguard.engine.decode_step import DecodeStep
from flashguard.kv.cache import TieredCache
from flashguard.kv.sparse_step import SparseKV
from tests.tiny import forwarding, qwen2_head64

TIERS = dict(page_size=16, sink_tokens=16, l1_tokens=64, l1_max_tokens=128, l2_tokens=4096, budget_tokens=32,
             policy="sparse", l1_codec="fp16")


@pytest.fixture(scope="module")
def model():
    m = qwen2_head64()
    with torch.no_grad():
        m.lm_head.weight.mul_(8)   # peaked choices: greedy paths do not split on near-ties
    return m


def _run(model, whole: bool, steps: int, ids: list[int]):
    cache = TieredCache(model.config, CacheConfig(**TIERS)).attach(model)
    step = DecodeStep(model, graphs=False, whole_step=whole)
    used_sparse = 0
    with torch.inference_mode():
        for a in range(0, len(ids), 100):
            with forwarding(cache, ids[a:a + 100]):
                logits = model(input_ids=torch.tensor([ids[a:a + 100]]), past_key_values=cache).logits[0, -1]
        out, tokens = [], []
        for _ in range(steps):
            token = int(logits.argmax())
            tokens.append(token)
            with forwarding(cache, [token]):
                used_sparse += isinstance(cache.sparse_view(), SparseKV) if whole else 0
                logits = step.step(token, cache).float()
            out.append(logits)
    return torch.stack(out), tokens, cache, used_sparse


def test_the_one_graph_sparse_step_equals_the_layer_by_layer_sparse_step(model):
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    a, tok_a, cache_a, sparse_steps = _run(model, True, 40, ids)   # 40 steps: pages leave the window meanwhile
    b, tok_b, cache_b, _ = _run(model, False, 40, ids)
    assert sparse_steps >= 35   # the others: the L1 buffer full just before a page left it (it grows, then shifts)
    assert not cache_a.layers[0].resident and cache_a.page_reads > 0
    assert tok_a == tok_b
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert cache_a.length == cache_b.length and cache_a.layers[0].win_start == cache_b.layers[0].win_start
    cache_a.check_integrity()


def test_no_sparse_view_while_resident_or_with_too_few_pages(model):
    cache = TieredCache(model.config, CacheConfig(**TIERS)).attach(model)
    ids = list(range(1, 60))
    with forwarding(cache, ids):
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), past_key_values=cache)
    assert cache.layers[0].resident and cache.sparse_view() is None
    exact = TieredCache(model.config, CacheConfig(**(TIERS | {"policy": "exact"}))).attach(model)
    ids = list(range(1, 300))
    with forwarding(exact, ids):
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]), past_key_values=exact)
    assert not exact.layers[0].resident and exact.sparse_view() is None


def test_a_kernel_is_given_up_only_when_the_gpu_lacks_it():
    """kv/attention.py's KernelChoice: an 'unsupported' error moves a use to its next kernel for good; any other
    error propagates and changes nothing."""
    from flashguard.kv.attention import KernelChoice

    choice = KernelChoice()
    assert choice.get("segment", 0, torch.float16) == "flash"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        choice.downgrade("segment", 0, torch.float16, RuntimeError("CUDA error: an illegal memory access"))
    assert choice.get("segment", 0, torch.float16) == "flash"
    nxt = choice.downgrade("segment", 0, torch.float16,
                           RuntimeError("FlashAttention only supports Ampere GPUs or newer."))
    assert nxt == choice.get("segment", 0, torch.float16) == "efficient"
    assert choice.downgrade("segment", 0, torch.float16, RuntimeError("No available kernel. Aborting")) is None
    assert choice.get("segment", 1, torch.float16) == "flash"       # another device keeps its own choice
    assert choice.downgrade("prefix", 0, torch.float16, TypeError("unexpected keyword 'seqused_k'")) == "sdpa"


def test_after_a_crop_below_the_window_the_one_graph_step_reads_the_new_pages(model):
    """A crop below the window, then other tokens up to the same length: the sparse step's slot table must follow
    (page i is another page now), so the one-graph path still equals the layer-by-layer one."""
    first = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(6)).tolist()
    second = torch.randint(0, 300, (250,), generator=torch.Generator().manual_seed(7)).tolist()
    outs = []
    for whole in (True, False):
        cache = TieredCache(model.config, CacheConfig(**TIERS)).attach(model)
        step = DecodeStep(model, graphs=False, whole_step=whole)
        with torch.inference_mode():
            for ids in (first, None):
                if ids is None:   # crop below the window, then other tokens up to the same length
                    cache.crop_to(150)
                    # the slot table is refilled at the next step (page i may be another page now)
                    assert cache.sparse_state is None or cache.sparse_state.slots_key is None
                    ids = second
                for a in range(0, len(ids), 100):
                    with forwarding(cache, ids[a:a + 100]):
                        logits = model(input_ids=torch.tensor([ids[a:a + 100]]), past_key_values=cache).logits[0, -1]
                rows = []
                for _ in range(12):
                    token = int(logits.argmax())
                    with forwarding(cache, [token]):
                        logits = step.step(token, cache).float()
                    rows.append(logits)
        outs.append(torch.stack(rows))
        cache.check_integrity()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_a_crop_and_a_release_outside_inference_mode_after_sparse_steps(model):
    """The engine crops (a new prompt sharing a prefix) and releases (a reset) outside inference mode, while the
    sparse step's device state was made inside one (DecodeStep.step): the H200's 128K turns failed there."""
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(8)).tolist()
    cache = TieredCache(model.config, CacheConfig(**TIERS)).attach(model)
    step = DecodeStep(model, graphs=False, whole_step=True)
    with torch.inference_mode():
        with forwarding(cache, ids):
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0, -1]
    for _ in range(4):
        token = int(logits.argmax())
        with forwarding(cache, [token]):
            logits = step.step(token, cache)
    assert cache.sparse_state is not None
    cache.crop_to(300)
    assert cache.length == 300 and cache.sparse_state.slots_key is None
    cache.release()
    assert cache.length == 0


def test_a_new_session_on_the_pools_buffers_runs_the_sparse_step_on_the_same_state(model):
    """kv/pool.py: the sparse step's device state (SparseState) and the layers' buffers pass to the next session's
    cache, which then computes what a cache of its own computes (a GPU replays the same graph over them)."""
    from flashguard.kv.pool import PoolBuffers
    from flashguard.kv.store import PageStore

    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(2)).tolist()
    step = DecodeStep(model, graphs=False, whole_step=True)
    kv = CacheConfig(**TIERS)

    def session(cache):
        with torch.inference_mode():
            for a in range(0, len(ids), 32):   # (chunks that fit the buffer's room: it is never replaced)
                with forwarding(cache, ids[a:a + 32]):
                    logits = model(input_ids=torch.tensor([ids[a:a + 32]]), past_key_values=cache).logits[0, -1]
            out = []
            for _ in range(12):
                token = int(logits.argmax())
                with forwarding(cache, [token]):
                    assert isinstance(cache.sparse_view(), SparseKV)
                    logits = step.step(token, cache).float()
                out.append(logits)
        return torch.stack(out)

    store, pool = PageStore(kv), PoolBuffers()
    first = TieredCache(model.config, kv, store=store, preallocate=True, pool=pool).attach(model)
    session(first)
    state, k = first.sparse_state, first.layers[0].l1_k.data_ptr()
    first.release(keep_pages=False)
    second = TieredCache(model.config, kv, store=store, preallocate=True, pool=pool).attach(model)
    got = session(second)
    assert second.sparse_state is state and second.layers[0].l1_k.data_ptr() == k
    fresh = TieredCache(model.config, kv, preallocate=True).attach(model)
    torch.testing.assert_close(got, session(fresh), atol=1e-4, rtol=1e-4)
    second.check_integrity()
