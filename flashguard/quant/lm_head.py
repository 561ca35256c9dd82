"""The ``lm_head`` key: the output matrix in 16 bits or as 8-bit codes (Q8_0, groups of 32), chosen once at start.

Every decoded token reads the whole output matrix: for DeepSeek-R1-Distill-Qwen-1.5B in int4 it is 0.47 GB of the
~1.2 GB a token reads at 16 bits, the largest single tensor. Held as llama.cpp's Q8_0 (an int8 code a weight, one
fp16 scale per 32) and computed by the int4 kernels as two 4-bit halves over ``[x, x]`` (``gguf_int4.Int4PairLinear``,
the form a GGUF's own Q8_0 matrices already load in), it reads 1.25 bytes a weight: 0.29 GB. A coarser head (int8
per row, or groups of 64) changes greedy tokens on the real SmolLM2; groups of 32 do not (docs/benchmarks/lm_head.md).

Contract:
- ``planned(lm_head, weights_kind) -> kind`` what the key makes of a float head, before a model is loaded.
- ``choose(lm_head, model, weights_kind) -> (kind, why)``: the key resolved. ``auto`` (the default) is ``int8`` where
  the decoder's linears are int4 (a model already traded 16-bit weights for bytes: the head follows), else
  ``float``; a head the file already holds in 4 or 8 bits keeps its codes (``int4`` / ``int8``) whatever the key
  says, since a 16-bit copy would only be its dequantization. ``float`` / ``int8`` are the user's call.
- ``quantize(model, device, int4_kernel)`` replaces a float ``lm_head`` by its Q8_0 codes on ``device``; a head
  tied to the input embeddings is untied (the table stays as it was, for the embedding lookup). The 16-bit head is
  freed. Logits equal those of gguf-py's Q8_0 round trip of the head, up to the int4 kernel's rounding.
- ``kind_of(module) -> "float" | "int4" | "int8"``: how a loaded head is held (the planner's ``Shape.lm_head``).
"""

from __future__ import annotations

import torch

from . import gguf_int4
from .int4_linear import Int4Linear

KINDS = ("auto", "float", "int8")


def kind_of(module) -> str:
    if isinstance(module, gguf_int4.Int4PairLinear):
        return "int8"
    return "int4" if isinstance(module, Int4Linear) else "float"


def planned(lm_head: str, weights_kind: str) -> str:
    """The kind ``lm_head`` gives a float head under ``weights_kind`` (``flashguard plan``, before loading)."""
    if lm_head == "auto":
        return "int8" if weights_kind == "int4" else "float"
    return lm_head


def choose(lm_head: str, model, weights_kind: str) -> tuple[str, str]:
    held = kind_of(model.get_output_embeddings())
    if held != "float":
        return held, f"the file's own {'Q4' if held == 'int4' else 'Q8_0'} codes"
    kind = planned(lm_head, weights_kind)
    if lm_head != "auto":
        return kind, f"lm_head: {lm_head}"
    if kind == "int8":
        return kind, "auto: an int4 decoder, so Q8_0 codes (0.6x the bytes a token reads of a 16-bit head)"
    return kind, "auto: a float decoder, so 16-bit; lm_head: int8 reads 0.6x the bytes"


def quantize(model, device: torch.device, int4_kernel: str = "auto") -> None:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"lm_head: int8 quantizes a float nn.Linear output matrix; this model's is "
                         f"{type(head).__name__}")
    weight = head.weight.detach()
    codes, zeros, scales = gguf_int4.q8_0_quantize(weight)
    bias = head.bias.detach() if head.bias is not None else None
    layer = Int4Linear.from_codes(codes, zeros, scales, gguf_int4.GROUP_SIZE, bias, device, int4_kernel)
    del codes, zeros, scales, weight
    model.set_output_embeddings(gguf_int4.Int4PairLinear(layer))
    if hasattr(model.config, "tie_word_embeddings"):   # save_pretrained / resize must not re-tie a quantized head
        model.config.tie_word_embeddings = False
    del head
    if device.type == "cuda":
        torch.cuda.empty_cache()
