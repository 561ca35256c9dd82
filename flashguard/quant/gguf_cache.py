"""The int4 model built from a GGUF (``gguf_load.load_int4``), kept in the user cache and memory-mapped at start.

Building the model from the file converts every matrix each start: Q4 blocks to codes, codes to the CPU kernel's
packing, Q8_0 embeddings dequantized, q/k/v and gate/up rows concatenated (the decode step's fused calls) - seconds
on a 2-core laptop for the 135M embedded model. The result is written once, as the model's tensors in one
``torch.save`` file (the fused layout kept: q/k/v are row blocks of one tensor, so the decode step's concatenation
is a view, not a copy), and read back with ``torch.load(mmap=True)``: the pages come from the OS page cache, nothing
is converted.

Contract:
- ``salt(device, dtype, backend)``: what besides the GGUF's content (``loader.content_key``) decides the bytes of
  an entry: ``FORMAT`` (bumped whenever the conversion or this layout changes), torch's and transformers' versions
  (the kernels' packing, the modules' parameter names), the device type, the dtype and the int4 backend. The loader
  keys an entry's folder by both.
- ``cacheable(device, backend)``: entries are kept for the CPU (a GPU's packing depends on the card, and the weights
  go to its memory anyway).
- ``prepare(model)``: the fused layout in place (``int4_linear.concat_rows`` on every layer's q/k/v and gate/up):
  the same values, computed by the same kernels; what the decode step would do at its start.
- ``write(model, folder)`` fills ``folder`` (``model.pt``, ``flashguard-complete.json``: the format, the file's size
  and CRC-32, the int4 modules and the load's log line); the loader renames it into place (atomic).
- ``read(folder, config, device, dtype) -> (model, log line)``: the model as ``load_int4`` returned it, its tensors
  memory-mapped, bit for bit the built one's. A missing entry is ``None``; a damaged one (size, CRC, format, a
  tensor missing or of the wrong shape, a file torch cannot read) is a ``Damaged`` naming what is wrong, never a
  model with wrong weights: the caller builds the model again and replaces the entry.
- ``remembered(model, name)`` / ``remember(model, name, value)``: a start-up decision kept beside the entry the
  model was read from or written to (``decisions.json``; e.g. the lm_head that ``auto`` timed faster on this
  machine, quant/lm_head.py), so that later starts skip the timing. Nothing is kept for a model without an entry.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import tempfile
import zlib
from pathlib import Path

import torch
from torch import nn

from . import gguf_int4
from .int4_linear import Int4Linear, concat_rows, set_module

log = logging.getLogger("flashguard")

FORMAT = "flashguard-gguf-int4/1"
MODEL_FILE = "model.pt"
COMPLETE = "flashguard-complete.json"
DECISIONS = "decisions.json"
_ENTRY = "flashguard_cache_entry"   # the model's attribute: the entry folder it was read from or written to


class Damaged(ValueError):
    """A cache entry that cannot be used as it is (the message says why)."""


def salt(device: torch.device, dtype: torch.dtype, backend: str) -> str:
    import transformers

    return f"{FORMAT}|torch {torch.__version__}|transformers {transformers.__version__}|{device.type}|{dtype}|" \
           f"{backend}"


def cacheable(device: torch.device, backend: str) -> bool:
    return device.type == "cpu"


def prepare(model: nn.Module) -> None:
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for names, parent in ((("q_proj", "k_proj", "v_proj"), attn), (("gate_proj", "up_proj"), mlp)):
            parts = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, Int4Linear) for m in parts):
                concat_rows(parts)   # (the parts become row views of the joined tensors; the joined layer is dropped)


def _crc32(path: Path) -> int:
    """The file's CRC-32, read through a map of it (no copy; an empty file cannot be mapped)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return zlib.crc32(b"")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return zlib.crc32(view)


def _modules(model: nn.Module) -> dict:
    """``{name: spec}`` of the modules ``load_int4`` put in place of the transformers model's ``nn.Linear``s."""
    specs = {}
    for name, m in model.named_modules():
        if isinstance(m, gguf_int4.Int4PairLinear):
            specs[name] = {"kind": "pair", "table": m.table is not None}
        elif isinstance(m, Int4Linear):
            specs[name] = {"kind": "int4", "in": m.in_features, "out": m.out_features, "group": m.group_size,
                           "backend": m.backend}
    return specs


def write(model: nn.Module, folder: Path, log_line: str) -> None:
    """``model.pt`` and ``flashguard-complete.json`` into ``folder`` (a temporary folder the caller renames)."""
    state = model.state_dict()   # (the Int4Linear buffers too; shared storages are written once)
    embeddings = model.get_input_embeddings().weight
    tied = getattr(model.get_output_embeddings(), "weight", None) is embeddings
    path = Path(folder) / MODEL_FILE
    torch.save(state, path)
    manifest = {"format": FORMAT, "size": path.stat().st_size, "crc32": _crc32(path), "modules": _modules(model),
                "tied": tied, "log": log_line}
    (Path(folder) / COMPLETE).write_text(json.dumps(manifest), encoding="utf-8")


