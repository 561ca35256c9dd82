"""Triton kernels for ``Int4Linear``'s ``triton`` backend: a one-token int4 matrix-vector product and a
dequantization to the activation dtype (for prompts, where a dense matmul on the dequantized weight wins).

Why beside torch's tinygemm: tinygemm is a matrix-vector kernel, 0.39x fp16 on 4,096-token prompt chunks, and it
needs bf16 (compute capability >= 8.0). These kernels share one layout: one token goes through a matrix-vector
kernel about as fast as tinygemm with the bias fused in (a 1.5B layer's seven linears: 36.3 vs 34.9 us inside a
CUDA graph, docs/benchmarks/int4.md), a prompt through a one-kernel dequantization and cuBLAS
(fp16 speed; 5.9x tinygemm at 32K), with fp16 as well as bf16 activations (pre-Ampere GPUs have no bf16).

Layout (``Int4Linear``, nn.Linear orientation): ``packed`` uint8 [N, K/2], byte ``j`` of row ``n`` holding code
``k = 2j`` in its high nibble and ``k = 2j + 1`` in its low one; ``scales`` fp16 [N, K/G]; ``zeros`` uint8
[N, K/G]. ``W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]``.

Contract: ``gemv(x, packed, scales, zeros, group)`` = ``x @ W.T`` for ``x`` [1, K] (fp32 accumulation, result in
``x.dtype``); ``dequantize(packed, scales, zeros, group, dtype)`` = ``W`` [N, K]. Both run under Triton's
interpreter on the CPU (the tests use it). ``available(device)`` checks once, on real data, that they run and agree
with the reference; callers use another backend where they do not.
"""

from __future__ import annotations

import torch

from ..selfcheck import SelfCheck

try:  # module globals, so that Triton's interpreter can patch ``tl`` inside the kernels (the CPU tests)
    import triton
    import triton.language as tl
except ImportError:  # Windows without triton-windows: ``available`` says no, Int4Linear uses torch's kernels
    triton = tl = None

if triton is not None:
    @triton.jit
    def _add(a, b):  # the sum of tl.reduce (a module global: the interpreter runs kernels with the module's names)
        return a + b

_kernels: dict = {}
TILE_BYTES = 8192     # packed bytes a program loads per loop iteration (all its rows)


