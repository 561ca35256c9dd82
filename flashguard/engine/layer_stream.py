"""Decoder layers whose weights live in host RAM and reach the compute device one layer ahead of use.

Why: a model whose decoder layers do not all fit the VRAM budget (the 7B distill's int4 layers are ~3.4 GiB) can
still run on the GPU when some layers' weights stay in pinned host RAM and are copied in just before they run,
while the previous layer computes: the GPU then holds the resident layers plus two layers' worth of slots.

How: the streamed layers' projections (q/k/v/o, gate/up/down: every parameter and buffer under them, int4 codes,
scales and a LoRA adapter's matrices included) are bound, once, to two slots of device tensors by parity: the
j-th streamed layer computes from slot ``j % 2``. The layers' own weights go to host RAM (pinned on CUDA). A
pre-hook on each streamed layer's ``q_proj`` (the first projection both transformers' forward and ``DecodeStep``
call) makes sure its slot holds its weights (waiting for the copy started one layer earlier) and starts the copy of
the next streamed layer into the other slot on a side stream, after the work already queued (which includes the
previous layer's last use of that slot). Norms and biases outside the projections stay resident: they are small.

Contract:
- ``LayerStream(model, layers, device)`` streams the decoder layers of index ``layers`` (a Llama / Qwen2-style
  ``model.model.layers``; those layers' projections must have the same tensor shapes). Outputs are those of the
  resident model, bit for bit (the same kernels on the same values). Install it before building a ``DecodeStep``
  (its fused int4 projections would keep a resident copy; a streamed layer is marked so it is not fused).
- On CUDA, while a CUDA graph is being captured, a hook copies its layer's weights on the capturing stream: the
  graph holds the copy as a memcpy node whose source (this layer's pinned host tensors) and target (its slot)
  never change, so replaying the graph is correct with the copies inside it, issued in order with the compute.
  That is what ``DecodeStep``'s graphs do, and why: a decode step of one token computes a layer in tens of
  microseconds while its int4 weights take milliseconds to cross PCIe, so overlapping the copy with compute could
  save only the compute's share; the copies run back to back either way. Once a graph exists, a replay refills
  the slots without this object knowing, so an eager forward (a prefill chunk, where compute per layer is as long
  as the copy and the overlap pays) forgets what the slots hold at its first streamed layer (copying it again
  after the work queued before) and prefetches from there on; it does not prefetch across the end of a forward
  (a replay may come next).
- ``place(model, device, layers)``: the engine's placement: the streamed layers as above, everything else on
  ``device`` (a model built in host RAM with ``dequant`` int4 layers, whose packed bytes are the ``triton``
  kernels' format, gets those kernels there).
- ``layers_to_stream(layers, layer_bytes, room)``: which layers a budget streams (the last ones).
- ``stats()``: the layers streamed, the bytes per layer, the slots' bytes and the copies made.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import torch
from torch import nn

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def layers_to_stream(layers: int, layer_bytes: int, room: int) -> list[int]:
    """Which decoder layers to stream when ``room`` bytes of the device are left for decoder layers: none when all
    fit; else the last ones, keeping as many resident as fit beside the two slots. A room smaller than two layers
    is a ValueError (the caller names ``vram_budget``): streaming needs two slots."""
    if layers * layer_bytes <= room:
        return []
    if room < 2 * layer_bytes:
        raise ValueError(f"{room / 2**20:.0f} MiB left for decoder layers holds less than the two streamed layers' "
                         f"slots ({2 * layer_bytes / 2**20:.0f} MiB)")
    resident = min(layers - 3, room // layer_bytes - 2)   # streaming fewer than 3 layers saves nothing
    return list(range(resident, layers))


def _slots_of(layer: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(module, "p" | "b", name)`` of every tensor under the layer's projections, in a fixed order."""
    out = []
    for path in PROJECTIONS:
        for module in layer.get_submodule(path).modules():
            out += [(module, "p", n) for n, t in module._parameters.items() if t is not None]
            out += [(module, "b", n) for n, t in module._buffers.items() if t is not None]
    return out


def _get(entry) -> torch.Tensor:
    module, kind, name = entry
    return (module._parameters if kind == "p" else module._buffers)[name]


def _bind(entry, tensor: torch.Tensor) -> None:
    module, kind, name = entry
    if kind == "p":
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[name] = tensor


