"""The engine's state machine on tiny random Llama / Qwen2 models (tests/tiny.py), fast: greedy output against the
model's own ``generate``, prefix reuse and crop, out-of-memory halving, lost-page recovery, page references,
stop strings and streaming. The same behaviours on the real embedded model are in test_engine.py (slow)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from flashguard import PromptError
from flashguard.engine.sampling import SamplingParams
from flashguard.errors import GpuMemoryError

from tests import tiny

CACHES = ["dynamic", "tiered"]
# pages of 16 tokens, a 32-token window over 16 sink tokens: a 200-token prompt leaves most pages outside L1. The
# pages keep fp16 (int8, the default, changes a random model's greedy tokens) and attention reads all of them, so
# the tokens stay the model's own
SMALL_KV = {"page_size": 16, "l1_tokens": 32, "sink_tokens": 16, "l1_max_tokens": 64, "l3_tokens": 0,
            "policy": "exact", "l2_codec": "fp16"}


def ask(engine, content: str) -> list[int]:
    return engine.encode_messages([{"role": "user", "content": content}])


def output_ids(engine, ids, max_tokens=24, **kw) -> list[int]:
    engine.generate(ids, SamplingParams(max_tokens=max_tokens, **kw))
    return list(engine.turns[-1].output_ids)


def reference(model, ids, n, eos_ids) -> list[int]:
    """The model's own greedy ``generate`` (no flashguard code), cut at the first end-of-turn."""
    inp = torch.tensor([ids])
    out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False)[0, len(ids):]
    ref = []
    for t in out.tolist():
        if t in eos_ids:
            break
        ref.append(t)
    return ref


def last(engine, task="generation") -> dict:
    return engine.stats.last[task]


@pytest.fixture(scope="module")
def llama():
    return tiny.model("llama")


# ---- greedy output --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("cache", CACHES)
def test_greedy_output_is_the_models_own_generate(tmp_path, arch, cache):
    engine = tiny.engine(tmp_path, arch, kv_cache=cache)
    ids = ask(engine, tiny.text(120))
    assert output_ids(engine, ids, 32) == reference(engine.model, ids, 32, engine.eos_ids)


@pytest.mark.parametrize("cache", CACHES)
def test_pages_outside_the_pool_give_the_same_tokens(tmp_path, llama, cache):
    """A long prompt through a 64-token pool (tiered: pages in L2, exact attention) or prefilled in 32-token chunks
    (dynamic): the tokens are the model's own."""
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache, kv=SMALL_KV, prefill_chunk=32)
    ids = ask(engine, tiny.text(300))
    assert output_ids(engine, ids, 24) == reference(llama, ids, 24, engine.eos_ids)
    if cache == "tiered":
        assert engine.store.tier_counts()["l2_pages"] > 0 and engine.session.cache.layers[0].win_start > 16
        engine.session.cache.check_integrity()


@pytest.mark.parametrize("cache", CACHES)
def test_public_prefill_and_step_give_generates_greedy_tokens(tmp_path, llama, cache):
    """``Engine.prefill`` / ``Engine.step`` (the benchmarks' entry points) run the decode loop's own path: their
    greedy tokens are ``generate``'s, the session then holds the prompt and the stepped tokens, and a second
    prefill of the same prompt reuses all of it but the last token."""
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache, kv=SMALL_KV, prefill_chunk=32)
    engine.eos_ids = frozenset()   # a random model: decode the full count on both paths
    ids = ask(engine, tiny.text(200, seed=3))
    expected = output_ids(engine, ids, 16)
    engine.reset_session()
    with engine.lock:
        logits, reused = engine.prefill(ids)
        got = [int(logits.argmax())]
        for _ in range(15):
            got.append(int(engine.step(got[-1]).argmax()))
    assert got == expected
    assert engine.session_ids == ids + got[:-1]
    assert engine.prefill(ids)[1] == len(ids) - 1
    assert engine.step_graphs == 0   # (no CUDA graphs on the CPU)
    with pytest.raises(PromptError):
        engine.prefill([])
    if cache == "tiered":
        engine.session.cache.check_integrity()
    engine.reset_session(keep_pages=False)   # no page kept anywhere: every token prefilled again
    assert engine.store is None and engine.prefill(ids)[1] == 0


