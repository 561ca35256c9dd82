"""Reading a GGUF file's header (metadata only) and building its tokenizer with the original token ids.

transformers' GGUF conversion of DeepSeek-R1-Distill-Qwen maps its control tokens wrongly (bos/eos get new ids,
``<｜User｜>`` is not one token) and cannot read a file whose tensors are incomplete. The header alone holds
everything a BPE tokenizer needs: the byte-level token strings in id order, their types (3 = control, 4 =
user-defined, 5 = unused padding), the merges, the special ids, the pre-tokenizer name and the chat template.

Contract: ``read_header(path)`` returns ``{key: value}`` (token arrays as lists) without reading tensor data;
``tokenizer_from_header(header)`` returns a ``PreTrainedTokenizerFast`` whose ids equal the GGUF's for every token,
for the GPT-2 style BPE vocabularies of the Qwen2 family (``tokenizer.ggml.pre`` in ``QWEN2_PRES``);
``config_from_header(header)`` returns the transformers ``Qwen2Config`` of a ``qwen2`` GGUF; ``llama_config(meta,
tensor_names)`` the ``LlamaConfig`` of a plain ``llama`` GGUF from its numbers alone (``gguf_load.read_gguf``:
milliseconds, where transformers' own reading parses the token lists too, ~3 s for the embedded model), or None
where the file holds something it does not cover (rope scaling, an expert count), which transformers then reads.
"""

from __future__ import annotations

from typing import Any

QWEN2_PRES = ("qwen2", "deepseek-r1-qwen")
# The Qwen2 pre-tokenizer split (the one llama.cpp uses for both names above): contractions, letters with one
# leading non-letter, single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
CONTROL, USER_DEFINED = 3, 4
# pre-tokenizer names transformers' GGUF conversion turns into plain byte-level BPE for a gpt2-model file (its
# converter reads no pre name); llama.cpp splits digits for "smollm", transformers does not: the ids here are
# transformers' (those the probes were fitted on)
BYTE_LEVEL_PRES = ("smollm",)


def read_header(path: str) -> dict[str, Any]:
    """The header's ``{key: value}``, token arrays as lists (``gguf_load.read_gguf`` with arrays: as gguf-py's
    ``field.contents()`` gives them, in a tenth of the time); tensor data is not read or checked."""
    from ..quant.gguf_load import read_gguf

    return read_gguf(path, arrays=True, tensors=False)[0]


def uses_qwen2_bpe(header: dict) -> bool:
    return header.get("tokenizer.ggml.model") == "gpt2" and header.get("tokenizer.ggml.pre") in QWEN2_PRES


def _bpe_lists(header: dict) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    """A BPE vocabulary's token strings in id order, their types and its merges, from the header."""
    return (header["tokenizer.ggml.tokens"], header["tokenizer.ggml.token_type"],
            [tuple(m.split(" ", 1)) for m in header["tokenizer.ggml.merges"]])


def tokenizer_from_header(header: dict):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not uses_qwen2_bpe(header):
        raise ValueError(f"tokenizer.ggml.pre is {header.get('tokenizer.ggml.pre')!r}; flashguard builds Qwen2-family "
                         f"BPE tokenizers ({', '.join(QWEN2_PRES)}) from GGUF headers")
    tokens, types, merges = _bpe_lists(header)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=(ty == CONTROL), normalized=False) for t, ty in zip(tokens, types)
             if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)
    for a in added:  # add_tokens keeps existing ids for tokens already in the vocabulary; check it did
        if tok.token_to_id(a.content) != vocab[a.content]:
            raise ValueError(f"token {a.content!r} would get id {tok.token_to_id(a.content)}, not {vocab[a.content]}")
    special = lambda key: tokens[header[key]] if key in header else None  # noqa: E731
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("tokenizer.ggml.bos_token_id"),
        eos_token=special("tokenizer.ggml.eos_token_id"), pad_token=special("tokenizer.ggml.padding_token_id"),
        chat_template=header.get("tokenizer.chat_template"),
        add_bos_token=bool(header.get("tokenizer.ggml.add_bos_token", False)), clean_up_tokenization_spaces=False,
        model_max_length=int(header.get("qwen2.context_length", 32768)))


