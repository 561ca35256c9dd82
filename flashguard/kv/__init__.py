"""The tiered, paged KV cache: pages, codecs, tiers, PageStore, TieredCache, attention over tiers."""

import torch

# what a CUDA allocation past the allocator's cap raises (torch < 2.5: torch.cuda's)
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

# Tokens of off-window pages decoded and attended at once: on a GPU one fused kernel call (no score matrix), on
# the CPU's einsum path the block's scores are materialised, so they stay small. The memory planner budgets the
# GPU value (vram/plan.py).
FETCH_BLOCK_TOKENS = 32768
FETCH_BLOCK_TOKENS_CPU = 4096

# Queries per score matrix of the masked attention path (kv/attention.py): bounds prefill memory to
# heads x Q_TILE x segment whatever the chunk; the planner budgets one tile.
Q_TILE = 512
