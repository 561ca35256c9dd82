"""The peer tier (kv/peer.py) on the CPU: gloo, a driver process as rank 0 (the engine) and spawned page servers.

Each scenario runs in a spawned driver process so that this pytest process never joins a process group; the driver
saves what it measured and the assertions run here. Every join has a bound: a hang fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch

from flashguard import CacheConfig, EngineConfig
from flashguard.errors import ConfigError
from flashguard.kv import attention, peer
from tests.tiny import forwarding

BOUND_S = 150          # a scenario that has not finished by then hangs
GLOO_TIMEOUT_S = 8.0   # what bounds every collective of the tier in these runs


def _spawn(target, path, *args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_guarded, args=(target, str(path), *args))
    proc.start()
    proc.join(BOUND_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"{target.__name__} did not finish within {BOUND_S} s (a hang)")
    out = torch.load(path, weights_only=False)
    assert "error" not in out, out.get("error")
    assert proc.exitcode == 0
    return out


def _guarded(target, path, *args):
    torch.set_num_threads(1)
    try:
        out = target(*args)
    except BaseException:   # report it to the test instead of a bare exit code
        out = {"error": traceback.format_exc()}
    torch.save(out, path)


# ---- sharded attention = one-device attention --------------------------------------------------------------------
def _random_kv(peers: int) -> dict:
    g = torch.Generator().manual_seed(peers)
    layers, kvh, n, p, d, group = 2, 2, 11, 4, 16, 3
    k = torch.randn(layers, kvh, n, p, d, generator=g)
    v = torch.randn(layers, kvh, n, p, d, generator=g)
    tier = peer.start(["cpu"] * peers, "cpu", page_size=p, timeout_s=GLOO_TIMEOUT_S, block_pages=2)  # blocks too
    errors, covers = [], []
    try:
        for a, b in ((0, 3), (3, 8), (8, 11)):             # pages arrive in runs, as they leave the window
            tier.put(a, k[:, :, a:b], v[:, :, a:b])
        covers.append((tier.covers(0, 11), tier.covers(0, 12)))
        # decode steps and a prefill chunk over several ranges, one page (one rank holds nothing) included
        for step, (lq, first, last) in enumerate([(1, 0, 11), (1, 2, 9), (5, 1, 11), (1, 4, 5), (1, 0, 11)]):
            q = torch.randn(kvh, group, lq, d, generator=g)
            for layer in range(layers):
                o, lse = tier.attend(layer, q, 0.25, first, last)
                kk = k[layer, :, first:last].reshape(kvh, -1, d)
                vv = v[layer, :, first:last].reshape(kvh, -1, d)
                ro, rl = attention.partial_attention(q.double(), kk.double(), vv.double(), 0.25)
                errors.append(((o.double() - ro).abs().max().item(), (lse.double() - rl).abs().max().item()))
        # a crop: pages from 6 on name other pages now; they are put again and overwrite the old ones
        tier.forget_from(6)
        covers.append((tier.covers(0, 6), tier.covers(0, 7)))
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 6:], v2[:, :, 6:] = -k[:, :, 6:], 2 * v[:, :, 6:]
        tier.put(6, k2[:, :, 6:], v2[:, :, 6:])
        q = torch.randn(kvh, group, 1, d, generator=g)
        o, lse = tier.attend(1, q, 0.25, 0, 11)
        ro, rl = attention.partial_attention(q.double(), k2[1].reshape(kvh, -1, d).double(),
                                             v2[1].reshape(kvh, -1, d).double(), 0.25)
        errors.append(((o.double() - ro).abs().max().item(), (lse.double() - rl).abs().max().item()))
        info = tier.info()
    finally:
        tier.close()
    return {"errors": errors, "covers": covers, "info": info}


@pytest.mark.slow
@pytest.mark.parametrize("peers", [1, 2])
def test_sharded_attention_equals_one_device(tmp_path, peers):
    out = _spawn(_random_kv, tmp_path / "out.pt", peers)
    assert out["covers"] == [(True, False), (True, False)]
    assert len(out["errors"]) == 11
    for err_o, err_lse in out["errors"]:
        assert err_o < 1e-5 and err_lse < 1e-5
    info = out["info"]
    assert info["ranks"] == peers + 1 and info["lost"] is None and info["pages"] == 11
    assert info["bytes_held"] == 11 * 2 * 2 * 2 * 4 * 16 * 4     # pages * (K, V) * layers * kvh * P * D * fp32


def test_merge_of_partials_equals_one_segment_and_skips_empty_ones():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 30, 8, generator=g), torch.randn(2, 30, 8, generator=g)
    parts = [attention.partial_attention(q, k[:, :7], v[:, :7], 0.3),
             attention.partial_attention(q, k[:, :3], v[:, :3], 0.3, torch.zeros(4, 3, dtype=torch.bool)),  # no key
             attention.partial_attention(q, k[:, 7:], v[:, 7:], 0.3)]
    o, lse = peer.merge(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    ro, rl = attention.partial_attention(q, k, v, 0.3)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rl, atol=1e-5, rtol=1e-5)
    assert torch.isinf(parts[1][1]).all()                        # the empty partial really was empty
    none_o, none_lse = peer.merge(parts[1][0].unsqueeze(0), parts[1][1].unsqueeze(0))
    assert (none_o == 0).all() and torch.isinf(none_lse).all()


def test_local_range_is_each_ranks_share_of_a_page_range():
    for peers in (1, 2, 3):
        for first in range(0, 9):
            for last in range(first, 12):
                for slot in range(peers):
                    lo, hi = peer.local_range(first, last, slot, peers)
                    assert list(range(lo, hi)) == [p // peers for p in range(first, last) if p % peers == slot]


# ---- a tiny random Qwen2 through TieredCache: pages on a peer ----------------------------------------------------
KV = dict(page_size=8, l1_tokens=16, sink_tokens=8, l1_max_tokens=16, l2_tokens=4096, l3_tokens=0,
          policy="exact", adaptive_l1=False, l1_codec="fp16", zero_copy=False)


def _logits(model, cache, ids, prefix, chunk=24):
    rows = []
    with torch.inference_mode():
        for a in range(0, prefix, chunk):
            with forwarding(cache, ids[a:min(a + chunk, prefix)]):
                rows.append(model(input_ids=torch.tensor([ids[a:min(a + chunk, prefix)]]),
                                  past_key_values=cache).logits[0])
        for t in range(prefix, len(ids)):                   # one-token decode steps
            with forwarding(cache, ids[t:t + 1]):
                rows.append(model(input_ids=torch.tensor([ids[t:t + 1]]), past_key_values=cache).logits[0])
    return torch.cat(rows)


def _qwen2(kill_after: int | None, l2_codec: str) -> dict:
    import time

    from transformers import DynamicCache

    from flashguard.kv.cache import TieredCache
    from tests import tiny

    model = tiny.model("qwen2", seed=1, layers=2)
    ids = torch.randint(3, len(tiny.tokenizer()), (120,), generator=torch.Generator().manual_seed(5)).tolist()
    prefix = 72
    ref = _logits(model, DynamicCache(config=model.config), ids, prefix)
    kv = CacheConfig(**{**KV, "l2_codec": l2_codec})
    plain = TieredCache(model.config, kv).attach(model)
    l2 = _logits(model, plain, ids, prefix)
    tier = peer.start(["cpu"], "cpu", page_size=KV["page_size"], timeout_s=GLOO_TIMEOUT_S)
    out = {"l2_page_reads": plain.page_reads}
    try:
        cache = TieredCache(model.config, kv).attach(model).use_peers(tier)
        if kill_after is None:
            out["peers"] = _logits(model, cache, ids, prefix)
        else:   # decode some steps on the peer, kill it, decode on
            rows = _logits(model, cache, ids[:prefix + kill_after], prefix)
            tier.processes[0].kill()
            tier.processes[0].join()
            t0 = time.monotonic()
            with torch.inference_mode():   # the cache meets the dead peer and reads the pages from the store
                for t in range(prefix + kill_after, len(ids)):
                    with forwarding(cache, ids[t:t + 1]):
                        rows = torch.cat([rows, model(input_ids=torch.tensor([ids[t:t + 1]]),
                                                      past_key_values=cache).logits[0]])
            out["after_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            try:                           # what a caller without the store's copy gets: a typed 503
                tier.attend(0, torch.randn(2, 2, 1, 16), 0.25, 1, 4)
            except peer.PeerLostError as err:
                out["lost"] = (type(err).__name__, err.status_code, str(err), time.monotonic() - t0)
            out["peers"] = rows
        cache.check_integrity()
        out.update(peer_page_reads=cache.page_reads, info=tier.info(), win_start=cache.layers[0].win_start)
    finally:
        tier.close()
    out.update(ref=ref, l2=l2, prefix=prefix)
    return out


@pytest.mark.slow
def test_tiny_qwen2_decode_with_pages_on_a_peer_equals_the_model(tmp_path):
    out = _spawn(_qwen2, tmp_path / "out.pt", None, "int8")
    assert out["win_start"] > 8 * 4 and out["info"]["pages"] > 5 and out["info"]["bytes_sent"] > 0
    assert out["peer_page_reads"] == 0 and out["l2_page_reads"] > 0   # the peer served every off-window page
    # the peer holds the pages in the model's dtype: equal to the model's own forward to fp32 tolerance; the L2
    # path reads int8 pages, visibly further off (so the peer's pages, not the store's, made these logits)
    torch.testing.assert_close(out["peers"], out["ref"], atol=1e-4, rtol=1e-4)
    assert (out["l2"] - out["ref"]).abs().max() > 1e-3
    assert (out["peers"].argmax(-1) == out["ref"].argmax(-1)).all()


# ---- a peer that dies mid-conversation -----------------------------------------------------------------------------
@pytest.mark.slow
def test_killed_peer_fails_fast_with_a_typed_error_and_the_cache_falls_back_to_the_store(tmp_path):
    out = _spawn(_qwen2, tmp_path / "out.pt", 20, "fp16")
    name, status, message, seconds = out["lost"]
    assert name == "PeerLostError" and status == 503 and "kv.peer_gpus" in message
    assert seconds < GLOO_TIMEOUT_S + 5                         # an error, not a hang
    assert out["after_s"] < 4 * (GLOO_TIMEOUT_S + 5)
    assert out["info"]["lost"].startswith(("attend failed", "put failed"))   # the cache met the dead peer first
    n = out["prefix"] + 20                                       # rows before the kill: from the peer, exact
    torch.testing.assert_close(out["peers"][:n], out["ref"][:n], atol=1e-4, rtol=1e-4)
    # after it: the same pages read from the store (a lossless L2 codec here), still equal to the model's forward
    assert out["peer_page_reads"] > 0 and out["l2_page_reads"] > 0
    torch.testing.assert_close(out["peers"][n:], out["ref"][n:], atol=1e-4, rtol=1e-4)


def _stalled(timeout_s: float) -> dict:
    import os
    import signal
    import time

    tier = peer.start(["cpu"], "cpu", page_size=4, timeout_s=timeout_s)
    k = torch.randn(2, 2, 3, 4, 8)
    q = torch.randn(2, 3, 1, 8)
    try:
        tier.put(0, k, k)
        tier.attend(0, q, 0.3, 0, 3)
        os.kill(tier.processes[0].pid, signal.SIGSTOP)   # alive, holding its sockets, answering nothing
        t0 = time.monotonic()
        try:
            tier.attend(1, q, 0.3, 0, 3)
            out = {"raised": None}
        except peer.PeerLostError as err:
            out = {"raised": (err.status_code, str(err))}
        out["seconds"] = time.monotonic() - t0
    finally:
        tier.processes[0].kill()
        tier.close()
    return out


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGSTOP"), reason="stopping a process needs SIGSTOP (POSIX)")
def test_stalled_peer_raises_after_the_group_timeout_not_a_hang(tmp_path):
    out = _spawn(_stalled, tmp_path / "out.pt", 3.0)
    status, message = out["raised"]
    assert status == 503 and "kv.peer_gpus" in message and "stopped answering" in message
    assert out["seconds"] < 3.0 + 10                             # the group timeout bounds it: no hang


# ---- the engine: sessions put their pages on the peers, adopted ones included --------------------------------------
def _engine(folder: str) -> dict:
    from flashguard.engine.sampling import SamplingParams
    from tests import tiny

    net = tiny.model("qwen2", seed=3, layers=2)   # a seed whose greedy replies vary (some repeat one token)
    kv = {**KV, "l2_codec": "fp16"}       # lossless here: the same text whichever tier serves a page
    turns = [[{"role": "user", "content": tiny.text(90, seed=1)}]]
    out = {}
    for name in ("plain", "peers"):
        eng = tiny.engine(f"{folder}/{name}", net=net, kv=kv, prefill_chunk=24)
        if name == "peers":   # what Engine.__init__ does for kv.peer_gpus on a GPU host, here on the CPU (gloo)
            eng.peers = peer.start(["cpu"], "cpu", page_size=KV["page_size"], timeout_s=GLOO_TIMEOUT_S)
        texts, reads = [], []
        try:
            msgs = list(turns[0])
            for turn in range(2):             # a conversation of two turns, the second extends the first
                reply = eng.generate(eng.encode_messages(msgs), SamplingParams(max_tokens=12)).text
                texts.append(reply)
                msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": tiny.text(40, seed=9)}]
            reads.append(eng.session.stats()["page_reads"])
            eng.reset_session()               # the next prefill adopts the stored pages (not put on peers yet)
            texts.append(eng.generate(eng.encode_messages(msgs), SamplingParams(max_tokens=12)).text)
            reads.append(eng.session.stats()["page_reads"])
            out[name] = {"texts": texts, "reads": reads, "info": eng.info()["tiers"]["peers"]}
        finally:
            if eng.peers is not None:
                eng.peers.close()
    return out


@pytest.mark.slow
def test_engine_sessions_with_pages_on_a_peer_give_the_same_text(tmp_path):
    out = _spawn(_engine, tmp_path / "out.pt", str(tmp_path))
    assert out["peers"]["texts"] == out["plain"]["texts"]
    assert all(len(set(t)) > 3 for t in out["plain"]["texts"])   # real replies, not one token repeated
    assert out["plain"]["info"] is None
    info = out["peers"]["info"]
    assert info["devices"] == ["cpu"] and info["pages"] > 4 and info["lost"] is None
    assert min(out["plain"]["reads"]) > 0 and out["peers"]["reads"] == [0, 0]   # the peer served every page


def test_engine_refuses_peer_gpus_on_the_cpu(tmp_path):
    from tests import tiny

    with pytest.raises(ConfigError, match=r"kv\.peer_gpus.*on a GPU"):
        tiny.engine(tmp_path, "qwen2", kv={"peer_gpus": [1]})


# ---- configuration -------------------------------------------------------------------------------------------------
def test_peer_gpus_config_values():
    assert EngineConfig.from_parameters({"kv": {"peer_gpus": [1, 3]}}).kv.peer_gpus == (1, 3)
    assert EngineConfig.from_parameters({"kv": {"peer_gpus": 1}}).kv.peer_gpus == 1
    assert EngineConfig.from_parameters({}).kv.peer_gpus is None
    for bad in ("two", [], [1, 1], 0, -2, True, [0.5], [-1]):
        with pytest.raises(ConfigError, match=r"kv\.peer_gpus"):
            EngineConfig.from_parameters({"kv": {"peer_gpus": bad}})


def test_peer_gpus_checked_against_the_host():
    cuda0 = torch.device("cuda", 0)
    assert peer.resolve_devices(None, torch.device("cpu")) == []
    assert peer.resolve_devices((1,), cuda0, device_count=2) == [1]
    assert peer.resolve_devices(2, torch.device("cuda", 1), device_count=4) == [0, 2]
    for value, device, count, words in [((1,), torch.device("cpu"), 2, "on a GPU"),
                                        ((1,), cuda0, 1, "1 GPU;"),
                                        (1, cuda0, 1, "1 GPU;"),
                                        ((2,), cuda0, 2, "GPU 2 does not exist"),
                                        ((0,), cuda0, 2, "engine's own"),
                                        (3, cuda0, 2, "asks for 3")]:
        with pytest.raises(ConfigError, match=r"kv\.peer_gpus") as err:
            peer.resolve_devices(value, device, device_count=count)
        assert words in str(err.value)


def test_plan_counts_each_peer_gpus_share_of_the_off_pool_pages():
    from flashguard.vram import plan as planner

    shape = planner.Shape.from_config(planner.deepseek_7b_config(), "7b")
    base = dict(gpu_mem=6 * 2**30, context=131072, weights="int4", prefill_chunk=256)
    none = planner.plan(shape, **base)
    one = planner.plan(shape, **base, kv=CacheConfig(peer_gpus=1))
    two = planner.plan(shape, **base, kv=CacheConfig(peer_gpus=(1, 2)))
    assert none.peers == {} and one.parts == none.parts and one.host == none.host   # GPU 0 and the host unchanged
    per_token = 28 * 2 * 4 * 128 * 2                                                 # layers, K/V, kv heads, D, fp16
    pool = none.parts["kv cache"] // per_token                                        # more than the pool's tokens
    off = one.peers["pages (16-bit, in blocks)"]
    assert (131072 - pool) * per_token <= off <= 131072 * per_token                  # ~7 GiB: the number
    assert two.peers["pages (16-bit, in blocks)"] * 2 - off <= 2 * peer.BLOCK_PAGES * 64 * per_token
    assert "each peer GPU (kv.peer_gpus)" in one.table() and "peer" not in none.table()


# ---- an idle tier stays up; the benchmark's CPU mode --------------------------------------------------------------
def _idle(timeout_s: float) -> dict:
    import time

    tier = peer.start(["cpu"], "cpu", page_size=4, timeout_s=timeout_s)
    k = torch.randn(2, 2, 3, 4, 8)
    q = torch.randn(2, 3, 1, 8)
    try:
        tier.put(0, k, k)
        before = tier.attend(0, q, 0.3, 0, 3)[0]
        time.sleep(timeout_s + 2)           # longer than the group timeout, no command: the peer must still serve
        after = tier.attend(0, q, 0.3, 0, 3)[0]
        return {"same": bool(torch.equal(before, after)), "lost": tier.lost}
    finally:
        tier.close()


@pytest.mark.slow
def test_an_idle_tier_outlives_the_group_timeout(tmp_path):
    out = _spawn(_idle, tmp_path / "out.pt", GLOO_TIMEOUT_S)
    assert out == {"same": True, "lost": None}


def test_cli_plan_plans_the_peer_gpus(capsys):
    from flashguard import cli

    assert cli.main(["plan", "--model", "deepseek-r1-distill-qwen-7b", "--context", "131072", "--gpu-mem", "6GiB",
                     "--peer-gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "each peer GPU (kv.peer_gpus)" in out and "pages (16-bit, in blocks)" in out


# ---- the step protocol: one header a step, steps closed in order, a peer lost mid-step ----------------------------
def _protocol() -> dict:
    import os
    import signal
    import time

    g = torch.Generator().manual_seed(11)
    layers, kvh, n, p, d, group = 3, 2, 9, 4, 8, 2
    k, v = torch.randn(layers, kvh, n, p, d, generator=g), torch.randn(layers, kvh, n, p, d, generator=g)
    tier = peer.start(["cpu"], "cpu", page_size=p, timeout_s=GLOO_TIMEOUT_S, block_pages=2)
    errors, steps = [], []

    def check(layer, q, first, last):
        o, lse = tier.attend(layer, q, 0.3, first, last)
        kk, vv = k[layer, :, first:last].reshape(kvh, -1, d), v[layer, :, first:last].reshape(kvh, -1, d)
        ro, rl = attention.partial_attention(q.double(), kk.double(), vv.double(), 0.3)
        errors.append(max((o.double() - ro).abs().max().item(), (lse.double() - rl).abs().max().item()))

    out = {}
    try:
        tier.put(0, k, v)
        q = torch.randn(kvh, group, 1, d, generator=g)
        for _ in range(2):                       # two decode steps: every layer in order, one header each
            for layer in range(layers):
                check(layer, q, 1, 9)
        steps.append(tier.info()["steps"])       # 2
        check(0, q, 1, 9)                        # a step left open after layer 0 ...
        check(0, q, 2, 7)                        # ... closed (layers 1, 2 get empty queries) by another range
        check(1, q, 2, 7)
        check(2, torch.randn(kvh, group, 3, d, generator=g), 0, 9)   # another shape: its own step, from layer 2
        steps.append(tier.info()["steps"])       # 2 + 3
        check(0, q, 0, 9)                        # a put while a step is open closes it first
        k[:, :, 4:6], v[:, :, 4:6] = -k[:, :, 4:6], 2 * v[:, :, 4:6]
        tier.put(4, k[:, :, 4:6], v[:, :, 4:6])
        for layer in range(layers):
            check(layer, q, 0, 9)
        steps.append(tier.info()["steps"])       # 5 + 2
        check(0, q, 0, 9)                        # the peer dies between two layers of a step
        os.kill(tier.processes[0].pid, signal.SIGKILL)
        tier.processes[0].join()
        t0 = time.monotonic()
        try:
            tier.attend(1, q, 0.3, 0, 9)
        except peer.PeerLostError as err:        # gloo: every layer was verified as it came: not a PeerStepLost
            out["lost"] = (type(err).__name__, err.status_code, time.monotonic() - t0)
        out["info"] = tier.info()
    finally:
        tier.close()
    out.update(errors=errors, steps=steps)
    return out


@pytest.mark.slow
def test_the_step_protocol_one_header_a_step_and_an_open_step_closed_in_order(tmp_path):
    out = _spawn(_protocol, tmp_path / "out.pt")
    assert len(out["errors"]) == 15 and max(out["errors"]) < 1e-5
    assert out["steps"] == [2, 5, 7]
    name, status, seconds = out["lost"]
    assert name == "PeerLostError" and status == 503 and seconds < GLOO_TIMEOUT_S + 5
    assert out["info"]["lost"].startswith("attend failed")


class _FailedWork:
    def is_completed(self):
        return True

    def wait(self):
        raise RuntimeError("the peer is gone")


@pytest.mark.parametrize("unverified", [0, 1])
def test_a_peer_lost_after_unverified_layers_is_a_page_lost_step(unverified):
    """On NCCL the layers of a step use the peers' partials before the host sees them arrive; a loss found at the
    step's end is then a PeerStepLost (a PageLost: the engine recomputes from the store; not a PeerLostError, which
    the cache would answer by attending only the rest of the step from the store). Without unverified layers it is
    the plain PeerLostError, and the cache falls back layer by layer."""
    from flashguard.kv.disk import PageLost

    assert issubclass(peer.PeerStepLost, PageLost) and not issubclass(peer.PeerStepLost, peer.PeerLostError)
    tier = peer.PeerTier.__new__(peer.PeerTier)
    tier.comm, tier.lost, tier.timeout_s = torch.device("cpu"), None, 1.0
    tier._step = peer._Step((0, 4, 1, 1, 1, 8, torch.float32, 0.5), 0, 1)
    tier._step.next, tier._step.works, tier._step.unverified = 1, [_FailedWork()], unverified
    pending = peer.Pending(tier, tier._step, [], [], (1, 1, 1, 8), torch.device("cpu"), final=True)
    with pytest.raises(peer.PeerStepLost if unverified else peer.PeerLostError) as info:
        pending.wait()
    assert info.value.status_code == 503 and "kv.peer_gpus" in str(info.value)
    assert tier.lost is not None and tier._step is None
    with pytest.raises(peer.PeerLostError):   # later calls: at once
        tier.ask(0, torch.zeros(1, 1, 1, 8), 0.5, 0, 4)