def read(folder: Path, config, device: torch.device, dtype: torch.dtype):
    """``(model, log line)`` of the entry in ``folder``, None where there is none, ``Damaged`` where it is bad."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / COMPLETE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise Damaged(f"its {COMPLETE} cannot be read ({exc})") from None
    path = folder / MODEL_FILE
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise Damaged(f"its format is {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                      f"not {FORMAT!r}")
    try:
        size = path.stat().st_size
        if size != manifest["size"]:
            raise Damaged(f"{MODEL_FILE} is {size} bytes, {manifest['size']} were written")
        if _crc32(path) != manifest["crc32"]:
            raise Damaged(f"{MODEL_FILE}'s CRC-32 is not the one written: its bytes changed")
        state = _load_mapped(path)
    except Damaged:
        raise
    except Exception as exc:   # noqa: BLE001 - whatever torch or the OS says of the file, it is not usable
        raise Damaged(f"{MODEL_FILE} cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        model = _assemble(state, manifest, config, device, dtype)
    except Damaged:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise Damaged(f"its tensors do not make the model ({type(exc).__name__}: {exc})") from None
    setattr(model, _ENTRY, folder)
    return model, manifest.get("log") or ""


def _load_mapped(path: Path) -> dict:
    """The state dict, memory-mapped where torch can (its mmap reader: POSIX and Windows), else read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError, ValueError) as exc:
        log.info("flashguard: %s not memory-mapped (%s); reading it", path, exc)
        return torch.load(path, map_location="cpu", weights_only=True)


def _assemble(state: dict, manifest: dict, config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from .awq_load import rebuild_meta_buffers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    specs = manifest["modules"]
    pairs = []
    for name, spec in specs.items():   # (a pair's inner layer is its own entry, ``<name>.inner``)
        if spec["kind"] != "int4":
            continue
        layer = Int4Linear(spec["in"], spec["out"], spec["group"], spec["backend"])
        prefix = name + "."
        for key in [k for k in state if k.startswith(prefix) and "." not in k[len(prefix):]]:
            layer.register_buffer(key[len(prefix):], state.pop(key))
        if "packed" not in layer._buffers:
            raise Damaged(f"no packed codes for {name}")
        if not name.endswith(".inner") or specs.get(name[:-len(".inner")], {}).get("kind") != "pair":
            set_module(model, name, layer)
        else:
            pairs.append((name[:-len(".inner")], layer))
    for name, inner in pairs:
        set_module(model, name, gguf_int4.Int4PairLinear(inner))
        state.pop(name + ".table", None)   # (the embeddings, registered again below)
    expected = model.state_dict()   # (what is left: parameters and persistent buffers, on the meta device)
    for key, tensor in state.items():
        if key not in expected:
            raise Damaged(f"an unexpected tensor {key}")
        if tuple(tensor.shape) != tuple(expected[key].shape) or tensor.dtype != expected[key].dtype:
            raise Damaged(f"{key} is {tuple(tensor.shape)} {tensor.dtype}, the model's is "
                          f"{tuple(expected[key].shape)} {expected[key].dtype}")
    model.load_state_dict(state, strict=False, assign=True)
    embeddings = model.get_input_embeddings().weight
    for name, _ in pairs:
        if specs[name].get("table"):
            model.get_submodule(name).table = embeddings   # the head's matrix in float (lm_head: int4, as built)
    if manifest.get("tied"):
        model.get_output_embeddings().weight = embeddings
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise Damaged(f"no tensor for {missing[0]} (and {len(missing) - 1} more)")
    rebuild_meta_buffers(model, device)
    model.eval()
    model.requires_grad_(False)
    return model


def mark(model: nn.Module, folder: Path) -> None:
    """``model`` was written to (or read from) the entry ``folder``: its decisions are kept there."""
    setattr(model, _ENTRY, Path(folder))


def _decision_key(name: str) -> str:
    return f"{name}|threads {torch.get_num_threads()}"


def remembered(model: nn.Module, name: str) -> dict | None:
    folder = getattr(model, _ENTRY, None)
    if folder is None:
        return None
    try:
        value = json.loads((folder / DECISIONS).read_text(encoding="utf-8")).get(_decision_key(name))
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, dict) else None


def remember(model: nn.Module, name: str, value: dict) -> None:
    """Kept atomically (a temporary file renamed over ``decisions.json``); a cache folder that cannot be written is
    only logged (the next start times again)."""
    folder = getattr(model, _ENTRY, None)
    if folder is None:
        return
    try:
        try:
            known = json.loads((folder / DECISIONS).read_text(encoding="utf-8"))
            known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            known = {}
        known[_decision_key(name)] = value
        fd, tmp = tempfile.mkstemp(prefix=DECISIONS + ".", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(known, fh)
            os.replace(tmp, folder / DECISIONS)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        log.info("flashguard: cannot keep the %s decision in %s (%s)", name, folder, exc)
