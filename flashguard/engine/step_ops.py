"""The kernels a decode step's layer runs, one set per device path: ``DecodeStep`` writes the layer once
(``_before`` / ``_after`` in ``decode_step.py``) and plugs one of these in (one exception, for speed:
``CpuOps.resident_step``, below).

Why: a Llama / Qwen2 layer is the same arithmetic everywhere (RMSNorm, q/k/v, rotary, attention, o_proj and the
residual, RMSNorm, the gated MLP and the residual), but what is fast differs by device. On a GPU without the step
kernels, the model's own modules and torch's kernels, recorded as CUDA graphs between attention calls. On a GPU with
them, Triton launches with the norm, the gating and the residual folded into the int4 gemv and rotary folded into
the pool write (``kv/step_kernels.py``). On a CPU an int4 step is bound by the host work around its kernels: the
fewest PyTorch calls a layer (SmolLM2-135M's 30 layers ran ~60 aten calls each through the model's modules, ~7 ms
of a 16 ms step on 2 cores, docs/benchmarks/cpu_decode.md).

Each set has the same five methods (``CpuOps`` adds ``resident_step`` and its ``layer_args``):
- ``start() -> (h, rot)``: this token's embedding (``step.token`` at ``step.position``) and its rotary angles in the
  form the set's ``rope`` takes (``KernelOps`` also sets ``step.used``, the key count its attention reads);
- ``norm(module, h)``: an RMSNorm (or any norm module);
- ``linear(module, x, residual=None, norm=None, act=None) -> residual + module(f(x))``, ``f`` the RMSNorm ``norm``
  and / or the MLP's gating ``act(gate) * up`` (x = [gate, up]);
- ``rope(q, k, v, rot, qk=None) -> (q, k, v)`` in the layout the set's attention takes (``KernelOps``: unchanged,
  its ``rope_write`` rotates as it writes the pool); ``qk``: q and k side by side in one tensor (the fused q/k/v's
  output, of which q and k are views), which a set may rotate at once;
- ``finish(h) -> logits [vocab]``: the final norm and the lm_head.
The attention is ``attend(i, q, k, v, rot) -> out`` given to ``DecodeStep._run`` beside the set: it depends on what
the step runs over, so it is bound to it by the caller (``KernelOps.attend(kv, ...)`` over a view: a StaticKV or
SparseKV, through its ``slot`` and ``attend``; ``CpuOps.attend(target, view, ...)``; torch's kernels use
``DecodeStep.attend_layer`` / ``_attend_static``). No set keeps state between steps but preallocated buffers.

- ``TorchOps``: the model's modules, ``F.rms_norm`` for its RMSNorms (one kernel on a GPU where transformers'
  module launches eight), rotary in one pass over q and k; shapes ``[1, 1, H]``.
- ``KernelOps``: ``Int4Linear.fused_gemv`` for Triton-backend int4 layers (one launch: qkv with its norm, o_proj
  with the residual, gate_up with its norm, down with the gating and the residual), torch for other modules;
  attention by ``step_kernels`` over a ``StaticKV`` pool or a ``SparseKV``; shapes ``[1, H]``.
- ``CpuOps`` (``CpuOps.make(step)``, or None): an fp32 int4 model on the CPU with fused q/k/v and gate/up on the
  ``cpu`` backend. The int4 kernel (``aten._weight_int4pack_mm_for_cpu``) called directly; RMSNorm as a dot
  product, a reciprocal square root and a multiply by the weight that writes bf16 where an int4 kernel reads it;
  the MLP's product written in bf16 the same way; rotary as a small matmul (``x @ (diag(cos) + R diag(sin))``, the
  matrix made once a step); a resident TieredCache (``static_view``: every token in its L1 buffer) written and
  attended by ``baddbmm`` / ``softmax`` / ``bmm`` (one query: faster here than the CPU flash kernel, 13 against 19 us
  at 64 keys, 62 against 73 at 512, one thread), any other cache through ``DecodeStep.attend_layer``. Over a resident
  cache the step is ``CpuOps.resident_step``: the same calls as ``DecodeStep._run`` with this set, bit for bit, in
  one loop over per-layer argument tuples (``layer_args``): 4-9% / 12-16% faster than the generic layer on the
  embedded model at one / two threads, the one place the layer is written twice, for that reason (the loop is
  engine/cpu_loop.py's ``layers``, run as TorchScript: the same calls without Python between them). The residual
  stream, rotary, the MLP's activation and the attention stay in fp32, so the logits are the model's forward's up
  to fp32 rounding (tests/engine/test_cpu_decode.py).
"""

