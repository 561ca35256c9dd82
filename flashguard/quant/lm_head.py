"""The ``lm_head`` key: the output matrix in 16 bits or as 8-bit codes (Q8_0, groups of 32), chosen once at start.

Every decoded token reads the whole output matrix: for DeepSeek-R1-Distill-Qwen-1.5B in int4 it is 0.47 GB of the
~1.4 GB a token reads at 8K, the largest single tensor. Held as llama.cpp's Q8_0 (an int8 code a weight, one fp16
scale per 32) and computed by the int4 kernels as two 4-bit halves over ``[x, x]`` (``gguf_int4.Int4PairLinear``,
the form a GGUF's own Q8_0 matrices already load in), it reads 1.25 bytes a weight: 0.29 GB. Fewer bytes are not
always less time: on an H200 cuBLAS reads the 16-bit head faster than the int4 kernel reads the codes (decode
1.2x faster with the 16-bit head at 8K, docs/benchmarks/lm_head.md), while a laptop GPU is bound by its bytes. So
``auto`` measures. A coarser head (int8 per row, or groups of 64) changes more greedy tokens on the real SmolLM2.

Contract:
- ``planned(lm_head, weights_kind) -> kind`` what the key may make of a float head, before a model is loaded
  (``flashguard plan`` plans the fewer bytes: ``auto`` with int4 weights is ``int8``).
- ``apply(lm_head, model, weights_kind, device, int4_kernel, budget_wins) -> (kind, why)`` resolves the key on the
  loaded model and leaves the head held that way. A head the file already holds in 4 or 8 bits keeps its codes
  (``int4`` / ``int8``) whatever the key says, since a 16-bit copy would only be its dequantization. ``float`` /
  ``int8`` are the user's call. ``auto`` keeps a float decoder's head in 16 bits; with an int4 decoder it holds the
  head as Q8_0 when ``budget_wins`` (the 16-bit head would push decoder layers off the GPU, the caller's planner
  says) or when one token's head runs faster so on ``device`` (timed at start, a few ms), else keeps 16 bits.
- ``quantize(model, device, int4_kernel)`` replaces a float ``lm_head`` by its Q8_0 codes on ``device``; a head
  tied to the input embeddings is untied (the table stays as it was, for the embedding lookup). The 16-bit head is
  freed. Logits equal those of gguf-py's Q8_0 round trip of the head, up to the int4 kernel's rounding.
- ``kind_of(module) -> "float" | "int4" | "int8"``: how a loaded head is held (the planner's ``Shape.lm_head``).
"""

from __future__ import annotations

import torch

from . import gguf_int4
from .int4_linear import Int4Linear


def kind_of(module) -> str:
    if isinstance(module, gguf_int4.Int4PairLinear):
        return "int8"
    return "int4" if isinstance(module, Int4Linear) else "float"


def planned(lm_head: str, weights_kind: str) -> str:
    """The kind ``lm_head`` gives a float head under ``weights_kind`` (``flashguard plan``, before loading)."""
    if lm_head == "auto":
        return "int8" if weights_kind == "int4" else "float"
    return lm_head


def apply(lm_head: str, model, weights_kind: str, device: torch.device, int4_kernel: str = "auto",
          budget_wins: bool = False) -> tuple[str, str]:
    held = kind_of(model.get_output_embeddings())
    if held != "float":
        return held, f"the file's own {'Q4' if held == 'int4' else 'Q8_0'} codes"
    kind = planned(lm_head, weights_kind)
    if lm_head != "auto":
        if kind == "int8":
            quantize(model, device, int4_kernel)
        return kind, f"lm_head: {lm_head}"
    if kind == "float":
        return kind, "auto: a float decoder, so 16-bit; lm_head: int8 reads 0.6x the bytes"
    layer = _q8_0_layer(model.get_output_embeddings(), device, int4_kernel)
    if budget_wins or model.get_output_embeddings().weight.device.type != device.type:   # (streamed layers)
        _install(model, layer, device)
        return "int8", "auto: Q8_0 codes, so that more decoder layers stay on the GPU"
    t16, t8 = _time_one_token(model.get_output_embeddings(), layer, device)
    timed = f"one token's head {t8 * 1e3:.3f} ms as Q8_0, {t16 * 1e3:.3f} ms in 16 bits here"
    if t8 < 0.97 * t16:
        _install(model, layer, device)
        return "int8", f"auto: Q8_0 codes ({timed})"
    del layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return "float", f"auto: 16-bit ({timed}); lm_head: int8 reads 0.6x the bytes"


def _time_one_token(head, layer, device: torch.device, reps: int = 30) -> tuple[float, float]:
    """Median seconds of one token through each head (warmed up first)."""
    import statistics
    import time

    x = torch.randn(1, 1, layer.in_features, dtype=head.weight.dtype, device=device)
    out = []
    for module in (head, layer):
        times = []
        with torch.inference_mode():
            for i in range(reps + 3):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                module(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out[0], out[1]


def quantize(model, device: torch.device, int4_kernel: str = "auto") -> None:
    _install(model, _q8_0_layer(model.get_output_embeddings(), device, int4_kernel), device)


def _q8_0_layer(head, device: torch.device, int4_kernel: str) -> "gguf_int4.Int4PairLinear":
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"lm_head: int8 quantizes a float nn.Linear output matrix; this model's is "
                         f"{type(head).__name__}")
    codes, zeros, scales = gguf_int4.q8_0_quantize(head.weight.detach())
    bias = head.bias.detach() if head.bias is not None else None
    return gguf_int4.Int4PairLinear(
        Int4Linear.from_codes(codes, zeros, scales, gguf_int4.GROUP_SIZE, bias, device, int4_kernel))


def _install(model, layer, device: torch.device) -> None:
    model.set_output_embeddings(layer)
    if hasattr(model.config, "tie_word_embeddings"):   # save_pretrained / resize must not re-tie a quantized head
        model.config.tie_word_embeddings = False
    if device.type == "cuda":   # the 16-bit head's memory back to the allocator
        torch.cuda.empty_cache()
