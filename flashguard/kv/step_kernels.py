"""Triton kernels of the one-graph decode step: what a layer of ``DecodeStep`` launches when the whole step is one
CUDA graph over the pool (``StaticKV``) or off it (``SparseKV``).

Why: such a step is bound by its number of kernels, not by bytes. The DeepSeek-R1-Distill-Qwen-1.5B shape reads
~0.8 GB a step (int4 layers + 16-bit lm_head), 0.2-0.3 ms of a datacenter GPU's bandwidth, but its ~23 kernels a layer
(norm, three projections, rotary in four, two pool writes, attention, a copy, the MLP in five, two residual adds)
cost 3.3-3.7 ms inside the graph (docs/benchmarks/e2e.md: 256 tok/s at 8K against llama.cpp's 384). With these
kernels a layer of an int4 model on the Triton backend is seven launches:

- ``Int4Linear.gemv`` (``quant/int4_triton.py``) with the RMSNorm before it, the residual add after it, or the
  MLP's ``silu(gate) * up`` on its input folded in: qkv (norm in), o_proj (+ residual), gate_up (norm in), down
  (gated input, + residual);
- ``rope_write``: rotary embedding of q and k, and the new token's k and v written into the pool at a position
  held in a device tensor (int8 pools: quantized on the way, as ``int8_pool.quantize``), in one launch;
- ``decode_attention``: split-K attention of one token over the first ``used`` keys (``used`` a device tensor)
  whose splits follow ``used`` (every program has work at any length), then one launch merging the splits by
  log-sum-exp; 16-bit or int8 pools alike.

Contract (tensors on one CUDA device; under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors, which is
how the tests check them):
- ``rope_write(q, k, v, cos, sin, pos, keys, values, key_scales=None, value_scales=None) -> q_rot [Hq, D]``:
  ``q`` [Hq * D], ``k``/``v`` [Hkv * D] (views of one fused projection are fine), ``cos``/``sin`` [D] (transformers'
  ``rotate_half`` convention), ``pos`` an int64 device tensor [1]; ``keys``/``values`` [Hkv, capacity, D] (any
  strides with a contiguous last dim). Equals transformers' ``apply_rotary_pos_emb`` and an ``index_copy_`` at
  ``pos`` (int8: ``int8_pool.quantize``'s codes within one step of rounding, its scales).
- ``decode_attention(q [Hq, D], keys, values, used, scale, key_scales=None, value_scales=None, lse=False)``:
  softmax attention over positions ``[0, used)``, in q's dtype; with ``lse`` also the log-sum-exp [Hq] (fp32), which
  the sparse step merges with its pages' part.
- ``decode_attention(..., pages=PageRead(slots, arena, layout, page_size))``: the same over L1 and, besides it, the
  selected off-window pages read from the L2 arena (int8 pages decoded in the kernel; zero-copy from pinned host
  memory on a GPU), merged in the same launch as L1's splits: the sparse step's attention, exact over the union.
- ``page_bounds(q, bounds, first, last) -> [Hkv, cols]``: Quest's page bounds of ``TieredLayer.bounds``, masked to
  the off-window pages (what the sparse step ranks).
- ``supported(head_dim, int8)``: the shapes the kernels take (power-of-two head dims; int8 needs halves that hold
  whole scale groups). Callers check ``available(device)`` (a once-per-GPU self-check) before using them.
"""

from __future__ import annotations

import torch

from ..selfcheck import SelfCheck

try:  # module globals, so that Triton's interpreter can patch ``tl`` inside the kernels (the CPU tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Windows without triton-windows: callers keep the torch ops
    triton = tl = None

from .int8_pool import GROUP   # channels per int8 scale (the pool's layout)
SPLITS = 64       # key ranges per KV head: 2 KV heads x 64 programs fill a large GPU's ~132 multiprocessors
BLOCK_N = 64      # keys per loop iteration of a split

_kernels: dict = {}


