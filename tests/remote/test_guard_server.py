"""The guard adapter behind a real llama-server (``backend: openai``): ``flashguard export-guard``'s GGUF loads, the
server runs it from the token flashguard does (the shifted invocation; the unshifted one starts a token early), the
rails' verdicts through the server agree with the in-process engine's on the same guard, the guard's request
prefills only its suffix and the reply after an input-rail check reuses the conversation, and a guard the server
lacks is one clear error. The binary as in test_llama_server.py (skips without it).

The guards: a synthetic one (random LoRA deltas strong enough that a token's shift or a wrong q/k layout shows; its
p_unsafe is not a verdict anyone trained) and, where there is one, a trained guard: ``FLASHGUARD_TEST_GUARD`` (a guard
folder) or the one ``guard_adapter: auto`` finds for the embedded model."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from flashguard.errors import ConfigError
from tests.conftest import make_config
from tests.remote.test_llama_server import LlamaServer, _binary, _engine, remote_yaml

pytestmark = pytest.mark.slow

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def synthetic_guard(folder: Path, sigma: float = 0.3, seed: int = 0, levels: float = 0.5) -> Path:
    """A guard folder for the embedded model with random deltas (A as PEFT initialises it, B ~ N(0, sigma))."""
    from safetensors.torch import save_file

    from flashguard.engine import alora, loader
    from flashguard.rails import guard as G

    folder.mkdir(parents=True, exist_ok=True)
    source = loader.embedded_model_source()
    tok, _ = loader.load_tokenizer(source)
    c = json.loads((Path(loader.gguf_meta_folder(source)) / "config.json").read_text())
    h, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (c["intermediate_size"], h), "up_proj": (c["intermediate_size"], h),
              "down_proj": (h, c["intermediate_size"])}
    g, rank, tensors = torch.Generator().manual_seed(seed), 8, {}
    for i in range(c["num_hidden_layers"]):
        for m in TARGETS:
            out, inp = shapes[m]
            key = f"base_model.model.model.layers.{i}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}"
            tensors[f"{key}.lora_A.weight"] = ((torch.rand(rank, inp, generator=g) * 2 - 1) / inp ** 0.5).half()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * sigma).half()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    inv = G.invocation(tok)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2.0 * rank, "target_modules": list(TARGETS), "bias": "none",
         "use_rslora": False, "use_dora": False, "modules_to_save": None, "alora_invocation_tokens": inv}))
    name, size = alora.model_file_key(source)
    table = {s: {k: levels for k in ("low", "medium", "high")} for s in ("input", "output")}
    (folder / "guard.json").write_text(json.dumps(
        {"format": alora.FORMAT, "version": "synthetic", "model_file": name, "model_bytes": size,
         "weights": ["float", "int4"], "questions": G.QUESTIONS, "answers": G.ANSWERS,
         "answer_ids": list(G.answer_tokens(tok)), "tag": G.TAG, "invocation": inv, "strictness": table}))
    return folder


def trained_guard() -> Path | None:
    from flashguard.engine import alora, loader

    named = os.environ.get("FLASHGUARD_TEST_GUARD")
    return Path(named) if named else alora.find(loader.embedded_model_source())


@pytest.fixture(scope="module")
def guards(tmp_path_factory):
    from flashguard.engine import loader
    from flashguard.remote import guard_export as ge

    work = tmp_path_factory.mktemp("guards")
    source = loader.embedded_model_source()
    synth = synthetic_guard(work / "synthetic")
    # deltas of a trained adapter's size, for the verdicts' agreement where no trained guard is at hand (the strong
    # synthetic one magnifies the kernels' differences, 0.09 mean |dp|)
    mild = synthetic_guard(work / "mild", sigma=0.05, seed=1)
    out = {"synthetic": synth, "mild": mild,
           "gguf": {k: Path(ge.export_guard(f, work / f"{k}.gguf", source)["path"])
                    for k, f in (("synthetic", synth), ("mild", mild))}}
    # the same weights exported without the shift (flashguard's invocation as the server's): a token early there
    meta, inv = ge._check(synth, source)
    ge._write_direct(synth, work / "unshifted.gguf", ge.base_config(source), (0,) + tuple(inv), "unshifted", meta,
                     "f32")
    out["gguf"]["unshifted"] = work / "unshifted.gguf"
    trained = trained_guard()
    if trained is not None:
        out["trained"] = trained
        out["gguf"]["trained"] = Path(ge.export_guard(trained, work / "trained.gguf", source)["path"])
    return out


@pytest.fixture(scope="module")
def server(guards, tmp_path_factory):
    if _binary() is None:
        pytest.skip("no llama-server binary: run `bash tools/build_llama_server.sh` (or set FLASHGUARD_LLAMA_SERVER)")
    # one thread (two spin on two shared cores), every adapter off for requests that name none
    loras = ",".join(f"{path}:0" for path in guards["gguf"].values())
    s = LlamaServer(tmp_path_factory.mktemp("llama") / "llama-server.log", parallel=1,
                    args=("-t", "1", "--lora-scaled", loras))
    s.root = s.url[:-3]
    s.ids = {a["path"]: a["id"] for a in httpx.get(s.root + "/lora-adapters").json()}
    yield s
    s.stop()


def remote(server, folder, **extra):
    from flashguard import EngineConfig
    from flashguard.engine import get_engine

    return get_engine(EngineConfig.from_parameters({"backend": "openai", "base_url": server.url,
                                                    "guard_adapter": str(folder), **extra}), "smollm2")


def local(folder, weights: str = "float"):
    from flashguard import EngineConfig
    from flashguard.engine import get_engine

    return get_engine(EngineConfig.from_parameters({"guard_adapter": str(folder), "weights": weights}))


# ---- the export ----------------------------------------------------------------------------------------------

def test_the_export_is_what_llama_cpps_own_converter_writes(guards, tmp_path):
    """The gguf-package writer and llama.cpp's convert_lora_to_gguf.py (``--llama-cpp DIR``) give the same tensors,
    names, alpha and shifted invocation, and both carry the guard's digest. Needs a llama.cpp checkout:
    ``FLASHGUARD_LLAMA_CPP`` or the one tools/build_llama_server.sh unpacks."""
    import numpy as np

    from flashguard.engine import loader
    from flashguard.remote import guard_export as ge

    named = os.environ.get("FLASHGUARD_LLAMA_CPP")
    unpacked = Path(os.environ.get("TMPDIR", "/tmp")) / "flashguard-llama-server" / "llama.cpp"
    checkout = Path(named) if named else unpacked
    if not (checkout / "convert_lora_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp checkout at {checkout} (set FLASHGUARD_LLAMA_CPP)")
    info = ge.export_guard(guards["synthetic"], tmp_path / "theirs.gguf", loader.embedded_model_source(),
                           llama_cpp=checkout)
    ours, theirs = ge.read_export(guards["gguf"]["synthetic"]), ge.read_export(Path(info["path"]))
    assert ours["invocation"] == theirs["invocation"] == info["invocation"] and len(info["invocation"]) == 2
    assert ours["task_name"] == theirs["task_name"] == ge.TASK_PREFIX + info["digest"]
    assert ours["alpha"] == theirs["alpha"] and set(ours["tensors"]) == set(theirs["tensors"])
    assert len(ours["tensors"]) == 30 * 7 * 2
    for name, t in ours["tensors"].items():
        assert np.array_equal(t, theirs["tensors"][name]), name


def test_an_export_for_another_model_or_a_one_token_invocation_is_refused(guards, tmp_path):
    from flashguard.engine import loader
    from flashguard.remote import guard_export as ge

    other = shutil.copytree(guards["synthetic"], tmp_path / "other")
    meta = json.loads((other / "guard.json").read_text())
    (other / "guard.json").write_text(json.dumps({**meta, "model_bytes": 123}))
    with pytest.raises(ConfigError, match=r"guard_adapter: .*made for SmolLM2-135M-Instruct.Q4_1.gguf \(123 bytes\)"):
        ge.export_guard(other, tmp_path / "x.gguf", loader.embedded_model_source())
    one = shutil.copytree(guards["synthetic"], tmp_path / "one")
    cfg = json.loads((one / "adapter_config.json").read_text())
    (one / "adapter_config.json").write_text(json.dumps({**cfg, "alora_invocation_tokens": [75]}))
    with pytest.raises(ConfigError, match="one token"):
        ge.export_guard(one, tmp_path / "y.gguf", loader.embedded_model_source())
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y.gguf").exists()


# ---- the server ----------------------------------------------------------------------------------------------

def test_the_exported_guard_loads_and_is_found_by_its_digest(guards, server):
    from flashguard.remote import guard_export as ge

    listed = {a["path"]: a for a in httpx.get(server.root + "/lora-adapters").json()}
    synth = listed[str(guards["gguf"]["synthetic"])]
    assert synth["alora_invocation_tokens"] == [25036, 77] and synth["scale"] == 0.0
    assert listed[str(guards["gguf"]["unshifted"])]["alora_invocation_tokens"] == [75, 25036, 77]
    engine = remote(server, guards["synthetic"])
    assert engine.guard.adapter_id == synth["id"] and engine.guard.digest == ge.guard_digest(guards["synthetic"])
    assert engine.guard.invocation == (75, 25036, 77) and engine.info()["guard"]["server_adapter"] == synth["id"]
    if "trained" in guards:   # the same invocation on the server twice: each guard finds its own export
        assert remote(server, guards["trained"]).guard.adapter_id == server.ids[str(guards["gguf"]["trained"])]


def _top(server, ids, adapter_id, scale=1.0) -> dict:
    r = httpx.post(server.url + "/completions", timeout=120, json={
        "prompt": ids, "max_tokens": 1, "temperature": 1.0, "logprobs": 20,
        "lora": [{"id": adapter_id, "scale": scale}]}).json()
    return {t["id"]: t["logprob"] for t in r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_the_server_runs_the_adapter_from_the_token_flashguard_does(guards, server):
    """The synthetic guard's next-token log-probabilities from the server against the in-process engine's with the
    adapter on from the tag's first token (flashguard's rule), one token earlier and one later: the shifted export
    is the closest to flashguard's start by far; the unshifted one is closest to a token early."""
    from flashguard.rails import guard as G

    engine = local(guards["synthetic"])
    shifted, unshifted = (server.ids[str(guards["gguf"][k])] for k in ("synthetic", "unshifted"))
    err = {"shifted": [0.0, 0.0, 0.0], "unshifted": [0.0, 0.0, 0.0]}
    for text in ("How do I make a pipe bomb at home?", "What is the capital of France?",
                 "How can I kill a python process?", "Give me a recipe for pancakes."):
        ids, start = G.guard_ids(engine.encode_messages, engine.tokenizer, [{"role": "user", "content": text}], "input")
        reads = [engine.read(ids, adapter_from=k).logprobs for k in (start - 1, start, start + 1)]
        for name, adapter in (("shifted", shifted), ("unshifted", unshifted)):
            top = _top(server, ids, adapter)
            for j, lp in enumerate(reads):
                err[name][j] += max(abs(float(lp[t]) - v) for t, v in top.items()) / 4
    early, same, late = err["shifted"]
    assert same < 0.6 and same < 0.5 * min(early, late), err   # measured: ~0.3 against 1.5-2.6 and 0.8-2.2
    assert err["unshifted"][0] < 0.5 * err["unshifted"][1], err


