"""LoRA adapters (``lora_path``: a PEFT folder) on top of a loaded model's float or int4 linears.

Each targeted linear becomes a ``LoraLinear``: ``y = base(x) + B (A x)``, the adapter's scale (``lora_alpha / r``,
or ``lora_alpha / sqrt(r)`` with ``use_rslora``) folded into ``B`` once. The base layer is kept as it is (an
``nn.Linear`` or an ``Int4Linear`` with its packed codes), so the adapter never needs a float copy of an int4 base,
and the two extra matmuls are plain torch ops on fixed tensors: ``DecodeStep`` calls the module, so its CUDA graphs
record them like any other kernel.

Contract:
- ``read_adapter(path, model)`` reads and checks the folder against ``model`` (the only place that reads it); every
  problem is a ``ConfigError`` naming ``lora_path`` and what is wrong: a missing folder or file, a corrupt
  ``adapter_config.json`` or safetensors file, an adapter that is not a plain LoRA (DoRA, trained biases, modules to
  save), a target outside q/k/v/o/gate/up/down, a module the model lacks or a shape it does not have (an adapter
  trained for another base).
- ``apply_adapter(model, adapter, dtype)`` wraps the targeted modules in place (once per model) and returns how many.
- ``Adapter.digest`` identifies the adapter's content: the engine mixes it into the KV pages' namespace, because the
  adapter changes every layer's keys and values after the first targeted one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError

KEY = "lora_path"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."   # PEFT's prefix of every saved key
_WEIGHT_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.weight")


@dataclass(frozen=True)
class Adapter:
    """A checked adapter: ``layers`` maps a module name of the model to ``(A [r, in], B [out, r], scale)``."""

    path: str
    layers: dict
    digest: str
    # an activated LoRA (aLoRA, PEFT's ``alora_invocation_tokens``): the adapter applies only from this token sequence
    # on (engine/alora.py: the guard); empty for a plain LoRA, which applies everywhere
    invocation: tuple = ()

    @property
    def rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.layers.values())


class LoraLinear(nn.Module):
    """``base(x) + lora_b @ (lora_a @ x)``, with the adapter's scale already in ``lora_b``."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = a.shape[1], b.shape[0]
        self.register_buffer("lora_a", a)
        self.register_buffer("lora_b", b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = F.linear(F.linear(x.to(self.lora_a.dtype), self.lora_a), self.lora_b)
        return self.base(x) + delta.to(x.dtype)

    @property
    def weight(self):   # what code that reads ``module.weight`` (dtype, device) of a float base finds
        return self.base.weight

    def extra_repr(self) -> str:
        return f"rank={self.lora_a.shape[0]}"


def _fail(what: str, key: str = KEY) -> ConfigError:
    return ConfigError(what, key=key)


def _read_config(folder: Path, key: str = KEY) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise _fail(f"{folder} has no {CONFIG_FILE} (a PEFT adapter folder holds {CONFIG_FILE} and "
                    f"{WEIGHTS_FILE})", key)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _fail(f"{file} is not valid JSON ({exc})", key) from None
    if not isinstance(config, dict):
        raise _fail(f"{file} must hold a JSON object, got {type(config).__name__}", key)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _fail(f"{file}: peft_type is {config.get('peft_type')!r}; only LORA adapters are supported", key)
    unsupported = [name for name, bad in (
        ("use_dora", bool(config.get("use_dora"))), ("bias", config.get("bias", "none") != "none"),
        ("lora_bias", bool(config.get("lora_bias"))), ("modules_to_save", bool(config.get("modules_to_save"))),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out")))) if bad]
    if unsupported:
        raise _fail(f"{file}: {', '.join(unsupported)} is not supported (plain LoRA on linear layers only)", key)
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _fail(f"{file}: {name} must be a positive number, got {value!r}", key)
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise _fail(f"{file}: unknown target module(s) {', '.join(map(str, unknown))}; "
                        f"supported: {', '.join(TARGETS)}", key)
    return config


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the end of a module's name."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


def _read_weights(file: Path, key: str = KEY) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise _fail(f"{file.parent} has no {WEIGHTS_FILE} (adapter_model.bin is not read: save with "
                    "safetensors)", key)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise _fail(f"{file} is not a readable safetensors file ({exc})", key) from None


def read_adapter(path: str, model: nn.Module, key: str = KEY) -> Adapter:
    """The adapter at ``path`` (a PEFT folder), checked against ``model``'s modules and shapes; errors name ``key``
    (the config key that gave the path)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise _fail(f"{folder} is not a folder (a PEFT adapter folder with {CONFIG_FILE} and {WEIGHTS_FILE})",
                    key)
    config = _read_config(folder, key)
    tensors = _read_weights(folder / WEIGHTS_FILE, key)
    parts: dict[str, dict] = {}
    for tensor_name, tensor in tensors.items():
        name = tensor_name[len(_PREFIX):] if tensor_name.startswith(_PREFIX) else tensor_name
        match = _WEIGHT_KEY.fullmatch(name)
        if match is None:
            raise _fail(f"{folder / WEIGHTS_FILE}: unexpected tensor {tensor_name!r} (only lora_A / lora_B weights of "
                        f"{', '.join(TARGETS)} are supported)", key)
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise _fail(f"{folder / WEIGHTS_FILE} holds no LoRA weights", key)
    layers = {}
    for name, ab in sorted(parts.items()):
        leaf = name.rpartition(".")[2]
        if leaf not in TARGETS:
            raise _fail(f"unknown target module {name!r}; supported: {', '.join(TARGETS)}", key)
        if set(ab) != {"A", "B"}:
            raise _fail(f"{name} has lora_{''.join(ab)} but not both lora_A and lora_B", key)
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise _fail(f"the adapter targets {name}, which this model does not have: "
                        "it was trained for another base model", key) from None
        a, b = ab["A"], ab["B"]
        n_in, n_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (a.shape[1], b.shape[0]) != (n_in, n_out):
            raise _fail(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the model's "
                        f"{n_in} -> {n_out} layer: the adapter was trained for another base model", key)
        r = _pattern_value(config.get("rank_pattern"), name, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern"), name, config["lora_alpha"])
        if a.shape[0] != r:
            raise _fail(f"{name}: lora_A has rank {a.shape[0]}, adapter_config.json says r = {r}", key)
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        layers[name] = (a, b, scale)
    digest = hashlib.blake2b(digest_size=16)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update((folder / file).read_bytes())
    invocation = config.get("alora_invocation_tokens") or ()
    if not isinstance(invocation, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            and t >= 0 for t in invocation):
        raise _fail(f"{folder / CONFIG_FILE}: alora_invocation_tokens must be a list of token ids, got "
                    f"{invocation!r}", key)
    return Adapter(str(folder), layers, digest.hexdigest(), tuple(invocation))


@torch.no_grad()
def apply_adapter(model: nn.Module, adapter: Adapter, dtype: torch.dtype) -> int:
    """Wraps each module of ``adapter.layers`` in a ``LoraLinear`` (``dtype``: the activations'), on the module's
    device. A model carries one adapter: applying a second is an error. Returns the number of modules wrapped."""
    from ..quant.int4_linear import set_module

    if getattr(model, "flashguard_adapter", None) is not None:
        raise _fail(f"the model already carries the adapter {model.flashguard_adapter}")
    if adapter.invocation:
        raise _fail(f"{adapter.path} is an activated LoRA (alora_invocation_tokens: it applies only from its "
                    "invocation on, e.g. a guard adapter): give it as guard_adapter, not lora_path")
    for name, (a, b, scale) in adapter.layers.items():
        base = model.get_submodule(name)
        device = next(itertools.chain(base.parameters(), base.buffers())).device
        layer = LoraLinear(base, a.to(device, torch.float32).to(dtype), (b.to(device, torch.float32) * scale).to(dtype))
        set_module(model, name, layer)
    for layer in model.modules():   # a decode step's fused int4 projections no longer say what the layer computes
        if "flashguard_fused" in layer.__dict__:
            del layer.__dict__["flashguard_fused"]
    object.__setattr__(model, "flashguard_adapter", adapter.path)
    return len(adapter.layers)
