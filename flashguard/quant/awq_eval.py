"""Held-out perplexity of a float model and its int4 checkpoint, loaded the way flashguard runs them.

``compare(float_folder, int4_folder)`` returns a small table: perplexity on the last 30% of Python's pydoc topics
(the calibration uses the first 70%), and weight bytes.
"""

from __future__ import annotations

import torch


def compare(float_folder: str, int4_folder: str, blocks: int = 16, seqlen: int = 512) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from . import awq_search
    from .awq_load import int4_weight_bytes, load_awq

    tokenizer = AutoTokenizer.from_pretrained(float_folder)
    ids = awq_search.token_blocks(tokenizer, awq_search.heldout_text(), blocks, seqlen)
    ref = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    ppl_float = awq_search.perplexity(ref, ids)
    float_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    del ref
    q = load_awq(int4_folder, AutoConfig.from_pretrained(int4_folder), torch.device("cpu"), torch.float32)
    ppl_int4 = awq_search.perplexity(q, ids)
    sizes = int4_weight_bytes(q)
    return (f"held-out perplexity ({ids.numel()} tokens): float {ppl_float:.3f}, int4 {ppl_int4:.3f} "
            f"(x{ppl_int4 / ppl_float:.3f}); weights float32 {float_bytes / 2**20:.1f} MiB, int4 model "
            f"{sizes['total'] / 2**20:.1f} MiB ({sizes['int4_layers'] / 2**20:.1f} MiB in int4 layers)")
