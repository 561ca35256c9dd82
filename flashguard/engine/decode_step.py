"""One-token decode steps for plain causal Llama / Qwen2 models, with the model's layers captured as CUDA graphs.

Why: a decode step of a small model in eager PyTorch is bound by the host, not the GPU. Each layer launches ~30
small kernels from Python; for the DeepSeek-R1-Distill-Qwen-1.5B shape on a datacenter GPU that is 60-110 ms a step
against a few ms of GPU work (docs/benchmarks/kv.md). ``DecodeStep`` runs the model's own modules (norms,
projections, MLP, ``lm_head``) but records everything *between two attention calls* as one CUDA graph part
(layers + 1 graphs a step) and calls the cache's attention eagerly in between: a TieredCache decides on the host,
step by step, which pages to bring, which a replayed graph cannot do. On a CPU, or when capture fails, the same
parts run eagerly (the tests compare them with the model's forward).

The layer is written once (``_before``: norm, q/k/v, rotary; ``_after``: o_proj, residual, norm, gated MLP,
residual) and runs on one of three kernel sets (``step_ops.py``): torch's (``TorchOps``: the eager step and the
per-part graphs), the Triton step kernels (``KernelOps``: the one-graph step) or the CPU's int4 calls (``CpuOps``;
over a resident cache its ``resident_step``, the same calls in one loop, which a CPU's Python cost asks for).

Contract:
- ``DecodeStep.supports(model)``: a plain causal Llama / Qwen2 decoder (``attention.plain_causal``) whose modules
  have the standard names; anything else keeps the model's forward.
- ``step(token_id, cache) -> logits [vocab]`` appends one token at position ``cache.get_seq_length()``, updating
  ``cache`` exactly as the model's forward would (``cache.update``; a TieredCache then ``attend``s, any other
  Cache gets one fused attention call over what ``update`` returned).
- With a ``StaticKV`` (a fixed-capacity cache on the device: a resident TieredCache's pool, ``static_view``) or a
  ``SparseKV`` (off the pool, ``kv/sparse_step.py``), the *whole* step, attention included, is one CUDA graph: no
  host work between layers, so the step costs what the GPU needs. Captured again when its buffers change. On a GPU
  with Triton its kernels are ``kv/step_kernels.py``'s (seven launches a layer for an int4 model: norms, gating
  and residuals folded into the int4 gemv, rotary + pool write, split-K attention), built by ``warm_up`` at engine
  start; a kernel that fails to build or run turns them off once (``kernels_failed``) and the step runs on torch's
  kernels. Other caches (a DynamicCache, a cache in the middle of paging) keep the per-part graphs.
- Batch size 1. The graphs hold a few MB of activations; they are made at the first step.
- ``cpu``: the CPU's kernels for int4 models (``step_ops.CpuOps``), or None. Setting it to None runs the step on
  torch's kernels instead (the same logits; benchmarks/cpu_time.py compares the two); ``step_graphs``: the
  one-graph steps recorded, read-only outside this class (``Engine.step_graphs`` counts them).
"""

from __future__ import annotations

import functools
import logging

import torch

from ..kv import attention
from ..kv import step_kernels
from ..kv.static import StaticKV, step_target   # StaticKV: tests and benchmarks import it from here too
from .host_embedding import HostEmbedding
from .step_ops import RMS_NORMS, CpuOps, KernelOps, TorchOps, rms_norm

log = logging.getLogger("flashguard")


