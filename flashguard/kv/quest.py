"""Which off-window pages a query attends (the ``sparse`` policy): Quest's page bound and a fixed-size selection.

Why: past L1 a decode step of the ``sparse`` policy reads only the pages whose keys can matter. Quest (Tang et al.,
2024) bounds a page's attention score from the per-channel maxima and minima of its keys: for query ``q`` the bound
is ``sum_d max(q_d max_d, q_d min_d)``, one matmul of ``[max(q, 0), min(q, 0)]`` against ``[max; min]``. The
selection has a fixed size (``kv_heads * budget`` pages), so a GPU can pick and read without the host: each KV
head's top ``budget`` pages come first (the union), topped up with the pages of highest bound over all heads.

Both the layer-by-layer sparse path (``TieredLayer._pick``, ``kv/cache.py``) and the one-graph sparse step
(``SparseKV.attend``, ``kv/sparse_step.py``) select with these two functions; ``step_kernels.page_bounds`` is the
Triton form of ``bound`` (one launch, pages outside a range masked), used inside the one-graph step.

Contract:
- ``bound(q [kvh, rows, D], bounds [kvh, 2D, cols]) -> [kvh, cols]`` fp32: each KV head's highest bound over its
  rows (a KV head's query heads, and for a short chunk every query of it).
- ``select(bound [kvh, cols], budget, extra=0) -> [kvh * budget + extra]``: page indices (columns of ``bound``),
  the selection first, then ``extra`` pages ranked just after it. Masked columns (-inf) are picked last; each
  head needs ``budget`` unmasked columns (the callers select only when there are more than ``kvh * budget``).
"""

from __future__ import annotations

import torch


def bound(q: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return torch.bmm(torch.cat([q.clamp(min=0), q.clamp(max=0)], dim=-1), bounds).amax(dim=1).float()


def select(bound: torch.Tensor, budget: int, extra: int = 0) -> torch.Tensor:
    top = bound.topk(budget, dim=-1).indices                                   # [kvh, budget]
    score = bound.amax(dim=0).scatter(0, top.flatten(), float("inf"))         # the heads' own picks first
    return score.topk(bound.shape[0] * budget + extra).indices
