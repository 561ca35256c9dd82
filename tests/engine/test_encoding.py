"""engine/encoding.py: a chat's ids with only the new tail tokenized equal the ids of tokenizing the whole text, on
the real tokenizers (DeepSeek-R1-Distill's from its GGUF header, the embedded SmolLM2's, the tiny test one), over
conversations grown turn by turn with the rails' branches (a question after the message, a suffix after a reply)."""

from __future__ import annotations

import random
from functools import lru_cache

import pytest

from flashguard.engine.encoding import ChatEncoder

from tests import tiny
from tests.conftest import deepseek_tokenizer

TEXTS = ["Hello there!", "What is the capital of France?", "  spaces  and\ttabs\n\nand blank lines\n",
         "def f(x):\n    return x * 2  # code\n", "ünïcödé, 日本語, emoji 😀🚀, and <b>markup</b>",
         "Is your last reply safe, kind and free of secrets? Answer Yes or No.", "<think>a thought</think>The answer.",
         "a" * 300, "Numbers 12345 67890 3.14159 and -42.", "<|im_start|> looks like a tag <｜User｜> too"]


def deepseek():
    return deepseek_tokenizer()   # from the real GGUF header, built once per test process (tests/conftest.py)


@lru_cache(maxsize=None)
def smollm2():
    from transformers import AutoTokenizer

    from flashguard.engine import loader

    src = loader.resolve_model(None, None)
    return AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)


TOKENIZERS = {"deepseek": deepseek, "smollm2": smollm2, "tiny": tiny.tokenizer}


def _whole(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "deepseek" else n for n in TOKENIZERS])
def test_ids_equal_whole_tokenizing_over_a_growing_conversation(name):   # (deepseek: a 152K tokenizer, slow)
    tok = TOKENIZERS[name]()
    enc = ChatEncoder(tok)
    rng = random.Random(0)
    messages: list[dict] = []
    for turn in range(12):
        messages.append({"role": "user", "content": rng.choice(TEXTS) + " " + rng.choice(TEXTS)})
        branch = messages + [{"role": "user", "content": TEXTS[5]}]   # the input rail's question branch
        for msgs in (messages, branch):
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            assert enc.encode(text) == _whole(tok, msgs), (name, turn)
        messages.append({"role": "assistant", "content": rng.choice(TEXTS)})
    assert enc._works, "the encoder fell back to whole tokenizing"


def test_only_the_new_tail_is_tokenized():
    tok = deepseek()
    enc = ChatEncoder(tok)
    seen = []
    plain = tok.__class__.__call__

    class Counting(tok.__class__):
        def __call__(self, text, *args, **kwargs):
            seen.append(len(text))
            return plain(self, text, *args, **kwargs)

    messages = [{"role": "user", "content": "word " * 5000}]
    first = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc.encode(first)
    branch = messages + [{"role": "user", "content": TEXTS[5]}]   # the question where the answer's header was
    nxt = messages + [{"role": "assistant", "content": "A reply."}, {"role": "user", "content": "And then?"}]
    for msgs in (branch, nxt):
        seen.clear()
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        tok.__class__ = Counting
        try:
            got = enc.encode(text)
        finally:
            tok.__class__ = Counting.__mro__[1]
        assert seen and max(seen) < 120 < len(text), seen
        assert got == _whole(tok, msgs)
