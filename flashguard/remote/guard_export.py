"""``flashguard export-guard``: the guard adapter (engine/alora.py's folder) as a llama.cpp LoRA GGUF, for
llama-server's ``--lora`` (``backend: openai``; remote/guard.py finds it on the server).

Two ways to the same file:
- by default, written here with the ``gguf`` package (a flashguard dependency): the PEFT tensors under llama.cpp's
  names (``blk.N.attn_q.weight.lora_a`` ...), ``lora_b`` of q_proj and k_proj permuted as llama.cpp's Llama
  converter permutes the base weights (its rotary layout), the adapter's alpha, float32 or float16 values. Llama
  models only (the embedded SmolLM2 is one); tested against llama.cpp's own converter (the same tensors) and
  against llama-server (the same next-token log-probabilities as the in-process guard: tests/remote/).
- ``--llama-cpp DIR`` (a llama.cpp checkout): llama.cpp's ``convert_lora_to_gguf.py`` writes it (any architecture
  that converter knows), from a temporary PEFT folder with the shifted invocation and a base folder holding the
  model's ``config.json``; flashguard then adds its identity key (below) to the file.

Both shift the invocation. flashguard and PEFT apply an activated LoRA from the invocation's first token; llama-server
looks for the LAST occurrence of ``adapter.alora.invocation_tokens`` in the prompt and applies the adapter from the
token BEFORE it (reusing its cache only up to there). So the GGUF's invocation is ``invocation[1:]``: the server then
starts exactly where flashguard does (the tag's first token). An invocation of one token cannot be shifted.

Both write ``adapter.lora.task_name = "flashguard-guard sha256:<digest>"`` (llama-server lists it in
``GET /lora-adapters``): the digest of the guard's weights and invocation, so the backend knows the server's adapter
is this guard and not an older export (``guard_digest``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..engine import alora, lora
from ..errors import ConfigError

TASK_PREFIX = "flashguard-guard sha256:"
KEY_TYPE, KEY_ALPHA = "adapter.type", "adapter.lora.alpha"
KEY_TASK, KEY_INVOCATION = "adapter.lora.task_name", "adapter.alora.invocation_tokens"
# a PEFT module name's last part -> llama.cpp's tensor name in a block
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
DIRECT_TYPES = ("llama", "mistral")   # model types whose llama.cpp converter is LlamaModel (q/k rows permuted)


def guard_digest(folder: Path) -> str:
    """The guard's identity on a server: sha256 of its adapter weights file and invocation (16 hex digits)."""
    folder = Path(folder)
    h = hashlib.sha256()
    with open(folder / lora.WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(json.dumps(list(invocation_of(folder))).encode())
    return h.hexdigest()[:16]


def invocation_of(folder: Path) -> tuple[int, ...]:
    """``alora_invocation_tokens`` of the guard folder's adapter_config.json (a ConfigError naming guard_adapter)."""
    path = Path(folder) / lora.CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        tokens = tuple(int(t) for t in config.get("alora_invocation_tokens") or ())
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{path}: not a readable adapter config ({exc}); make the guard again with "
                          f"`{alora.TRAIN_HINT}`", key=alora.KEY) from None
    if not tokens:
        raise ConfigError(f"{path} has no alora_invocation_tokens (a guard is an activated LoRA)", key=alora.KEY)
    return tokens


def server_invocation(invocation) -> list[int]:
    """The invocation as exported for llama-server (see the module docstring)."""
    return [int(t) for t in invocation[1:]]


def base_config(source) -> dict:
    """The model's HF ``config.json`` (a GGUF's from its header, kept in the user cache), with ``architectures``."""
    from ..engine import loader

    folder = loader.gguf_meta_folder(source) if source.gguf_file else source.folder
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    if not config.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
        if arch:
            config["architectures"] = [arch]
    return config