def uses_byte_level_bpe(header: dict) -> bool:
    return header.get("tokenizer.ggml.model") == "gpt2" and header.get("tokenizer.ggml.pre") in BYTE_LEVEL_PRES


def gpt2_tokenizer_from_header(header: dict):
    """The tokenizer transformers' GGUF conversion builds for a ``gpt2``-model GGUF whose pre-tokenizer it reads as
    plain byte-level BPE (``tokenizer.ggml.pre`` in ``BYTE_LEVEL_PRES``: the embedded SmolLM2), from the header
    alone: the same tokenizer.json and tokenizer_config.json (tests/engine/test_gguf_tokenizer.py compares them),
    without transformers' second reading of the header (~2-5 s on the first start)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if not uses_byte_level_bpe(header):
        raise ValueError(f"tokenizer.ggml.pre is {header.get('tokenizer.ggml.pre')!r}; built here for "
                         f"{', '.join(BYTE_LEVEL_PRES)}")
    tokens, types, merges = _bpe_lists(header)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False, continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                            if ty in (CONTROL, USER_DEFINED)])
    special = lambda key: tokens[header[key]] if key in header else None  # noqa: E731
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("tokenizer.ggml.bos_token_id"),
        eos_token=special("tokenizer.ggml.eos_token_id"), pad_token=special("tokenizer.ggml.padding_token_id"),
        unk_token=special("tokenizer.ggml.unknown_token_id"), chat_template=header.get("tokenizer.chat_template"),
        add_bos_token=bool(header.get("tokenizer.ggml.add_bos_token", False)))


def config_from_header(header: dict):
    from transformers import Qwen2Config

    if header.get("general.architecture") != "qwen2":
        raise ValueError(f"general.architecture is {header.get('general.architecture')!r}, not qwen2")
    p = "qwen2."
    return Qwen2Config(
        vocab_size=len(header["tokenizer.ggml.tokens"]), hidden_size=int(header[p + "embedding_length"]),
        intermediate_size=int(header[p + "feed_forward_length"]), num_hidden_layers=int(header[p + "block_count"]),
        num_attention_heads=int(header[p + "attention.head_count"]),
        num_key_value_heads=int(header[p + "attention.head_count_kv"]),
        max_position_embeddings=int(header[p + "context_length"]),
        rms_norm_eps=float(header[p + "attention.layer_norm_rms_epsilon"]),
        rope_theta=float(header[p + "rope.freq_base"]), tie_word_embeddings=False,
        bos_token_id=int(header["tokenizer.ggml.bos_token_id"]), eos_token_id=int(header["tokenizer.ggml.eos_token_id"]))


def llama_config(meta: dict, tensor_names):
    from transformers import LlamaConfig

    p = "llama."
    covered = {"block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon", "vocab_size",
               "rope.dimension_count"}
    if meta.get("general.architecture") != "llama" or \
            any(k.startswith(p) and k[len(p):] not in covered for k in meta) or p + "vocab_size" not in meta:
        return None
    heads = int(meta[p + "attention.head_count"])
    hidden = int(meta[p + "embedding_length"])
    head_dim = int(meta.get(p + "rope.dimension_count", hidden // heads))
    if head_dim != hidden // heads:
        return None
    ids = {k: int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in ("bos", "eos", "padding", "unknown")
           if f"tokenizer.ggml.{k}_token_id" in meta}
    return LlamaConfig(
        vocab_size=int(meta[p + "vocab_size"]), hidden_size=hidden,
        intermediate_size=int(meta[p + "feed_forward_length"]), num_hidden_layers=int(meta[p + "block_count"]), num_attention_heads=heads,
        num_key_value_heads=int(meta.get(p + "attention.head_count_kv", heads)),
        max_position_embeddings=int(meta[p + "context_length"]),
        rms_norm_eps=float(meta[p + "attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)), head_dim=head_dim,
        tie_word_embeddings="output.weight" not in set(tensor_names),
        bos_token_id=ids.get("bos"), eos_token_id=ids.get("eos"), pad_token_id=ids.get("padding"),
        unk_token_id=ids.get("unknown"))
