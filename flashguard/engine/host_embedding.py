"""The embedding table in host RAM: a GPU needs only the rows of the tokens it runs.

A DeepSeek-R1-Distill-Qwen-1.5B's table is 151,936 x 1,536 in 16-bit: 445 MiB, a quarter of the int4 model's GPU
memory, of which a decode step reads one row (3 KiB). With int4 weights on CUDA the engine moves an untied table
to pinned host RAM (``install``); a lookup gathers the rows on the host and copies them to the GPU (one small
copy per forward, from pinned memory). The freed GPU memory goes to the KV pool. A table tied to lm_head stays
where it is (lm_head reads all of it every step); one whose lm_head holds its own int4 codes moves.

Contract: ``HostEmbedding(embedding, device)`` replaces an ``nn.Embedding`` (same ``forward(input_ids)`` result,
on ``device``, in the table's dtype); ``rows(token_ids)`` gives the rows for host-side ids (what ``DecodeStep``
copies into its graph's input before a replay). It holds no parameters or buffers (``model.device`` and
``state_dict`` stay those of the GPU modules); ``weight`` is the host table.
"""

from __future__ import annotations

import torch


class HostEmbedding(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Embedding, device: torch.device):
        super().__init__()
        table = embedding.weight.detach().to("cpu")
        self._table = table.pin_memory() if device.type == "cuda" else table
        self.num_embeddings, self.embedding_dim = table.shape
        self.padding_idx = embedding.padding_idx
        self.target = device
        self._scale = getattr(embedding, "embed_scale", None)   # Gemma-style scaled embeddings

    @property
    def weight(self) -> torch.Tensor:
        return self._table

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``token_ids`` (any device, any shape) on the target device, shape ``ids.shape + [hidden]``."""
        ids = token_ids.to("cpu")
        rows = self._table.index_select(0, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)
        if self.target.type == "cuda":
            rows = rows.pin_memory().to(self.target, non_blocking=True)
        else:
            rows = rows.to(self.target)
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
