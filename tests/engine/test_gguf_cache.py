"""The int4 model of a GGUF kept in the user cache (quant/gguf_cache.py): written at the first load, memory-mapped
at the next, bit for bit the model the conversion builds (every tensor, the logits, the generated text); a damaged
entry is built again with one warning, never used; the lm_head ``auto`` timed is kept with it. Behaviour only:
no timing is asserted."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from flashguard.engine import loader  # noqa: E402
from flashguard.quant import gguf_cache, gguf_load, lm_head  # noqa: E402
from flashguard.quant.gguf_int4 import Int4PairLinear  # noqa: E402
from flashguard.quant.int4_linear import Int4Linear, concat_rows  # noqa: E402
from tests.engine.test_gguf_load import write_tiny_gguf  # noqa: E402

CPU = torch.device("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def assert_same_model(a, b) -> None:
    """The same modules (types, int4 layout) and every tensor bit for bit."""
    assert [(n, type(m).__name__) for n, m in a.named_modules()] == [(n, type(m).__name__) for n, m in b.named_modules()]
    for m, n in zip(a.modules(), b.modules()):
        if isinstance(m, Int4Linear):
            assert (m.in_features, m.out_features, m.group_size, m.backend) == \
                (n.in_features, n.out_features, n.group_size, n.backend)
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, key
        assert torch.equal(_bits(sa[key]), _bits(sb[key])), key
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())   # (rotary inv_freq: not persistent)
    assert sorted(buffers_a) == sorted(buffers_b)
    for key in buffers_a:
        assert torch.equal(_bits(buffers_a[key]), _bits(buffers_b[key])), key


def logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGUARD_CACHE_DIR", str(tmp_path / "cache"))

    def make(arch="llama", output_type=None):
        path = tmp_path / f"{arch}-{output_type}.gguf"
        write_tiny_gguf(path, arch, output_type=output_type)
        return loader.resolve_model(str(path))

    return make


def _entry(tmp_path):
    entries = list((tmp_path / "cache" / "gguf-int4").iterdir())
    assert len(entries) == 1
    return entries[0]


def _no_conversion(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was converted again; the cache entry should have been read")

    monkeypatch.setattr(gguf_load, "load_int4", refuse)


def _uncached(source, backend, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(gguf_cache, "cacheable", lambda device, backend: False)
        return loader.load(source, CPU, torch.float32, "int4", backend)


@pytest.mark.parametrize("arch,output_type", [("llama", None), ("qwen2", T.Q4_K), ("llama", T.Q6_K)])
@pytest.mark.parametrize("backend", ["cpu", "dequant"])
def test_the_cached_model_is_the_built_one_bit_for_bit(tmp_path, monkeypatch, tiny_gguf, arch, output_type, backend):
    source = tiny_gguf(arch, output_type)
    built, tokenizer = _uncached(source, backend, monkeypatch)
    assert not (tmp_path / "cache" / "gguf-int4").exists()
    first, _ = loader.load(source, CPU, torch.float32, "int4", backend)    # builds it and keeps it
    entry = _entry(tmp_path)
    assert (entry / "model.pt").is_file() and json.loads((entry / "flashguard-complete.json").read_text())["crc32"]
    with monkeypatch.context() as m:
        _no_conversion(m)
        cached, _ = loader.load(source, CPU, torch.float32, "int4", backend)   # reads it
    assert_same_model(built, first)
    assert_same_model(built, cached)
    ids = tokenizer("hello world")["input_ids"]
    want = logits(built, ids)
    assert torch.equal(logits(first, ids), want)
    assert torch.equal(logits(cached, ids), want)
    if output_type is None:   # the head made of the Q8_0 embeddings keeps its float table (lm_head: int4 reads it)
        assert isinstance(cached.lm_head, Int4PairLinear)
        assert cached.lm_head.table is cached.get_input_embeddings().weight


def test_the_cached_layers_join_without_a_copy(tmp_path, monkeypatch, tiny_gguf):
    """q/k/v and gate/up are kept as row blocks of one tensor: the decode step's joined layer is a view of them and
    computes what the layers compute apart."""
    source = tiny_gguf("qwen2")
    loader.load(source, CPU, torch.float32, "int4", "cpu")
    model, _ = loader.load(source, CPU, torch.float32, "int4", "cpu")
    mlp = model.model.layers[1].mlp   # (this file's attn_v is Q6_K, kept in float: q/k/v do not join)
    parts = [mlp.gate_proj, mlp.up_proj]
    joined = concat_rows(parts)
    assert joined.packed.data_ptr() == mlp.gate_proj.packed.data_ptr()   # a view of the mapped file, not a copy
    x = torch.randn(3, mlp.gate_proj.in_features)
    with torch.inference_mode():
        assert torch.equal(joined(x), torch.cat([m(x) for m in parts], -1))


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "drop the model file", "garbage manifest",
                                    "another format", "a tensor of another shape"])
def test_a_damaged_entry_is_built_again_with_one_warning(tmp_path, monkeypatch, tiny_gguf, caplog, damage):
    source = tiny_gguf("llama")
    built, tokenizer = _uncached(source, "cpu", monkeypatch)
    loader.load(source, CPU, torch.float32, "int4", "cpu")
    entry = _entry(tmp_path)
    data = (entry / "model.pt").read_bytes()
    manifest = json.loads((entry / "flashguard-complete.json").read_text())
    if damage == "flip a byte":   # (in the tensors' bytes: the file still reads, its weights would be wrong)
        i = len(data) // 2
        (entry / "model.pt").write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:])
    elif damage == "truncate":
        (entry / "model.pt").write_bytes(data[:len(data) // 3])
    elif damage == "drop the model file":
        os.remove(entry / "model.pt")
    elif damage == "garbage manifest":
        (entry / "flashguard-complete.json").write_text("{not json")
    elif damage == "another format":
        (entry / "flashguard-complete.json").write_text(json.dumps({**manifest, "format": "flashguard-gguf-int4/0"}))
    else:   # a consistent file (size and CRC match) whose tensors do not fit the model
        state = torch.load(entry / "model.pt", weights_only=True)
        key = "model.norm.weight"
        state[key] = torch.cat([state[key], state[key]])
        torch.save(state, entry / "model.pt")
        size = (entry / "model.pt").stat().st_size
        (entry / "flashguard-complete.json").write_text(json.dumps(
            {**manifest, "size": size, "crc32": gguf_cache._crc32(entry / "model.pt")}))
    with caplog.at_level(logging.INFO, logger="flashguard"):
        model, _ = loader.load(source, CPU, torch.float32, "int4", "cpu")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "is damaged" in warnings[0].getMessage() and "building it again" in \
        warnings[0].getMessage()
    assert_same_model(built, model)
    ids = tokenizer("hello")["input_ids"]
    assert torch.equal(logits(model, ids), logits(built, ids))
    caplog.clear()
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="flashguard"):   # replaced: read again
        _no_conversion(m)
        again, _ = loader.load(source, CPU, torch.float32, "int4", "cpu")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert_same_model(built, again)


def test_a_cache_that_cannot_be_written_only_costs_the_conversion(tmp_path, monkeypatch, tiny_gguf, caplog):
    source = tiny_gguf("llama")

    def full_disk(model, folder, summary):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_cache, "write", full_disk)
    with caplog.at_level(logging.INFO, logger="flashguard"):
        model, _ = loader.load(source, CPU, torch.float32, "int4", "cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot keep the int4 model" in warnings[0]
    assert not list((tmp_path / "cache" / "gguf-int4").iterdir())   # (no half-written entry)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) > 0


def test_a_read_logs_the_builds_line(tmp_path, monkeypatch, tiny_gguf, caplog):
    """``-v`` shows what the weights are whether they were converted or read (and, reading, where from)."""
    source = tiny_gguf("llama")
    with caplog.at_level(logging.INFO, logger="flashguard"):
        loader.load(source, CPU, torch.float32, "int4", "cpu")
    built = [r.getMessage() for r in caplog.records if "matrices int4 straight from" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flashguard"):
        loader.load(source, CPU, torch.float32, "int4", "cpu")
    read = [r.getMessage() for r in caplog.records]
    assert len(built) == 1 and built[0] in read
    assert any("read from the cache (memory-mapped)" in line for line in read)


def test_auto_times_the_lm_head_once_and_keeps_the_choice(tmp_path, monkeypatch, tiny_gguf):
    """The Q8_0 embeddings' head: ``auto`` times it against int4 codes at the first start and keeps the winner with
    the cached model; a later start takes it without timing (and without building the losing head)."""
    source = tiny_gguf("llama")
    model, _ = loader.load(source, CPU, torch.float32, "int4", "cpu")
    kind, why = lm_head.apply("auto", model, "int4", CPU, "cpu")
    assert "ms as the file's Q8_0 here" in why and not why.endswith(lm_head.KEPT_NOTE)

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(lm_head, "_time_one_token", no_timing)
    again, _ = loader.load(source, CPU, torch.float32, "int4", "cpu")
    kind2, why2 = lm_head.apply("auto", again, "int4", CPU, "cpu")
    assert (kind2, why2) == (kind, why + lm_head.KEPT_NOTE)
    assert lm_head.kind_of(again.get_output_embeddings()) == lm_head.kind_of(model.get_output_embeddings())
    assert lm_head.apply("int8", again, "int4", CPU, "cpu")[1].startswith("the file's own Q8_0")  # (keys: as ever)


def test_a_model_without_an_entry_times_as_before(tmp_path, monkeypatch, tiny_gguf):
    source = tiny_gguf("llama")
    model, _ = _uncached(source, "cpu", monkeypatch)
    assert "ms as the file's Q8_0 here" in lm_head.apply("auto", model, "int4", CPU, "cpu")[1]
    assert not (tmp_path / "cache" / "gguf-int4").exists()


@pytest.mark.slow
def test_the_embedded_model_answers_the_same_from_the_cache(tmp_path, monkeypatch):
    """The embedded SmolLM2 through the Engine: converted (no cache), written, read: the same logits bit for bit
    and the same greedy answer (lm_head: int8, so that no timing chooses the head)."""
    from flashguard import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.engine.sampling import SamplingParams

    monkeypatch.setenv("FLASHGUARD_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(device="cpu", lm_head="int8")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    runs = []
    for step in ("uncached", "written", "read"):
        with monkeypatch.context() as m:
            if step == "uncached":
                m.setattr(gguf_cache, "cacheable", lambda device, backend: False)
            if step == "read":
                _no_conversion(m)
            engine = Engine(config)
        ids = engine.encode_messages(messages)
        runs.append((ids, logits(engine.model, ids)[0, -1], engine.generate(ids, SamplingParams(max_tokens=16)).text))
        del engine
    assert runs[0][0] == runs[1][0] == runs[2][0]
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][1], runs[2][1])
    assert runs[0][2] == runs[1][2] == runs[2][2] and "paris" in runs[0][2].lower()


def _legacy_copy(folder, tmp_path):
    """The tokenizer folder as flashguard wrote it before: no added_tokens_decoder in tokenizer_config.json."""
    import shutil

    legacy = tmp_path / "legacy-tokenizer"
    shutil.copytree(folder, legacy)
    config = json.loads((legacy / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    (legacy / "tokenizer_config.json").write_text(json.dumps(config))
    return legacy


TEXTS = ["hello", "Hello <|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n", "  spaces\tand\nlines  ",
         "ünïcödé ✓ 日本語", "<|endoftext|><|endoftext|>"]


def assert_same_tokenizer(a, b, special: bool = True) -> None:
    for text in TEXTS:
        assert a(text)["input_ids"] == b(text)["input_ids"], text
        ids = a(text)["input_ids"]
        assert a.decode(ids) == b.decode(ids) and a.decode(ids, skip_special_tokens=True) == \
            b.decode(ids, skip_special_tokens=True)
    assert a.added_tokens_decoder == b.added_tokens_decoder
    if special:
        assert (a.bos_token, a.eos_token, a.pad_token, a.unk_token) == \
            (b.bos_token, b.eos_token, b.pad_token, b.unk_token)
    messages = [{"role": "user", "content": "hi"}]
    if a.chat_template:
        assert a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            b.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_tokenizer_folder_keeps_its_added_tokens(tmp_path, tiny_gguf):
    """The GGUF's tokenizer folder lists its added tokens in tokenizer_config.json (so that a start does not parse
    tokenizer.json twice): the same tokenizer as the header's and as a folder without them."""
    from transformers import AutoTokenizer

    source = tiny_gguf("qwen2")
    folder = loader.gguf_meta_folder(source)
    assert json.loads((tmp_path / "cache" / "gguf-meta" / os.path.basename(folder) / "tokenizer_config.json")
                      .read_text())["added_tokens_decoder"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert_same_tokenizer(tok, AutoTokenizer.from_pretrained(_legacy_copy(folder, tmp_path)))
    assert_same_tokenizer(tok, loader.gguf_tokenizer(source), special=False)   # (a saved folder names its unk)


@pytest.mark.slow
def test_the_embedded_tokenizer_folder_keeps_its_added_tokens(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("FLASHGUARD_CACHE_DIR", str(tmp_path / "cache"))
    source = loader.resolve_model(None)
    folder = loader.gguf_meta_folder(source)
    tok = AutoTokenizer.from_pretrained(folder)
    assert_same_tokenizer(tok, AutoTokenizer.from_pretrained(_legacy_copy(folder, tmp_path)))
    assert_same_tokenizer(tok, loader.gguf_tokenizer(source), special=False)   # (a saved folder names its unk)
