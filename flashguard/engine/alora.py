"""Activated LoRA (aLoRA, arXiv 2504.12397): an adapter that applies only from an invocation token sequence on.

Every position before the invocation is the base model's own, so a conversation's K/V pages stay the ones the
generation wrote and reads; a rail runs its suffix (invocation, question) with the adapter's deltas added and reads
the verdict from that suffix. The generation never sees the adapter. This is the guard (``rails/guard.py``).

Contract:
- ``Deltas.of(adapter, device, dtype)``: an ``lora.Adapter`` with an invocation, as the tensors the forward adds
  (``A``, ``B * scale`` per module, on the compute device). Its ``bytes`` are what it holds there.
- ``activated(model, deltas)``: a context in which every forward of ``model`` adds ``B (A x)`` to the outputs of the
  adapter's modules, at every position that forward runs from ``deltas.offset`` on (``Deltas.from_position(k)``:
  the forward's first ``k`` positions keep the base model's outputs). Hooks live only inside the context (nothing
  stays installed: the decode step, CUDA graphs and the CPU's int4 step never see them). The caller puts the
  offset at the invocation (``Engine.read(adapter_from=...)``), which is the aLoRA rule: PEFT and llama.cpp apply
  the adapter from the invocation's first token on.
- ``TrainableLora``: the same deltas as trainable parameters (``rails/lab/guard_train.py``), used through the same
  ``activated`` context (its ``deltas`` carry dropout while training); ``save(folder, ...)`` writes a PEFT folder
  (``adapter_config.json`` with ``alora_invocation_tokens``, ``adapter_model.safetensors``) that
  ``lora.read_adapter`` and PEFT both read.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from . import lora

_PREFIX = "base_model.model."


class Deltas:
    """Per module name: ``(a [r, in], b [out, r])`` with the scale folded into ``b``; ``dropout`` on the input while
    training."""

    def __init__(self, tensors: dict, dropout: float = 0.0, scale: float = 1.0, offset: int = 0):
        self.tensors = tensors
        self.dropout = dropout
        self.scale = scale
        self.offset = offset   # the forward's first ``offset`` positions run without the deltas (base weights)

    def from_position(self, offset: int) -> "Deltas":
        """These deltas, on only from the ``offset``-th position of a forward (``[batch, seq, ...]`` inputs): the
        activation point inside one forward, so that the base tokens before an invocation need no forward of
        their own."""
        return Deltas(self.tensors, self.dropout, self.scale, int(offset))

    @classmethod
    def of(cls, adapter: lora.Adapter, device: torch.device, dtype: torch.dtype) -> "Deltas":
        tensors = {name: (a.to(device, torch.float32).to(dtype), (b.to(device, torch.float32) * scale).to(dtype))
                   for name, (a, b, scale) in adapter.layers.items()}
        return cls(tensors)

    @property
    def bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())

    def hook(self, name: str):
        a, b = self.tensors[name]

        def add(module, args, out):
            x = args[0]
            if self.dropout and torch.is_grad_enabled():
                x = F.dropout(x, self.dropout, training=True)
            if self.offset:   # the positions before it keep the base model's output
                x = x[..., self.offset:, :]
                if x.shape[-2] == 0:
                    return out
            delta = F.linear(F.linear(x.to(a.dtype), a), b)
            if self.scale != 1.0:
                delta = delta * self.scale
            if self.offset:
                return torch.cat([out[..., :self.offset, :], out[..., self.offset:, :] + delta.to(out.dtype)], -2)
            return out + delta.to(out.dtype)
        return add


@contextlib.contextmanager
def activated(model: nn.Module, deltas: Deltas) -> Iterator[None]:
    """The adapter's deltas added to every forward run inside (see the module docstring)."""
    handles = [model.get_submodule(name).register_forward_hook(deltas.hook(name)) for name in deltas.tensors]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def target_names(model: nn.Module, targets: Sequence[str], first_layer: int = 0) -> list[str]:
    """The names of ``model``'s decoder linears whose last part is one of ``targets`` (q_proj, ..., down_proj), in
    decoder layers ``first_layer`` and above."""
    import re

    unknown = sorted(set(targets) - set(lora.TARGETS))
    if unknown:
        raise ValueError(f"unknown target module(s) {', '.join(unknown)}; supported: {', '.join(lora.TARGETS)}")
    out = []
    for name, _ in model.named_modules():
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if name.rpartition(".")[2] in targets and layer is not None and int(layer.group(1)) >= first_layer:
            out.append(name)
    return out


