"""Attention over tiers: exact over whatever segments it is given, merged by log-sum-exp.

Each segment (the L1 window with its sinks, a block of fetched pages) gives a partial output ``o_s`` and its
log-sum-exp ``lse_s``; the merge is ``o = sum exp(lse_s - m) o_s / sum exp(lse_s - m)`` with ``m = max lse_s``,
which equals softmax attention over the union of the segments.

``flashguard_attention`` is registered as ``tiered_kv`` with transformers' ``AttentionInterface`` (and a mask function that
returns None with ``AttentionMaskInterface``): the model calls it per layer, right after the cache's ``update``.

Contract: the forward that runs a TieredCache is given it twice, as transformers' cache argument (``update``) and
as the keyword ``CACHE_KWARG``, which transformers hands on to every layer's attention call; the attention asks that
cache's layer ``module.layer_idx`` (``TieredLayer.attend``). Nothing is found through global or thread state, so any
number of TieredCaches can take turns on one model, on any thread. ``forward_kwargs`` builds both for a caller (the
engine's prefill, ``flashguard stress``); ``pass_cache`` (``TieredCache.attach``) adds the keyword to a forward that
names only transformers' argument (plain ``model.generate``, tests). With no such keyword (any other Cache) the
attention is PyTorch SDPA.
"""

from __future__ import annotations

import weakref

import torch

from ..selfcheck import SelfCheck

NAME = "tiered_kv"  # must not contain "flash": transformers treats such names as flash-attn kernels


from . import Q_TILE  # noqa: E402 - queries per score matrix (the planner budgets one tile)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[kvh, g, Lq, D]``, k/v ``[kvh, N, D]``, mask ``[Lq, N]`` bool (True = visible).

    Returns ``(o [kvh, g, Lq, D], lse [kvh, g, Lq])`` in float32 (float64 for a float64 model). Long query
    blocks (chunked prefill) run in tiles of ``Q_TILE`` rows, so the fp32 scores never exceed one tile.
    """
    lq = q.shape[2]
    if lq > Q_TILE:
        outs = [_partial(q[:, :, a:a + Q_TILE], k, v, scale, None if mask is None else mask[a:a + Q_TILE])
                for a in range(0, lq, Q_TILE)]
        return torch.cat([o for o, _ in outs], dim=2), torch.cat([lse for _, lse in outs], dim=2)
    return _partial(q, k, v, scale, mask)


_CPU_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
UNSUPPORTED = ("no available kernel", "not supported", "unsupported", "only supports", "not implemented",
               "requires a gpu", "sm80", "sm_80", "ampere")   # what a GPU or build without a kernel says


class KernelChoice:
    """Which fused kernel each use runs on a (device, dtype), in one place: ``segment`` tries flash, then
    memory-efficient, then the einsum path (None); ``prefix`` flash's variable-length kernel, then masked SDPA.
    A kernel is given up for the process only on an error that says the GPU or the build lacks it (a message in
    ``UNSUPPORTED``, or a TypeError: an older torch without the argument); any other error propagates."""

    ORDER = {"segment": ("flash", "efficient", None), "prefix": ("flash", "sdpa")}

    def __init__(self):
        self._chosen: dict = {}

    def get(self, use: str, device_index, dtype):
        return self._chosen.get((use, device_index, dtype), self.ORDER[use][0])

    def downgrade(self, use: str, device_index, dtype, exc: Exception):
        """The next kernel after the one that raised ``exc``, remembered; ``exc`` again if it is not a 'this GPU
        lacks it' error."""
        if not isinstance(exc, TypeError) and not any(m in str(exc).lower() for m in UNSUPPORTED):
            raise exc
        order = self.ORDER[use]
        current = self.get(use, device_index, dtype)
        nxt = order[min(order.index(current) + 1, len(order) - 1)]
        self._chosen[(use, device_index, dtype)] = nxt
        return nxt


KERNELS = KernelChoice()


def segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` of a segment without a mask (``causal``: q and k are the same Lq tokens), on a
    fused PyTorch kernel that returns the log-sum-exp when the tensors are fp16/bf16 on a GPU (flash on Ampere
    and later, memory-efficient before) or fp32/bf16 on the CPU (its flash kernel), else the einsum path. The
    output is in the query dtype there.

    GQA without copies: with no causal structure the group of query heads of one KV head is just more query
    rows of that head (``[kvh, g * Lq, D]``); a causal segment repeats K/V per query head instead."""
    kvh, g, lq, d = q.shape
    key = (q.device.index, q.dtype)
    kind = KERNELS.get("segment", *key) if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
    if kind is not None:
        if causal:
            qq = q.reshape(1, kvh * g, lq, d)
            kk, vv = (t.repeat_interleave(g, dim=0).unsqueeze(0) for t in (k, v))
        else:
            qq, kk, vv = q.reshape(1, kvh, g * lq, d), k.unsqueeze(0), v.unsqueeze(0)
        try:
            if kind == "flash":
                o, lse = torch.ops.aten._scaled_dot_product_flash_attention(qq, kk, vv, 0.0, causal, False,
                                                                            scale=scale)[:2]
            else:
                o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qq, kk, vv, None, True, 0.0, causal,
                                                                                scale=scale)[:2]
            return o.reshape(kvh, g, lq, d), lse[..., :qq.shape[2]].reshape(kvh, g, lq)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as exc:   # this GPU lacks it: the next kernel, from now on
            KERNELS.downgrade("segment", *key, exc)
            return segment(q, k, v, scale, causal)
    if _CPU_FLASH and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and \
            (not causal or lq == k.shape[1]):
        # PyTorch's CPU flash kernel returns the log-sum-exp too: 2-6x faster than the einsum path for a decode step
        # (SmolLM2's shape, 64-2048 keys, docs/benchmarks/cpu_decode.md)
        if causal:
            qq = q.reshape(1, kvh * g, lq, d)
            kk, vv = (t.repeat_interleave(g, dim=0).unsqueeze(0) for t in (k, v))
        else:
            qq, kk, vv = q.reshape(1, kvh, g * lq, d), k.unsqueeze(0), v.unsqueeze(0)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qq, kk, vv, 0.0, causal, scale=scale)
        return o.reshape(kvh, g, lq, d), lse.reshape(kvh, g, lq)
    mask = None
    if causal:
        mask = torch.ones(lq, k.shape[1], dtype=torch.bool, device=q.device).tril_(k.shape[1] - lq)
    return partial_attention(q, k, v, scale, mask)


_OFFSETS: dict = {}        # (device index, capacity) -> int32 tensors [0, 1], [0, capacity] (flash's varlen form)


def _flash_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor, scale: float):
    """flash's variable-length kernel for one token's heads ``q [Hq, D]`` over the first ``used`` keys of
    ``k``/``v`` ``[kvh, capacity, D]`` (``seqused_k``: it reads only those, split over the GPU like a decode
    kernel): ``(o [Hq, D], lse [Hq] fp32)``, or None where it does not run (not a 16-bit CUDA tensor, or this GPU
    or torch lacks it: ``KERNELS``). The first call for a device and capacity must run outside graph capture."""
    key = (q.device.index, q.dtype)
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and KERNELS.get("prefix", *key) == "flash"):
        return None
    cap = k.shape[1]
    at = (q.device.index, cap)
    if at not in _OFFSETS:
        _OFFSETS[at] = tuple(torch.tensor([0, n], dtype=torch.int32, device=q.device) for n in (1, cap))
    cum_q, cum_k = _OFFSETS[at]
    try:
        out, lse = torch.ops.aten._flash_attention_forward(
            q.unsqueeze(0), k.transpose(0, 1), v.transpose(0, 1), cum_q, cum_k, 1, cap, 0.0, False, False,
            scale=scale, seqused_k=used)[:2]
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError) as exc:
        KERNELS.downgrade("prefix", *key, exc)
        return None
    hq = q.shape[0]
    return out[0], lse.reshape(-1)[:hq].float()


def _flash_chunk_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """flash's variable-length kernel for a chunk's queries ``q [Hq, Lq, D]`` (the last ``Lq`` of the ``N`` keys of
    ``k``/``v`` ``[kvh, N, D]``), causal with the queries aligned bottom-right, GQA in the kernel: ``[Hq, Lq, D]``.
    The offsets ``[0, Lq]`` and ``[0, N]`` are made on the device, one kernel each (a host-to-device copy would wait
    for the stream), and belong to this call alone."""
    hq, lq, d = q.shape
    n = k.shape[1]
    cum_q = torch.arange(0, 2 * lq, lq, dtype=torch.int32, device=q.device)
    cum_k = torch.arange(0, 2 * n, n, dtype=torch.int32, device=q.device)
    out = torch.ops.aten._flash_attention_forward(q.transpose(0, 1).contiguous(), k.transpose(0, 1),
                                                  v.transpose(0, 1), cum_q, cum_k, lq, n, 0.0, True, False,
                                                  scale=scale)[0]
    return out.transpose(0, 1)


def _chunk_probe(device: torch.device) -> bool:
    """The one-call chunk attention against the chunk-over-itself and prefix segments merged (what it replaces),
    on random data with a prefix, in both 16-bit dtypes the pool may hold."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        kvh, g, lq, n, d = 2, 3, 40, 100, 128
        q, k, v = (torch.randn(shape, generator=gen).to(device, dtype)
                   for shape in ((kvh * g, lq, d), (kvh, n, d), (kvh, n, d)))
        got = _flash_chunk_call(q, k, v, d ** -0.5)
        qg = q.reshape(kvh, g, lq, d)
        acc = merge_into(segment(qg, k[:, n - lq:], v[:, n - lq:], d ** -0.5, causal=True),
                         segment(qg, k[:, :n - lq], v[:, :n - lq], d ** -0.5))
        want = acc[0].reshape(kvh * g, lq, d).to(dtype)
        if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
            return False
    return True


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """A prefill chunk over a resident pool in one kernel call: ``q [Hq, Lq, D]`` the chunk's queries, the chunk's
    keys the last ``Lq`` of ``k``/``v`` ``[kvh, N, D]``; ``[Hq, Lq, D]`` in the query dtype. None where the kernel is
    missing or disagreed with the two merged segments at its self-check (the caller merges them instead): one call
    replaces two, the per-head K/V copies of the causal one and the merge's kernels (~12 launches a layer)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype
            and KERNELS.get("segment", q.device.index, q.dtype) == "flash" and one_call_chunks(q.device)):
        return None
    try:
        return _flash_chunk_call(q, k, v, scale)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as exc:   # a shape its self-check did not try: merged segments from now on, said once
        one_call_chunks.give_up(q.device, exc)
        return None


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One token's query heads ``q [Hq, D]`` over the first ``used`` positions of ``k``/``v`` ``[kvh, capacity, D]``,
    ``used`` an int32 device tensor ``[1]``: no host value, so a whole decode step can be a CUDA graph. Returns
    ``[Hq, D]``. On a GPU ``_flash_prefix``; elsewhere, or where that kernel is missing, SDPA with a mask over the
    whole capacity."""
    flash = _flash_prefix(q, k, v, used, scale)
    if flash is not None:
        return flash[0]
    kvh, cap, d = k.shape
    visible = torch.arange(cap, device=q.device) < used
    qg = q.reshape(kvh, 1, -1, d)                      # a KV head's query heads as its query rows
    out = torch.nn.functional.scaled_dot_product_attention(qg, k.unsqueeze(1), v.unsqueeze(1),
                                                           attn_mask=visible.view(1, 1, 1, cap), scale=scale)
    return out.reshape(-1, d)


def prefix_segment(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, used: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``segment`` of one query token ``qg [kvh, g, 1, D]`` over the first ``used`` keys of ``k``/``v``
    ``[kvh, capacity, D]`` (``used`` an int32 device tensor ``[1]``): ``(o [kvh, g, 1, D], lse [kvh, g, 1])``, no
    host value (a sparse step's L1 part inside a CUDA graph, merged with its pages' part). On a GPU
    ``_flash_prefix``; elsewhere (or where it is missing) the einsum path with a mask."""
    kvh, g, _, d = qg.shape
    flash = _flash_prefix(qg.reshape(kvh * g, d), k, v, used, scale)
    if flash is not None:
        return flash[0].reshape(kvh, g, 1, d), flash[1].reshape(kvh, g, 1)
    visible = (torch.arange(k.shape[1], device=qg.device) < used).unsqueeze(0)     # [1, capacity]
    return partial_attention(qg, k, v, scale, visible)


def _partial(q, k, v, scale, mask):
    # One score matrix in the accumulation dtype, updated in place (scale, mask, shift, exp): the peak is that
    # matrix plus its 16-bit copy for the second einsum, not five fp32 temporaries.
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 statistics for fp16/bf16, float64 stays float64
    s = torch.einsum("hgqd,hnd->hgqn", q, k).to(acc)
    s.mul_(scale)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = s.sub_(m).exp_()
    l = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("hgqn,hnd->hgqd", p.to(v.dtype), v).to(acc) / l.clamp_min(1e-30)
    lse = (m + torch.log(l.clamp_min(1e-30))).squeeze(-1)
    lse = torch.where(l.squeeze(-1) > 0, lse, torch.full_like(lse, float("-inf")))
    return o, lse


def merge_into(acc: tuple[torch.Tensor, torch.Tensor] | None,
               part: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Running LSE merge of two partial results: memory stays one partial output however many segments.
    Every query must see at least one key in ``acc`` (the tiered attention starts with the L1 segment)."""
    if acc is None:
        return part
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)  # finite: the L1 segment, always merged first, shows every query a key
    o = torch.exp(l1 - lse).unsqueeze(-1) * o1 + torch.exp(l2 - lse).unsqueeze(-1) * o2
    return o, lse


CACHE_KWARG = "flashguard_kv"   # the forward's keyword that carries a TieredCache to its layers' attention calls
_CACHE_ARGS = ("cache", "past_key_values")   # transformers' name for the forward's Cache (>= 5.2x, older)


def serves_attention(cache) -> bool:
    """True for a cache whose layers attend themselves (a TieredCache: ``layers[i].attend``)."""
    return bool(getattr(cache, "serves_attention", False))


def forward_kwargs(kwarg: str, cache) -> dict:
    """The keyword arguments that run a forward over ``cache``: transformers' ``kwarg`` (``engine.cache_kwarg``)
    and, for a TieredCache, ``CACHE_KWARG`` for its attention."""
    return {kwarg: cache, CACHE_KWARG: cache} if serves_attention(cache) else {kwarg: cache}


def _add_cache_kwarg(module, args, kwargs):
    if CACHE_KWARG not in kwargs:
        cache = next((kwargs[a] for a in _CACHE_ARGS if kwargs.get(a) is not None), None)
        if serves_attention(cache):
            kwargs[CACHE_KWARG] = cache
            return args, kwargs
    return None


_passing: "weakref.WeakSet" = weakref.WeakSet()   # the models whose forward ``pass_cache`` hooked


def pass_cache(model) -> None:
    """``model``'s forward hands a TieredCache given as transformers' cache argument on to its attention (as
    ``CACHE_KWARG``) when the caller did not: what plain ``model.generate(past_key_values=cache)`` needs. Once per
    model."""
    if model not in _passing:
        model.register_forward_pre_hook(_add_cache_kwarg, with_kwargs=True)
        _passing.add(model)


def flashguard_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache = kwargs.pop(CACHE_KWARG, None)
    if cache is None:
        if attention_mask is None and query.shape[0] == 1:  # no_mask() gave None: one causal sequence
            return causal_sdpa(query, key, value, scaling), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError("TieredCache serves one sequence at a time (batch size 1)")
    layer = cache.layers[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = layer.attend(query[0], scale)   # [Hq, Lq, D]
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal attention of the last ``Lq`` positions over ``Lk`` keys (queries aligned bottom-right) with PyTorch
    SDPA and no mask tensor: ``is_causal`` when Lq == Lk, none for one query, else a lower-right ``CausalBias``
    that the flash / memory-efficient kernels take as is. transformers would materialise an [Lq, Lk] mask, which
    keeps SDPA off its flash kernel (measured on a GPU: 20 of 32 ms of a 21-token suffix over a 32K cache).

    query ``[1, Hq, Lq, D]``, key/value ``[1, Hkv, Lk, D]``; returns ``[1, Lq, Hq, D]`` (the layout transformers'
    attention functions return)."""
    import torch.nn.functional as F

    lq, lk = query.shape[2], key.shape[2]
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    if lq == 1 or lq == lk:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=lq > 1, scale=scaling)
    else:
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(lq, lk), scale=scaling)
    return out.transpose(1, 2).contiguous()


def plain_causal(config) -> bool:
    """True when every layer of ``config`` attends causally to all earlier tokens (no sliding window, no chunked
    or bidirectional layers): then ``tiered_kv`` may replace transformers' mask with ``causal_sdpa``."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    if c.model_type not in ("llama", "qwen2"):
        return False
    if getattr(c, "use_sliding_window", False) and getattr(c, "sliding_window", None):
        return False
    return all(t == "full_attention" for t in (getattr(c, "layer_types", None) or ["full_attention"]))


def no_mask(*args, **kwargs):
    """The tiered attention builds its own causal structure; the model needs no mask tensor."""
    return None


_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, flashguard_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    _registered = True


# one_call_chunks(device): the one-call chunk attention runs and agrees with the merged segments on ``device``
one_call_chunks = SelfCheck("one-call chunk attention", _chunk_probe, "chunks attend in two merged segments")
