"""Where the model's weights live: the device the loader loads onto, the embedding table and the decoder layers
that stay in host RAM under ``vram_budget``, and what that placement costs a decoded token.

Contract:
- ``load_target`` runs before the model exists (from its config alone): host RAM with the ``dequant`` int4 layout
  when the int4 decoder layers will not all fit ``vram_budget`` (the Budget's forecast, ``Budget.streams_at_load``),
  else the engine's device and ``int4_kernel``. It decides only where the loader puts the weights; the engine's plan
  is made once, after loading (``budget.EnginePlan``).
- ``Placement(model, ...)`` describes the loaded model (``shape``, ``weights_kind``, ``int4_group``): the facts the
  Budget plans from. It never calls the planner and holds no plan. ``hold_lm_head(budget_wins)`` holds the output
  matrix as the ``lm_head`` key says (``quant/lm_head.py``; ``budget_wins``: the Budget's call,
  ``Budget.head_budget_wins``), once, before the plan is made; ``lm_head_kind`` and ``lm_head_reason`` say how and
  why. ``place(streamed)`` puts the embedding table in host RAM (int4 on CUDA) and the last ``streamed`` decoder
  layers (the plan's ``streamed``) in pinned host RAM (``layer_stream.place``), the rest on the device. It runs
  once, before the decode step is built (the step must see the streamed layers).
- ``info()`` and ``decode_bytes()`` only read.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..config import EngineConfig
from ..quant import lm_head
from . import loader

log = logging.getLogger("flashguard")


def load_target(config: EngineConfig, source: loader.ModelSource, device: torch.device, budget,
                weights: str) -> tuple[torch.device, str]:
    """``(device, int4_kernel)`` for the loader: the engine's, or host RAM with the ``dequant`` int4 layout (the
    Triton kernels' bytes, ``layer_stream.place`` switches them) when the model's int4 decoder layers will not
    all fit ``vram_budget`` (``budget``: the engine's Budget, whose ``streams_at_load`` forecasts it): a 7B's would
    not fit the device to be moved off it after loading."""
    from ..vram.shapes import Shape

    if budget.vram_budget is None or device.type != "cuda" or weights != "int4":
        return device, config.int4_kernel
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(loader.gguf_meta_folder(source) if source.gguf_file else source.folder)
        shape = Shape.from_config(cfg, source.label)
        shape = dataclasses.replace(shape, lm_head=lm_head.planned(config.lm_head, weights))
    except (ValueError, OSError, KeyError, AttributeError):   # the loader says what is wrong
        return device, config.int4_kernel
    context = min(getattr(cfg, "max_position_embeddings", None) or 2048, config.max_context or 1 << 62)
    streams = budget.streams_at_load(shape, context)
    return (torch.device("cpu"), "dequant") if streams else (device, config.int4_kernel)


class Placement:
    """The loaded model's weights and where they live (see the module docstring)."""

    def __init__(self, model, config: EngineConfig, device: torch.device, dtype: torch.dtype, label: str):
        self.model, self.config, self.device, self.dtype, self.label = model, config, device, dtype, label
        self.streamed = 0   # decoder layers in host RAM (the last ones): the plan's, once placed
        self.layer_stream = None   # layer_stream.LayerStream, or None (every layer resident)
        self.embedding_on_host = False
        self.lm_head_reason = None   # hold_lm_head

    def hold_lm_head(self, budget_wins: bool) -> None:
        """The output matrix in 16 bits, as Q8_0 codes or as int4 codes with its top rows recomputed, as the
        ``lm_head`` key says (auto: measured, or the Budget's call ``budget_wins``: ``Budget.head_budget_wins``),
        quant/lm_head.py."""
        kind, self.lm_head_reason = lm_head.apply(
            self.config.lm_head, self.model, self.weights_kind, self.device, self.config.int4_kernel, budget_wins)
        log.info("flashguard: lm_head %s (%s)", kind, self.lm_head_reason)

    @property
    def lm_head_kind(self) -> str:
        """How the output matrix is held: "float", "int8" (Q8_0 codes) or "int4" (int4 codes: ``lm_head.kind_of``)."""
        return lm_head.kind_of(self.model.get_output_embeddings())

    def place(self, streamed: int, vram_budget: int | None = None) -> None:
        """The embedding table and the last ``streamed`` decoder layers off the device (see the module docstring);
        once. ``vram_budget``: for the log line only."""
        if self.device.type == "cuda" and self.weights_kind == "int4":
            # the GPU needs one row of the table per token; its 16-bit copy would take a quarter of an int4
            # model's GPU memory (vram/plan.py's weight_bytes leaves it out of the GPU's weights)
            from .host_embedding import install

            self.embedding_on_host = install(self.model, self.device) > 0
        self.layer_stream = self._place_layers(streamed, vram_budget)

    def _place_layers(self, streamed: int, vram_budget: int | None):
        """The last ``streamed`` decoder layers in pinned host RAM, copied to the device one layer ahead of use
        (``layer_stream.place``; DecodeStep's graphs hold the copies, see layer_stream's contract), the rest of the
        model on the device. Returns the LayerStream, or None (every layer resident)."""
        from .layer_stream import place

        self.streamed = streamed
        n = self.model.config.num_hidden_layers
        on_device = all(t.device.type == self.device.type for t in [*self.model.parameters(), *self.model.buffers()])
        if not self.streamed and on_device:
            return None
        if self.streamed:
            log.info("flashguard: vram_budget %.2f GiB: decoder layers %d-%d stream from pinned host RAM, %d resident",
                     (vram_budget or 0) / 2**30, n - self.streamed, n - 1, n - self.streamed)
        return place(self.model, self.device, list(range(n - self.streamed, n)), self.config.int4_kernel)

    # ---- what was placed -----------------------------------------------------------------------------------
    def shape(self):
        """The planner's Shape of the loaded model; ``lm_head`` says how its output matrix is held."""
        from ..vram.shapes import Shape

        shape = Shape.from_config(self.model.config, self.label)
        return dataclasses.replace(shape, lm_head=self.lm_head_kind)

    @property
    def weights_kind(self) -> str:
        """"int4" when the decoder's linears are int4, else "float": the ``weights`` key's values, which the
        planner takes too. The lm_head's codes do not count (``lm_head_kind`` says how it is held)."""
        from ..quant.int4_linear import Int4Linear

        out = self.model.get_output_embeddings()
        in_head = {id(m) for m in out.modules()} if out is not None else set()
        return "int4" if any(isinstance(m, Int4Linear) and id(m) not in in_head
                             for m in self.model.modules()) else "float"

    def int4_group(self) -> int:
        """The int4 group size the planner counts scales for: the smallest of the model's Int4Linear layers (a GGUF
        keeps 32, ``flashguard quantize`` writes 64), or the quantizer's for a float model."""
        from ..quant import AWQ_GROUP_SIZE
        from ..quant.int4_linear import Int4Linear

        return min((m.group_size for m in self.model.modules() if isinstance(m, Int4Linear)), default=AWQ_GROUP_SIZE)

    def info(self) -> dict:
        """Where each part of the model lives: the embedding table, lm_head, the resident and streamed layers."""
        n = self.model.config.num_hidden_layers
        stats = self.layer_stream.stats() if self.layer_stream is not None else None
        return {"embedding": "host" if self.embedding_on_host else str(self.device),
                "lm_head": {"device": str(self.device), "weights": self.lm_head_kind,
                            "why": self.lm_head_reason},
                "layers_resident": list(range(n - self.streamed)),
                "layers_streamed": list(range(n - self.streamed, n)),
                "streamed_from": "pinned host RAM" if self.device.type == "cuda" and self.streamed else
                ("host RAM" if self.streamed else None),
                "streamed_layer_bytes": stats["layer_bytes"] if stats else 0,
                "slot_bytes": stats["slot_bytes"] if stats else 0,
                "layer_copies": stats["copies"] if stats else 0}

    def decode_bytes(self, context: int, kv) -> dict:
        """Bytes one decoded token reads at ``context``, from the loaded tensors: the decoder layers' linears and
        the lm_head as they are held (int4 codes, 16-bit, an int4 pair), and the K/V the cache as sized (``kv``:
        the plan's) attends (``vram.plan.kv_read_bytes``)."""
        from ..vram.sizes import kv_read_bytes

        linears = sum(lm_head.read_bytes(m) for layer in self.model.model.layers
                      for name, m in layer.named_modules() if name.endswith("_proj"))
        out = {"decoder linears": linears, "lm_head": lm_head.read_bytes(self.model.get_output_embeddings()),
               "kv attended": kv_read_bytes(self.shape(), context=context, kv=kv,
                                            value_bytes=self.dtype.itemsize)}
        out["total"] = sum(out.values())
        return out