class TrainableLora(nn.Module):
    """An activated LoRA being trained: ``A`` (Kaiming-uniform, as PEFT) and ``B`` (zeros) per target module, the
    delta ``B (A x) * alpha / r``."""

    def __init__(self, model: nn.Module, targets: Sequence[str], r: int, alpha: float, dropout: float = 0.0,
                 seed: int = 0, first_layer: int = 0):
        super().__init__()
        self.names = target_names(model, targets, first_layer)
        self.first_layer, self.layers = int(first_layer), len(model.model.layers)
        if not self.names:
            raise ValueError(f"the model has none of the target modules {', '.join(targets)}")
        self.targets, self.r, self.alpha, self.dropout = tuple(targets), int(r), float(alpha), float(dropout)
        g = torch.Generator().manual_seed(seed)
        self.a, self.b = nn.ParameterList(), nn.ParameterList()
        for name in self.names:
            m = model.get_submodule(name)
            a = torch.empty(self.r, m.in_features)
            bound = 1.0 / math.sqrt(m.in_features)   # kaiming_uniform_(a=sqrt(5)), PEFT's default init of A
            a.uniform_(-bound, bound, generator=g)
            self.a.append(nn.Parameter(a))
            self.b.append(nn.Parameter(torch.zeros(m.out_features, self.r)))

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def deltas(self) -> Deltas:
        """The live parameters as ``Deltas`` (dropout while grad is enabled)."""
        return Deltas({n: (a, b) for n, a, b in zip(self.names, self.a, self.b)}, self.dropout, self.scale)

    def save(self, folder: Path, invocation: Sequence[int], base_model: str, dtype=torch.float16) -> Path:
        """A PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) of this adapter, activated from
        ``invocation`` (``alora_invocation_tokens``)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, a, b in zip(self.names, self.a, self.b):
            tensors[f"{_PREFIX}{name}.lora_A.weight"] = a.detach().to("cpu", dtype).contiguous()
            tensors[f"{_PREFIX}{name}.lora_B.weight"] = b.detach().to("cpu", dtype).contiguous()
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
                  "r": self.r, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                  "target_modules": sorted(self.targets), "bias": "none", "use_rslora": False, "use_dora": False,
                  "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True,
                  "alora_invocation_tokens": [int(t) for t in invocation]}
        if self.first_layer:   # the adapter holds the upper layers only (guard_cache.py: trained on kept states)
            config.update(layers_to_transform=list(range(self.first_layer, self.layers)), layers_pattern="layers")
        tmp = folder / (lora.WEIGHTS_FILE + ".part")
        save_file(tensors, str(tmp))
        tmp.replace(folder / lora.WEIGHTS_FILE)
        (folder / lora.CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
        return folder


# ---- the guard's files ------------------------------------------------------------------------------------------

KEY = "guard_adapter"
META_FILE = "guard.json"
FORMAT = "flashguard-guard/1"
TRAIN_HINT = "flashguard train-guard"


def model_file_key(source) -> tuple[str, int]:
    """What a guard is made for: the weights file's name and size (a GGUF), or the folder's name and the bytes of
    its weight files (an HF folder); the same on any machine that holds the same weights."""
    import os

    if source.gguf_file:
        target = os.path.join(source.folder, source.gguf_file)
        return source.gguf_file, os.path.getsize(target)
    folder = Path(source.folder)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) or \
        sum(p.stat().st_size for p in folder.glob("*.bin"))
    return folder.name.rstrip("/\\"), size


def shipped_dir() -> Path:
    """The guards shipped in the package (``flashguard.rails``'s ``guards`` folder), found without importing it; in a
    source tree run without installing (``flashguard/`` beside ``rails/``, as a copy of the repository is), the
    tree's ``rails/guards``. Neither: a ConfigError naming ``guard_adapter`` and how to install the rails."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("flashguard.rails")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]) / "guards"
    tree = Path(__file__).resolve().parents[2] / "rails"
    if (tree / "__init__.py").is_file():
        return tree / "guards"
    raise ConfigError("the moderation rails' package (flashguard.rails) is not installed, so the shipped guards "
                      "cannot be found: install flashguard (`pip install -e .` in the repository), or set "
                      "guard_adapter to a guard folder (or off)", key="guard_adapter")


def cache_dir() -> Path:
    """Where ``flashguard train-guard`` writes a guard by default: the user cache's ``guards`` folder."""
    from .loader import user_cache_dir

    return user_cache_dir() / "guards"


def guard_folder_name(model_file: str) -> str:
    return Path(model_file).stem if model_file.lower().endswith(".gguf") else model_file


def find(source) -> Path | None:
    """``guard_adapter: auto``: the guard made for ``source``'s weights, in the user cache (``train-guard``'s), then
    among the shipped ones; None where there is none."""
    name, size = model_file_key(source)
    for base in (cache_dir(), shipped_dir()):
        folder = base / guard_folder_name(name)
        meta = folder / META_FILE
        if meta.is_file():
            try:
                data = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return folder   # corrupt: ``load`` says so, naming the file
            if data.get("model_file") == name and data.get("model_bytes") == size:
                return folder
    return None


class Guard:
    """A loaded guard: its adapter checked against the model, its ``Deltas`` on the compute device, and its
    ``meta`` (guard.json: what it was made for, the rails' questions and answers, the strictness table)."""

    def __init__(self, folder: Path, adapter: lora.Adapter, deltas: Deltas, meta: dict):
        self.folder, self.adapter, self.deltas, self.meta = folder, adapter, deltas, meta

    @property
    def invocation(self) -> tuple:
        return self.adapter.invocation

    @property
    def bytes(self) -> int:
        return self.deltas.bytes

    def info(self) -> dict:
        return {"path": str(self.folder), "rank": self.adapter.rank, "modules": len(self.adapter.layers),
                "bytes": self.bytes, "made_for": self.meta.get("model_file"),
                "weights": self.meta.get("weights"), "version": self.meta.get("version")}


def _bad(folder: Path, what: str) -> ConfigError:
    return ConfigError(f"{folder}: {what}; make one for this model with `{TRAIN_HINT}` or set "
                            f"{KEY}: off", key=KEY)


def read_meta(folder: Path) -> dict:
    """guard.json, checked for its format (a ConfigError naming ``guard_adapter`` otherwise)."""
    meta_file = Path(folder) / META_FILE
    if not meta_file.is_file():
        raise _bad(folder, f"no {META_FILE} (a guard folder holds {META_FILE}, {lora.CONFIG_FILE} and "
                           f"{lora.WEIGHTS_FILE})")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise _bad(folder, f"{META_FILE} is not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(folder, f"{META_FILE} is not a {FORMAT} file")
    for field in ("model_file", "model_bytes", "questions", "answers", "weights"):
        if field not in meta:
            raise _bad(folder, f"{META_FILE} has no {field!r}")
    return meta


def load(folder: Path, source, model: nn.Module, weights: str, device: torch.device, dtype: torch.dtype) -> Guard:
    """The guard at ``folder`` for this engine's model, or a ConfigError naming ``guard_adapter``: another model's
    guard (its file, size or shapes), one not made for these weights (float / int4), a corrupt file."""
    folder = Path(folder).expanduser()
    meta = read_meta(folder)
    name, size = model_file_key(source)
    if (meta["model_file"], meta["model_bytes"]) != (name, size):
        raise _bad(folder, f"it was made for {meta['model_file']} ({meta['model_bytes']:,} bytes), not for {name} "
                           f"({size:,} bytes)")
    if weights not in meta["weights"]:
        raise _bad(folder, f"it was made and validated for {' and '.join(meta['weights'])} weights, not {weights} "
                           f"(set weights: {meta['weights'][0]})")
    try:
        adapter = lora.read_adapter(str(folder), model, key=KEY)
    except ConfigError as exc:
        raise ConfigError(f"{str(exc).split(': ', 1)[1]}; make a guard for this model with `{TRAIN_HINT}` or set "
                          f"{KEY}: off", key=KEY) from None
    if not adapter.invocation:
        raise _bad(folder, f"{lora.CONFIG_FILE} has no alora_invocation_tokens (a guard is an activated LoRA)")
    return Guard(folder, adapter, Deltas.of(adapter, device, dtype), meta)
