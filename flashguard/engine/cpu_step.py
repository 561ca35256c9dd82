"""The CPU's decode step for an int4 Llama / Qwen2 model: the fewest PyTorch calls a layer.

Why: on a CPU a decode step of a small int4 model is bound by the host work around its kernels. SmolLM2-135M's 30
layers ran ~60 aten calls each through ``DecodeStep._between`` (RMSNorm as a composite of ~9 ops, a bf16 cast on
each side of every int4 call, views and transposes of q/k/v, rotary, the tiered cache's update and attention in
Python), ~7 ms of a 16 ms step on 2 cores (docs/benchmarks/cpu_decode.md). ``CpuStep`` computes the same layer
with about half the calls, each cheap:

- the int4 kernel (``aten._weight_int4pack_mm_for_cpu``) called directly, q/k/v and gate/up fused
  (``decode_step._fuse``); RMSNorm as a dot product, a reciprocal square root and a multiply by the weight that
  writes bf16 where an int4 kernel reads it; the MLP's product written in bf16 the same way;
- rotary as one small matmul a layer (``x @ (diag(cos) + R diag(sin))``, the matrix made once a step);
- a resident TieredCache (``static_view``: every token in its L1 buffer, room for one more): this token's k / v
  written into L1 and the used keys attended by ``baddbmm`` / ``softmax`` / ``bmm`` (one query: faster here than
  the CPU flash kernel, 13 against 19 us at 64 keys, 62 against 73 at 512, one thread), the page bookkeeping
  once a step (``advance``). Any other cache goes through ``DecodeStep._attend`` (its own update and attention).

The residual stream, rotary, the MLP's activation and the attention stay in fp32, so the logits are the model's
forward's up to fp32 rounding (tests/engine/test_cpu_decode.py).

Contract: ``CpuStep.make(step)`` returns None unless ``step`` (a ``DecodeStep`` without CUDA graphs) is over an
fp32 model on the CPU whose every layer has fused int4 projections on the ``cpu`` backend, RMSNorms and a SiLU
MLP; ``run(cache)`` is ``DecodeStep.step``'s eager path (``step.token`` / ``step.position`` set), logits ``[vocab]``.
"""

from __future__ import annotations

import math

import torch

from ..kv.cache import TieredCache

# the RMSNorm classes whose forward is weight * x / rms(x) (decode_step.py fuses and steps over these too)
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
_SILUS = ("SiLU", "SiLUActivation")   # torch's and transformers' (ACT2FN["silu"])


