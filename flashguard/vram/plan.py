"""``flashguard plan``: will this model, cache and context fit this GPU, and if not, which keys to change.

All numbers are computed from the model shape and the flashguard config, the way the engine allocates:

- weights      embeddings in 16-bit; lm_head in 16-bit, Q8_0 codes (``Shape.lm_head`` int8, 1.25 bytes a weight
               in the int4 kernels' pair form, quant/lm_head.py) or int4 codes (int4: a GGUF's Q4, or ``lm_head:
               int4``, whose top rows a token reads from host RAM); decoder linears in 16-bit or
               int4 (codes K*N/2 bytes plus a 16-bit scale and zero per group and output column); norms and biases
               in 16-bit. With int4 weights the embedding table stays in host RAM (``engine/host_embedding.py``)
               unless one 16-bit tensor is both table and head (tied); the lm_head stays.
- kv           dynamic: every token, K and V, every layer, 16-bit. tiered: the pool (16-bit, or int8 codes and
               scales with one layer's 16-bit copy for prefill when ``kv.l1_codec`` is int8) (sinks + the largest adaptive
               window + one chunk; the whole context when it fits), the per-page Quest key summaries (min and
               max), and, when pages live off the pool, one fetch block of pages. ``pool_tokens`` finds the
               largest pool that fits a budget; an unsized tiered config (``auto``) is planned with it.
- activations  the largest of the chunked prefill (tiered attention materialises fp32 scores for a chunk
               against one segment: the window or a fetch block; dynamic SDPA materialises the chunk's
               boolean mask against the whole cache) and the MLP of one chunk.
- slack        the caching allocator's reserved-but-unallocated share (estimated as a fixed fraction).
- context      the CUDA context and kernels, outside torch's allocator (not capped by vram_budget).
- peers        with ``kv.peer_gpus`` (kv/peer.py), on each peer GPU: its share of the off-pool pages in 16-bit,
               allocated in blocks of ``BLOCK_PAGES`` pages, and its own CUDA context. The store keeps those pages
               too, so the host rows stay as they are; GPU 0's parts do not change.

Contract: ``plan(shape, ...)`` returns a frozen ``Plan``; ``Plan.table()`` renders it; ``suggest(...)`` returns the
config changes (YAML keys) that make a plan fit, or an empty dict when it already fits. The model's shape is
shapes.py's (``Shape``, ``resolve_shape``) and each part's bytes sizes.py's (``weight_bytes``, ``decode_bytes``, ...);
this module re-exports them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..kv import FETCH_BLOCK_TOKENS, Q_TILE
from ..quant import AWQ_GROUP_SIZE
# (shapes.py and sizes.py hold the model's shape and its parts' bytes; their names are the planner's too)
from .shapes import NAMED_SHAPES, Shape, deepseek_1_5b_config, deepseek_7b_config, resolve_shape  # noqa: F401
from .sizes import (LAPTOP_GB_S, Q4_K_BITS, Q6_K_BITS, decode_bytes, guard_bytes, head_bytes,  # noqa: F401
                    int4_bytes, kv_read_bytes, layer_bytes, llamacpp_decode_bytes, table_on_host, weight_bytes)

SLACK = 0.08           # reserved - allocated: 5-10% measured in the GPU runs (docs/benchmarks/fit_4gib.md)
CUDA_CONTEXT = 400 * 2**20
HEADROOM = 0.10        # share of vram_budget left unplanned: planner error and fragmentation (SLACK covers the
                       # allocator's own); measured NVML at 4 GiB stayed <= 3.36 GiB with 0.15 (0.6 GiB unused)


@dataclass(frozen=True)
class Plan:
    shape: Shape
    gpu_mem: int
    context: int
    weights_kind: str
    cache: str
    prefill_chunk: int
    parts: dict  # category -> bytes on the GPU
    host: dict   # category -> bytes in RAM / on disk
    peers: dict = dataclasses.field(default_factory=dict)   # category -> bytes on each peer GPU (kv.peer_gpus)
    streamed: int = 0   # decoder layers streamed from host RAM (the rest resident)

    @property
    def peak_reserved(self) -> int:
        return sum(v for k, v in self.parts.items() if k != "cuda context")

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_mem

    def table(self) -> str:
        g = 2**30
        lines = [f"plan: {self.shape.name}, {self.weights_kind} weights, cache {self.cache}, context {self.context}, "
                 f"prefill_chunk {self.prefill_chunk}, GPU {self.gpu_mem / g:.2f} GiB", "",
                 f"placement: embedding {'host RAM' if table_on_host(self.shape, self.weights_kind) else 'GPU'}"
                 f", lm_head GPU ({self.shape.lm_head}), decoder layers "
                 f"{self.shape.layers - self.streamed} resident"
                 + (f" + {self.streamed} streamed from pinned host RAM through 2 GPU slots" if self.streamed else ""),
                 "",
                 "| GPU category | GiB |", "|---|---|"]
        lines += [f"| {k} | {v / g:.3f} |" for k, v in self.parts.items()]
        lines += [f"| **peak reserved (torch)** | **{self.peak_reserved / g:.3f}** |",
                  f"| **total with CUDA context** | **{self.total / g:.3f}** |", "", "| host category | GiB |",
                  "|---|---|"]
        lines += [f"| {k} | {v / g:.3f} |" for k, v in self.host.items()]
        if self.peers:
            lines += ["", "| each peer GPU (kv.peer_gpus) | GiB |", "|---|---|"]
            lines += [f"| {k} | {v / g:.3f} |" for k, v in self.peers.items()]
        lines += ["", "fits" if self.fits else f"does NOT fit: {(self.total - self.gpu_mem) / g:.2f} GiB over"]
        return "\n".join(lines) + "\n"


def plan(shape: Shape, *, gpu_mem: int, context: int, weights: str = "int4", cache: str = "tiered",
         prefill_chunk: int = 512, kv=None, group: int = AWQ_GROUP_SIZE, cuda_context: int = CUDA_CONTEXT,
         streamed: int = 0, guard: int = 0) -> Plan:
    """``streamed``: decoder layers kept in pinned host RAM and copied in one layer ahead (``layer_placement``):
    the GPU holds the others plus two slots. ``guard``: the guard adapter's bytes on the GPU (``guard_bytes``)."""
    from ..config import CacheConfig

    kv = kv or CacheConfig()
    if cache == "tiered" and not kv.sized:
        kv = sized_kv(shape, budget=gpu_mem, context=context, weights=weights, prefill_chunk=prefill_chunk, kv=kv,
                      group=group, cuda_context=cuda_context, streamed=streamed)
    s = shape
    kvd = s.kv_heads * s.head_dim
    per_token_kv = s.layers * 2 * kvd * 2
    w = weight_bytes(s, weights, group)
    one = layer_bytes(s, weights, group)
    parts = {"weights": sum(w.values()) - streamed * one + min(2, streamed) * one}
    if guard:
        parts["guard adapter"] = guard
    chunk = min(prefill_chunk, context)
    if cache == "dynamic":
        parts["kv cache"] = context * per_token_kv
        attn = chunk * context  # bool mask of the chunk against the cache (SDPA path)
        l2 = l3 = 0
    else:
        pages = context // kv.page_size
        # resident: sinks + the largest adaptive window + one chunk; a prefill chunk attends to the window as
        # it is while prefilling (l1_tokens: the window grows only with how far back decode queries reach)
        window = min(context, kv.sink_tokens + kv.l1_max_tokens + chunk + kv.page_size)
        prefill_window = min(context, kv.sink_tokens + kv.l1_tokens + chunk)
        summaries = pages * s.layers * s.kv_heads * 2 * s.head_dim * 2
        # a streamed block of pages: decoded (16-bit) plus its encoded bytes and the next block's in flight
        fetch = min(FETCH_BLOCK_TOKENS, context) * 2 * kvd * 2 * 2 if window < context else 0
        pool = window * per_token_kv
        if kv.l1_codec == "int8":   # codes and scales, and one layer's 16-bit copy while a prefill chunk attends
            from ..kv.int8_pool import bytes_per_value

            pool = int(window * s.layers * 2 * kvd * bytes_per_value()) + window * 2 * kvd * 2
        parts["kv cache"] = pool + summaries + fetch
        # On the GPU, blocks of pages and the window are attended by fused kernels that keep no scores; only a
        # chunk that reaches into the sinks (the first) is attended with a mask over L1: one query tile against
        # it, fp32 scores (scaled, masked, exp'd in place) plus, at either end, one 16-bit copy (the einsum result
        # being widened, or the probabilities for the second einsum); the bool mask is shared by the heads
        segment = min(prefill_window, kv.sink_tokens + chunk)   # later chunks attend L1 with fused kernels
        tile = min(chunk, Q_TILE)
        attn = s.heads * tile * segment * (4 + 2) + tile * segment
        off = max(0, context - window)
        l2 = min(off, kv.l2_tokens) * s.layers * 2 * kvd * (1 if kv.l2_codec == "int8" else 2)
        l3 = max(0, off - kv.l2_tokens) * s.layers * 2 * kvd // 2 if kv.l3_tokens else 0
    mlp = chunk * s.intermediate * 2 * 3 + chunk * s.hidden * 2 * 6 + chunk * (s.heads + 2 * s.kv_heads) * s.head_dim * 4
    logits = s.vocab * 4 * 2
    parts["activations"] = max(attn, 0) + mlp + logits
    parts["allocator slack"] = int(SLACK * sum(parts.values()))
    parts["cuda context"] = cuda_context
    host = {"L2 (host RAM)": l2, "L3 (disk, before zstd)": l3}
    if streamed:
        host["streamed decoder layers (pinned RAM)"] = streamed * one
    peers = {}
    if cache == "tiered" and kv.peer_gpus is not None:
        from ..kv.peer import BLOCK_PAGES

        n = kv.peer_gpus if isinstance(kv.peer_gpus, int) else len(kv.peer_gpus)
        share = -(-(-(-off // kv.page_size)) // n)                 # off-pool pages per peer (round robin)
        blocks = -(-share // BLOCK_PAGES)
        peers = {"pages (16-bit, in blocks)": blocks * BLOCK_PAGES * kv.page_size * per_token_kv,
                 "cuda context": cuda_context}
    return Plan(s, gpu_mem, context, weights, cache, prefill_chunk, parts, host, peers, streamed)


MIN_POOL_PAGES = 8   # the smallest pool worth running: sinks, a few window pages and a hot set


def planned(budget: int) -> int:
    """The share of ``vram_budget`` (the process's whole GPU memory, CUDA context included) a plan may fill."""
    return int(budget * (1 - HEADROOM))


def pool_tokens(shape: Shape, *, budget: int, context: int, weights: str, prefill_chunk: int, kv,
                group: int = AWQ_GROUP_SIZE, cuda_context: int = CUDA_CONTEXT, streamed: int = 0) -> int:
    """The most tokens the tiered cache's pool (L1) may hold for the plan of ``context`` to fit ``budget`` (the
    process's whole GPU memory, less ``HEADROOM``): a binary search over page multiples; 0 when not even
    ``MIN_POOL_PAGES`` pages fit."""
    from ..kv.policy import round_pages, size_tiers

    p = kv.page_size
    full = round_pages(context, p)

    def fits(pool: int) -> bool:
        k = size_tiers(kv, context=context, pool_tokens=pool, l2_bytes_per_token=1, host_available=None,
                       kv_heads=shape.kv_heads)
        return plan(shape, gpu_mem=planned(budget), context=context, weights=weights, cache="tiered",
                    prefill_chunk=prefill_chunk, kv=k, group=group, cuda_context=cuda_context, streamed=streamed).fits

    if fits(full):
        return full
    lo, hi = 0, full // p      # in pages: lo fits (or is 0), hi does not
    if not fits(MIN_POOL_PAGES * p + kv.sink_tokens):
        return 0
    lo = (MIN_POOL_PAGES * p + kv.sink_tokens) // p
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * p) else (lo, mid)
    return lo * p


def sized_kv(shape: Shape, *, budget: int, context: int, weights: str, prefill_chunk: int, kv,
             group: int = AWQ_GROUP_SIZE, cuda_context: int = CUDA_CONTEXT, host_available: int | None = None,
             l2_bytes_per_token: int = 1, streamed: int = 0):
    """``kv`` with its ``auto`` sizes set for ``budget``: the largest pool that fits (at least the minimum, which
    ``fit_to_budget`` reports when even that does not fit). ``kv.l1_codec: auto`` becomes int8 when a 16-bit
    pool would be shorter than the context and an int8 pool holds all of it (the head size allowing it), else
    fp16: measured (docs/benchmarks/e2e.md), an int8 pool decodes at 0.55-0.67x the 16-bit
    pool's speed where both hold the conversation, and a pool short of the context decodes off the pool anyway."""
    from ..kv import int8_pool
    from ..kv.policy import round_pages, size_tiers

    def largest(k):
        return pool_tokens(shape, budget=budget, context=context, weights=weights, prefill_chunk=prefill_chunk,
                           kv=k, group=group, cuda_context=cuda_context, streamed=streamed)

    if kv.l1_codec == "auto":
        fp16 = kv.replace(l1_codec="fp16")
        pool = largest(fp16)
        kv = fp16
        if pool < round_pages(context, kv.page_size) and kv.l1_tokens is None and int8_pool.supported(shape.head_dim):
            int8 = kv.replace(l1_codec="int8")
            pool8 = largest(int8)
            if pool8 >= round_pages(context, kv.page_size):
                kv, pool = int8, pool8
    else:
        pool = largest(kv)
    pool = max(pool, MIN_POOL_PAGES * kv.page_size + kv.sink_tokens)
    return size_tiers(kv, context=context, pool_tokens=pool, l2_bytes_per_token=l2_bytes_per_token,
                      host_available=host_available, kv_heads=shape.kv_heads)


def suggest(shape: Shape, *, gpu_mem: int, context: int, weights: str, cache: str, prefill_chunk: int, kv=None,
            group: int = AWQ_GROUP_SIZE, cuda_context: int = CUDA_CONTEXT) -> dict:
    """The YAML changes that make a plan fit, cheapest for quality/speed first: int4 weights, the tiered cache,
    then what ``fit_to_budget`` shrinks (prefill chunk, tiered window). Empty when it already fits."""
    from ..config import CacheConfig

    kv = kv or CacheConfig()
    changes: dict = {}

    def fits() -> bool:
        return plan(shape, gpu_mem=gpu_mem, context=context, weights=weights, cache=cache,
                    prefill_chunk=prefill_chunk, kv=kv, group=group, cuda_context=cuda_context).fits

    if not fits() and weights != "int4":
        weights = changes["weights"] = "int4"
    if not fits() and cache != "tiered":
        cache = changes["kv_cache"] = "tiered"
    if fits():
        return changes
    new_kv, chunk, _, _ = fit_to_budget(shape, budget=gpu_mem, context=context, weights=weights,
                                     cache=cache, prefill_chunk=prefill_chunk, kv=kv, cuda_context=cuda_context)
    if chunk != prefill_chunk:
        changes["prefill_chunk"] = chunk
    if kv.sized and new_kv.l1_max_tokens != kv.l1_max_tokens:
        changes["kv.l1_max_tokens"] = new_kv.l1_max_tokens
    prefill_chunk, kv = chunk, new_kv
    return changes if fits() else {"error": "does not fit even with int4 weights, the tiered cache, a 256-token "
                                            "prefill chunk and a 1024-token window; use a smaller model"}


def plan_cpu(shape: Shape, *, context: int, weights: str, prefill_chunk: int = 512, group: int = AWQ_GROUP_SIZE,
             l2_codec: str = "int8", guard: int = 0) -> dict:
    """Host RAM by category for the engine on the CPU (``flashguard plan`` on a machine without a CUDA GPU): there
    everything is in RAM and computed in float32, and the cache keeps the whole context resident (``Budget.fit``:
    no budget), its pages copied to L2 when a conversation ends. ``weights``: "int4" (the decoder's linears as int4
    codes; the embedding table in float32) or "float" (float32). Bytes, estimated the way ``plan`` estimates a
    GPU's."""
    s = shape
    kvd = s.kv_heads * s.head_dim
    linear = weight_bytes(s, "float", group)["decoder linears"] // 2   # parameters
    table = s.vocab * s.hidden * 4
    if weights == "int4":
        head = 0 if s.tied and s.lm_head == "float" else (head_bytes(s, group) if s.lm_head != "float"
                                                           else s.vocab * s.hidden * 4)
        size = int4_bytes(linear, group) + table + head
        what = "int4 decoder linears, float32 embedding table" + (
            "" if s.tied and s.lm_head == "float" else f", {s.lm_head} lm_head")
    else:
        size, what = linear * 4 + table * (1 if s.tied else 2), "float32"
    small = s.layers * (2 * s.hidden + ((s.heads * s.head_dim + 2 * kvd) if s.qkv_bias else 0)) + s.hidden
    chunk = min(prefill_chunk, context)
    out = {f"weights ({what})": size + small * 4}
    if guard:
        out["guard adapter (float32)"] = guard
    out["KV cache (the whole context, float32)"] = context * s.layers * 2 * kvd * 4
    out[f"L2 pages (a finished conversation's, {l2_codec})"] = context * s.layers * 2 * kvd * (
        1 if l2_codec == "int8" else 2)
    # a prefill chunk's activations in float32 and its attention scores against the context, the logits
    out["activations (a prefill chunk)"] = (chunk * (3 * s.intermediate + 6 * s.hidden + (s.heads + 2 * s.kv_heads)
                                                      * s.head_dim) * 4 + s.heads * chunk * context * 4
                                             + s.vocab * 4 * 2)
    return out


def fit_to_budget(shape: Shape, *, budget: int, context: int, weights: str, cache: str, prefill_chunk: int,
                  kv, cuda_context: int = CUDA_CONTEXT, host_available: int | None = None,
                  l2_bytes_per_token: int = 1, group: int = AWQ_GROUP_SIZE, streamed: int = 0) -> tuple:
    """What the engine does with ``vram_budget`` (``budget``: the process's whole GPU memory, CUDA context
    included) at start: the prefill chunk shrunk while not even the smallest
    pool fits beside it, then the tiered cache's ``auto`` sizes set (the largest pool that fits; see
    ``sized_kv``); a config with explicit sizes has its adaptive window shrunk instead. Returns
    ``(kv, prefill_chunk, plan, notes)``: ``plan`` is the final plan (``plan.fits`` False when even the minimum
    does not fit) and ``notes`` lists what changed."""
    from ..kv.policy import size_tiers

    notes: list[str] = []

    def plan_of(k, c) -> Plan:
        return plan(shape, gpu_mem=planned(budget), context=context, weights=weights, cache=cache,
                    prefill_chunk=c, kv=k, group=group, cuda_context=cuda_context, streamed=streamed)

    chunk = prefill_chunk
    if cache == "tiered" and not kv.sized:
        smallest = size_tiers(kv, context=context, pool_tokens=MIN_POOL_PAGES * kv.page_size + kv.sink_tokens,
                              l2_bytes_per_token=1, host_available=None, kv_heads=shape.kv_heads)
        while not plan_of(smallest, chunk).fits and chunk > 256:
            chunk //= 2
        kv = sized_kv(shape, budget=budget, context=context, weights=weights, prefill_chunk=chunk, kv=kv,
                      group=group, cuda_context=cuda_context, host_available=host_available,
                      l2_bytes_per_token=l2_bytes_per_token, streamed=streamed)
    else:
        while not plan_of(kv, chunk).fits and chunk > 256:
            chunk //= 2
        if cache == "tiered":
            while not plan_of(kv, chunk).fits and kv.l1_max_tokens > max(kv.page_size, 1024):
                smaller = max(kv.page_size, kv.l1_max_tokens // 2)
                kv = dataclasses.replace(kv, l1_max_tokens=smaller, l1_tokens=min(kv.l1_tokens, smaller))
                notes.append(f"kv.l1_max_tokens -> {smaller}")
    if chunk != prefill_chunk:
        notes.insert(0, f"prefill_chunk {prefill_chunk} -> {chunk}")
    final = plan_of(kv, chunk)
    if not final.fits:
        hint = "weights: int4" if weights != "int4" else ""
        hint += (", " if hint else "") + ("kv_cache: tiered" if cache != "tiered" else "a smaller model or context")
        notes.append(f"the plan for {context} tokens still exceeds vram_budget; set {hint} "
                     "(`flashguard plan` shows the categories)")
    return kv, chunk, final, notes


MIN_STREAMED = 3   # streaming fewer layers saves nothing: the GPU holds two layers' slots besides the resident ones


def layer_placement(shape: Shape, *, budget: int, context: int, weights: str, cache: str, prefill_chunk: int, kv,
                    cuda_context: int = CUDA_CONTEXT, group: int = AWQ_GROUP_SIZE,
                    shrink_chunk: bool = False) -> tuple[int, int]:
    """How many decoder layers stream from pinned host RAM (``engine/layer_stream.py``) for the plan of ``context``
    to fit ``budget`` (the process's whole GPU memory): 0 when every layer fits beside the smallest KV pool
    (``MIN_POOL_PAGES`` pages and the sinks, or ``kv``'s explicit sizes); else the fewest, at least
    ``MIN_STREAMED``: resident layers are preferred to a longer pool, since a streamed layer costs its whole
    weights over PCIe every step while pages past the pool cost only what a step reads of them (sparse: a few
    MB). The last layers stream. Only int4 weights stream (a float model is told to use int4 first).

    Returns ``(streamed, prefill_chunk)``: the chunk is halved (down to 256) only when even every layer streamed
    does not fit; with ``shrink_chunk`` (``prefill_chunk: auto``), a model that streams takes the chunk down to 512
    where that keeps more layers resident (the 7B at 4 GiB: a streamed layer costs ~2.3 ms of PCIe a token,
    docs/benchmarks/big.md; a smaller chunk costs only prefill launches). A budget that cannot hold even that is
    a ``ConfigError`` naming ``vram_budget`` and the smallest budget that works."""
    from ..errors import ConfigError
    from ..kv.policy import size_tiers

    if cache == "tiered" and not kv.sized:
        kv = size_tiers(kv, context=context, pool_tokens=MIN_POOL_PAGES * kv.page_size + kv.sink_tokens,
                        l2_bytes_per_token=1, host_available=None, kv_heads=shape.kv_heads)

    def smallest(streamed: int, chunk: int) -> Plan:
        return plan(shape, gpu_mem=planned(budget), context=context, weights=weights, cache=cache,
                    prefill_chunk=chunk, kv=kv, group=group, cuda_context=cuda_context, streamed=streamed)

    if weights != "int4" or smallest(0, prefill_chunk).fits:
        return 0, prefill_chunk
    def fewest(chunk: int) -> int | None:
        return next((n for n in range(MIN_STREAMED, shape.layers + 1) if smallest(n, chunk).fits), None)

    streamed = fewest(prefill_chunk)
    if streamed is not None:
        best = (streamed, prefill_chunk)
        chunk = prefill_chunk
        while shrink_chunk and chunk > 512:
            chunk //= 2
            n = fewest(chunk)
            if n is not None and n < best[0]:
                best = (n, chunk)
        return best
    chunk = prefill_chunk
    while chunk > 256:
        chunk //= 2
        if smallest(shape.layers, chunk).fits:
            return shape.layers, chunk
    need = smallest(shape.layers, chunk).total / (1 - HEADROOM)
    need = -(-int(need) // 2**24) * 2**24   # up to a multiple of 16 MiB
    raise ConfigError(
        f"{budget / 2**30:.2f} GiB cannot hold {shape.name}'s lm_head, two streamed decoder layers "
        f"({2 * layer_bytes(shape, weights, group) / 2**20:.0f} MiB) and the smallest KV window beside the CUDA "
        f"context; the smallest vram_budget that works is {need / 2**30:.2f} GiB", key="vram_budget")
