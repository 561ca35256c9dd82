"""A model's shape, as the planner reads it: ``Shape`` (layers, heads, widths, vocabulary, how the lm_head is held,
the model's own context) from a transformers config, and ``resolve_shape(model)`` from a name, a folder or a GGUF
header, never from the network (a ModelLoadError lists the known names).

Why ``resolve_shape`` imports the engine (inside the function, for ``embedded``, a .gguf file or its folder only):
reading a model's header is the loader's (``engine/loader.py``: where the embedded model is, its GGUF metadata
folder; ``engine/gguf_header.py``), and ``flashguard plan`` plans a model by name without loading it. The engine
never reaches ``resolve_shape``: its plan (``engine/budget.py``) takes a ``Shape`` made from the loaded model's
config, so the plan calls into vram/ and vram/ does not call back.
"""

from __future__ import annotations

from dataclasses import dataclass


def deepseek_1_5b_config(vocab: int = 151936):
    """The transformers config of DeepSeek-R1-Distill-Qwen-1.5B (Qwen2: 28 layers, 12 heads, 2 KV heads, head_dim
    128), for random-weight speed and memory runs and for planning."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, head_dim=128, vocab_size=vocab, max_position_embeddings=131072 + 4096,
                       rope_theta=10000.0, tie_word_embeddings=False)


def deepseek_7b_config(vocab: int = 152064):
    """The transformers config of DeepSeek-R1-Distill-Qwen-7B (Qwen2: 28 layers, hidden 3584, 28 heads, 4 KV heads,
    head_dim 128, intermediate 18944, untied lm_head), for planning and random-weight runs."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, vocab_size=vocab, max_position_embeddings=131072,
                       rope_theta=10000.0, tie_word_embeddings=False)


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    lm_head: str = "float"   # how the output matrix is held: "float", "int8" (Q8_0 codes) or "int4" (int4 codes)
    context: int = 0         # the model's own context length (max_position_embeddings), 0 where unknown

    @classmethod
    def from_config(cls, config, name: str = "") -> "Shape":
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(name or getattr(c, "_name_or_path", "") or c.model_type, c.hidden_size, c.num_hidden_layers,
                   c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads, head_dim,
                   c.intermediate_size, c.vocab_size, bool(getattr(c, "tie_word_embeddings", False)),
                   c.model_type == "qwen2", context=int(getattr(c, "max_position_embeddings", 0) or 0))


NAMED_SHAPES = ("deepseek-r1-distill-qwen-1.5b", "deepseek-r1-distill-qwen-7b", "embedded")


def resolve_shape(model: str) -> Shape:
    """A named shape (``NAMED_SHAPES``, any case), an HF folder, a .gguf file (header only), or ``embedded``; never
    a network request: anything else is a ModelLoadError listing the names."""
    import os

    from ..errors import ModelLoadError

    name = model.lower()
    if name == "deepseek-r1-distill-qwen-1.5b":
        return Shape.from_config(deepseek_1_5b_config(), name)
    if name == "deepseek-r1-distill-qwen-7b":
        return Shape.from_config(deepseek_7b_config(), name)
    if name == "embedded":   # the config and tokenizer of the GGUF's header: no weights converted
        from transformers import AutoConfig

        from ..engine import loader

        folder = loader.gguf_meta_folder(loader.resolve_model(None))
        return Shape.from_config(AutoConfig.from_pretrained(folder), "SmolLM2-135M-Instruct")
    if os.path.isfile(model):  # a GGUF file: its header holds the shape
        from ..engine import gguf_header, loader

        try:
            return Shape.from_config(gguf_header.config_from_header(gguf_header.read_header(model)),
                                     os.path.basename(model))
        except ValueError:   # not qwen2: transformers reads the header (config and tokenizer only, cached)
            from transformers import AutoConfig

            source = loader.resolve_model(model)
            return Shape.from_config(AutoConfig.from_pretrained(loader.gguf_meta_folder(source)), source.label)
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ModelLoadError(f"unknown model {model!r}: the known names are {', '.join(NAMED_SHAPES)}; an HF model "
                             "folder (with its config.json) or a .gguf file path works too")
    from transformers import AutoConfig

    return Shape.from_config(AutoConfig.from_pretrained(model, local_files_only=True),
                             os.path.basename(model.rstrip("/\\")))
