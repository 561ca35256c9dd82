"""The GPU recipe's shared job steps over one work folder (rails/lab/recipe.py runs them; tools/guard_gpu.sh on the
GPU machine): ``prepare`` tokenizes the rows into the rails' prompts once (``examples.pt``), ``_load`` gives every
later job the same examples and config, ``_model_and_tokenizer`` the training model (a GGUF's float copy made once),
``_save`` writes a job's file atomically.

Contract: a job reads only what ``prepare`` wrote in WORK and writes its own file with ``_save``; the examples'
order is the rows' order, so every job's row indices agree.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .. import guard
from . import guard_train as gt


def _save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _tokenize_part(args):
    rows, model, max_tokens = args
    _, tokenizer = _model_and_tokenizer(model, tokenizer_only=True)
    return gt.examples(rows, tokenizer, max_tokens, log=lambda *_: None)


def _model_and_tokenizer(model_path: str, device: str = "cpu", tokenizer_only: bool = False):
    from flashguard.engine import loader
    from flashguard.engine.engine import PLAIN_CHAT_TEMPLATE

    source = loader.resolve_model(model_path if model_path != "embedded" else None)
    if tokenizer_only:
        tok = loader.load_tokenizer(source)
        tok = tok[0] if isinstance(tok, tuple) else tok
        if getattr(tok, "chat_template", None) is None:
            tok.chat_template = PLAIN_CHAT_TEMPLATE
        return source, tok
    model, tok = gt.load_training_model(source, torch.device(device))
    return source, tok, model


def prepare(work: Path, model: str, rows_path: Path, cfg: gt.TrainConfig, workers: int = 8) -> None:
    from multiprocessing import get_context

    from . import guard_data

    t0 = time.perf_counter()
    rows = guard_data.load(rows_path)
    chunks = [rows[i::workers] for i in range(workers)]
    with get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_tokenize_part, [(c, model, cfg.max_tokens) for c in chunks])
    exs = [None] * len(rows)
    for k, part in enumerate(parts):
        for j, e in enumerate(part):
            exs[k + j * workers] = e
    source, tok, _ = _model_and_tokenizer(model, "cpu")   # a GGUF's float copy made once, before the jobs share it
    work.mkdir(parents=True, exist_ok=True)
    _save({"examples": [asdict(e) for e in exs], "model": model, "cfg": asdict(cfg),
           "answers": guard.answer_tokens(tok)}, work / "examples.pt")
    print(f"prepare: {len(exs)} examples, {sum(len(e.ids) for e in exs):,} tokens in {time.perf_counter() - t0:.0f}s",
          flush=True)


def _load(work: Path):
    data = torch.load(work / "examples.pt", weights_only=False)
    exs = [gt.Example(**e) for e in data["examples"]]
    return data, exs, gt.TrainConfig(**{**data["cfg"], "targets": tuple(data["cfg"]["targets"])})
