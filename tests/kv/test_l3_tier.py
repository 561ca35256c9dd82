"""L3 (disk) with the rest of the cache: a crop keeps the pages it drops for a later session, the one-graph sparse
step serves pages whose only copy is on disk (read once, on the prefetch worker or, when a step misses many, before
it runs again; then read from L2 while hot), a prefill writes its L3 files off its path, and why L3 is off is visible (issue 13)."""

import collections
import sys
import threading

import pytest
import torch

from flashguard import CacheConfig
from flashguard.engine.decode_step import DecodeStep
from flashguard.engine.sampling import SamplingParams
from flashguard.kv.cache import TieredCache
from flashguard.kv.store import PageStore
from tests import tiny


def test_a_crop_to_a_few_tokens_keeps_the_window_pages_for_a_new_session(tmp_path):
    """The 128K e2e row: the output rail judged a too-long reply in windows, a prompt sharing one token with the
    session, so the session was cropped to 1 token; the window's pages (only in L1) were lost and a new session
    with the same prefix prefilled them again (41K tokens)."""
    e = tiny.engine(tmp_path, kv={"page_size": 16, "l1_tokens": 256, "l1_max_tokens": 320, "sink_tokens": 16,
                                  "budget_tokens": 32}, max_context=2048)
    ids = e.encode_messages([{"role": "user", "content": tiny.text(1200)}])
    e.generate(ids, SamplingParams(max_tokens=20, temperature=0.0))
    assert 0 < e.session.cache.layers[0].win_start < len(ids) - 128   # pages left the window: the rest only in L1
    other = e.encode_messages([{"role": "assistant", "content": tiny.text(100, seed=3)}])
    assert other[0] == ids[0] and other[1] != ids[1]               # the crop keeps one token
    e.next_token_logprobs(other)
    e.reset_session()
    _, reused = e.next_token_logprobs(ids)
    assert reused == (len(ids) - 1) // 16 * 16                     # every full page of the prompt was stored
    e.session.cache.check_integrity()


TIERS = dict(page_size=16, sink_tokens=16, l1_tokens=64, l1_max_tokens=128, budget_tokens=32, policy="sparse",
             l1_codec="fp16", l3_codec="fp16-zstd")   # a lossless L3: the step equals the all-in-L2 step exactly
SMOL_TIERS = dict(TIERS, page_size=32, sink_tokens=32, l1_tokens=256, l1_max_tokens=384, budget_tokens=64)