def _build() -> dict:
    """The kernels, made on first use (under ``TRITON_INTERPRET=1`` as interpreted functions: the tests)."""
    global _add, _max, _round, _quantized_store, _store_row
    if _kernels:
        return _kernels
    if triton is None:
        raise ImportError("Triton is not installed")

    # Only language builtins inside the kernels (tl.reduce with these combines, tl.full, tl.exp...): the standard
    # library's jit helpers (tl.sum, tl.max, tl.zeros) stay compiled-only under the interpreter.
    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _max(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _round(x):   # half away from zero (torch.round is half to even: they differ only on exact halves)
        return tl.where(x >= 0, tl.floor(x + 0.5), tl.ceil(x - 0.5))

    @triton.jit
    def _quantized_store(x, codes_ptr, scales_ptr, HALF: tl.constexpr, GRP: tl.constexpr):
        # x: HALF fp32 values; codes at codes_ptr[0:HALF], one fp16 scale per GRP values at scales_ptr[0:HALF/GRP]
        NG: tl.constexpr = HALF // GRP
        g = tl.reshape(x, [NG, GRP])
        amax = tl.reduce(tl.abs(g), 1, _max)                                  # [NG]
        scale = (amax / 127.0).to(tl.float16)
        scale = tl.where(scale == 0, 1.0, scale).to(tl.float16)
        c = _round(g / scale.to(tl.float32)[:, None])
        c = tl.minimum(tl.maximum(c, -127.0), 127.0)
        tl.store(codes_ptr + tl.arange(0, HALF), tl.reshape(c, [HALF]).to(tl.int8))
        tl.store(scales_ptr + tl.arange(0, NG), scale)

    @triton.jit
    def _store_row(y1, y2, dst, sdst, ref, HALF: tl.constexpr, GRP: tl.constexpr, INT8: tl.constexpr):
        # one head's new row of the pool from its two fp32 halves: in the pool's dtype, or (INT8) int8 codes and
        # scales quantized from the values rounded to the model's dtype (``ref``'s), as int8_pool.quantize does
        if INT8:
            _quantized_store(y1.to(ref.dtype.element_ty).to(tl.float32), dst, sdst, HALF, GRP)
            _quantized_store(y2.to(ref.dtype.element_ty).to(tl.float32), dst + HALF, sdst + HALF // GRP, HALF, GRP)
        else:
            lo = tl.arange(0, HALF)
            tl.store(dst + lo, y1.to(dst.dtype.element_ty))
            tl.store(dst + HALF + lo, y2.to(dst.dtype.element_ty))

    @triton.jit
    def _rope_write_kernel(Q, K, V, COS, SIN, POS, QO, KC, VC, KS, VS,
                           s_kh, s_kn, s_vh, s_vn, s_ksh, s_ksn, s_vsh, s_vsn,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, INT8: tl.constexpr,
                           GRP: tl.constexpr):
        # programs 0..HQ-1: a query head, rotated into QO; HQ..HQ+HKV-1: a key head, rotated into the pool at POS;
        # the rest: a value head, copied into the pool at POS
        HALF: tl.constexpr = D // 2
        p = tl.program_id(0)
        lo = tl.arange(0, HALF)
        pos = tl.load(POS).to(tl.int64)
        if p < HQ + HKV:
            if p < HQ:
                src = Q + p * D
            else:
                src = K + (p - HQ) * D
            x1 = tl.load(src + lo).to(tl.float32)
            x2 = tl.load(src + HALF + lo).to(tl.float32)
            c1 = tl.load(COS + lo).to(tl.float32)
            c2 = tl.load(COS + HALF + lo).to(tl.float32)
            s1 = tl.load(SIN + lo).to(tl.float32)
            s2 = tl.load(SIN + HALF + lo).to(tl.float32)
            y1 = x1 * c1 - x2 * s1           # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
            y2 = x2 * c2 + x1 * s2
            if p < HQ:
                tl.store(QO + p * D + lo, y1.to(QO.dtype.element_ty))
                tl.store(QO + p * D + HALF + lo, y2.to(QO.dtype.element_ty))
            else:
                h = (p - HQ).to(tl.int64)
                _store_row(y1, y2, KC + h * s_kh + pos * s_kn, KS + h * s_ksh + pos * s_ksn, QO, HALF, GRP, INT8)
        else:
            h = (p - HQ - HKV).to(tl.int64)
            x1 = tl.load(V + h * D + lo).to(tl.float32)
            x2 = tl.load(V + h * D + HALF + lo).to(tl.float32)
            _store_row(x1, x2, VC + h * s_vh + pos * s_vn, VS + h * s_vsh + pos * s_vsn, QO, HALF, GRP, INT8)

    @triton.jit
    def _split_kernel(Q, KC, VC, KS, VS, USED, O, L, scale,
                      s_kh, s_kn, s_vh, s_vn, s_ksh, s_ksn, s_vsh, s_vsn,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, INT8: tl.constexpr,
                      GRP: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_N: tl.constexpr, TOTAL: tl.constexpr):
        # program (h, s): KV head h's G query heads over split s of [0, used); splits are sized from ``used`` at run
        # time (multiples of BLOCK_N), so a short context still spreads over the programs
        h = tl.program_id(0)
        s = tl.program_id(1)
        used = tl.load(USED)
        per = ((used + NSPLIT * BLOCK_N - 1) // (NSPLIT * BLOCK_N)) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, used)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        h64 = h.to(tl.int64)
        q = tl.load(Q + (h * G + offs_g)[:, None] * D + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.full([BLOCK_G], 0.0, tl.float32)
        acc = tl.full([BLOCK_G, D], 0.0, tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = (n0 + offs_n).to(tl.int64)
            valid = n < end
            k = tl.load(KC + h64 * s_kh + n[:, None] * s_kn + offs_d[None, :], mask=valid[:, None], other=0)
            v = tl.load(VC + h64 * s_vh + n[:, None] * s_vn + offs_d[None, :], mask=valid[:, None], other=0)
            if INT8:
                ks = tl.load(KS + h64 * s_ksh + n[:, None] * s_ksn + (offs_d // GRP)[None, :], mask=valid[:, None],
                             other=0.0)
                vs = tl.load(VS + h64 * s_vsh + n[:, None] * s_vsn + (offs_d // GRP)[None, :], mask=valid[:, None],
                             other=0.0)
                k = k.to(tl.float32) * ks.to(tl.float32)
                v = v.to(tl.float32) * vs.to(tl.float32)
            sc = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.reduce(sc, 1, _max))
            alpha = tl.exp(m - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l = l * alpha + tl.reduce(pr, 1, _add)
            acc = acc * alpha[:, None] + tl.dot(pr.to(q.dtype), v.to(q.dtype))
            m = m_new
        has = l > 0
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        o = acc / tl.where(has, l, 1.0)[:, None]
        base = (h * TOTAL + s) * BLOCK_G     # (parts TOTAL >= NSPLIT a head: the pages' parts follow)
        tl.store(O + (base + offs_g)[:, None] * D + offs_d[None, :], o)
        tl.store(L + base + offs_g, lse)

    @triton.jit
    def _page_bounds_kernel(Q, B, FIRST, LAST, OUT, cols, s_bh, s_bd,
                            G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr):
        # Quest's bound of KV head h's query heads on pages [c0, c0 + BLOCK_C): max over the heads of
        # sum_d max(q_d * kmax_d, q_d * kmin_d), bounds B[h] = [kmax (D rows); kmin (D rows)] x cols; pages
        # outside [FIRST, LAST) are -inf
        h = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + (h * G + offs_g)[:, None] * D + offs_d[None, :], mask=offs_g[:, None] < G,
                    other=0.0).to(tl.float32)
        c_ok = c < cols
        at = B + h.to(tl.int64) * s_bh + offs_d[:, None] * s_bd + c[None, :]
        # fp32 (the bounds may be kept in another 16-bit type than q; tf32 holds both exactly)
        kmax = tl.load(at, mask=c_ok[None, :], other=0.0).to(tl.float32)
        kmin = tl.load(at + D * s_bd, mask=c_ok[None, :], other=0.0).to(tl.float32)
        sc = tl.dot(tl.maximum(q, 0.0), kmax) + tl.dot(tl.minimum(q, 0.0), kmin)      # [BLOCK_G, BLOCK_C]
        sc = tl.where((offs_g < G)[:, None], sc, float("-inf"))
        bound = tl.reduce(sc, 0, _max)
        first = tl.load(FIRST)
        last = tl.load(LAST)
        bound = tl.where((c >= first) & (c < last), bound, float("-inf"))
        tl.store(OUT + h * cols + c, bound, mask=c_ok)

    @triton.jit
    def _page_kernel(Q, SLOTS, A8, A16, O, L, scale, n_pages, row_bytes, off_kq, off_ks, off_kz, off_vq, off_vs,
                     off_vz, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                     HKV: tl.constexpr, GRP: tl.constexpr, NSPLIT: tl.constexpr, TOTAL: tl.constexpr):
        # program (h, j): KV head h's query heads over selected page j, read where it lies (an L2 slot of the int8
        # arena: pinned host memory a GPU reads over PCIe, or plain memory on a CPU) and decoded on the way:
        # keys (q * scale + zero) per channel, values per token and group of GRP channels (codecs.py's int8)
        h = tl.program_id(0)
        j = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, P)
        base = (h * TOTAL + NSPLIT + j) * BLOCK_G
        slot = tl.load(SLOTS + j, mask=j < n_pages, other=-1).to(tl.int64)
        if slot >= 0:   # (-1: padding, or a page only on disk, which this step attends without)
            row = slot * row_bytes
            h64 = h.to(tl.int64)
            tok = (h64 * P + offs_n)[:, None] * D + offs_d[None, :]                       # [P, D]
            kq = tl.load(A8 + row + off_kq + tok).to(tl.float32)
            ks = tl.load(A16 + (row + off_ks) // 2 + h64 * D + offs_d).to(tl.float32)
            kz = tl.load(A16 + (row + off_kz) // 2 + h64 * D + offs_d).to(tl.float32)
            vq = tl.load(A8 + row + off_vq + tok).to(tl.float32)
            grp = (h64 * P + offs_n)[:, None] * (D // GRP) + (offs_d // GRP)[None, :]
            vs = tl.load(A16 + (row + off_vs) // 2 + grp).to(tl.float32)
            vz = tl.load(A16 + (row + off_vz) // 2 + grp).to(tl.float32)
            q = tl.load(Q + (h * G + offs_g)[:, None] * D + offs_d[None, :], mask=offs_g[:, None] < G, other=0.0)
            k = (kq * ks[None, :] + kz[None, :]).to(q.dtype)
            v = (vq * vs + vz).to(q.dtype)
            sc = tl.dot(q, tl.trans(k)) * scale                                              # [BLOCK_G, P]
            m = tl.reduce(sc, 1, _max)
            pr = tl.exp(sc - m[:, None])
            lsum = tl.reduce(pr, 1, _add)
            o = tl.dot(pr.to(q.dtype), v) / lsum[:, None]
            tl.store(O + (base + offs_g)[:, None] * D + offs_d[None, :], o)
            tl.store(L + base + offs_g, m + tl.log(lsum))
        else:   # weighs nothing in the merge
            tl.store(O + (base + offs_g)[:, None] * D + offs_d[None, :], tl.full([BLOCK_G, D], 0.0, tl.float32))
            tl.store(L + base + offs_g, tl.full([BLOCK_G], float("-inf"), tl.float32))

    @triton.jit
    def _merge_kernel(O, L, OUT, LSE, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                      NSPLIT: tl.constexpr):
        # program p = query head (h, g): the NSPLIT partial outputs merged by their log-sum-exp (split 0 always
        # holds key 0, so the maximum is finite; empty splits weigh exp(-inf) = 0)
        p = tl.program_id(0)
        h = p // G
        g = p % G
        sp = tl.arange(0, NSPLIT)
        offs_d = tl.arange(0, D)
        rows = (h * NSPLIT + sp) * BLOCK_G + g
        lse = tl.load(L + rows)
        mx = tl.reduce(lse, 0, _max)
        w = tl.exp(lse - mx)
        total = tl.reduce(w, 0, _add)
        o = tl.load(O + rows[:, None] * D + offs_d[None, :])
        out = tl.reduce(o * w[:, None], 0, _add) / total
        tl.store(OUT + p * D + offs_d, out.to(OUT.dtype.element_ty))
        tl.store(LSE + p, mx + tl.log(total))

    _kernels.update(rope_write=_rope_write_kernel, split=_split_kernel, merge=_merge_kernel,
                    page_bounds=_page_bounds_kernel, pages=_page_kernel)
    return _kernels


def supported(head_dim: int, int8: bool = False) -> bool:
    """The head sizes the kernels take: a power of two >= 16 (``tl.arange``, ``tl.dot``); int8 pools also need each
    half of a head to hold whole scale groups."""
    ok = triton is not None and head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return ok and (not int8 or (head_dim // 2) % GROUP == 0)


def _strides(t: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_scales: torch.Tensor | None = None,
               value_scales: torch.Tensor | None = None) -> torch.Tensor:
    hkv, _, d = keys.shape
    hq = q.numel() // d
    out = torch.empty((hq, d), dtype=q.dtype, device=q.device)
    int8 = key_scales is not None
    _build()["rope_write"][(hq + 2 * hkv,)](
        q, k, v, cos, sin, pos, out, keys, values,
        key_scales if int8 else keys, value_scales if int8 else values,
        *_strides(keys), *_strides(values), *_strides(key_scales), *_strides(value_scales),
        HQ=hq, HKV=hkv, D=d, INT8=int8, GRP=GROUP, num_warps=1)
    return out


class PageRead:
    """The selected off-window pages a sparse step attends besides L1: ``slots`` [M] (their L2 slots, a device
    tensor; -1 for a page not in L2, which is skipped), read from ``arena`` (``L2Arena.data[layer]``, [slots, row_bytes] uint8: pinned host memory for a
    GPU) with ``layout`` (``L2Arena.layout``) of ``page_size`` tokens. ``takes(layout, page_size, head_dim)``
    says whether the page kernel reads that codec (int8 of ``codecs.py``, power-of-two pages of 16+ tokens)."""

    FIELDS = ("kq", "ks", "kz", "vq", "vs", "vz")

    def __init__(self, slots: torch.Tensor, arena: torch.Tensor, layout, page_size: int):
        self.slots, self.arena, self.page_size = slots, arena, page_size
        self.offsets = {name: off for name, _, _, off, _ in layout}

    @classmethod
    def takes(cls, layout, page_size: int, head_dim: int) -> bool:
        fields = {name: (dtype, shape) for name, dtype, shape, _, _ in layout}
        if set(fields) != set(cls.FIELDS) or page_size < 16 or page_size & (page_size - 1) or head_dim % GROUP:
            return False
        return fields["kq"][0] == torch.uint8 and fields["ks"][0] == torch.float16 and \
            fields["vq"][1][-1] == GROUP and fields["kq"][1][1] == page_size


def page_bounds(q: torch.Tensor, bounds: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of each KV head's query heads on each page: ``q`` [Hq, D], ``bounds`` [Hkv, 2D, cols]
    (key maxima then minima per channel), pages outside [``first``, ``last``) (device scalars) -inf ->
    [Hkv, cols] fp32. One launch for what torch does in eight."""
    hkv, _, cols = bounds.shape
    hq, d = q.shape
    g = hq // hkv
    out = torch.empty((hkv, cols), dtype=torch.float32, device=q.device)
    block_c = 64
    _build()["page_bounds"][(hkv, -(-cols // block_c))](
        q.contiguous(), bounds, first, last, out, cols, bounds.stride(0), bounds.stride(1),
        G=g, BLOCK_G=max(16, 1 << (g - 1).bit_length()), D=d, BLOCK_C=block_c, num_warps=4)
    return out


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, used: torch.Tensor, scale: float,
                     key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None,
                     lse: bool = False, pages: PageRead | None = None):
    hkv, _, d = keys.shape
    hq = q.shape[0]
    g = hq // hkv
    block_g = max(16, 1 << (g - 1).bit_length())
    n_pages = 0 if pages is None else pages.slots.shape[0]
    total = SPLITS if pages is None else 1 << (SPLITS + n_pages - 1).bit_length()   # parts a head, a power of 2
    parts = torch.empty((hkv * total * block_g, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((hkv * total * block_g,), dtype=torch.float32, device=q.device)
    int8 = key_scales is not None
    q = q.contiguous()
    _build()["split"][(hkv, SPLITS)](
        q, keys, values, key_scales if int8 else keys, value_scales if int8 else values, used, parts,
        part_lse, scale, *_strides(keys), *_strides(values), *_strides(key_scales), *_strides(value_scales),
        G=g, BLOCK_G=block_g, D=d, INT8=int8, GRP=GROUP, NSPLIT=SPLITS, BLOCK_N=BLOCK_N, TOTAL=total, num_warps=4)
    if pages is not None:
        at = pages.offsets
        _build()["pages"][(hkv, total - SPLITS)](
            q, pages.slots, pages.arena, pages.arena.view(torch.float16), parts, part_lse, scale, n_pages,
            pages.arena.shape[1], at["kq"], at["ks"], at["kz"], at["vq"], at["vs"], at["vz"],
            G=g, BLOCK_G=block_g, D=d, P=pages.page_size, HKV=hkv, GRP=GROUP, NSPLIT=SPLITS, TOTAL=total,
            num_warps=4)
    out = torch.empty((hq, d), dtype=q.dtype, device=q.device)
    out_lse = torch.empty((hq,), dtype=torch.float32, device=q.device)
    _build()["merge"][(hq,)](parts, part_lse, out, out_lse, G=g, BLOCK_G=block_g, D=d, NSPLIT=total, num_warps=4)
    return (out, out_lse) if lse else out


def _probe(device: torch.device) -> bool:
    """Both kernels on a small pool (16-bit and int8) against the torch reference."""
    from . import attention, int8_pool

    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, cap = 4, 2, 64, 200
    qkv = torch.randn(hq * d + 2 * hkv * d, generator=gen).half().to(device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d])
    angle = torch.rand(d // 2, generator=gen).repeat(2)
    cos, sin = angle.cos().half().to(device), angle.sin().half().to(device)
    keys = torch.randn(hkv, cap, d, generator=gen).half().to(device)
    values = torch.randn(hkv, cap, d, generator=gen).half().to(device)
    pos = torch.tensor([150], device=device)
    used = torch.tensor([151], dtype=torch.int32, device=device)
    qr = rope_write(q, k, v, cos, sin, pos, keys, values)
    out = decode_attention(qr, keys, values, used, d ** -0.5)
    ref = attention.prefix_attention(qr, keys, values, used, d ** -0.5)
    ok = bool(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2))
    codes, scales = int8_pool.quantize(keys)
    vcodes, vscales = int8_pool.quantize(values)
    rope_write(q, k, v, cos, sin, pos, codes, vcodes, scales, vscales)
    out8 = decode_attention(qr, codes, vcodes, used, d ** -0.5, scales, vscales)
    return ok and bool(torch.allclose(out8.float(), ref.float(), atol=6e-2, rtol=6e-2))


# available(device): True when the kernels build, run and agree with the torch reference on ``device`` (once)
available = SelfCheck("the decode step's Triton kernels", _probe, "the one-graph step keeps its torch kernels")