def _build() -> dict:
    if _kernels:
        return _kernels
    if triton is None:
        raise ImportError("Triton is not installed")

    # Only language builtins below (tl.reduce with our own combine, tl.full): the standard library's jit helpers
    # (tl.sum, tl.zeros) were made when Triton was imported and stay compiled-only under the interpreter.
    @triton.jit
    def gemv_kernel(x_ptr, packed_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, res_ptr, norm_ptr, eps,
                    N, K_HALF, N_GROUPS, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, GATED: tl.constexpr):
        # One program: BLOCK_N output rows; each iteration BLOCK_B packed bytes (2 * BLOCK_B weights) of each row.
        # Per group g: s_g * (sum_j q_j x_j - z_g * sum_j x_j), so scales and zeros are loaded once per group.
        # Folded in (the one-graph decode step, kv/step_kernels.py): HAS_NORM, x is RMSNorm(x) * norm weight
        # (each program sums x^2 itself: K values from L2, cheaper than a launch); GATED, x is silu(x[:K]) *
        # x[K:2K] (the MLP's gate and up halves); HAS_RES, a residual row is added to the output.
        GH: tl.constexpr = GROUP // 2               # bytes per group
        NG: tl.constexpr = BLOCK_B // GH            # groups per iteration
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        acc = tl.full([BLOCK_N, NG], 0.0, tl.float32)
        rstd = 1.0
        if HAS_NORM:
            ss = tl.full([2 * BLOCK_B], 0.0, tl.float32)
            for b0 in range(0, K_HALF, BLOCK_B):
                xk = 2 * b0 + tl.arange(0, 2 * BLOCK_B)
                xv = tl.load(x_ptr + xk, mask=xk < 2 * K_HALF, other=0.0).to(tl.float32)
                ss += xv * xv
            rstd = 1.0 / tl.sqrt(tl.reduce(ss, 0, _add) / (2 * K_HALF) + eps)
        for b0 in range(0, K_HALF, BLOCK_B):
            cols = b0 + tl.arange(0, BLOCK_B)
            col_ok = cols < K_HALF
            byte = tl.load(packed_ptr + rows64[:, None] * K_HALF + cols[None, :],
                           mask=row_ok[:, None] & col_ok[None, :], other=0).to(tl.int32)
            hi = (byte >> 4).to(tl.float32)
            lo = (byte & 15).to(tl.float32)
            xk = 2 * b0 + tl.arange(0, 2 * BLOCK_B)   # x in one contiguous load, then split into even / odd
            xv = tl.load(x_ptr + xk, mask=xk < 2 * K_HALF, other=0.0).to(tl.float32)
            if HAS_NORM:
                xv = (xv * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * \
                    tl.load(norm_ptr + xk, mask=xk < 2 * K_HALF, other=0.0).to(tl.float32)
            if GATED:   # silu(gate) * up, gate = x[k], up = x[K + k]
                up = tl.load(x_ptr + 2 * K_HALF + xk, mask=xk < 2 * K_HALF, other=0.0).to(tl.float32)
                xv = xv / (1.0 + tl.exp(-xv)) * up
            xe, xo = tl.split(tl.reshape(xv, [BLOCK_B, 2]))
            prod = hi * xe[None, :] + lo * xo[None, :]
            qx = tl.reduce(tl.reshape(prod, [BLOCK_N, NG, GH]), 2, _add)                       # [BLOCK_N, NG]
            xs = tl.reduce(tl.reshape(xe + xo, [NG, GH]), 1, _add)                             # [NG]
            groups = b0 // GH + tl.arange(0, NG)
            g_ok = row_ok[:, None] & (groups < N_GROUPS)[None, :]
            at = rows64[:, None] * N_GROUPS + groups[None, :]
            s = tl.load(scales_ptr + at, mask=g_ok, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + at, mask=g_ok, other=0).to(tl.float32)
            acc += s * (qx - z * xs[None, :])
        out = tl.reduce(acc, 1, _add)
        if HAS_BIAS:   # the bias in the same kernel: one launch less per layer than a separate add
            out += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if HAS_RES:
            out += tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def dequant_kernel(packed_ptr, scales_ptr, zeros_ptr, out_ptr, N, K_HALF, N_GROUPS,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        ok = (rows < N)[:, None] & (cols < K_HALF)[None, :]
        rows64 = rows.to(tl.int64)
        byte = tl.load(packed_ptr + rows64[:, None] * K_HALF + cols[None, :], mask=ok, other=0).to(tl.int32)
        at = rows64[:, None] * N_GROUPS + (2 * cols[None, :]) // GROUP
        s = tl.load(scales_ptr + at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + at, mask=ok, other=0).to(tl.float32)
        dst = out_ptr + rows64[:, None] * (2 * K_HALF) + 2 * cols[None, :]
        ty = out_ptr.dtype.element_ty
        tl.store(dst, (((byte >> 4).to(tl.float32) - z) * s).to(ty), mask=ok)
        tl.store(dst + 1, (((byte & 15).to(tl.float32) - z) * s).to(ty), mask=ok)

    _kernels.update(gemv=gemv_kernel, dequant=dequant_kernel)
    return _kernels


def gemv_config(n: int, k_half: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N rows per program, BLOCK_B bytes per row per iteration, warps). From a sweep of 40 launch shapes per
    linear shape (docs/benchmarks/int4.md): few, long iterations (a row's bytes in one or two
    loads, up to 2 KB), ~8 KB per program and iteration, but at least one program per multiprocessor. This rule
    came within 6% of the best shape for the 1.5B's linears, 12% for the 7B's."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    block_b = min(2048, max(256, 1 << (k_half - 1).bit_length()))
    block_n = min(16, TILE_BYTES // block_b)
    while block_n > 1 and n // block_n < sms:
        block_n //= 2
    return block_n, block_b, 4


def gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
         bias: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
         residual: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None,
         gated: bool = False) -> torch.Tensor:
    """``x`` [1, K] (fp16/bf16/fp32) times the int4 weight [N, K] transposed, plus ``bias`` [N] -> [1, N] in
    ``x.dtype``. ``config`` overrides ``gemv_config`` (the sweep that chose it). Folded in, for the decode step:
    ``norm = (weight [K], eps)`` multiplies x by RMSNorm first (rounded to x's dtype before the weight, as
    transformers' Llama / Qwen2 norms do); ``gated``: x is [1, 2K] and the product takes silu(x[:K]) * x[K:];
    ``residual`` [N] (any shape of N values) is added to the result."""
    n, k_half = packed.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_b, warps = config or gemv_config(n, k_half, x.device)
    block_b = max(block_b, group // 2)
    grid = (-(-n // block_n),)
    norm_weight, eps = norm if norm is not None else (out, 0.0)
    _build()["gemv"][grid](x, packed, scales, zeros, out if bias is None else bias, out,
                           out if residual is None else residual, norm_weight, eps, n, k_half, scales.shape[1],
                           GROUP=group, BLOCK_N=block_n, BLOCK_B=block_b, HAS_BIAS=bias is not None,
                           HAS_RES=residual is not None, HAS_NORM=norm is not None, GATED=gated, num_warps=warps)
    return out


def dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in ``dtype``, one kernel (no float32 temporaries)."""
    n, k_half = packed.shape
    out = torch.empty((n, 2 * k_half), dtype=dtype, device=packed.device)
    block_n, block_b = 16, 128
    grid = (-(-n // block_n), -(-k_half // block_b))
    _build()["dequant"][grid](packed, scales, zeros, out, n, k_half, scales.shape[1],
                              GROUP=group, BLOCK_N=block_n, BLOCK_B=block_b)
    return out


def _probe(device: torch.device) -> bool:
    from . import awq_format

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (40, 256), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (40, 4), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(40, 4, generator=gen) / 8 + 0.01).half()
    x = torch.randn(1, 256, generator=gen).half()
    ref = awq_format.dequantize(codes, zeros, scales, 64)
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(device)
    s, z = scales.to(device), zeros.to(device)
    w = dequantize(packed, s, z, 64, torch.float32).cpu()
    y = gemv(x.to(device), packed, s, z, 64).float().cpu()
    return torch.equal(w, ref) and bool(torch.allclose(y, x.float() @ ref.t(), rtol=2e-3, atol=2e-2))


# available(device): True when both kernels run on ``device`` and match the reference dequantization (checked once)
available = SelfCheck("the Triton int4 kernels", _probe, "using torch's int4 kernels")