def _permute(b: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute of a projection's output rows (HF's rotate-half layout -> GGML's)."""
    return b.reshape(n_head, 2, b.shape[0] // n_head // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def _check(folder: Path, source) -> tuple[dict, tuple[int, ...]]:
    meta = alora.read_meta(folder)
    name, size = alora.model_file_key(source)
    if (meta["model_file"], meta["model_bytes"]) != (name, size):
        raise ConfigError(f"{folder}: it was made for {meta['model_file']} ({meta['model_bytes']:,} bytes), not for "
                          f"{name} ({size:,} bytes); export the guard of the model the server runs", key=alora.KEY)
    invocation = invocation_of(folder)
    if len(invocation) < 2:
        raise ConfigError(f"{folder}: its invocation {list(invocation)} is one token; llama-server applies an "
                          "activated LoRA from the token before its invocation, so it needs two or more to shift",
                          key=alora.KEY)
    return meta, invocation


def export_guard(folder: Path, out: Path, source, *, llama_cpp: Path | None = None, outtype: str = "f32") -> dict:
    """Write the guard at ``folder`` (made for ``source``'s model) as a llama.cpp LoRA GGUF at ``out``; returns what
    was written (path, bytes, tensors, invocation, digest, how)."""
    folder, out = Path(folder).expanduser(), Path(out).expanduser()
    if outtype not in ("f32", "f16"):
        raise ValueError(f"outtype must be f32 or f16, got {outtype!r}")
    meta, invocation = _check(folder, source)
    digest = guard_digest(folder)
    config = base_config(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    if llama_cpp is None:
        n = _write_direct(folder, tmp, config, invocation, digest, meta, outtype)
        how = "gguf package"
    else:
        n = _write_with_llama_cpp(folder, tmp, config, invocation, digest, Path(llama_cpp).expanduser(), outtype)
        how = f"{Path(llama_cpp).expanduser() / 'convert_lora_to_gguf.py'}"
    tmp.replace(out)
    return {"path": str(out), "bytes": out.stat().st_size, "tensors": n, "invocation": server_invocation(invocation),
            "digest": digest, "how": how, "guard": str(folder)}


def _peft(folder: Path) -> tuple[dict, dict]:
    from safetensors.numpy import load_file

    cfg = json.loads((folder / lora.CONFIG_FILE).read_text(encoding="utf-8"))
    try:
        tensors = load_file(str(folder / lora.WEIGHTS_FILE))
    except Exception as exc:   # (safetensors raises its own error types for a damaged file)
        raise ConfigError(f"{folder / lora.WEIGHTS_FILE}: not a readable safetensors file ({exc}); make the guard "
                          f"again with `{alora.TRAIN_HINT}`", key=alora.KEY) from None
    return cfg, tensors


def _write_direct(folder: Path, path: Path, config: dict, invocation, digest: str, meta: dict, outtype: str) -> int:
    import gguf

    model_type = config.get("model_type")
    if model_type not in DIRECT_TYPES:
        raise ConfigError(f"the model is a {model_type!r} model; flashguard writes the GGUF itself for Llama models "
                          f"only: pass --llama-cpp DIR (a llama.cpp checkout) to convert it with llama.cpp's "
                          "convert_lora_to_gguf.py", key=alora.KEY)
    cfg, tensors = _peft(folder)
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise ConfigError(f"{folder}: rsLoRA / DoRA adapters are not exported", key=alora.KEY)
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    dtype = np.float32 if outtype == "f32" else np.float16
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string(KEY_TYPE, "lora")
    writer.add_float32(KEY_ALPHA, float(cfg["lora_alpha"]))
    writer.add_key_value(KEY_INVOCATION, server_invocation(invocation), gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.UINT32)
    writer.add_string(KEY_TASK, TASK_PREFIX + digest)
    writer.add_name(f"flashguard guard ({meta.get('model_file')}, {meta.get('version')})")
    count = 0
    for key in sorted(tensors):
        parsed = _parse(key)
        if parsed is None:
            raise ConfigError(f"{folder / lora.WEIGHTS_FILE}: unexpected tensor {key!r} (a guard holds lora_A / "
                              "lora_B of q/k/v/o/gate/up/down projections only)", key=alora.KEY)
        layer, module, part = parsed
        t = tensors[key].astype(np.float32)
        if part == "b" and model_type in DIRECT_TYPES and module in ("q_proj", "k_proj"):
            t = _permute(t, n_head if module == "q_proj" else n_kv)
        writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{part}", np.ascontiguousarray(t.astype(dtype)))
        count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count


def _parse(key: str):
    """``base_model.model.model.layers.N.(self_attn|mlp).X_proj.lora_(A|B).weight`` -> (N, X_proj, a|b)."""
    parts = key.split(".")
    try:
        i = parts.index("layers")
        layer, module, part = int(parts[i + 1]), parts[i + 3], parts[i + 4]
    except (ValueError, IndexError):
        return None
    if module not in GGUF_NAMES or part not in ("lora_A", "lora_B") or parts[-1] != "weight":
        return None
    return layer, module, part[-1].lower()


def _write_with_llama_cpp(folder: Path, path: Path, config: dict, invocation, digest: str, llama_cpp: Path,
                          outtype: str) -> int:
    script = llama_cpp / "convert_lora_to_gguf.py"
    if not script.is_file():
        raise ConfigError(f"--llama-cpp {llama_cpp}: no convert_lora_to_gguf.py there (a llama.cpp checkout has it "
                          "at its root)")
    with tempfile.TemporaryDirectory(prefix="flashguard-export-") as work:
        work = Path(work)
        peft, base = work / "peft", work / "base"
        peft.mkdir()
        base.mkdir()
        cfg = json.loads((folder / lora.CONFIG_FILE).read_text(encoding="utf-8"))
        cfg["alora_invocation_tokens"] = server_invocation(invocation)
        cfg["base_model_name_or_path"] = str(base)
        (peft / lora.CONFIG_FILE).write_text(json.dumps(cfg, indent=1), encoding="utf-8")
        try:
            os.symlink(folder.resolve() / lora.WEIGHTS_FILE, peft / lora.WEIGHTS_FILE)
        except OSError:   # (Windows without the privilege)
            import shutil

            shutil.copyfile(folder / lora.WEIGHTS_FILE, peft / lora.WEIGHTS_FILE)
        (base / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        converted = work / "converted.gguf"
        run = subprocess.run([sys.executable, str(script), "--base", str(base), "--outfile", str(converted),
                              "--outtype", outtype, str(peft)], capture_output=True, text=True)
        if run.returncode != 0 or not converted.is_file():
            tail = (run.stderr or run.stdout).strip().splitlines()[-12:]
            raise ConfigError(f"llama.cpp's convert_lora_to_gguf.py failed (exit {run.returncode}):\n  " +
                              "\n  ".join(tail))
        return _copy_with_task_name(converted, path, TASK_PREFIX + digest)


def _copy_with_task_name(src: Path, dst: Path, task_name: str) -> int:
    """``src`` (a GGUF) copied to ``dst`` with ``adapter.lora.task_name`` set (tensors as they are)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name in ("general.architecture", KEY_TASK) or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_string(KEY_TASK, task_name)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return len(reader.tensors)


def read_export(path: Path) -> dict:
    """What a guard GGUF says about itself: its invocation, task name, tensor count (tests, ``export-guard``)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = reader.fields
    return {"invocation": [int(t) for t in fields[KEY_INVOCATION].contents()] if KEY_INVOCATION in fields else [],
            "task_name": fields[KEY_TASK].contents() if KEY_TASK in fields else "",
            "alpha": float(fields[KEY_ALPHA].contents()), "tensors": {t.name: np.array(t.data) for t in reader.tensors}}


# ---- flashguard export-guard -------------------------------------------------------------------------------------

def add_arguments(p, default_config: str = "configs/flash") -> None:
    p.add_argument("--config", default=default_config, help="the config folder whose model the guard is for")
    p.add_argument("--model", help="a model_path instead of the config's")
    p.add_argument("--guard", metavar="FOLDER", help="the guard folder (default: the config's guard_adapter; auto: "
                   "the one made for the model, from train-guard or shipped)")
    p.add_argument("--gguf", required=True, metavar="OUT", help="the GGUF file to write (llama-server's --lora)")
    p.add_argument("--llama-cpp", metavar="DIR", help="a llama.cpp checkout: convert with its "
                   "convert_lora_to_gguf.py (any architecture it knows) instead of writing the file here (Llama "
                   "models)")
    p.add_argument("--outtype", choices=("f32", "f16"), default="f32",
                   help="the adapter's values in the file (default f32; f16 halves the file and agrees with the "
                        "in-process guard as well: docs/benchmarks/guard_remote.md)")


def main(args) -> int:
    import yaml

    from ..config import EngineConfig, main_parameters
    from ..engine import loader

    params = main_parameters(yaml.safe_load((Path(args.config) / "config.yml").read_text(encoding="utf-8")) or {})
    if args.model:
        params["model_path"] = args.model
    config = EngineConfig.from_parameters(params)
    source = loader.resolve_model(config.model_path, config.gguf_file)
    folder = args.guard or config.guard_adapter
    if folder == "auto":
        folder = alora.find(source)
        if folder is None:
            raise ConfigError(f"no guard is made for {source.label} (none shipped, none in the user cache): make one "
                              f"with `{alora.TRAIN_HINT}` or pass --guard FOLDER")
    elif folder == "off":
        raise ConfigError("guard_adapter is off in the config: pass --guard FOLDER")
    info = export_guard(Path(folder), Path(args.gguf), source, llama_cpp=args.llama_cpp, outtype=args.outtype)
    model = Path(source.folder) / source.gguf_file if source.gguf_file else Path(source.folder)
    print(f"flashguard export-guard: {info['guard']} -> {info['path']} ({info['bytes'] / 1e6:.1f} MB, "
          f"{info['tensors']} tensors, {args.outtype}; written by the {info['how']})")
    print(f"  invocation for llama-server: {info['invocation']} (the guard's without its first token: the server "
          f"starts the adapter one token before it); task_name {TASK_PREFIX}{info['digest']}")
    print(f"  start the server:  llama-server -m {model} --lora-scaled {info['path']}:0 --port 8080")
    print(f"  config.yml:        backend: openai, base_url: http://127.0.0.1:8080/v1, guard_adapter: "
          f"{'auto' if args.guard is None and config.guard_adapter == 'auto' else info['guard']}")
    return 0