def _decode(model, l2_tokens: int, steps: int, ids: list[int], chunk: int = 100, tiers: dict = TIERS):
    cfg = CacheConfig(**tiers, l2_tokens=l2_tokens)
    store = PageStore(cfg)
    reads = []   # (step, page key, reading thread) of every L3 read
    read = store.disk.read
    store.disk.read = lambda key, path: (reads.append((cache.length, key, threading.current_thread().name)),
                                         read(key, path))[1]
    cache = TieredCache(model.config, cfg, store=store).attach(model)
    step = DecodeStep(model, graphs=False, whole_step=True)   # the one-graph step's kernels, eagerly
    with torch.inference_mode():
        with store.deferred():   # as the engine's prefill: the prompt's pages stay in L2 until it ends
            for a in range(0, len(ids), chunk):
                with tiny.forwarding(cache, ids[a:a + chunk]):
                    logits = model(input_ids=torch.tensor([ids[a:a + chunk]]), past_key_values=cache).logits[0, -1]
        prefill_reads, counts = len(reads), store.tier_counts()
        assert store.clock == -(-len(ids) // chunk)           # the policy's clock: one tick a forward (``update``)
        out, tokens = [], []
        for _ in range(steps):
            token = int(logits.argmax())
            tokens.append(token)
            with tiny.forwarding(cache, [token]):
                logits = step.step(token, cache).float()
            out.append(logits)
    assert store.clock == -(-len(ids) // chunk) + steps       # ... and one a one-graph step (``advance``)
    cache.check_integrity()
    return torch.stack(out), tokens, cache, reads, prefill_reads, counts


def _kl(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(out.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _check_l3_promotion(model, ids, steps, l2_small, pages_per_step, tiers=TIERS):
    ref, ref_tokens, ref_cache, _, _, _ = _decode(model, 1 << 20, steps, ids, tiers=tiers)
    out, tokens, cache, reads, prefill_reads, counts = _decode(model, l2_small, steps, ids, tiers=tiers)
    assert counts["l3_pages"] >= counts["pages"] / 2           # at least half the pages on disk when decoding starts
    assert prefill_reads == 0                                  # the prefill read nothing back from disk
    assert tokens == ref_tokens
    if cache.pages_missed == 0:   # every picked page on disk was promoted before use (the step ran again)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:                         # a few were attended without, fetched for the next steps: within sparse fidelity
        assert float(_kl(ref, out).mean()) <= 0.01
    assert reads, "no page was read from L3"
    again = [k for k, n in collections.Counter(k for _, k, _ in reads).items() if n > 1]
    assert not again, f"{len(again)} pages read from disk more than once"
    late = sum(1 for at, _, _ in reads if at >= len(ids) + 16)
    assert late <= 0.01 * pages_per_step * (steps - 16)       # after 16 steps: <= 1% of the pages attended
    return cache, reads, _kl(ref, out)


def test_the_one_graph_sparse_step_reads_an_l3_page_once(tmp_path):
    m = tiny.qwen2_head64()
    with torch.no_grad():
        m.lm_head.weight.mul_(8)
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    cache, _, _ = _check_l3_promotion(m, ids, 40, l2_small=128, pages_per_step=2 * 2 * 2 * 100)
    assert cache.sparse_state is not None and cache.store.stats.page_faults > 0


def test_a_page_missed_by_a_sparse_step_is_read_on_the_prefetch_worker(monkeypatch):
    """With every miss left to the worker (no step run again): no L3 read on the decoding thread, each page read
    once, and what a step missed is in L2 a few steps later (the step attended the others meanwhile)."""
    monkeypatch.setattr(TieredCache, "REPLAY_SHARE", 1.0)
    m = tiny.qwen2_head64()
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    views, stale = [], []
    real_view = TieredCache.sparse_view

    def checked_view(self):
        views.append(self.length)
        view = real_view(self)
        if view is not None:   # the table brought up to date from the store's log = the store's slots now
            last = self.layers[0].win_start // self.page_size
            if self.sparse_state.slots[:last].tolist() != self.store.peek_slots(self.page_keys[:last]):
                stale.append(self.length)
        return view

    monkeypatch.setattr(TieredCache, "sparse_view", checked_view)
    out, tokens, cache, reads, prefill_reads, counts = _decode(m, 128, 24, ids)
    assert not stale, f"the slot table was stale at steps {stale}"
    assert counts["l3_pages"] >= counts["pages"] / 2 and prefill_reads == 0
    assert len(views) == len(set(views)) == 24                 # one view a step: none ran again
    assert cache.pages_missed > 0, "no step missed a page: the test does not test anything"
    assert reads and all(name.startswith("flashguard-l3-read") for _, _, name in reads)
    assert max(collections.Counter(k for _, k, _ in reads).values()) == 1
    assert cache.store.stats.prefetched == len(reads)
    cache.store.install_prefetched(wait=True)
    read_keys = {k for _, k, _ in reads}
    assert all(cache.store.pages[k].l2 is not None or cache.store.pages[k].l3 is not None for k in read_keys)
    assert torch.isfinite(out).all()
    cache.check_integrity()


@pytest.mark.slow
def test_l3_promotion_with_the_real_smollm2(engine):
    """SmolLM2 (30 layers, 3 KV heads): half the pages on disk, decoded by the one-graph sparse step."""
    ids = engine.tokenizer(tiny.text(6000, seed=5))["input_ids"][:1400]
    _check_l3_promotion(engine.model, ids, 24, l2_small=256, pages_per_step=30 * 3 * 2, tiers=SMOL_TIERS)


@pytest.mark.slow
def test_pages_left_to_the_prefetch_worker_keep_the_real_smollm2_within_sparse_fidelity(engine, monkeypatch):
    """Every page a step finds only on disk attended without (REPLAY_SHARE 1: never run again) and read on the
    worker: the same greedy tokens as with every page in L2, KL <= 0.01 nats a step on average, and no L3 read on
    the decoding thread."""
    monkeypatch.setattr(TieredCache, "REPLAY_SHARE", 1.0)
    ids = engine.tokenizer(tiny.text(6000, seed=5))["input_ids"][:1400]
    cache, reads, kl = _check_l3_promotion(engine.model, ids, 32, l2_small=256, pages_per_step=30 * 3 * 2,
                                           tiers=SMOL_TIERS)
    assert cache.pages_missed > 0
    assert all(name.startswith("flashguard-l3-read") for _, _, name in reads)
    assert float(kl.max()) <= 0.05


def test_why_l3_is_off_is_visible(monkeypatch, caplog):
    from flashguard.kv import store as store_module

    def no_cryptography(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'cryptography'", name="cryptography")

    monkeypatch.setattr(store_module, "L3Folder", no_cryptography)
    with caplog.at_level("WARNING", logger="flashguard"):
        store = PageStore(CacheConfig(l2_tokens=64, page_size=16))
    assert store.disk is None and "cryptography" in store.l3_error
    assert "cryptography" in caplog.text and "L2" in caplog.text
    k = torch.zeros(2, 2, 16, 8)
    for i in range(8):   # over budget with no L3: unreferenced pages are forgotten, nothing crashes
        store.put(bytes([i]) * 16, k, k, torch.zeros(2, 2, 2, 8))
    store.check_integrity()


def test_engine_info_names_the_l3_error(tmp_path, monkeypatch):
    from flashguard.kv import store as store_module

    def unusable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(store_module, "L3Folder", unusable)
    e = tiny.engine(tmp_path)
    e.generate(e.encode_messages([{"role": "user", "content": "hi"}]), SamplingParams(max_tokens=2))
    l3 = e.info()["tiers"]["l3"]
    assert l3["dir"] is None and "Permission denied" in l3["error"]


def test_a_fresh_engines_first_prompt_is_not_read_back_from_disk(tmp_path):
    """The first prompt an engine sees, longer than L2: each prefill chunk attends every page before it, so its
    pages stay in L2 until the prefill ends (``PageStore.deferred``) and go to disk after it. The engine made its
    store inside that first prefill, too late to defer it: every chunk read the earlier pages back from disk (a
    fresh engine's 128K prompt with a 16K L2 never finished on the H200)."""
    kv = {"page_size": 16, "l1_tokens": 32, "sink_tokens": 16, "l1_max_tokens": 64, "l2_tokens": 64,
          "l3_tokens": 1 << 16, "policy": "exact", "l2_codec": "fp16", "l3_codec": "fp16-zstd",
          "l3_dir": str(tmp_path / "l3")}
    e = tiny.engine(tmp_path / "model", kv=kv, prefill_chunk=32)
    ids = e.tokenizer(tiny.text(600, seed=3))["input_ids"][:480]
    e.generate(ids, SamplingParams(max_tokens=1))
    assert e.store.stats.page_faults == 0                 # no page came back from L3 during the prefill
    assert e.store.tier_counts()["l3_pages"] > 0           # and the pages over L2's budget went to disk after it
    e.session.cache.check_integrity()


def test_a_long_prompts_pages_get_room_in_l2_in_one_allocation(tmp_path):
    """A prompt's pages all stay in L2 while it is prefilled: the engine announces them (``PageStore.expect_tokens``)
    and the arena grows to them once, instead of doubling (a 128K prompt's 8.4K pages: 32K slots allocated in all,
    8.3 GiB of pinned memory, 1.6 s of the prefill on the H200, and 16K slots kept). A later turn adds only its
    own pages."""
    kv = {"page_size": 16, "l1_tokens": 32, "sink_tokens": 16, "l1_max_tokens": 64, "l2_tokens": 64,
          "l3_tokens": 1 << 16, "policy": "exact", "l2_codec": "fp16", "l3_codec": "fp16-zstd",
          "l3_dir": str(tmp_path / "l3")}
    e = tiny.engine(tmp_path / "model", kv=kv, prefill_chunk=32)
    ids = e.tokenizer(tiny.text(3000, seed=5))["input_ids"][:1800]   # 113 pages: doubling went 64, then 128
    arena = e.sessions.page_store().arena
    grown = []
    grow = arena._grow
    arena._grow = lambda enc: (grown.append(arena.capacity), grow(enc))
    e.generate(ids, SamplingParams(max_tokens=2))
    assert len(grown) == 1, grown                                # one allocation for the whole prompt
    assert 114 <= arena.capacity <= 128, arena.capacity          # its pages and an eighth to spare
    e.session.cache.check_integrity()
    more = ids + e.tokenizer(tiny.text(200, seed=6))["input_ids"][:100]
    e.generate(more, SamplingParams(max_tokens=2))
    assert len(grown) == 1, grown                                # L2 is back within budget: room was there


def test_a_prompt_that_fits_the_pool_announces_no_l2_room(tmp_path, monkeypatch):
    """Only the pages that leave the pool go to L2 while a prompt is prefilled: a prompt that fits the pool
    announces nothing and starts no pinned allocation (a 32K prompt's 0.5 GiB, never used, was pinned during its
    prefill on the H200). Past the pool the whole prompt is announced (the test above)."""
    from flashguard.kv import store as store_mod

    monkeypatch.setattr(store_mod.L2Arena, "AHEAD_BYTES", 0)
    kv = {"page_size": 16, "l1_tokens": 2048, "sink_tokens": 16, "l1_max_tokens": 2048, "l2_tokens": 64,
          "l3_tokens": 1 << 16, "policy": "exact", "l2_codec": "fp16", "l3_codec": "fp16-zstd",
          "l3_dir": str(tmp_path / "l3")}
    e = tiny.engine(tmp_path / "model", kv=kv, prefill_chunk=256)
    ids = e.tokenizer(tiny.text(3000, seed=5))["input_ids"][:1800]
    arena = e.sessions.page_store().arena
    arena.pin = True   # (a CPU build pins nothing: the request falls back to pageable memory, the same path)
    announced = []
    expect = arena.expect
    arena.expect = lambda slots: (announced.append(slots), expect(slots))[1]
    e.generate(ids, SamplingParams(max_tokens=2))
    assert announced == [] and arena.ahead is None and arena.capacity <= 64, (announced, arena.capacity)
    assert e.session.leaving(0) == 0 and e.session.leaving(300) % 16 == 0 < e.session.leaving(300)   # past: pages
    edge = 16 + 2048 + 16 - e.session.cache.length       # sinks + window + a page, less what is held
    assert e.session.leaving(edge) == 0 and e.session.leaving(edge + 1) == 16   # one token past: its page leaves
    e.session.cache.check_integrity()


def test_a_long_prompts_pinned_l2_block_is_allocated_on_a_thread(tmp_path, monkeypatch):
    """Pinning host memory is slow (a 128K prompt's 2.4 GiB took 1.8 s of its time to the first token on the H200),
    and no page leaves the pool before the pool is full: the announced block is allocated on a thread
    (``L2Arena.ahead``) while the prompt's first chunks run, and the growth takes it; a first prompt (no page
    layout known when it is announced) starts it at its first page, with a small block meanwhile. The pages moved
    from the small block are intact: the same tokens as an engine that allocates as it goes. (A CPU build has no
    pinned memory: the thread's request falls back to pageable memory, the same path.)"""
    from flashguard.kv import arena as arena_mod

    kv = {"page_size": 16, "l1_tokens": 32, "sink_tokens": 16, "l1_max_tokens": 64, "l2_tokens": 64,
          "l3_tokens": 1 << 16, "policy": "exact", "l2_codec": "fp16", "l3_codec": "fp16-zstd"}
    ids = None
    outs, names = [], []
    real = arena_mod._host_empty
    for ahead in (False, True):
        e = tiny.engine(tmp_path / "model", kv=dict(kv, l3_dir=str(tmp_path / f"l3-{ahead}")), prefill_chunk=32)
        ids = ids or e.tokenizer(tiny.text(3000, seed=5))["input_ids"][:1800]
        arena = e.sessions.page_store().arena
        if ahead:
            arena.pin = True
            monkeypatch.setattr(arena_mod.L2Arena, "AHEAD_BYTES", 0)
            monkeypatch.setattr(arena_mod, "_host_empty", lambda shape, dtype, pin: (
                names.append((threading.current_thread().name, shape[1], sys._getframe(1).f_code.co_name)),
                real(shape, dtype, pin))[1])
        outs.append(e.generate(ids, SamplingParams(max_tokens=4)).text)
        e.session.cache.check_integrity()
        e.sessions.page_store().check_integrity()
    grows = [n[:2] for n in names if n[2] != "gather"]           # (not the gathers' buffers)
    assert grows[0] == ("flashguard-l2-grow", grows[0][1]) and 114 <= grows[0][1] <= 128, names
    assert grows[1:] == [("MainThread", 64)], names              # the first page's small block, meanwhile
    assert arena.capacity == grows[0][1] and arena.ahead is None
    assert outs[0] == outs[1]


def test_a_larger_announcement_replaces_the_pinned_allocation_on_its_way(monkeypatch):
    """A conversation's announced pages start a pinned allocation that may still be on its way (or unused: its
    pages stayed in the pool) when a longer prompt is announced: the longer one replaces it, so the growth makes
    room for the longer prompt at once instead of taking the smaller allocation and doubling from there; a
    smaller announcement keeps the larger one; closing waits for and discards one on its way."""
    from flashguard.kv import arena as arena_mod
    from flashguard.kv import codecs

    monkeypatch.setattr(arena_mod.L2Arena, "AHEAD_BYTES", 0)
    gate, real = threading.Event(), arena_mod._host_empty

    def slow(shape, dtype, pin):   # the pinning thread waits until the test lets it finish
        if threading.current_thread().name == "flashguard-l2-grow":
            gate.wait(10)
        return real(shape, dtype, pin)

    monkeypatch.setattr(arena_mod, "_host_empty", slow)
    arena = arena_mod.L2Arena(pin=True)   # (a CPU build: the pinned request falls back to pageable memory)
    k = torch.randn(2, 2, 16, 8)
    page = codecs.encode(k, k, "int8")
    arena.write(page)                      # the layout; 64 slots
    arena.expect(1000)
    first = arena.ahead
    arena.expect(5000)
    second = arena.ahead
    assert first is not None and second is not first and second[0] == arena._room_for(5000)
    arena.expect(2000)
    assert arena.ahead is second
    gate.set()
    for _ in range(64):                    # the 65th page grows the arena
        arena.write(page)
    assert arena.capacity == arena._room_for(5000) and arena.ahead is None and arena.wanted == 0
    assert arena.used() == 65
    arena.expect(arena.capacity + 100)
    assert arena.ahead is not None
    arena.drop_ahead()
    assert arena.ahead is None