class DecodeStep:
    def __init__(self, model, graphs: bool | None = None, whole_step: bool | None = None,
                 kernels: bool | None = None):
        """``graphs``: record CUDA graphs (default: on CUDA). ``whole_step``: run a resident TieredCache's step as
        the one-graph step's kernels (default: with graphs; eagerly it only serves tests, since on a CPU the
        masked full-capacity attention costs more than attending the used keys). ``kernels``: the one-graph step
        launches ``step_kernels`` (default: where they pass their self-check on this GPU and take this model's
        shape; the tests force them on the CPU under Triton's interpreter)."""
        inner = model.model
        self.embed, self.layers, self.norm, self.lm_head = inner.embed_tokens, inner.layers, inner.norm, model.lm_head
        self.rotary = inner.rotary_emb
        first = self.layers[0].self_attn
        self.head_dim, self.scaling = first.head_dim, first.scaling
        weight = self.norm.weight   # (the embedding table may live in host RAM: host_embedding.py)
        self.device, self.dtype = weight.device, weight.dtype
        # a host table the GPU cannot read itself: the token's row is copied in before each step (zero-copy: the
        # step's graph looks it up like a device table, host_embedding.py)
        self.host_embed = isinstance(self.embed, HostEmbedding) and not self.embed.zero_copy
        self.use_graphs = self.device.type == "cuda" if graphs is None else graphs
        self.whole_step = self.use_graphs if whole_step is None else whole_step
        n = len(self.layers)
        hq = model.config.num_attention_heads
        self.token = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.embedded = torch.zeros((1, 1, model.config.hidden_size), dtype=self.dtype, device=self.device) \
            if self.host_embed else None
        self.position = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.attn_out = [torch.zeros((1, 1, hq * self.head_dim), dtype=self.dtype, device=self.device)
                         for _ in range(n)]
        self.used = None   # the one-graph step's key count (a device tensor made at its first layer)
        self.sparse_graphs = True   # off the pool, the whole sparse step as one graph (until a capture fails)
        self.graphs: list | None = None
        self.outputs: list | None = None
        self.step_graphs: dict = {}   # kv.static.GraphKey -> (graph, logits): the one-graph steps recorded
        if kernels is None:
            kernels = self.use_graphs and step_kernels.available(self.device)
        self.kernels = kernels and _kernels_take(model, self.head_dim) and \
            (self.dtype in (torch.float16, torch.bfloat16) or self.device.type == "cpu")   # (fp32 dots: tf32)
        # int4 q/k/v and gate/up as one kernel call each: on the CPU, where each call costs host time, and in the
        # step kernels' one-graph step, where each launch costs GPU time
        self.fused = [_fuse(layer) for layer in self.layers] if self.kernels or not self.use_graphs else [None] * n
        self.torch_ops, self.kernel_ops = TorchOps(self), KernelOps(self)
        self.cpu = CpuOps.make(self)   # the CPU's kernels for int4 models (step_ops.py), else None

    @torch.inference_mode()
    def warm_up(self, page_size: int | None = None, pages: int = 0, int8: bool = False) -> None:
        """Build the step kernels now, eagerly over a throwaway 64-token StaticKV (``int8``: an int8 one too):
        Triton compiles each kernel at its first use (1-3 s on a machine whose cache does not hold them yet),
        which would otherwise land in the first answer's latency. With ``page_size`` and ``pages`` (the pages a
        sparse step reads: kv_heads x budget pages), the sparse step's kernels too, over a one-page int8 arena.
        This is also their gate: a kernel that fails to build or run here turns them off (``kernels_failed``).
        Touched besides: the step's own input buffers, and a streamed layer's slots (filled again before use)."""
        if not self.kernels:
            return
        try:
            self._warm_up(page_size, pages, int8)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:   # noqa: BLE001 - Triton's errors are not RuntimeErrors
            self.kernels_failed(exc)

    def _warm_up(self, page_size: int | None, pages: int, int8: bool) -> None:
        config = self.layers[0].self_attn.config
        kvh = config.num_key_value_heads
        shape = (len(self.layers), kvh, 64, self.head_dim)
        kv = StaticKV(torch.zeros(shape, dtype=self.dtype, device=self.device),
                      torch.zeros(shape, dtype=self.dtype, device=self.device), 0)
        self.token.zero_()
        self.position.zero_()
        if self.embedded is not None:
            self.embedded.zero_()
        self._kernel_layers(kv)
        if int8 and step_kernels.supported(self.head_dim, int8=True):
            self._kernel_layers(kv.quantized())
        if page_size and pages:
            one = torch.ones(1, dtype=torch.long, device=self.device)
            q = torch.zeros((config.num_attention_heads, self.head_dim), dtype=self.dtype, device=self.device)
            step_kernels.page_bounds(q, torch.zeros((kvh, 2 * self.head_dim, 64), dtype=self.dtype,
                                                    device=self.device), one - 1, one)
            from ..kv import codecs
            from ..kv.arena import L2Arena

            page = torch.zeros((1, kvh, page_size, self.head_dim), dtype=self.dtype)
            arena = L2Arena(pin=self.device.type == "cuda")
            slot = arena.write(codecs.encode(page, page, "int8"))
            if not step_kernels.PageRead.takes(arena.layout, page_size, self.head_dim):
                return
            read = step_kernels.PageRead(torch.full((pages,), slot, dtype=torch.long, device=self.device),
                                         arena.data[0], arena.layout, page_size)
            step_kernels.decode_attention(q, kv.keys[0], kv.values[0], one.to(torch.int32), self.scaling, pages=read)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)   # (the arena is read by the kernel: keep it until done)

    @staticmethod
    def supports(model) -> bool:
        inner = getattr(model, "model", None)
        if inner is None or not attention.plain_causal(model.config):
            return False
        names = ("embed_tokens", "layers", "norm", "rotary_emb")
        if not all(hasattr(inner, n) for n in names) or not hasattr(model, "lm_head"):
            return False
        layer = inner.layers[0]
        return all(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and not \
            hasattr(layer.self_attn, "q_norm")

    # ---- the layer, once: ``ops`` (step_ops.py) are the device's kernels ---------------------
    def _before(self, ops, i: int, h: torch.Tensor, rot) -> tuple:
        """Layer ``i`` up to its attention: this token's (q, k, v), rotated where ``ops`` rotates them."""
        layer, fused = self.layers[i], self.fused[i]
        if fused is not None:   # q and k side by side in one output: ``qk`` lets ``rope`` rotate them at once
            nq, nk, nv = fused[1]
            qk, v = ops.linear(fused[0], h, norm=layer.input_layernorm).split((nq + nk, nv), dim=-1)
            q, k = qk.split((nq, nk), dim=-1)
            return ops.rope(q, k, v, rot, qk)
        attn, x = layer.self_attn, ops.norm(layer.input_layernorm, h)
        return ops.rope(ops.linear(attn.q_proj, x), ops.linear(attn.k_proj, x), ops.linear(attn.v_proj, x), rot)

    def _after(self, ops, i: int, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` from its attention's output ``out``: o_proj and the residual, the MLP and the residual."""
        layer, fused = self.layers[i], self.fused[i]
        h = ops.linear(layer.self_attn.o_proj, out, residual=h)
        if fused is None:
            return h + layer.mlp(ops.norm(layer.post_attention_layernorm, h))
        gate_up = ops.linear(fused[2], h, norm=layer.post_attention_layernorm)
        return ops.linear(layer.mlp.down_proj, gate_up, residual=h, act=layer.mlp.act_fn)

    def _run(self, ops, attend) -> torch.Tensor:
        """The whole step eagerly: ``attend(i, q, k, v, rot) -> out`` between the halves of each layer."""
        h, rot = ops.start()
        for i in range(len(self.layers)):
            q, k, v = self._before(ops, i, h, rot)
            h = self._after(ops, i, h, attend(i, q, k, v, rot))
        return ops.finish(h)

    def _between(self, i: int, inputs: tuple) -> tuple:
        """The per-part graphs' part ``i`` (torch's kernels): the work between attention ``i - 1`` and attention
        ``i``, ``(h, rot, q, k, v)``; part 0 embeds the token, the last one ends with the logits ``(logits,)``.
        The same calls as ``_run(self.torch_ops, ...)``."""
        ops = self.torch_ops
        if i == 0:
            h, rot = ops.start()
        else:
            h, rot = inputs
            h = self._after(ops, i - 1, h, self.attn_out[i - 1])
        if i == len(self.layers):
            return (ops.finish(h),)
        return (h, rot, *self._before(ops, i, h, rot))

    def attend_layer(self, i: int, target, q, k, v) -> None:
        """Layer ``i``'s attention in the layer-by-layer step: ``target`` (``kv.static.step_target``: the cache
        the step runs over) appends ``k``, ``v`` ``[1, kvh, 1, D]`` and attends ``q`` ``[1, Hq, 1, D]``; the result is
        written to ``attn_out[i]`` (what the next part, or the CPU's ops, read)."""
        out = target.attend_layer(i, q, k, v, self.scaling)          # [Hq, 1, D]
        self.attn_out[i].copy_(out.reshape(1, 1, -1))

    def _attend_static(self, i: int, kv, q, k, v) -> None:
        """Write this token's k, v at ``position`` (a SparseKV: at its L1 position) and attend over what is
        written (a SparseKV: L1 and its selected pages): the view's own ``attend`` (kv/static.py)."""
        if i == 0:
            self.used = (self.position[0] + 1).to(torch.int32)
        split = self.split_kernel if getattr(kv, "scales", None) is not None else False   # an int8 pool's codes
        out = kv.attend(i, q[0, :, 0], k[0], v[0], self.scaling, position=self.position[0], used=self.used,
                        split=split)
        self.attn_out[i].copy_(out.reshape(1, 1, -1))

    @functools.cached_property
    def split_kernel(self) -> bool:
        """An int8 pool attended outside the step kernels (a model they do not compute, an int8 head they do not
        rotate) still reads its codes with their split-K attention, on a GPU where it passes its self-check, for a
        16-bit model (fp32 dots would run in tf32). A failure of it is raised, as for any kernel the step kernels
        did not launch (``kernels_failed``)."""
        return self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16) and \
            step_kernels.supported(self.head_dim) and \
            step_kernels.available(self.device)

    def _kernel_layers(self, kv) -> torch.Tensor:
        """The whole step over ``kv`` (a StaticKV or SparseKV) on ``step_kernels`` (``KernelOps``): per layer qkv
        (norm folded in), rotary + pool write, attention (two launches), o_proj (+ residual), gate_up (norm folded
        in), down (gating in, + residual); the same result as ``_layers(self._attend_static, kv)`` to rounding."""
        return self._run(self.kernel_ops, functools.partial(self.kernel_ops.attend, kv))

    def _static_layers(self, kv) -> torch.Tensor:
        """The whole step over ``kv``: the step kernels where they run (an int8 pool: where its head size splits
        into whole scale groups), else the parts with ``_attend_static``."""
        int8 = getattr(kv, "scales", None) is not None
        if self.kernels and (not int8 or step_kernels.supported(self.head_dim, int8=True)):
            return self._kernel_layers(kv)
        return self._layers(self._attend_static, kv)

    def kernels_failed(self, exc: Exception) -> bool:
        """A step kernel that does not build or run on this GPU (a Triton compilation or launch error): torch's
        kernels from now on, said once. True when that is what happened (the caller runs the step again); False
        for an error the step kernels did not cause (they were off)."""
        if not self.kernels:
            return False
        log.warning("flashguard: the decode step's Triton kernels failed here (%s: %s); decoding on torch's "
                    "kernels instead", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        self.kernels = False
        return True

    def _layers(self, attend, cache) -> torch.Tensor:
        """The step on torch's kernels with ``attend(i, cache, q, k, v)`` (which fills ``attn_out[i]``): the eager
        step, or (with ``_attend_static``) the one-graph step without the step kernels."""
        def attend_into(i, q, k, v, rot):
            attend(i, cache, q, k, v)
            return self.attn_out[i]

        return self._run(self.torch_ops, attend_into)

    # ---- running -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, token_id: int, cache) -> torch.Tensor:
        self.token.fill_(int(token_id))
        self.position.fill_(cache.get_seq_length())
        if self.host_embed:
            self.embedded.copy_(self.embed.rows(torch.tensor([[int(token_id)]])))
        target = step_target(cache)   # what the step asks the cache (kv/static.py's interface)
        # the whole step, attention included, as one graph: over the pool (a StaticKV) or off it (a SparseKV)
        view = target.decode_view(self.whole_step, self.sparse_graphs)
        if view is not None:
            logits = self._whole_step(view)
            # pages the sparse step picked were only on disk (L3): promoted to L2 now, the step again
            while target.promote_missed():
                view = target.decode_view(self.whole_step, self.sparse_graphs)
                if view is None:   # (cannot happen: nothing the view depends on changed but the slots)
                    return self._layers(self.attend_layer, target)
                logits = self._whole_step(view)
            target.advance(1)
            return logits
        if self.use_graphs and self.graphs is None:
            self._capture()
        if self.graphs is None and self.cpu is not None:   # the CPU's int4 calls
            view = self.cpu.resident(target)
            if view is not None and self.cpu.layer_args is not None:   # the generic layer's calls in one loop
                logits = self.cpu.resident_step(view)
            else:
                logits = self._run(self.cpu, functools.partial(self.cpu.attend, target, view))
            if view is not None:
                target.advance(1)
            return logits
        if self.graphs is None:  # eager: the same parts
            return self._layers(self.attend_layer, target)
        n = len(self.layers)
        for i in range(n):
            self.graphs[i].replay()
            self.attend_layer(i, target, *self.outputs[i][2:])
        self.graphs[n].replay()
        return self.outputs[n][0].clone()  # the graph's own output changes at the next replay

    MAX_STEP_GRAPHS = 8   # one per StaticKV key (buffers and visible capacity) in use; the oldest goes first

    def forget_steps(self, keep: set[int] | None = None) -> None:
        """A cache's buffers are gone (its session ended): the one-graph steps recorded over them go too, and the
        device memory their graphs hold (each graph keeps its own pool) is given back: kept, a few sessions'
        graphs added up past the budget (a 128K new session after 8K and 32K conversations ran out of memory in a
        4 GiB budget). With ``keep`` (the addresses of buffers the next session will run on: the
        engine's ``PoolBuffers.ptrs()``) only the steps recorded over other buffers go."""
        if keep is None:
            self.step_graphs.clear()
            return
        for key in [k for k in self.step_graphs if not k.buffers() <= keep]:
            del self.step_graphs[key]

    def _whole_step(self, kv) -> torch.Tensor:
        """One step over the view ``kv`` as one graph (recorded once per ``kv.key``), or eagerly without graphs;
        the caller counts the token (``advance``)."""
        entry = self.step_graphs.get(kv.key)
        if self.use_graphs and entry is None:
            entry = self._capture_step(kv)
        if entry is None:
            try:
                logits = self._static_layers(kv)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as exc:   # noqa: BLE001 - a step kernel that fails here: torch's kernels, once
                if not self.kernels_failed(exc):
                    raise
                logits = self._static_layers(kv)
        else:
            entry[0].replay()
            logits = entry[1].clone()  # the graph's own output changes at the next replay
        return logits

    def _record(self, warm_up, record, sparse: bool = False):
        """``warm_up()`` on a side stream (lazy inits, kernel choices, outside capture), then ``record()`` (which
        captures graphs and returns what to keep). Where capture fails, None: steps stay eager, said once; where
        only the sparse step's capture fails, only sparse steps leave the one-graph path (``sparse_graphs``)."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm_up()
            torch.cuda.current_stream().wait_stream(side)
            return record()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:   # noqa: BLE001 - Triton's errors are not RuntimeErrors
            if self.kernels_failed(exc):
                return self._record(warm_up, record, sparse)
            if not isinstance(exc, RuntimeError):   # (a module that cannot be captured raises a RuntimeError)
                raise
            if sparse:
                log.warning("flashguard: sparse decode steps run layer by layer (one-graph capture failed: %s)", exc)
                self.sparse_graphs = False
                return None
            log.warning("flashguard: decode runs without CUDA graphs (%s)", exc)
            self.use_graphs = False
            return None

    def _capture_step(self, kv):
        """The whole step over ``kv`` as one graph (its warm-up writes what the replay writes again); returns
        ``(graph, logits)``, kept under ``kv.key``, or None where capture failed."""
        def record():
            graph = torch.cuda.CUDAGraph()
            # thread_local: the store's L3 writer (kv/store.py, its own thread and stream) may run codec work on the
            # GPU meanwhile; the default (global) mode made its calls fail (a 128K turn)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = self._static_layers(kv)
            return graph, logits

        for old in [k for k in self.step_graphs if k.replaced_by(kv.key)]:
            del self.step_graphs[old]
        while len(self.step_graphs) >= self.MAX_STEP_GRAPHS:
            self.step_graphs.pop(next(iter(self.step_graphs)))
        entry = self._record(lambda: self._static_layers(kv), record, kv.key.kind == "sparse")
        if entry is not None:
            self.step_graphs[kv.key] = entry
        return entry

    def _capture(self) -> None:
        """The layers + 1 parts, each reading the previous one's outputs, as graphs in one memory pool."""
        def warm_up():
            out = self._between(0, ())
            for i in range(1, len(self.layers) + 1):
                out = self._between(i, out[:2])

        def record():
            pool = torch.cuda.graph_pool_handle()
            graphs, outputs, prev = [], [], ()
            for i in range(len(self.layers) + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):   # (as above)
                    out = self._between(i, prev)
                graphs.append(g)
                outputs.append(out)
                prev = out[:2]
            return graphs, outputs

        self.graphs, self.outputs = self._record(warm_up, record) or (None, None)


def _fuse(layer):
    """``(qkv, (q, k, v sizes), gate_up)``: a layer's int4 projections concatenated (``int4_linear.concat_rows``),
    or None where they are not all Int4Linear layers that concatenate. Kept on the layer as ``flashguard_fused``, so
    several steps over one model (engines sharing it) share one copy."""
    from ..quant.int4_linear import Int4Linear, concat_rows

    if hasattr(layer, "flashguard_fused"):
        return layer.flashguard_fused
    attn, mlp = layer.self_attn, layer.mlp
    parts = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    if not all(isinstance(m, Int4Linear) for m in parts) or not hasattr(mlp, "act_fn") or \
            mlp.gate_proj.out_features != mlp.up_proj.out_features:
        return None
    qkv, gate_up = concat_rows(list(parts[:3])), concat_rows(list(parts[3:]))
    fused = None if qkv is None or gate_up is None else (qkv, tuple(m.out_features for m in parts[:3]), gate_up)
    object.__setattr__(layer, "flashguard_fused", fused)   # not a submodule: state_dict and .to() stay as they were
    return fused


def _kernels_take(model, head_dim: int) -> bool:
    """``step_kernels`` compute this model's layers: RMSNorms, a SiLU-gated MLP, a head size the kernels take."""
    layer = model.model.layers[0]
    return step_kernels.supported(head_dim) and getattr(model.config, "hidden_act", None) == "silu" and \
        all(type(m).__name__ in RMS_NORMS for m in (layer.input_layernorm, layer.post_attention_layernorm))


def fuse_norms(model) -> int:
    """Every Llama / Qwen2 RMSNorm of ``model`` runs as ``step_ops.rms_norm`` (one fused kernel on a GPU) in the
    model's own forward too, so a prompt's chunks launch what the decode step launches: transformers' module
    launches eight kernels, 57 times a chunk for the 28-layer 1.5B shape, a quarter of a 2048-token chunk's launches
    on a fast GPU (where a chunk's host time is about its GPU time). The modules are changed in place (a model the
    caller passed to the engine too). Returns how many modules were changed."""
    n = 0
    for module in model.modules():
        if type(module).__name__ in RMS_NORMS and "forward" not in vars(module):
            module.forward = functools.partial(rms_norm, module)
            n += 1
    return n


def greedy_step(model, cache, token: torch.Tensor, step: "DecodeStep | None", kwarg: str = "past_key_values"):
    """One greedy token ``[1, 1]`` after ``token`` ``[1, 1]``: through ``step`` when given, else the model's forward
    (what transformers runs), in the cache's forward protocol (``kv.session.forwarding``). ``flashguard stress``'s
    and the benchmarks' loop."""
    from ..kv.session import forwarding

    with forwarding(cache, token[0].tolist()):
        if step is not None:
            return step.step(int(token[0, 0]), cache).argmax(-1).view(1, 1)
        out = model(input_ids=token, **attention.forward_kwargs(kwarg, cache), logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True)