# ---- prefix reuse and crop ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", CACHES)
def test_the_same_prompt_again_prefills_one_token(tmp_path, llama, cache):
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache)
    ids = ask(engine, tiny.text(80))
    first = output_ids(engine, ids)
    assert last(engine)["reused"] == 0
    assert output_ids(engine, ids) == first
    assert last(engine)["reused"] == len(ids) - 1 and last(engine)["prefilled"] == 1


@pytest.mark.parametrize("cache", CACHES)
def test_the_next_turn_prefills_only_its_new_tokens(tmp_path, llama, cache):
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache)
    turn1 = [{"role": "user", "content": tiny.text(90)}]
    ids = engine.encode_messages(turn1)
    answer = engine.generate(ids, SamplingParams(max_tokens=16)).text
    held = list(engine.session_ids)
    ids2 = engine.encode_messages(turn1 + [{"role": "assistant", "content": answer},
                                           {"role": "user", "content": "and the wind?"}])
    common = next(i for i, (a, b) in enumerate(zip(held + [None], ids2)) if a != b)
    assert common >= len(ids)   # the whole first prompt at least
    second = output_ids(engine, ids2, 16)
    assert last(engine)["reused"] == common and last(engine)["prefilled"] == len(ids2) - common
    fresh = tiny.engine(tmp_path, net=llama, kv_cache="dynamic")
    assert output_ids(fresh, ids2, 16) == second


@pytest.mark.parametrize("cache", CACHES)
def test_a_diverging_prompt_crops_the_session_to_the_common_prefix(tmp_path, llama, cache):
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache, kv=SMALL_KV)
    ids = ask(engine, tiny.text(200, seed=1))
    output_ids(engine, ids)
    cut = 77   # inside a page and behind the window
    other = ids[:cut] + ask(engine, "a different ending")[5:]
    got = output_ids(engine, other)
    assert last(engine)["reused"] == cut
    assert engine.session_ids[:len(other)] == other
    assert got == reference(llama, other, 24, engine.eos_ids)
    if cache == "tiered":
        engine.session.cache.check_integrity()


@pytest.mark.parametrize("cache", CACHES)
def test_the_session_holds_exactly_the_tokens_that_ran(tmp_path, llama, cache):
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache, kv=SMALL_KV)
    ids = ask(engine, tiny.text(150))
    res = engine.generate(ids, SamplingParams(max_tokens=20))
    out = list(engine.turns[-1].output_ids)
    assert res.finish_reason == "length" and len(out) == 20
    # the last chosen token was never fed back: the cache holds the prompt and every output token but the last
    assert engine.session_ids == ids + out[:-1]
    assert engine.session.cache.get_seq_length() == len(engine.session_ids)


def test_reset_session_keeps_pages_for_the_next_session(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="tiered", kv=SMALL_KV)
    ids = ask(engine, tiny.text(200, seed=2))
    first = output_ids(engine, ids)
    engine.reset_session()
    assert engine.session is None and engine.session_ids == []
    assert output_ids(engine, ids) == first
    reused = last(engine)["reused"]
    assert reused > 0 and reused % 16 == 0 and reused >= len(ids) - 16   # every full page of the prompt adopted


def test_a_dynamic_session_starts_from_nothing_after_reset(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="dynamic")
    ids = ask(engine, tiny.text(60))
    first = output_ids(engine, ids)
    engine.reset_session()
    assert output_ids(engine, ids) == first and last(engine)["reused"] == 0


# ---- page references -------------------------------------------------------------------------------------------
def refs(engine) -> int:
    return sum(p.refs for p in engine.store.pages.values())


def test_page_references_belong_to_the_session_and_go_back(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="tiered", kv=SMALL_KV)
    ids = ask(engine, tiny.text(250, seed=3))
    output_ids(engine, ids)
    held = engine.session.references()
    assert held > 0 and refs(engine) == held   # pages that left the window are stored, referenced once
    session = engine.session
    engine.reset_session()
    assert session.released and session.references() == 0 and refs(engine) == 0
    engine.store.check_integrity()
    # a second conversation that shares the first pages: it references them again, once each
    output_ids(engine, ids[:100] + ask(engine, tiny.text(150, seed=4)))
    assert refs(engine) == engine.session.references() > 0
    engine.session.cache.check_integrity()