from __future__ import annotations

import math

import torch

from ..kv import step_kernels
from . import cpu_loop

# the RMSNorm classes whose forward is weight * x / rms(x)
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
_SILUS = ("SiLU", "SiLUActivation")   # torch's and transformers' (ACT2FN["silu"])


def rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for the RMSNorms of Llama / Qwen2 as one ``F.rms_norm`` call (one fused kernel on a GPU, where
    transformers' module launches eight); any other norm module runs as it is."""
    if type(module).__name__ in RMS_NORMS:
        return torch.nn.functional.rms_norm(x, module.weight.shape, module.weight, module.variance_epsilon)
    return module(x)


def _torch_linear(module, x: torch.Tensor, residual: torch.Tensor | None = None, norm=None,
                  act=None) -> torch.Tensor:
    if norm is not None:
        x = rms_norm(norm, x)
    if act is not None:
        gate, up = x.chunk(2, dim=-1)
        x = act(gate) * up
    out = module(x)
    return out if residual is None else residual + out


class StepOps:
    """What the three sets share: the step they serve and ``norm``; ``embedding()``, this token's embedding row."""
    norm = staticmethod(rms_norm)

    def __init__(self, step):
        self.step = step

    def embedding(self) -> torch.Tensor:
        s = self.step
        return s.embedded.clone() if s.host_embed else s.embed(s.token)   # [1, 1, H]


class TorchOps(StepOps):
    linear = staticmethod(_torch_linear)

    def __init__(self, step):
        super().__init__(step)
        half = step.head_dim // 2   # rotate_half(x) = roll(x, D/2) * sign: the sign goes into sin once a step
        self.sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(step.device, step.dtype)

    def start(self) -> tuple:
        h = self.embedding()
        cos, sin = self.step.rotary(h, self.step.position)
        return h, (cos.unsqueeze(1), (sin * self.sign).unsqueeze(1))        # [1, 1, 1, D]

    def rope(self, q, k, v, rot, qk=None) -> tuple:
        """[1, heads, 1, D] each; q and k rotated in one pass (4 kernels instead of transformers' 10):
        x*cos + rotate_half(x)*sin."""
        d = self.step.head_dim
        heads = q.shape[-1] // d
        qk = torch.cat([q, k], -1) if qk is None else qk
        qk, v = (t.view(1, 1, -1, d).transpose(1, 2) for t in (qk, v))
        cos, sin = rot
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
        return qk[:, :heads], qk[:, heads:], v

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.step.lm_head(rms_norm(self.step.norm, h))[0, -1]


def _kernel_linear(module, x: torch.Tensor, residual: torch.Tensor | None = None, norm=None,
                   act=None) -> torch.Tensor:
    """One launch for a Triton-backend Int4Linear (``Int4Linear.fused_gemv``; its gating is SiLU, which
    ``DecodeStep`` checks before it takes the step kernels), torch ops for any other module."""
    from ..quant.int4_linear import Int4Linear

    if isinstance(module, Int4Linear) and module.backend == "triton":
        return module.fused_gemv(x, residual, None if norm is None else (norm.weight, norm.variance_epsilon),
                                 act is not None)
    return _torch_linear(module, x, residual, norm, act)


class KernelOps(StepOps):
    linear = staticmethod(_kernel_linear)

    def start(self) -> tuple:
        s = self.step
        h = self.embedding().view(1, -1)
        cos, sin = s.rotary(h.view(1, 1, -1), s.position)
        s.used = (s.position[0] + 1).to(torch.int32)
        return h, (cos.reshape(-1), sin.reshape(-1))

    @staticmethod
    def rope(q, k, v, rot, qk=None) -> tuple:
        return q, k, v   # rotated by ``rope_write`` as it writes the pool

    def attend(self, kv, i: int, q, k, v, rot) -> torch.Tensor:
        """Rotary, this token's k / v into the pool (a SparseKV: into L1 at its position), attention; [1, Hq * D]."""
        s = self.step
        pos, keys, values, ks, vs = kv.slot(i, s.position[0])   # (a SparseKV: L1 at its own position)
        q = step_kernels.rope_write(q, k, v, *rot, pos, keys, values, ks, vs)
        return kv.attend(i, q, None, None, s.scaling, used=s.used).view(1, -1)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.step.lm_head(rms_norm(self.step.norm, h.view(1, 1, -1)))[0, -1]


class CpuOps(StepOps):
    # the int4 kernel, called directly; an instance's may be replaced (a measurement of the step without its int4
    # work: benchmarks/cpu_decode.py --breakdown) and deleted again to restore the class's
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default

    def __init__(self, step, int4: dict, norms: dict):
        super().__init__(step)
        self.int4, self.norms = int4, norms
        self.layer_args = self._layer_args()   # per layer, what ``resident_step`` reads (None: the generic layer)
        # ``cpu_loop.layers``' arguments, and whether it runs scripted once engine/cpu_loop.py has made it
        # (``use_script`` False: as Python always, as where TorchScript is not there)
        self.loop_args = self._loop_args() if self.layer_args is not None else None
        self.use_script = self.layer_args is not None
        if self.use_script:
            cpu_loop.start()
        self.final_norm = _norm(step.norm)
        self.buffers: dict = {}   # bf16 inputs of the int4 kernels (RMSNorm's output, the MLP's activation)
        self.zero = torch.zeros(())
        d, half = step.head_dim, step.head_dim // 2
        self.rotate_half = torch.zeros(d, d)   # x @ rotate_half = cat(-x[half:], x[:half])
        self.rotate_half[torch.arange(half, d), torch.arange(half)] = -1
        self.rotate_half[torch.arange(half), torch.arange(half, d)] = 1

    @classmethod
    def make(cls, step) -> "CpuOps | None":
        if step.use_graphs or step.host_embed or step.device.type != "cpu" or step.dtype != torch.float32 or \
                type(step.norm).__name__ not in RMS_NORMS:
            return None
        int4, norms = {}, {}   # id(module) -> its int4 call's arguments / its RMSNorm's (weight * sqrt(H), eps H)
        for layer, fused in zip(step.layers, step.fused):
            attn, mlp = layer.self_attn, layer.mlp
            if fused is None or fused[0].backend != "cpu" or type(mlp.act_fn).__name__ not in _SILUS:
                return None
            for module in (fused[0], attn.o_proj, fused[2], mlp.down_proj):
                int4[id(module)] = _int4_args(module)
                if int4[id(module)] is None:
                    return None
            for n in (layer.input_layernorm, layer.post_attention_layernorm):
                if type(n).__name__ not in RMS_NORMS:
                    return None
                norms[id(n)] = _norm(n)
        return cls(step, int4, norms)

    def _layer_args(self) -> list | None:
        """Per layer ``(qkv, o_proj, gate_up, down, qkv's bias, input norm, post-attention norm, q heads, q + k
        columns)``, each int4 call as its ``(packed, group, scale_zeros)`` and each norm as ``_norm``'s pair:
        ``resident_step``'s loop reads them as locals. None where a layer is not the plain case (a Q8_0 matrix as an
        int4 pair, a bias past q/k/v): ``DecodeStep.step`` then runs the generic layer for every layer (a mixed
        file keeps the generic speed)."""
        args, d = [], self.step.head_dim
        for layer, (qkv, (nq, nk, _), gate_up) in zip(self.step.layers, self.step.fused):
            calls = [self.int4[id(m)] for m in (qkv, layer.self_attn.o_proj, gate_up, layer.mlp.down_proj)]
            if any(c[4] for c in calls) or any(c[3] is not None for c in calls[1:]):
                return None
            args.append((*(c[:3] for c in calls), calls[0][3], self.norms[id(layer.input_layernorm)],
                         self.norms[id(layer.post_attention_layernorm)], nq // d, nq + nk))
        # ``cpu_loop.layers`` takes layer 0's head counts for every layer (Llama, Qwen2): else the generic layer
        return args if len({a[7:] for a in args}) == 1 else None

    def _loop_args(self) -> tuple:
        """``layer_args`` as ``cpu_loop.layers`` takes them: lists over the layers (four int4 calls each)."""
        packed, groups, scale_zeros, biases, w1, e1, w2, e2 = [], [], [], [], [], [], [], []
        for qkv, o, gate_up, down, bias, (a, b), (c, e), _, _ in self.layer_args:
            for call in (qkv, o, gate_up, down):
                packed.append(call[0])
                groups.append(int(call[1]))
                scale_zeros.append(call[2])
            biases.append(bias)
            w1.append(a)
            e1.append(float(b))
            w2.append(c)
            e2.append(float(e))
        return packed, groups, scale_zeros, biases, w1, e1, w2, e2

    def _buffer(self, name: str, n: int) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape[1] != n:
            buf = self.buffers[name] = torch.empty((1, n), dtype=torch.bfloat16)
        return buf

    @staticmethod
    def _rms(h: torch.Tensor, norm: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of ``h`` ``[1, H]`` written into ``out`` (its dtype; None: a new fp32 tensor):
        ``h * w * rsqrt(mean(h^2) + eps)``, with ``w * sqrt(H)`` kept so that the mean is a dot product:
        ``rsqrt(h.h + eps H)``."""
        weight, eps_h = norm
        v = h.view(-1)
        return torch.mul(torch.mul(h, weight), torch.dot(v, v).add_(eps_h).rsqrt_(), out=out)

    def linear(self, module, x: torch.Tensor, residual: torch.Tensor | None = None, norm=None,
               act=None) -> torch.Tensor:
        packed, group, scale_zeros, bias, pair = self.int4[id(module)]
        if norm is not None:
            x = self._rms(x, self.norms[id(norm)], self._buffer("x", x.shape[1]))
        if act is not None:
            gate, up = x.chunk(2, -1)
            x = torch.mul(act(gate), up, out=self._buffer("act", gate.shape[1]))
        elif x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        out = self.mm(torch.cat([x, x], -1) if pair else x, packed, group, scale_zeros)
        if bias is not None:
            out = torch.add(bias, out)   # as Int4Linear: the bias in the model's dtype
        return out.to(torch.float32) if residual is None else residual + out

    @staticmethod
    def resident(target):
        """The step target's pool as a StaticKV when every token is there in 16 bits (``decode_view``, a resident
        TieredCache's ``static_view``): ``attend`` writes and attends it itself, and the caller advances the cache
        after the step; else None (the cache's own update and attention; an int8 pool too)."""
        view = target.decode_view(True, False)
        return None if view is not None and view.scales is not None else view

    def start(self) -> tuple:
        s = self.step
        d = s.head_dim
        h = self.embedding().view(1, -1)                               # [1, H]
        cos, sin = s.rotary(h, s.position)
        # rotary as one matmul a layer: x cos + rotate_half(x) sin = x @ (diag(cos) + R diag(sin))
        return h, torch.diag_embed(cos.view(d)).addcmul_(self.rotate_half, sin.view(1, d))

    def rope(self, q, k, v, rot, qk=None) -> tuple:
        """[heads, D] each, rotated by a matmul (one for both where ``qk`` holds them side by side)."""
        d = self.step.head_dim
        if qk is None:
            return torch.mm(q.view(-1, d), rot), torch.mm(k.view(-1, d), rot), v
        qk = torch.mm(qk.view(-1, d), rot)
        return qk[:q.shape[-1] // d], qk[q.shape[-1] // d:], v

    def attend(self, target, view, i: int, q, k, v, rot) -> torch.Tensor:
        """Layer ``i``'s attention over ``target`` (the step's ``kv.static.step_target``); ``view``: its
        ``resident`` StaticKV, or None."""
        s, d = self.step, self.step.head_dim
        if view is None:
            s.attend_layer(i, target, q.view(1, -1, 1, d), k.view(1, -1, 1, d), v.view(1, -1, 1, d))
            return s.attn_out[i].view(1, -1)
        pos = view.length   # resident: this token's k, v into L1, attention over the keys in use
        keys, values = view.keys[i], view.values[i]                      # [kvh, capacity, D]
        kvh = keys.shape[0]
        keys.select(1, pos).copy_(k)
        values.select(1, pos).copy_(v.view(kvh, d))
        scores = torch.baddbmm(self.zero, q.view(kvh, -1, d), keys[:, :pos + 1].transpose(1, 2), beta=0,
                               alpha=s.scaling)
        return torch.bmm(torch.softmax(scores, -1), values[:, :pos + 1]).view(1, -1)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.step.lm_head(self._rms(h, self.final_norm))[0]

    def resident_step(self, view) -> torch.Tensor:
        """The step over ``view`` (``resident``'s StaticKV) with the arithmetic of ``DecodeStep._run(self, attend)``
        call for call, bit for bit (tests/engine/test_cpu_decode.py), as one loop over ``layer_args``: on a CPU the
        Python between the int4 calls is the step's other cost, and it grows in place (each kernel streams its codes
        through the caches the interpreter runs from): without the generic layer's method calls and lookups the
        embedded model decodes 4-9% faster at one thread, 12-16% at two (docs/benchmarks/cpu_decode.md). The MLP's
        activation is ``F.silu`` (what both ``_SILUS`` classes run); every layer has layer 0's sizes (Llama, Qwen2).
        Only with ``layer_args``; the caller advances the cache after. The loop is ``cpu_loop.layers``: scripted
        once engine/cpu_loop.py has made it (the same calls; 7-20% faster decoding at two threads), as Python
        before and where ``use_script`` is False."""
        s = self.step
        h, rot = self.start()
        x = self._buffer("x", h.shape[1])
        act = self._buffer("act", self.layer_args[0][2][0].shape[0] // 2)   # gate_up's rows: [gate, up]
        layers = (cpu_loop.ready() if self.use_script else None) or cpu_loop.layers
        q_heads, qk_cols = self.layer_args[0][7], self.layer_args[0][8]
        h = layers(h, rot, self.zero, x, act, *self.loop_args, list(view.keys), list(view.values), view.length,
                   q_heads, qk_cols, s.head_dim, float(s.scaling))
        return self.finish(h)


def _norm(module) -> tuple:
    h = module.weight.shape[0]
    return module.weight.float() * math.sqrt(h), module.variance_epsilon * h


def _int4_args(layer) -> tuple | None:
    """``(packed, group size, scales and zeros, bias, pair)`` of an Int4Linear on the ``cpu`` backend, or of an
    Int4PairLinear around one (a GGUF's Q8_0 matrix as two int4 halves over ``[x, x]``); else None."""
    from ..quant.gguf_int4 import Int4PairLinear
    from ..quant.int4_linear import Int4Linear

    pair = isinstance(layer, Int4PairLinear)
    inner = layer.inner if pair else layer
    if not isinstance(inner, Int4Linear) or inner.backend != "cpu":
        return None
    return inner.packed, inner.group_size, inner.scale_zeros, inner.bias, pair
