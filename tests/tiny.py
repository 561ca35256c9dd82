"""Tiny random models for the fast tests: a Llama or Qwen2 decoder of a few layers with random weights and a real
character-level tokenizer (ASCII, ChatML chat template), built in memory in well under a second. The engine runs
them exactly as it runs the embedded model (``Engine(config, source, model=..., tokenizer=...)``); what their
answers mean does not matter, only that the engine's bookkeeping gives the same tokens as the model's own forward.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from flashguard import EngineConfig
from flashguard.engine.engine import Engine
from flashguard.engine.loader import ModelSource
from flashguard.kv.session import forwarding  # noqa: F401 - the tests drive caches with it

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@lru_cache(maxsize=None)
def tokenizer():
    """One token per character of printable ASCII and newline (byte-level, as GPT-2's), ChatML's three specials;
    ``<|im_end|>`` is the end of a turn. Other characters are ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(0x10A), chr(0x120)] + [chr(b) for b in range(33, 127)]   # byte-level "\n", " ", then as is
    vocab = {t: i for i, t in enumerate(SPECIALS + tuple(chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    return fast


def model(arch: str = "llama", seed: int = 0, layers: int = 2, context: int = 2048):
    """A random decoder of ``arch`` (llama: no biases; qwen2: q/k/v biases) with GQA (4 query, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer()), max_position_embeddings=context,
                 eos_token_id=tokenizer().eos_token_id, pad_token_id=tokenizer().pad_token_id, tie_word_embeddings=False)
    cls, cfg = (LlamaForCausalLM, LlamaConfig) if arch == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    torch.manual_seed(seed)
    m = cls(cfg(**shape)).eval()
    with torch.no_grad():   # larger logits than the default init: greedy choices are far from ties
        m.lm_head.weight.mul_(8)
    return m


def engine(folder: Path, arch: str = "llama", net=None, tok=None, **parameters) -> Engine:
    """An Engine on a tiny model (``net``, or a new one of ``arch``), configured as config.yml's ``parameters:``
    would. ``folder`` stands for the model's path (its identity keys the cache's pages)."""
    config = EngineConfig.from_parameters({"device": "cpu", "dtype": "float32", **parameters})
    Path(folder).mkdir(parents=True, exist_ok=True)
    source = ModelSource(folder=str(folder), gguf_file=None, label=f"tiny-{arch}")
    return Engine(config, source, model=net if net is not None else model(arch),
                  tokenizer=tok if tok is not None else tokenizer())


def text(n: int, seed: int = 0) -> str:
    """``n`` characters of plain words (``n`` tokens)."""
    words = ["sea", "wind", "tide", "salt", "harbour", "gull", "rope", "sail", "stone", "light"]
    g = torch.Generator().manual_seed(seed)
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(words[int(torch.randint(len(words), (1,), generator=g))])
    return " ".join(out)[:n]


def qwen2_head64(seed: int = 0):
    """A random Qwen2 with a 64-wide head (the int8 pool's groups of 32 and the flash kernels' sizes), 2 layers,
    4 query / 2 KV heads, 300 tokens: for cache tests that feed random ids, no tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=300, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()