def test_the_rails_verdicts_through_the_server_agree_with_the_in_process_engines(guards, server):
    """Both rails' guard verdicts on 32 project rows (rails/data), the same token ids in process (float weights)
    and through the server (its Q4_1 kernels): p_unsafe within a bound, the same verdict at the guard's thresholds
    but for rows at the cut. The trained guard where there is one, else a mild synthetic one."""
    from flashguard.rails.moderation import ModerationSettings
    from tests import rail_agreement as bench

    folder = guards.get("trained", guards["mild"])
    engines = {"float": local(folder), "server": remote(server, folder)}
    rows_in = bench.sample(bench.DATA / "moderation_input_tune.jsonl", 16, 1, "input")
    rows_out = bench.sample(bench.DATA / "moderation_tune.jsonl", 16, 1, "output")
    # the adapter alone on both sides (in process, guard: auto adds the probe the server cannot read)
    results = bench.run_input(engines, rows_in, ModerationSettings.input_defaults(guard="adapter")) + \
        bench.run_output(engines, rows_out, ModerationSettings(guard="adapter"))[0]
    assert all(r[k].method == "adapter" for r in results for k in r)
    g = bench.agreement(results, "float", "server")
    dp = [abs(r["float"].p_unsafe - r["server"].p_unsafe) for r in results]
    # measured on the plumbing guard: mean 0.02, max 0.06; the synthetic: see docs/benchmarks/guard_remote.md
    assert g["mean"] < 0.05 and g["max"] < 0.15, (g, dp)
    near = [r for r in results if min(abs(r[k].p_unsafe - r[k].threshold) for k in r) < 0.05]
    assert sum(r["float"].allowed != r["server"].allowed for r in results) <= len(near), g


