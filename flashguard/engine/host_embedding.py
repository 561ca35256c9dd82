"""The embedding table in host RAM: a GPU needs only the rows of the tokens it runs.

A DeepSeek-R1-Distill-Qwen-1.5B's table is 151,936 x 1,536 in 16-bit: 445 MiB, a quarter of the int4 model's GPU
memory, of which a decode step reads one row (3 KiB). With int4 weights on CUDA the engine moves an untied table
to pinned host RAM (``install``). Where zero-copy reads work (``kv/uva.py``: Triton, UVA) a lookup of device ids is
a GPU kernel reading the rows straight from the pinned table: no wait for the GPU and no copy call, so it is part
of a decode step's CUDA graph like any other kernel. Elsewhere (and for host ids) the rows are gathered on the host
and copied over. The freed GPU memory goes to the KV pool. A table tied to a 16-bit lm_head stays where it is
(lm_head reads all of it every step); one whose lm_head holds its own codes moves (with ``lm_head: int4`` the table
and the head's rows are one pinned copy).

Contract: ``HostEmbedding(embedding, device, table=None)`` replaces an ``nn.Embedding`` (same ``forward(input_ids)`` result,
on ``device``, in the table's dtype); ``rows(token_ids)`` gives the rows for host-side ids (what ``DecodeStep``
copies into its graph's input before a replay). It holds no parameters or buffers (``model.device`` and
``state_dict`` stay those of the GPU modules); ``weight`` is the host table (``kv.uva.PinnedRows``; ``table``: one
already pinned, an ``lm_head: int4`` head's rows of the same tied matrix). ``zero_copy``: device ids are looked
up on the GPU (a graph may record ``forward``); otherwise a lookup of device ids waits for the GPU.
"""

from __future__ import annotations

import torch

from ..kv import uva


class HostEmbedding(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Embedding, device: torch.device, table: uva.PinnedRows | None = None):
        super().__init__()
        self._rows = table if table is not None else uva.PinnedRows(embedding.weight, device)
        self.num_embeddings, self.embedding_dim = self._rows.table.shape
        self.padding_idx = embedding.padding_idx
        self.target = device
        self._scale = getattr(embedding, "embed_scale", None)   # Gemma-style scaled embeddings
        self.zero_copy = self._rows.reads_itself

    @property
    def weight(self) -> torch.Tensor:
        return self._rows.table

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``token_ids`` (any device, any shape) on the target device, shape ``ids.shape + [hidden]``."""
        return self._scaled(self._rows.rows(token_ids).view(*token_ids.shape, self.embedding_dim))

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        if self._scale is not None:
            rows = rows * self._scale.to(rows.dtype) if torch.is_tensor(self._scale) else rows * self._scale
        return rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids)


def install(model, device: torch.device) -> int:
    """Move ``model``'s input embedding table to host RAM when it is not tied to lm_head; returns the GPU bytes
    freed (0 when it stays)."""
    from ..quant.lm_head import RescoredHead

    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()   # an Int4Linear lm_head (a GGUF's own codes) has no float weight
    if not isinstance(emb, torch.nn.Embedding) or getattr(out, "weight", None) is emb.weight:
        return 0
    freed = emb.weight.numel() * emb.weight.element_size()
    shared = out.rows_of(emb.weight) if isinstance(out, RescoredHead) else None   # a tied table: one pinned copy
    model.set_input_embeddings(HostEmbedding(emb, device, shared))
    del emb
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return freed
