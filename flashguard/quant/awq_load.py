"""Load an AWQ "gemm" checkpoint (``quantization_config.quant_method: awq``) into a transformers model.

transformers 5 reads such checkpoints only through gptqmodel, which is heavy and hard to install on Windows.
flashguard builds the model skeleton on the meta device (no weight memory), puts an ``Int4Linear`` wherever the
checkpoint has a ``qweight``, assigns every other tensor from the safetensors files, and re-creates the
non-persistent buffers (rotary frequencies) on the target device. Peak memory is the int4 weights plus the float
embeddings, never the dequantized model.

Contract: ``awq_settings(config_dict)`` validates the quantization block (errors name the key) and
``load_awq(folder, config, device, dtype, backend)`` returns the model in eval mode on ``device``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ModelLoadError
from . import awq_format
from .int4_linear import Int4Linear, set_module


@dataclass(frozen=True)
class AwqSettings:
    group_size: int
    zero_point: bool
    modules_to_not_convert: tuple[str, ...]


def is_awq(config_dict: dict) -> bool:
    q = config_dict.get("quantization_config") or {}
    return str(q.get("quant_method", "")).lower() == "awq"


def awq_settings(config_dict: dict) -> AwqSettings:
    q = config_dict.get("quantization_config") or {}
    bits = q.get("bits", q.get("w_bit", 4))
    version = str(q.get("version", "gemm")).lower()
    group = q.get("group_size", q.get("q_group_size", 128))
    key = "config.json quantization_config"
    if bits != 4:
        raise ModelLoadError(f"{key}.bits is {bits}; flashguard loads 4-bit AWQ only", key="model_path")
    if version != "gemm":
        raise ModelLoadError(f"{key}.version is {version!r}; flashguard loads the 'gemm' layout (the one AutoAWQ, "
                             "llm-compressor and vLLM write by default); re-export the model as gemm", key="model_path")
    if group not in (32, 64, 128):
        raise ModelLoadError(f"{key}.group_size is {group}; flashguard loads group sizes 32, 64 and 128",
                             key="model_path")
    return AwqSettings(group_size=int(group), zero_point=bool(q.get("zero_point", True)),
                       modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()))


def _read_state_dict(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ModelLoadError(f"{folder!r} has no model.safetensors (AWQ checkpoints in .bin files are not read); "
                             "convert it to safetensors", key="model_path")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(folder, name)))
    return state


def load_awq(folder: str, config, device: torch.device, dtype: torch.dtype, backend: str = "auto") -> nn.Module:
    from transformers import AutoModelForCausalLM

    settings = awq_settings(config.to_dict())
    state = _read_state_dict(folder)
    config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    quantized = sorted(k[: -len(".qweight")] for k in state if k.endswith(".qweight"))
    if not quantized:
        raise ModelLoadError(f"{folder!r} says quant_method awq but holds no '.qweight' tensors", key="model_path")
    for name in quantized:
        try:
            old = model.get_submodule(name)
        except AttributeError as exc:
            raise ModelLoadError(f"the checkpoint quantizes {name!r}, which this {config.model_type} model does "
                                 "not have", key="model_path") from exc
        qweight = state.pop(name + ".qweight")
        qzeros = state.pop(name + ".qzeros", None)
        scales = state.pop(name + ".scales")
        bias = state.pop(name + ".bias", None)
        codes, zeros = awq_format.unpack(qweight, qzeros if settings.zero_point else None, settings.group_size)
        if codes.shape != (old.out_features, old.in_features):
            raise ModelLoadError(f"{name}.qweight unpacks to {tuple(codes.shape)} but the model expects "
                                 f"{(old.out_features, old.in_features)}", key="model_path")
        layer = Int4Linear.from_codes(codes, zeros, scales.t(), settings.group_size,
                                      None if bias is None else bias.to(dtype), device, backend)
        set_module(model, name, layer)
    floats = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(floats, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in floats:
        if "lm_head.weight" not in floats and hasattr(model, "lm_head"):
            model.lm_head.weight = model.get_input_embeddings().weight
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta or unexpected:
        raise ModelLoadError(f"the AWQ checkpoint does not match the model: missing {still_meta[:4]}, "
                             f"unexpected {list(unexpected)[:4]}", key="model_path")
    rebuild_meta_buffers(model, device)
    model.eval()
    model.requires_grad_(False)
    return model


def rebuild_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in checkpoints; re-create their modules on ``device``."""
    for name, module in list(model.named_modules()):
        if any(b is not None and b.device.type == "meta" for b in module.buffers(recurse=False)):
            if not hasattr(module, "config"):
                raise ModelLoadError(f"cannot initialise buffers of {name!r} ({type(module).__name__})",
                                     key="model_path")
            with torch.device("cpu"):  # signatures differ across transformers versions; build on CPU, then move
                fresh = type(module)(config=module.config)
            set_module(model, name, fresh.to(device))


def int4_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the int4 layers (codes + scales + zeros) and of every other parameter/buffer."""
    int4 = sum(m.weight_bytes() for m in model.modules() if isinstance(m, Int4Linear))
    seen, other = set(), 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            continue
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                other += t.numel() * t.element_size()
    return {"int4_layers": int4, "other": other, "total": int4 + other}