class LayerStream:
    def __init__(self, model: nn.Module, layers: Sequence[int], device: torch.device):
        decoder = model.model.layers
        self.order = sorted(set(int(i) for i in layers))
        if not self.order:
            raise ValueError("no layer to stream")
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        entries = {i: _slots_of(decoder[i]) for i in self.order}
        signature = [(tuple(_get(e).shape), _get(e).dtype) for e in entries[self.order[0]]]
        for i in self.order:
            if [(tuple(_get(e).shape), _get(e).dtype) for e in entries[i]] != signature:
                raise ValueError(f"decoder layer {i}'s projections differ in shape from layer {self.order[0]}'s")
        self.slots = [[torch.empty(s, dtype=d, device=self.device) for s, d in signature] for _ in range(min(2, len(self.order)))]
        self.host: dict[int, list[torch.Tensor]] = {}
        with torch.no_grad():
            for j, i in enumerate(self.order):
                tensors = [_get(e).detach().to("cpu", copy=True) for e in entries[i]]
                self.host[i] = [t.pin_memory() for t in tensors] if cuda else tensors
                for e, slot in zip(entries[i], self.slots[j % len(self.slots)]):
                    _bind(e, slot)   # the layer's own device tensors are dropped here
                object.__setattr__(decoder[i], "flashguard_fused", None)   # DecodeStep: do not fuse a streamed layer
                decoder[i].get_submodule(PROJECTIONS[0]).register_forward_pre_hook(self._hook(j))
        self.held: list[int | None] = [None] * len(self.slots)   # which layer's weights each slot holds
        self.ready: list = [None] * len(self.slots)              # CUDA: the event of each slot's last copy
        self.side = torch.cuda.Stream(self.device) if cuda else None
        self.copies = 0
        self.captured = False   # a CUDA graph has recorded the copies (see _arrive)
        self.layer_bytes = sum(t.numel() * t.element_size() for t in self.host[self.order[0]])

    def _hook(self, j: int):
        def pre_hook(module, args):
            self._arrive(j)
        return pre_hook

    def _copy(self, j: int, stream=None, *, capturing: bool = False) -> None:
        """Layer ``order[j]``'s weights into its slot, on ``stream`` (None: the current one); on CUDA an event marks
        the copy's end (not while capturing: the graph orders the copy itself)."""
        s = j % len(self.slots)
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else nullcontext():
            for slot, host in zip(self.slots[s], self.host[self.order[j]]):
                slot.copy_(host, non_blocking=self.side is not None)
            if self.side is not None and not capturing:
                self.ready[s] = torch.cuda.Event()
                self.ready[s].record()
        self.held[s] = None if capturing else self.order[j]
        self.copies += 1

    def _arrive(self, j: int) -> None:
        """Before layer ``order[j]`` runs: its weights in its slot, the next streamed layer's copy under way."""
        s = j % len(self.slots)
        if self.side is not None and torch.cuda.is_current_stream_capturing():
            # recorded into the graph: every replay copies, in order (see the contract)
            self.captured = True
            self._copy(j, capturing=True)
            return
        if self.captured and j == 0:   # a replay may have refilled the slots since the last eager forward
            self.held = [None] * len(self.slots)
        if self.held[s] != self.order[j]:
            if self.side is not None:   # after the work queued before (the last reads of this slot)
                self.side.wait_stream(torch.cuda.current_stream(self.device))
            self._copy(j, self.side)
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready[s])
        nxt = (j + 1) % len(self.order)
        t = nxt % len(self.slots)
        if self.captured and nxt == 0:   # the next forward may be a replay, which copies for itself
            return
        if t != s and self.held[t] != self.order[nxt]:   # the other slot: its layer's work is queued already
            if self.side is not None:
                self.side.wait_stream(torch.cuda.current_stream(self.device))
            self._copy(nxt, self.side)

    def stats(self) -> dict:
        return {"layers": list(self.order), "layer_bytes": self.layer_bytes,
                "slot_bytes": self.layer_bytes * len(self.slots), "copies": self.copies}


def place(model: nn.Module, device: torch.device, layers: Sequence[int], int4_kernel: str = "auto") -> "LayerStream | None":
    """Put ``model`` on ``device`` but for the projections of decoder ``layers``, which stream (``LayerStream``;
    None when ``layers`` is empty). Int4 layers built in host RAM with the ``dequant`` backend (the loader does so
    when layers will stream: a 7B's int4 layers would not fit the device first) take the ``triton`` kernels on a
    CUDA device, whose format is the same packed bytes, scales and zeros; other backends' layouts are per device
    and must have been built there."""
    from ..quant.int4_linear import Int4Linear, choose_backend

    device = torch.device(device)
    stream = LayerStream(model, layers, device) if layers else None
    model.to(device)   # the resident parts (a host embedding table has no parameters: it stays)
    if device.type == "cuda":
        backend = choose_backend(device, int4_kernel)
        for m in model.modules():
            if isinstance(m, Int4Linear) and m.backend == "dequant" and backend == "triton" and \
                    m.group_size in (32, 64, 128, 256):
                m.backend = "triton"
    return stream