def test_crop_gives_back_the_references_of_the_pages_it_drops(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="tiered", kv=SMALL_KV)
    ids = ask(engine, tiny.text(250, seed=5))
    output_ids(engine, ids)
    before = engine.session.references()
    output_ids(engine, ids[:40] + [ids[40] + 1] + ids[41:60])   # diverges at 40: pages 3.. are dropped
    assert engine.session.references() < before and refs(engine) == engine.session.references()
    engine.session.cache.check_integrity()


def test_two_engines_on_one_model_never_share_pages(tmp_path, llama):
    """Pages are keyed by the model's identity: an engine of another path finds none of the first one's pages."""
    a = tiny.engine(tmp_path / "a", net=llama, kv_cache="tiered", kv=SMALL_KV)
    os.makedirs(tmp_path / "b")
    b = tiny.engine(tmp_path / "b", net=llama, kv_cache="tiered", kv=SMALL_KV)
    ids = ask(a, tiny.text(200, seed=6))
    assert output_ids(a, ids) == output_ids(b, ids)
    assert last(b)["reused"] == 0 and not set(a.store.pages) & set(b.store.pages)


# ---- out of memory ---------------------------------------------------------------------------------------------
class OutOfMemoryAbove:
    """Raises torch.OutOfMemoryError inside the last decoder layer's MLP (after the earlier layers wrote their K/V)
    whenever a forward carries more than ``limit`` tokens; ``once_at_one``: also once on a one-token step."""

    def __init__(self, engine, limit: int, once_at_one: bool = False):
        self.limit, self.once_at_one, self.raised = limit, once_at_one, 0
        self.handle = engine.model.model.layers[-1].mlp.register_forward_pre_hook(self)

    def __call__(self, module, args):
        tokens = args[0].shape[1]
        if tokens > self.limit or (tokens == 1 and self.once_at_one):
            self.raised += 1
            self.once_at_one = False
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("cache", CACHES)
def test_out_of_memory_in_prefill_halves_the_chunk_with_the_same_output(tmp_path, llama, cache):
    ids = None
    expected = None
    for fault in (False, True):
        engine = tiny.engine(tmp_path, net=llama, kv_cache=cache, kv=SMALL_KV, prefill_chunk=256)
        ids = ids or ask(engine, tiny.text(200, seed=7))
        if not fault:
            expected = output_ids(engine, ids)
            continue
        with OutOfMemoryAbove(engine, 40) as oom:
            got = output_ids(engine, ids)
    assert got == expected
    assert oom.raised >= 2 and engine.oom_retries == oom.raised
    assert engine.prefill_chunk <= 40 and engine.prefill_chunk >= engine.MIN_CHUNK   # kept for later calls
    assert engine.session_ids == ids + got[:-1]
    if cache == "tiered":
        engine.session.cache.check_integrity()
        assert refs(engine) == engine.session.references()


@pytest.mark.parametrize("cache", CACHES)
def test_out_of_memory_on_a_decode_step_is_retried_once(tmp_path, llama, cache):
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache)
    ids = ask(engine, tiny.text(50))
    expected = output_ids(engine, ids)
    engine.reset_session()
    with OutOfMemoryAbove(engine, 10_000, once_at_one=True) as oom:
        assert output_ids(engine, ids) == expected
    assert oom.raised == 1 and engine.oom_retries == 1


@pytest.mark.parametrize("cache", CACHES)
def test_a_step_that_never_fits_names_the_keys_and_leaves_the_engine_usable(tmp_path, llama, cache):
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache, prefill_chunk=64)
    ids = ask(engine, tiny.text(100))
    with OutOfMemoryAbove(engine, 0), pytest.raises(GpuMemoryError) as err:
        output_ids(engine, ids, 4)
    text = str(err.value)
    assert "weights: int4" in text and "prefill_chunk" in text and "kv.l1_tokens" in text
    assert err.value.status_code == 507
    assert engine.prefill_chunk == engine.MIN_CHUNK
    assert output_ids(engine, ids, 8) == reference(llama, ids, 8, engine.eos_ids)


