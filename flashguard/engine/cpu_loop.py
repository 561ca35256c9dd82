"""The CPU resident step's layer loop as one TorchScript function (``CpuOps.resident_step``).

Contract: ``layers(h, ...)`` runs every decoder layer of an int4 model for one token over a resident pool (keys and
values ``[kv heads, capacity, D]`` a layer, this token written at ``pos``) and returns the residual stream after the
last layer. It makes the calls of ``DecodeStep._run`` with ``CpuOps`` (the generic layer), in the same order with
the same arguments, so the logits and the K/V written are the same bit for bit (tests/engine/test_cpu_decode.py).
``CpuOps.resident_step`` runs it scripted, or as Python where TorchScript cannot make it.

Why: on a CPU an int4 decode step is bound by the host work between its kernels: ~25 aten calls a layer, each
paying Python's argument parsing and dispatch. Scripted, the loop is one call from Python and TorchScript's
interpreter dispatches the aten calls itself: the embedded model decoded 7-20% faster at two threads, 6-15% at one
(docs/benchmarks/cpu_decode.md).

``start()`` scripts it once per process on a thread of its own, ``ready()`` gives it once made (the Python loop
runs until then). TorchScript is deprecated in torch (2.13 warns, once, filtered here by its
message; it still ships and runs; on Python 3.14+ torch says it may break, so it is not used there). Where it is gone, or cannot compile this (no source files, as in a frozen app), ``ready()`` stays None, the log
says so once, and the Python loop runs: the same numbers, slower.
"""

import logging
import sys
import threading
import warnings
from typing import List, Optional

import torch

log = logging.getLogger("flashguard")
# the int4 kernel ``layers`` calls (TorchScript reads the global when it scripts; run as Python, ``layers`` reads it
# at each call, which is where benchmarks/cpu_decode.py's clock goes)
int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
# torch 2.13 warns at every torch.jit.script; one narrow filter, set here on import (warnings' filters are not
# thread-safe to change while the script is made on its thread)
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=DeprecationWarning)


def layers(h: torch.Tensor, rot: torch.Tensor, zero: torch.Tensor, x: torch.Tensor, act: torch.Tensor,
           packed: List[torch.Tensor], groups: List[int], scale_zeros: List[torch.Tensor],
           biases: List[Optional[torch.Tensor]], w1: List[torch.Tensor], e1: List[float], w2: List[torch.Tensor],
           e2: List[float], keys: List[torch.Tensor], values: List[torch.Tensor], pos: int, q_heads: int,
           qk_cols: int, d: int, scaling: float) -> torch.Tensor:
    """Layer ``i``'s int4 calls are ``packed/groups/scale_zeros[4 i + j]``, j = q/k/v, o_proj, gate/up, down;
    ``biases[i]`` the q/k/v bias or None; ``w1/e1``, ``w2/e2`` its two RMSNorms as ``CpuOps._rms`` takes them; ``x``
    and ``act`` the bf16 buffers of the int4 calls' inputs; ``rot`` this token's rotary matrix."""
    for i in range(len(keys)):
        flat = h.view(-1)
        torch.mul(torch.mul(h, w1[i]), torch.dot(flat, flat).add_(e1[i]).rsqrt_(), out=x)
        out = int4_mm(x, packed[4 * i], groups[4 * i], scale_zeros[4 * i])
        bias = biases[i]
        if bias is not None:
            out = torch.add(bias, out)
        out = out.to(torch.float32)
        qk = torch.mm(out[:, :qk_cols].view(-1, d), rot)
        k_pool, v_pool = keys[i], values[i]
        kvh = k_pool.shape[0]
        k_pool.select(1, pos).copy_(qk[q_heads:])
        v_pool.select(1, pos).copy_(out[:, qk_cols:].view(kvh, d))
        scores = torch.baddbmm(zero, qk[:q_heads].view(kvh, -1, d), k_pool[:, :pos + 1].transpose(1, 2), beta=0,
                               alpha=scaling)
        attn = torch.bmm(torch.softmax(scores, -1), v_pool[:, :pos + 1]).view(1, -1)
        h = h + int4_mm(attn.to(torch.bfloat16), packed[4 * i + 1],
                                                           groups[4 * i + 1], scale_zeros[4 * i + 1])
        flat = h.view(-1)
        torch.mul(torch.mul(h, w2[i]), torch.dot(flat, flat).add_(e2[i]).rsqrt_(), out=x)
        gate_up = int4_mm(x, packed[4 * i + 2], groups[4 * i + 2],
                                                             scale_zeros[4 * i + 2]).to(torch.float32)
        gate, up = gate_up.chunk(2, -1)
        h = h + int4_mm(
            torch.mul(torch.nn.functional.silu(gate), up, out=act), packed[4 * i + 3], groups[4 * i + 3],
            scale_zeros[4 * i + 3])
    return h


_lock = threading.Lock()
_made: list = []   # [the scripted function, or None where it could not be made], once tried
_thread: list = []


def _make() -> None:
    made = None
    try:
        if sys.version_info >= (3, 14):
            raise RuntimeError("not on Python 3.14+ (torch: TorchScript is not supported there and may break)")
        made = torch.jit.script(layers)
    except Exception as exc:   # noqa: BLE001 - whatever TorchScript says, the Python loop runs
        log.info("flashguard: the CPU step's layers run as Python (TorchScript: %s: %s)", type(exc).__name__,
                 str(exc).splitlines()[0] if str(exc) else "")
    finally:
        _made.append(made)


def start() -> None:
    """Script ``layers`` on a thread of its own (once a process; ~0.2-0.3 s of CPU on the embedded machine), so
    that an engine's load and its first forwards do not wait for it."""
    with _lock:
        if not _thread:
            _thread.append(threading.Thread(target=_make, name="flashguard-cpu-loop", daemon=True))
            _thread[0].start()


def ready():
    """The scripted ``layers`` once made; None before, or where TorchScript cannot make it (the Python loop runs:
    the same calls, so a generation may switch between the two at any step)."""
    return _made[0] if _made else None


def scripted():
    """The scripted ``layers``, waiting for it; None where TorchScript cannot make it."""
    start()
    _thread[0].join()
    return _made[0]
