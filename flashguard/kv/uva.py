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

import logging

import torch

log = logging.getLogger("flashguard")

_kernel = None
_checked: dict = {}   # device index -> bool
last_error = ""       # why zero-copy is unavailable, when it is
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


def available(device: torch.device) -> bool:
    """True when zero-copy reads work on ``device`` (checked once against a host gather)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _checked:
        try:
            host = torch.arange(64 * 256, dtype=torch.int32).view(torch.uint8).view(64, 1024).pin_memory()
            rows = torch.tensor([5, 63, 0, 5], device=device)
            with torch.cuda.device(index):
                got = gather_rows(host, rows, torch.device("cuda", index)).cpu()
            _checked[index] = bool(torch.equal(got, host[rows.cpu()]))
            if not _checked[index]:
                log.warning("flashguard: zero-copy page reads returned wrong bytes; using host gathers")
        except Exception as exc:  # no Triton, no UVA, an old GPU: the host gather works everywhere
            global last_error
            last_error = f"{type(exc).__name__}: {exc}"
            log.info("flashguard: zero-copy page reads unavailable (%s); using host gathers", last_error)
            _checked[index] = False
    return _checked[index]