# ---- lost pages ------------------------------------------------------------------------------------------------
def l3_kv(tmp_path) -> dict:
    return {**SMALL_KV, "l2_tokens": 32, "l3_tokens": 4096, "l3_codec": "fp16-zstd",
            "l3_dir": str(tmp_path / "l3")}


def two_turns(engine, between=None):
    turn1 = [{"role": "user", "content": tiny.text(260, seed=8)}]
    first = engine.generate(engine.encode_messages(turn1), SamplingParams(max_tokens=12)).text
    if between:
        between(engine)
    msgs = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
    return first, engine.generate(engine.encode_messages(msgs), SamplingParams(max_tokens=12)).text


def damage(engine):
    """A bit flip, a truncation and a deletion among the L3 page files."""
    d = engine.store.l3_dir
    files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".page"))
    assert len(files) >= 3
    data = bytearray(open(files[0], "rb").read())
    data[len(data) // 2] ^= 0x10
    open(files[0], "wb").write(bytes(data))
    open(files[1], "r+b").truncate(os.path.getsize(files[1]) // 2)
    os.remove(files[2])


@pytest.mark.parametrize("reset", [False, True], ids=["same-session", "adopted"])
def test_damaged_disk_pages_are_recomputed_never_used(tmp_path, llama, reset):
    """Damaged pages met by attention (the live session) or by adoption (a new session after reset_session)."""
    clean_engine = tiny.engine(tmp_path / "m", net=llama, kv_cache="tiered", kv=l3_kv(tmp_path / "clean"))
    clean = two_turns(clean_engine)
    assert clean_engine.store.tier_counts()["l3_pages"] > 0

    def between(engine):
        if reset:
            engine.reset_session()
        damage(engine)

    engine = tiny.engine(tmp_path / "m", net=llama, kv_cache="tiered", kv=l3_kv(tmp_path / "damaged"))
    assert two_turns(engine, between) == clean
    assert engine.store.stats.corrupt_pages >= 1
    engine.session.cache.check_integrity()
    assert refs(engine) == engine.session.references()


def test_a_damaged_page_met_by_a_crop_is_recomputed(tmp_path, llama):
    """A prompt that diverges far behind the window refills L1 from stored pages: a damaged one among them."""
    ids = ask(tiny.engine(tmp_path / "m", net=llama), tiny.text(260, seed=12))
    other = ids[:70] + ask(llama_engine := tiny.engine(tmp_path / "m", net=llama), "something else")[3:]
    expected = reference(llama, other, 12, llama_engine.eos_ids)
    engine = tiny.engine(tmp_path / "m", net=llama, kv_cache="tiered", kv=l3_kv(tmp_path / "damaged"))
    output_ids(engine, ids, 12)
    damage(engine)
    assert output_ids(engine, other, 12) == expected
    engine.session.cache.check_integrity()
    assert refs(engine) == engine.session.references()


# ---- stop strings ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def talker(tmp_path_factory, llama):
    """A dynamic-cache engine and the text of one 40-token answer (long enough to stop inside)."""
    engine = tiny.engine(tmp_path_factory.mktemp("talker"), net=llama, kv_cache="dynamic")
    ids = ask(engine, tiny.text(70, seed=9))
    full = engine.generate(ids, SamplingParams(max_tokens=40))
    assert full.finish_reason == "length" and len(full.text) >= 20
    return engine, ids, full.text


def test_a_stop_string_cuts_the_text_before_it(talker):
    engine, ids, full = talker
    stop = full[10:13]
    res = engine.generate(ids, SamplingParams(max_tokens=40, stop=(stop,)))
    assert res.finish_reason == "stop" and res.text == full[:full.find(stop)]


def test_the_earliest_of_several_stop_strings_wins(talker):
    engine, ids, full = talker
    late, early = full[15:18], full[6:8]
    res = engine.generate(ids, SamplingParams(max_tokens=40, stop=(late, early)))
    assert res.text == full[:min(full.find(late), full.find(early))]


def test_a_stop_string_at_the_start_gives_an_empty_reply(talker):
    engine, ids, full = talker
    res = engine.generate(ids, SamplingParams(max_tokens=40, stop=(full[:2],)))
    assert res.text == "" and res.finish_reason == "stop"


def test_a_stop_string_never_produced_changes_nothing(talker):
    engine, ids, full = talker
    res = engine.generate(ids, SamplingParams(max_tokens=40, stop=("\u00e9t\u00e9",)))   # not in the vocabulary
    assert res.text == full and res.finish_reason == "length"


def test_a_stream_never_shows_part_of_a_stop_string(talker):
    engine, ids, full = talker
    stop = full[12:16]
    parts = [d.text for d in engine.stream(ids, SamplingParams(max_tokens=40, stop=(stop,)))]
    shown = ""
    for p in parts:
        shown += p
        assert stop not in shown and not any(stop.startswith(shown[-k:]) for k in range(1, len(stop)))
    assert shown == full[:full.find(stop)]


def test_the_end_of_turn_token_stops_with_reason_stop(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="dynamic")
    ids = ask(engine, tiny.text(70, seed=9))
    out = output_ids(engine, ids, 40)
    eot = out[5]
    engine.eos_ids = frozenset({eot})   # the model's 6th token now ends its turn
    res = engine.generate(ids, SamplingParams(max_tokens=40))
    assert res.finish_reason == "stop" and list(engine.turns[-1].output_ids) == out[:out.index(eot)]


# ---- streaming ------------------------------------------------------------------------------------------------
def test_a_stream_is_the_generated_text_in_pieces(talker):
    engine, ids, full = talker
    deltas = list(engine.stream(ids, SamplingParams(max_tokens=40)))
    assert "".join(d.text for d in deltas) == full and len(deltas) > 5
    assert all(d.finish_reason is None for d in deltas[:-1]) and deltas[-1].finish_reason == "length"
    assert (deltas[-1].prompt_tokens, deltas[-1].completion_tokens) == (len(ids), 40)


def test_a_stream_closed_early_releases_the_engine_and_keeps_its_tokens(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="tiered", kv=SMALL_KV)
    ids = ask(engine, tiny.text(120, seed=10))
    expected = output_ids(engine, ids, 30)
    engine.reset_session()
    stream = engine.stream(ids, SamplingParams(max_tokens=30))
    for _ in range(3):
        next(stream)
    stream.close()
    other = threading.Thread(target=engine.generate, args=(ids, SamplingParams(max_tokens=30)))
    other.start()
    other.join(timeout=60)
    assert not other.is_alive(), "a closed stream kept the engine's lock"
    assert list(engine.turns[-1].output_ids) == expected
    assert last(engine)["reused"] >= len(ids) - 1   # the closed stream's prompt stayed in the session
    engine.session.cache.check_integrity()


def test_a_closed_stream_counts_the_tokens_it_made(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="dynamic")
    stream = engine.stream(ask(engine, tiny.text(60)), SamplingParams(max_tokens=30))
    next(stream)
    stream.close()
    s = engine.stats.as_dict()["generation"]
    assert s["calls"] == 1 and 1 <= s["generated_tokens"] < 30


# ---- length, sampling, prompts ---------------------------------------------------------------------------------
def test_the_reply_stops_at_the_context(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="tiered", max_context=96)
    ids = ask(engine, tiny.text(70))
    res = engine.generate(ids, SamplingParams(max_tokens=200))
    assert res.finish_reason == "length" and res.completion_tokens == 96 - len(ids)


def test_seeded_sampling_repeats_and_other_seeds_differ(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="dynamic")
    ids = ask(engine, tiny.text(60))
    p = dict(max_tokens=24, temperature=1.5, top_p=0.95)
    a = output_ids(engine, ids, **p, seed=1)
    assert output_ids(engine, ids, **p, seed=1) == a
    assert output_ids(engine, ids, **p, seed=2) != a


def test_the_configured_seed_is_used_when_a_call_has_none(tmp_path, llama):
    a = tiny.engine(tmp_path, net=llama, kv_cache="dynamic", seed=5)
    ids = ask(a, tiny.text(60))
    p = dict(max_tokens=24, temperature=1.5)
    assert output_ids(a, ids, **p) == output_ids(a, ids, **p) == output_ids(a, ids, **p, seed=5)


def test_bad_prompts_say_what_to_change(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="dynamic", max_context=64)
    with pytest.raises(PromptError, match="empty"):
        engine.encode_messages([])
    with pytest.raises(PromptError, match=r"messages\[1\]\.role must be system, user, assistant or tool"):
        engine.encode_messages([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}])
    with pytest.raises(PromptError, match=r"messages\[0\]\.content must be a string"):
        engine.encode_messages([{"role": "user", "content": None}])
    with pytest.raises(PromptError, match="empty"):
        engine.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(PromptError, match="context is 64 tokens.*max_context"):
        engine.generate(ask(engine, tiny.text(80)), SamplingParams(max_tokens=4))
    assert engine.encode_messages([{"role": "tool", "content": "42"}])   # a tool result is a role too
    vocab = engine.model.get_input_embeddings().num_embeddings   # (a GPU's lookup of a host table checks nothing)
    for bad in (vocab, -1):
        with pytest.raises(PromptError, match=rf"token id {bad} is outside the model's vocabulary \(0\.\.{vocab - 1}\)"):
            engine.generate([5, bad, 6], SamplingParams(max_tokens=2))


def test_the_system_prompt_is_added_when_the_chat_has_none(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="dynamic", system_prompt="Be brief.")
    plain = engine.decode(ask(engine, "hi"))
    assert plain.startswith("system\nBe brief.\nuser\nhi")
    own = engine.encode_messages([{"role": "system", "content": "Be long."}, {"role": "user", "content": "hi"}])
    assert "Be brief." not in engine.decode(own)


# ---- next-token state (the moderation rail's call) ----------------------------------------------------------------
@pytest.mark.parametrize("cache", CACHES)
def test_next_token_state_is_the_models_forward_and_reuses_the_turn(tmp_path, llama, cache):
    engine = tiny.engine(tmp_path, net=llama, kv_cache=cache, kv=SMALL_KV)
    ids = ask(engine, tiny.text(150, seed=11))
    turn = engine.teacher_force(ids, output_ids(engine, ids, 12))
    assert engine.turns[-1] == turn
    probe_ids = list(turn.prompt_ids + turn.output_ids) + ask(engine, "safe?")[1:]
    logprobs, hidden, reused = engine.next_token_state(probe_ids, hidden=True)
    assert reused == len(turn.prompt_ids) + len(turn.output_ids)
    with torch.no_grad():
        out = llama(torch.tensor([probe_ids]), output_hidden_states=True)
    torch.testing.assert_close(logprobs, torch.log_softmax(out.logits[0, -1], -1), atol=1e-4, rtol=1e-4)
    assert hidden.shape == (llama.config.num_hidden_layers + 1, llama.config.hidden_size)
    torch.testing.assert_close(hidden, torch.stack([h[0, -1] for h in out.hidden_states]), atol=1e-4, rtol=1e-4)
    s = engine.stats.as_dict()["moderation"]
    assert s["calls"] == 1 and s["reused_tokens"] == reused and s["prefilled_tokens"] == len(probe_ids) - reused


# ---- start-up facts ------------------------------------------------------------------------------------------------
def test_a_cpu_engine_holds_the_whole_context_in_its_pool(tmp_path, llama):
    engine = tiny.engine(tmp_path, net=llama, kv_cache="tiered", max_context=512)
    info = engine.info()
    assert info["context"] == 512 and info["tiers"]["pool"]["tokens"] == 512 and info["vram_budget"] is None
    assert info["weights"] == "float" and info["cache"] == "tiered"
    # bytes a decoded token reads: the held linears and lm_head, and every K/V value of the 512-token context (fp32)
    read, cfg = info["decode_bytes"], llama.config
    assert read["lm_head"] == llama.lm_head.weight.numel() * 4
    assert read["kv attended"] == 512 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 16 * 4
    assert read["total"] == read["decoder linears"] + read["lm_head"] + read["kv attended"] > 0
