"""Zero-copy page reads: a GPU kernel reads L2 rows straight from pinned host RAM.

Pinned host memory is mapped into the GPU's address space (CUDA unified virtual addressing: the device address
of a ``cudaHostAlloc`` block is its host address), so a kernel can load it over PCIe without a host-side gather
or a copy call. ``gather_rows`` takes the row indices as a *device* tensor, which lets sparse decoding pick its
pages on the GPU and never wait for the host (no device-to-host sync per layer).

The kernel is Triton's (``triton`` ships with PyTorch's CUDA wheels on Linux; on Windows it is the optional
``triton-windows``). ``available(device)`` checks once, on real data, that the kernel runs and reads the right
bytes; where it does not (no Triton, no UVA), callers use the host gather (``L2Arena.gather``).
"""

from __future__ import annotations

import torch

from ..selfcheck import SelfCheck

_kernel = None
BLOCK = 1024          # 32-bit words per program


def _build():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows_kernel(src, idx_ptr, out_ptr, row_words, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1)
        row = tl.load(idx_ptr + r).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        x = tl.load(src + row * row_words + offs, mask=mask)
        tl.store(out_ptr + r.to(tl.int64) * row_words + offs, x, mask=mask)

    _kernel = gather_rows_kernel
    return _kernel


def gather_rows(host: torch.Tensor, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host[rows]`` for a pinned, contiguous host tensor ``[n, row_bytes]`` (uint8, row_bytes % 4 == 0) and a
    device index tensor ``rows``; the result is a new device tensor ``[len(rows), row_bytes]``."""
    n, row_bytes = host.shape
    out = torch.empty((rows.shape[0], row_bytes), dtype=torch.uint8, device=device)
    if rows.shape[0]:
        words = row_bytes // 4
        grid = (rows.shape[0], -(-words // BLOCK))
        # a pinned host tensor is a valid pointer argument: Triton's launcher asks CUDA for its device address
        _build()[grid](host.view(torch.int32), rows, out.view(torch.int32), words, BLOCK=BLOCK)
    return out


def _probe(device: torch.device) -> bool:
    host = torch.arange(64 * 256, dtype=torch.int32).view(torch.uint8).view(64, 1024).pin_memory()
    rows = torch.tensor([5, 63, 0, 5], device=device)
    return torch.equal(gather_rows(host, rows, device).cpu(), host[rows.cpu()])


# available(device): True when zero-copy reads work on ``device`` (checked once against a host gather)
available = SelfCheck("zero-copy page reads", _probe, "using host gathers")


class PinnedRows:
    """A table ``[n, d]`` in host RAM whose rows a device asks for by index (an embedding table, an lm_head's rows).

    ``PinnedRows(table, device)``: on CUDA the table is copied to pinned host RAM, and where zero-copy reads work
    (``reads_itself``: ``available`` and rows of a multiple of 4 bytes) the GPU reads the rows it needs itself, a
    kernel a CUDA graph can record; elsewhere rows are gathered on the host and copied over. Off CUDA the table
    is used as it is (a CPU tensor is shared, not copied). ``rows(ids)`` -> ``table[ids]`` on ``device``, shape
    ``[len(ids), d]``, for ids on any device; ``table`` is the host tensor."""

    def __init__(self, table: torch.Tensor, device: torch.device):
        host = table.detach().to("cpu")
        self.table = host.pin_memory() if device.type == "cuda" else host
        self.target = device
        self.reads_itself = self.zero_copy_on(device, host.shape[1] * host.element_size())
        self._bytes = self.table.view(torch.uint8).view(host.shape[0], -1) if self.reads_itself else None

    @staticmethod
    def zero_copy_on(device: torch.device, row_bytes: int) -> bool:
        """Whether a GPU reads rows of ``row_bytes`` from pinned host RAM itself on ``device``."""
        return device.type == "cuda" and row_bytes % 4 == 0 and available(device)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1)
        if self.reads_itself and ids.device.type == "cuda":
            return gather_rows(self._bytes, ids, self.target).view(self.table.dtype).view(len(ids), -1)
        got = self.table.index_select(0, ids.to("cpu"))
        if self.target.type == "cuda":
            return got.pin_memory().to(self.target, non_blocking=True)
        return got.to(self.target)
