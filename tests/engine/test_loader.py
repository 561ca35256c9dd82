"""Finding and loading models; bad paths and non-causal models give errors naming model_path."""

import pytest

from flashguard import EngineConfig, ModelLoadError
from flashguard.engine import loader


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"parameters\.model_path: .*does not exist"):
        loader.resolve_model(str(tmp_path / "nope"))


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        loader.resolve_model(str(f))


def test_empty_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        loader.resolve_model(str(tmp_path))


def test_several_ggufs_ask_for_gguf_file(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"parameters\.gguf_file"):
        loader.resolve_model(str(tmp_path))


def test_corrupt_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGUARD_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"model_path: cannot load broken.gguf"):
        loader.load(loader.resolve_model(str(f)), loader.resolve_device("cpu"), loader.resolve_dtype("auto", loader.resolve_device("cpu")))
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # nothing half-written left behind


def test_non_causal_model_is_refused(tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"model_path: .*'bert' model, which is not a causal"):
        from flashguard.engine.engine import Engine

        Engine(EngineConfig(model_path=str(tmp_path)))


def test_cuda_without_gpu_names_device():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ModelLoadError, match=r"parameters\.device"):
        loader.resolve_device("cuda")


def test_embedded_model_is_found():
    src = loader.resolve_model(None)
    assert src.gguf_file == loader.EMBEDDED_FILE
