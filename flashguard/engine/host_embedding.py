"""The embedding table in host RAM: a GPU needs only the rows of the tokens it runs.

A DeepSeek-R1-Distill-Qwen-1.5B's table is 151,936 x 1,536 in 16-bit: 445 MiB, a quarter of the int4 model's GPU
memory, of which a decode step reads one row (3 KiB). With int4 weights on CUDA the engine moves an untied table
to pinned host RAM (``install``). Where zero-copy reads work (``kv/uva.py``: Triton, UVA) a lookup of device ids is
a GPU kernel reading the rows straight from the pinned table: no wait for the GPU and no copy call, so it is part
of a decode step's CUDA graph like any other kernel. Elsewhere (and for host ids) the rows are gathered on the host
and copied over. The freed GPU memory goes to the KV pool. A table tied to lm_head stays
where it is (lm_head reads all of it every step); one whose lm_head holds its own int4 codes moves.

Contract: ``HostEmbedding(embedding, device)`` replaces an ``nn.Embedding`` (same ``forward(input_ids)`` result,
on ``device``, in the table's dtype); ``rows(token_ids)`` gives the rows for host-side ids (what ``DecodeStep``
copies into its graph's input before a replay). It holds no parameters or buffers (``model.device`` and
``state_dict`` stay those of the GPU modules); ``weight`` is the host table. ``zero_copy``: device ids are looked
up on the GPU (a graph may record ``forward``); otherwise a lookup of device ids waits for the GPU.
"""

from __future__ import annotations

import torch

from ..kv import uva


class HostEmbedding(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Embedding, device: torch.device):
        super().__init__()
        table = embedding.weight.detach().to("cpu")
        self._table = table.pin_memory() if device.type == "cuda" else table
        self.num_embeddings, self.embedding_dim = table.shape
        self.padding_idx = embedding.padding_idx
        self.target = device
        self._scale = getattr(embedding, "embed_scale", None)   # Gemma-style scaled embeddings
        row_bytes = self.embedding_dim * table.element_size()
        self.zero_copy = device.type == "cuda" and row_bytes % 4 == 0 and uva.available(device)
        self._bytes = self._table.view(torch.uint8).view(self.num_embeddings, row_bytes) if self.zero_copy else None

    @property
    def weight(self) -> torch.Tensor:
        return self._table

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``token_ids`` (any device, any shape) on the target device, shape ``ids.shape + [hidden]``."""
        if self.zero_copy and token_ids.device.type == "cuda":   # the GPU reads the pinned rows itself
            rows = uva.gather_rows(self._bytes, token_ids.reshape(-1), self.target)
            rows = rows.view(self._table.dtype).view(*token_ids.shape, self.embedding_dim)
            return self._scaled(rows)
        ids = token_ids.to("cpu")
        rows = self._table.index_select(0, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
        if self.target.type == "cuda":
            rows = rows.pin_memory().to(self.target, non_blocking=True)
        else:
            rows = rows.to(self.target)
        return self._scaled(rows)

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        if self._scale is not None:
            rows = rows * self._scale.to(rows.dtype) if torch.is_tensor(self._scale) else rows * self._scale
        return rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids)


def install(model, device: torch.device) -> int:
    """Move ``model``'s input embedding table to host RAM when it is not tied to lm_head; returns the GPU bytes
    freed (0 when it stays)."""
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()   # an Int4Linear lm_head (a GGUF's own codes) has no float weight
    if not isinstance(emb, torch.nn.Embedding) or getattr(out, "weight", None) is emb.weight:
        return 0
    freed = emb.weight.numel() * emb.weight.element_size()
    model.set_input_embeddings(HostEmbedding(emb, device))
    del emb
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return freed