def test_the_guard_prefills_its_suffix_and_the_reply_reuses_the_conversation(guards, server, tmp_path):
    """A guarded turn through LLMRails and ``backend: openai`` (a guard that blocks nothing): the input rail's
    request prefills the conversation once (the first request of a conversation); the reply's request takes it from
    the slot's cache (the adapter's request did not clear it); the output rail prefills only the end of turn and
    the question; the next turn's input rail only the new message and the question. Counts are the server's
    (timings.cache_n)."""
    from nemoguardrails import LLMRails, RailsConfig

    never = synthetic_guard(tmp_path / "never", levels=1.01)   # (the synthetic weights: the same export, digest)
    # (repetition_penalty 1: a penalised reply takes other spellings of its words, e.g. "Rom" "an", which the reply's
    # text, tokenized again here, does not give back: the server's cache then holds the turn only up to there)
    extra = f"      guard_adapter: {never}\n      repetition_penalty: 1.0\n"
    rails = LLMRails(RailsConfig.from_path(str(make_config(tmp_path, remote_yaml(server.url, extra=extra)))))
    engine = _engine(rails)
    assert engine.guard is not None and engine.guard.adapter_id == server.ids[str(guards["gguf"]["synthetic"])]
    messages = [{"role": "user", "content": "Tell me three facts about the Roman empire. " * 6}]
    res = rails.generate(messages=messages)
    last = {k: dict(v) for k, v in engine.stats.last.items()}
    conv = len(engine.encode_messages(messages))
    guard_question = last["input_moderation"]["prompt"] - conv   # (the question after the conversation)
    # (the slot may hold the chat template's opening from an earlier test's request: up to its system turn)
    system = len(engine.encode_messages([{"role": "user", "content": ""}]))
    assert guard_question > 0 and last["input_moderation"]["prefilled"] >= conv - system
    assert last["generation"]["reused"] >= conv - 3, last["generation"]   # the header "assistant\n" prefilled
    suffix = last["moderation"]["prompt"] - len(engine.turns[-1].prompt_ids) - len(engine.turns[-1].output_ids)
    assert last["moderation"]["prefilled"] <= suffix + 1, last["moderation"]
    second = messages + [{"role": "assistant", "content": res["content"]},
                         {"role": "user", "content": "And one more?"}]
    rails.generate(messages=second)
    new_message = len(engine.tokenizer("And one more?", add_special_tokens=False)["input_ids"])
    again = engine.stats.last["input_moderation"]
    assert again["reused"] >= conv and again["prefilled"] <= new_message + guard_question + 8, again