class CpuStep:
    # the int4 kernel, called directly; an instance's may be replaced (a measurement of the step without its int4
    # work: benchmarks/cpu_decode.py --breakdown) and deleted again to restore the class's
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default

    def __init__(self, step, layers: list):
        self.step, self.layers = step, layers
        self.final_norm = _norm(step.norm)
        self.x = self.act = None   # bf16 buffers the int4 kernels read (RMSNorm's output, the MLP's activation)
        self.zero = torch.zeros(())
        d, half = step.head_dim, step.head_dim // 2
        self.rotate_half = torch.zeros(d, d)   # x @ rotate_half = cat(-x[half:], x[:half])
        self.rotate_half[torch.arange(half, d), torch.arange(half)] = -1
        self.rotate_half[torch.arange(half), torch.arange(half, d)] = 1

    @classmethod
    def make(cls, step) -> "CpuStep | None":
        if step.use_graphs or step.host_embed or step.device.type != "cpu" or step.dtype != torch.float32 or \
                type(step.norm).__name__ not in RMS_NORMS:
            return None
        layers = []
        for layer, fused in zip(step.layers, step.fused):
            attn, mlp = layer.self_attn, layer.mlp
            if fused is None or fused[0].backend != "cpu" or _kernel(attn.o_proj) is None or \
                    _kernel(mlp.down_proj) is None or type(mlp.act_fn).__name__ not in _SILUS or \
                    any(type(n).__name__ not in RMS_NORMS for n in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)):
                return None
            qkv, (nq, nk, nv), gate_up = fused
            layers.append((_norm(layer.input_layernorm), _kernel(qkv), nq, nk, nv, _kernel(attn.o_proj),
                           _norm(layer.post_attention_layernorm), _kernel(gate_up), _kernel(mlp.down_proj)))
        return cls(step, layers)

    def _rms(self, h: torch.Tensor, norm: tuple, out: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``h`` ``[1, H]`` written into ``out`` (its dtype): ``h * w * rsqrt(mean(h^2) + eps)``, with
        ``w * sqrt(H)`` kept so that the mean is a dot product: ``rsqrt(h.h + eps H)``."""
        weight, eps_h = norm
        v = h.view(-1)
        return torch.mul(torch.mul(h, weight), torch.dot(v, v).add_(eps_h).rsqrt_(), out=out)

    def _linear(self, x: torch.Tensor, kernel: tuple) -> torch.Tensor:
        packed, group, scale_zeros, bias, pair = kernel
        out = self.mm(torch.cat([x, x], -1) if pair else x, packed, group, scale_zeros)
        return out if bias is None else torch.add(bias, out)   # as Int4Linear: the bias in the model's dtype

    @torch.inference_mode()
    def run(self, cache) -> torch.Tensor:
        step = self.step
        d = step.head_dim
        h = step.embed(step.token).view(1, -1)                               # [1, H]
        cos, sin = step.rotary(h, step.position)
        # rotary as one matmul a layer: x cos + rotate_half(x) sin = x @ (diag(cos) + R diag(sin))
        rotary = torch.diag_embed(cos.view(d)).addcmul_(self.rotate_half, sin.view(1, d))
        dtype = h.dtype
        if self.x is None or self.x.shape[1] != h.shape[1]:
            self.x = torch.empty_like(h, dtype=torch.bfloat16)
        x = self.x
        view = cache.static_view() if isinstance(cache, TieredCache) else None
        if view is not None and view.scales is not None:   # an int8 pool: its own update and attention
            view = None
        pos = None if view is None else view.length
        for i, (n_in, qkv_k, nq, nk, nv, o_k, n_post, gu_k, down_k) in enumerate(self.layers):
            qk, v = self._linear(self._rms(h, n_in, x), qkv_k).to(dtype).split((nq + nk, nv), -1)
            q, k = torch.mm(qk.view(-1, d), rotary).split((nq // d, nk // d))   # [H, D] each, rotated
            if view is None:
                step._attend(i, cache, q.view(1, -1, 1, d), k.view(1, -1, 1, d), v.view(1, -1, 1, d))
                o = step.attn_out[i].view(1, -1).to(torch.bfloat16)
            else:   # resident: write this token's k, v into L1 and attend the keys in use
                keys, values = view.keys[i], view.values[i]                  # [kvh, capacity, D]
                kvh = keys.shape[0]
                keys.select(1, pos).copy_(k)
                values.select(1, pos).copy_(v.view(kvh, d))
                scores = torch.baddbmm(self.zero, q.view(kvh, -1, d), keys[:, :pos + 1].transpose(1, 2), beta=0,
                                       alpha=step.scaling)
                o = torch.bmm(torch.softmax(scores, -1), values[:, :pos + 1]).view(1, -1).to(torch.bfloat16)
            h = h + self._linear(o, o_k)
            gate, up = self._linear(self._rms(h, n_post, x), gu_k).to(dtype).chunk(2, -1)
            act = torch.mul(torch.nn.functional.silu(gate), up, out=self._act(gate.shape[1]))
            h.add_(self._linear(act, down_k))
        if view is not None:
            cache.advance(1)
        weight, eps_h = self.final_norm
        v = h.view(-1)
        return step.lm_head(torch.mul(h, weight).mul_(torch.dot(v, v).add_(eps_h).rsqrt_()))[0]

    def _act(self, n: int) -> torch.Tensor:
        if self.act is None or self.act.shape[1] != n:
            self.act = torch.empty((1, n), dtype=torch.bfloat16)
        return self.act


def _norm(module) -> tuple:
    h = module.weight.shape[0]
    return module.weight.float() * math.sqrt(h), module.variance_epsilon * h


def _kernel(layer) -> tuple | None:
    """``(packed, group size, scales and zeros, bias, pair)`` of an Int4Linear on the ``cpu`` backend, or of an
    Int4PairLinear around one (a GGUF's Q8_0 matrix as two int4 halves over ``[x, x]``); else None."""
    from ..quant.gguf_int4 import Int4PairLinear
    from ..quant.int4_linear import Int4Linear

    pair = isinstance(layer, Int4PairLinear)
    inner = layer.inner if pair else layer
    if not isinstance(inner, Int4Linear) or inner.backend != "cpu":
        return None
    return inner.packed, inner.group_size, inner.scale_zeros, inner.bias, pair