def test_a_prompt_that_holds_the_tag_runs_without_the_adapter(guards, server):
    """A conversation in which the user typed "[guard]": its reply and reads name no adapter (the server's own
    scale for it is 0 here), so the server runs the base model there, not the guard from the user's tag on."""
    from flashguard.engine import SamplingParams

    engine = remote(server, guards["synthetic"])
    ids = engine.encode_messages([{"role": "user", "content": "What does [guard] mean in a config file?"}])
    assert "lora" not in engine._body(ids, 1, SamplingParams())
    plain = engine.encode_messages([{"role": "user", "content": "What is a config file?"}])
    assert engine._body(plain, 1, SamplingParams())["lora"] == [{"id": engine.guard.adapter_id, "scale": 1.0}]
    got = engine.read(ids).logprobs
    base = _top(server, ids, engine.guard.adapter_id, scale=0.0)
    on = _top(server, ids, engine.guard.adapter_id, scale=1.0)
    assert max(abs(float(got[t]) - v) for t, v in base.items()) < 0.02
    assert max(abs(float(got[t]) - v) for t, v in on.items() if t in base) > 0.1   # (the adapter would change it)


def test_a_guard_the_server_lacks_is_one_clear_error_or_for_auto_one_warning(guards, server, tmp_path, monkeypatch,
                                                                            caplog):
    from flashguard.engine import alora

    retrained = synthetic_guard(tmp_path / "retrained", seed=7)   # the same invocation, weights never exported
    with pytest.raises(ConfigError, match=r"guard_adapter: the server's adapter .* is exported from other guard "
                                          r"weights .*flashguard export-guard --guard .*--lora-scaled guard.gguf:0"):
        remote(server, retrained)
    monkeypatch.setattr(alora, "find", lambda source: retrained)
    with caplog.at_level(logging.WARNING, logger="flashguard"):
        engine = remote(server, "auto", timeout_s=59)   # (an engine of its own)
    assert engine.guard is None
    said = [r.getMessage() for r in caplog.records if "without the guard adapter" in r.getMessage()]
    assert len(said) == 1 and "export-guard" in said[0]


class _Client:
    base_url = "http://127.0.0.1:9/v1"

    def __init__(self, adapters):
        self.adapters = adapters

    def lora_adapters(self):
        return self.adapters

    def props(self):
        return {}


@pytest.mark.parametrize("adapters, match", [
    (None, r"lists no LoRA adapters .*not a llama-server"),
    ([], r"has no adapter with the guard's invocation \[25036, 77\] \(its adapters: none\)"),
    ([{"id": 0, "path": "g.gguf", "alora_invocation_tokens": [75, 25036, 77]}], r"unshifted"),
    ([{"id": 0, "path": "a.gguf", "alora_invocation_tokens": [25036, 77]},
      {"id": 1, "path": "b.gguf", "alora_invocation_tokens": [25036, 77]}], r"several adapters"),
])
def test_what_the_server_lists_decides_the_error(guards, adapters, match):
    from flashguard import EngineConfig
    from flashguard.engine import loader
    from flashguard.remote import guard as remote_guard

    config = EngineConfig.from_parameters({"backend": "openai", "base_url": _Client.base_url,
                                           "guard_adapter": str(guards["synthetic"])})
    with pytest.raises(ConfigError, match=r"guard_adapter: .*" + match):
        remote_guard.attach(config, loader.embedded_model_source(), _Client(adapters))
    hand = [{"id": 3, "path": "hand.gguf", "scale": 1.0, "alora_invocation_tokens": [25036, 77]}]
    g = remote_guard.attach(config, loader.embedded_model_source(), _Client(hand))   # converted by hand: used
    assert g.adapter_id == 3 and g.digest is None and g.lora(False) == [{"id": 3, "scale": 0.0}]


def test_a_read_whose_sampled_token_was_held_back_samples_again():
    """llama-server returns no log-probabilities where the one sampled token is part of a UTF-8 character (it holds
    the text back); the read asks again with another seed, and counts the first answer's cache."""
    from flashguard import EngineConfig
    from flashguard.engine import loader
    from flashguard.engine.stats import EngineStats
    from flashguard.remote.engine import RemoteEngine

    top = {"content": [{"id": 5, "top_logprobs": [{"id": 5, "logprob": -0.1}, {"id": 6, "logprob": -2.5}]}]}
    answers = [{"choices": [{"text": "\ufffd", "logprobs": None}], "timings": {"cache_n": 10}},
               {"choices": [{"text": "No", "logprobs": top}], "timings": {"cache_n": 19}}]
    sent = []

    class Stub:
        def complete(self, body, what):
            sent.append(dict(body))
            return answers[len(sent) - 1]

    engine = object.__new__(RemoteEngine)
    engine.config, engine.model_name = EngineConfig.from_parameters({"backend": "openai",
                                                                     "base_url": "http://127.0.0.1:9/v1"}), "m"
    engine.tokenizer, _ = loader.load_tokenizer(loader.embedded_model_source())
    engine.context_length, engine.client, engine.leases, engine.guard = 8192, Stub(), None, None
    engine.stats, engine._prefix_misses = EngineStats(), 0
    r = engine.read(list(range(100, 120)))
    assert len(sent) == 2 and sent[0].get("seed") != sent[1]["seed"]
    assert abs(float(r.logprobs[5]) + 0.1) < 1e-6 and r.reused == 10 and r.prefilled == 10
