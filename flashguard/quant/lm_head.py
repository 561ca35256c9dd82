"""The ``lm_head`` key: the output matrix in 16 bits, as 8-bit codes (Q8_0), or as int4 codes with its top
candidates recomputed from the head's own rows; chosen once at start.

Every decoded token reads the whole output matrix: for DeepSeek-R1-Distill-Qwen-1.5B in int4 it is 0.47 GB of the
~1.4 GB a token reads at 8K, the largest single tensor. Held as llama.cpp's Q8_0 (an int8 code a weight, one fp16
scale per 32) and computed by the int4 kernels as two 4-bit halves over ``[x, x]`` (``gguf_int4.Int4PairLinear``,
the form a GGUF's own Q8_0 matrices already load in), it reads 1.25 bytes a weight: 0.29 GB. ``int4``
(``RescoredHead``) reads 0.625 bytes a weight (0.15 GB): int4 codes (group 32) give every logit, and the ``TOP``
largest, with the tokens the rails read (``keep_exact``), are recomputed from the head as loaded (its 16-bit rows,
or a GGUF's Q8_0 table dequantized), which stay in host RAM (``kv.uva.PinnedRows``: on a GPU the GPU reads the rows
it needs itself) and cost ``TOP`` rows a token. The greedy token is the exact head's whenever it is among the int4
head's ``TOP`` (every position measured); the tail keeps int4's error, KL 0.001-0.003 nats on the real SmolLM2 and
Gemma 3 (docs/benchmarks/lm_head.md). Fewer bytes are not always less time: on a datacenter GPU cuBLAS reads the 16-bit
head fastest (0.15 ms against 0.33 for Q8_0 and 0.39 for int4 + top rows), while a laptop GPU is bound by its
bytes. So ``auto`` measures.

Contract:
- ``planned(lm_head, weights_kind) -> kind`` what the key may make of a float head, before a model is loaded
  (``flashguard plan`` plans ``auto`` with int4 weights as ``int8``; ``int4`` as the int4 codes and top rows).
- ``apply(lm_head, model, weights_kind, device, int4_kernel, budget_wins) -> (kind, why)`` resolves the key on the
  loaded model and leaves the head held that way. A head the file holds in Q4 keeps its codes whatever the key
  says; one in Q8_0 keeps them too, except that where the model holds the same matrix in float (a GGUF's tied
  table) ``int4`` reads it as int4 codes over that table (and ``auto`` does when that times 10% faster). ``float`` /
  ``int8`` / ``int4`` are the user's call; ``int4`` on a GPU that cannot read host RAM itself (no Triton) raises a
  ConfigError naming the key. ``auto`` keeps a float decoder's head in 16 bits; with an int4 decoder, when
  ``budget_wins`` (the 16-bit head would push decoder layers off the GPU, the caller's planner says) it holds the
  fewest bytes on the device (``int4`` where its rows can stay in host RAM, else ``int8``), otherwise it times one
  token through each head it can hold on ``device`` (a few ms at start) and keeps the fastest (16-bit unless
  another is 3% faster; int4 over Q8_0 only when 10% faster, so that a near tie does not flip between runs). The
  choice is kept beside a model read from the int4 cache (``gguf_cache.remember``: a GGUF's int4 model on the CPU)
  and taken from there at later starts (no timing, no losing head built; the reason says so).
- ``quantize(model, device, int4_kernel)`` replaces a float ``lm_head`` by its Q8_0 codes on ``device``
  (``rescored_head(weight, bias, device)`` builds a ``RescoredHead``). A head tied to the input embeddings is untied (the table stays as it was, for the embedding lookup). The
  16-bit head is freed from the device. Q8_0 logits equal those of gguf-py's Q8_0 round trip of the head, up to the
  int4 kernel's rounding.
- ``kind_of(module) -> "float" | "int4" | "int8"``: how a loaded head is held (the planner's ``Shape.lm_head``;
  ``int4`` is a GGUF's Q4 codes or a ``RescoredHead``); ``read_bytes(module)``: the bytes one token reads through it.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..kv import uva
from . import awq_format, gguf_cache, gguf_int4
from .int4_linear import Int4Linear

TOP = 1024         # candidates recomputed exactly: KL 0.0026 nats on SmolLM2 (256: 0.0070, 64: 0.0145)
GROUP = 32         # the int4 codes' group (llama.cpp's Q4 block)
KEPT = 64          # token ids ``keep_exact`` may name (the rails' answer spellings)
INT4_MARGIN = 0.9  # auto takes int4 over Q8_0 only when 10% faster: a near tie (a CPU) would flip between runs
_CHUNK = 64        # positions rescored at once (a prompt's logits: TOP rows each)
KEPT_NOTE = "; timed at an earlier start, kept with the cached model"   # auto's choice read back (gguf_cache)


class RescoredHead(torch.nn.Module):
    """``x @ W.T`` read as int4 codes (``approx``, an ``Int4Linear``), its ``top`` largest logits per position and
    the ``keep_exact`` tokens recomputed from ``table`` (``W`` as loaded, a ``kv.uva.PinnedRows``; bias included).
    The table is not a buffer (host RAM; on the CPU the head's own tensor, so a tied table is shared, not copied).
    Graph-safe: no host sync, fixed shapes (the kept ids live in a buffer of ``KEPT`` slots)."""

    def __init__(self, approx: Int4Linear, table: uva.PinnedRows, source_ptr: int, top: int = TOP):
        super().__init__()
        self.approx, self.table = approx, table
        self.out_features, self.in_features = table.table.shape
        self.top = min(top, self.out_features)
        self.source_ptr = source_ptr   # the matrix it was built from (``rows_of``)
        self.register_buffer("kept", torch.zeros(KEPT, dtype=torch.long, device=table.target))

    def rows_of(self, weight: torch.Tensor) -> uva.PinnedRows | None:
        """Its table when it was built from ``weight`` (a tied embedding table: one pinned copy for both)."""
        return self.table if weight.data_ptr() == self.source_ptr else None

    def keep_exact(self, token_ids) -> None:
        """Recompute these tokens' logits exactly at every position too (at most ``KEPT``; the rails' answers)."""
        ids = sorted({int(i) for i in token_ids} | {int(i) for i in self.kept.tolist() if i})
        if len(ids) > KEPT:
            raise ValueError(f"keep_exact: {len(ids)} token ids, at most {KEPT}")
        if ids:
            self.kept.copy_(torch.tensor(ids + [ids[0]] * (KEPT - len(ids)), dtype=torch.long))

    def read_bytes(self) -> int:
        t = self.table.table
        return self.approx.weight_bytes() + (self.top + KEPT) * self.in_features * t.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.approx(x)
        flat = logits.view(-1, self.out_features)
        xs = x.reshape(-1, self.in_features)
        bias = self.approx.bias
        for i in range(0, flat.shape[0], _CHUNK):
            part, xp = flat[i:i + _CHUNK], xs[i:i + _CHUNK]
            idx = torch.cat([part.topk(self.top, -1).indices, self.kept.expand(len(part), -1)], -1)
            w = self.table.rows(idx).view(*idx.shape, self.in_features).to(xp.dtype)
            exact = torch.bmm(w, xp.unsqueeze(-1)).squeeze(-1)
            if bias is not None:
                exact = exact + bias.to(exact.dtype)[idx]
            part.scatter_(-1, idx, exact.to(part.dtype))
        return logits


def kind_of(module) -> str:
    if isinstance(module, gguf_int4.Int4PairLinear):
        return "int8"
    return "int4" if isinstance(module, (Int4Linear, RescoredHead)) else "float"


def read_bytes(module) -> int:
    """Bytes one token reads through the head ``module`` (its tensors; a ``RescoredHead``'s codes and top rows)."""
    if isinstance(module, RescoredHead):
        return module.read_bytes()
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def planned(lm_head: str, weights_kind: str) -> str:
    """The kind ``lm_head`` gives a float head under ``weights_kind`` (``flashguard plan``, before loading)."""
    if lm_head == "auto":
        return "int8" if weights_kind == "int4" else "float"
    return lm_head


def int4_possible(device: torch.device, weight: torch.Tensor) -> str | None:
    """Why ``lm_head: int4`` cannot hold ``weight`` [N, K] on ``device``, or None: its codes need K a multiple of
    ``GROUP``, and on CUDA its rows stay in host RAM only where the GPU reads them itself."""
    if weight.shape[1] % GROUP:
        return f"the head's {weight.shape[1]} inputs are not a multiple of {GROUP}"
    if device.type == "cuda" and not uva.PinnedRows.zero_copy_on(device, weight.shape[1] * weight.element_size()):
        return ("this GPU cannot read the head's rows from host RAM itself (zero-copy reads need Triton: "
                "triton-windows on Windows)")
    return None


def apply(lm_head: str, model, weights_kind: str, device: torch.device, int4_kernel: str = "auto",
          budget_wins: bool = False) -> tuple[str, str]:
    held = kind_of(model.get_output_embeddings())
    if held != "float":
        return _file_codes(lm_head, model, held, device, int4_kernel)
    kind = planned(lm_head, weights_kind)
    head = model.get_output_embeddings()
    if lm_head != "auto":
        if kind == "int8":
            quantize(model, device, int4_kernel)
        elif kind == "int4":
            _check_linear(head, "int4")
            why_not = int4_possible(device, head.weight)
            if why_not:
                raise ConfigError(f"int4: {why_not}; use int8 or auto", key="lm_head")
            _install(model, rescored_head(head.weight.detach(), _bias(head), device, int4_kernel), device)
        return kind, f"lm_head: {lm_head}"
    if kind == "float":
        return kind, "auto: a float decoder, so 16-bit; lm_head: int8 or int4 reads 0.6x or 0.3x the bytes"
    four = int4_possible(device, head.weight) is None
    if budget_wins or head.weight.device.type != device.type:   # (streamed layers)
        layer = _rescored_layer(head, device, int4_kernel) if four else _q8_0_layer(head, device, int4_kernel)
        _install(model, layer, device)
        return kind_of(layer), (f"auto: {'int4 codes, top rows in host RAM' if four else 'Q8_0 codes'}, so "
                                "that more decoder layers stay on the GPU")
    makers = {"int8": ("Q8_0", _q8_0_layer)}
    if four:
        makers["int4"] = ("int4 + top rows", _rescored_layer)
    kept = gguf_cache.remembered(model, f"lm_head auto {device.type}")   # timed at an earlier start here
    if kept and kept.get("kind") in ("float", *makers):
        if kept["kind"] != "float":
            _install(model, makers[kept["kind"]][1](head, device, int4_kernel), device)
        return kept["kind"], kept["why"] + KEPT_NOTE
    best, best_t, t16, timed = None, None, None, []
    for name, (label, make) in makers.items():
        layer = make(head, device, int4_kernel)
        t_head, t_layer = _time_one_token(head, layer, device)
        t16 = t_head if t16 is None else min(t16, t_head)
        timed.append(f"{t_layer * 1e3:.3f} ms as {label}")
        if best_t is None or t_layer < (INT4_MARGIN if name == "int4" else 1.0) * best_t:
            best, best_t = (name, layer), t_layer
        del layer   # (the loser's memory back before the next is built)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    timed = f"one token's head {', '.join(timed)}, {t16 * 1e3:.3f} ms in 16 bits here"
    if best_t < 0.97 * t16:
        _install(model, best[1], device)
        why = f"auto: {makers[best[0]][0]} codes ({timed})"
        gguf_cache.remember(model, f"lm_head auto {device.type}", {"kind": best[0], "why": why})
        return best[0], why
    del best
    if device.type == "cuda":
        torch.cuda.empty_cache()
    why = f"auto: 16-bit ({timed}); lm_head: int8 or int4 reads 0.6x or 0.3x the bytes"
    gguf_cache.remember(model, f"lm_head auto {device.type}", {"kind": "float", "why": why})
    return "float", why


def _file_codes(key: str, model, held: str, device: torch.device, int4_kernel: str) -> tuple[str, str]:
    """A head the file holds in Q4 or Q8_0 keeps its codes; a Q8_0 head whose matrix the model also holds in
    float (``Int4PairLinear.table``: a GGUF's tied embeddings) becomes int4 codes over that table under ``int4``,
    and under ``auto`` where that times faster."""
    why = f"the file's own {'Q4' if held == 'int4' else 'Q8_0'} codes"
    pair = model.get_output_embeddings()
    table = pair.table if held == "int8" else None
    if held == "int8":
        pair.table = None   # a kept pair must not hold the table alive (it may move to host RAM)
    if table is None or key not in ("int4", "auto"):
        if key == "int4":
            why += " (lm_head: int4 needs the head's matrix in float, which this file does not hold)"
        return held, why
    why_not = int4_possible(device, table)
    if why_not:
        if key == "int4":
            raise ConfigError(f"int4: {why_not}; use int8 or auto", key="lm_head")
        return held, why
    kept = gguf_cache.remembered(model, f"lm_head auto {device.type} over the Q8_0 table") \
        if key == "auto" else None   # timed at an earlier start on this machine (the model's cache entry)
    if kept and kept.get("kind") in ("int4", held):
        if kept["kind"] == "int4":
            _install(model, rescored_head(table, None, device, int4_kernel), device)
        return kept["kind"], kept["why"] + KEPT_NOTE
    layer = rescored_head(table, None, device, int4_kernel)
    if key == "int4":
        _install(model, layer, device)
        return "int4", "lm_head: int4 (over the file's Q8_0 table)"
    t8, t4 = _time_one_token(pair, layer, device, table.dtype)
    timed = f"one token's head {t4 * 1e3:.3f} ms as int4 + top rows, {t8 * 1e3:.3f} ms as the file's Q8_0 here"
    if t4 < INT4_MARGIN * t8:
        _install(model, layer, device)
        kind, why = "int4", f"auto: int4 + top rows over the file's Q8_0 table ({timed})"
    else:
        del layer
        kind, why = held, f"{why} ({timed})"
    gguf_cache.remember(model, f"lm_head auto {device.type} over the Q8_0 table", {"kind": kind, "why": why})
    return kind, why


def _time_one_token(head, layer, device: torch.device, dtype: torch.dtype | None = None,
                    reps: int = 30) -> tuple[float, float]:
    """Median seconds of one token through each head (warmed up first)."""
    import statistics
    import time

    x = torch.randn(1, 1, layer.in_features, dtype=dtype or head.weight.dtype, device=device)
    out = []
    for module in (head, layer):
        times = []
        with torch.inference_mode():
            for i in range(reps + 3):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                module(x)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out[0], out[1]


def quantize(model, device: torch.device, int4_kernel: str = "auto") -> None:
    _install(model, _q8_0_layer(model.get_output_embeddings(), device, int4_kernel), device)


def _rescored_layer(head, device: torch.device, int4_kernel: str) -> RescoredHead:
    _check_linear(head, "int4")
    return rescored_head(head.weight.detach(), _bias(head), device, int4_kernel)


def _bias(head):
    return head.bias.detach() if head.bias is not None else None


def rescored_head(weight: torch.Tensor, bias, device: torch.device, int4_kernel: str = "auto", top: int = TOP,
                  rows: int = 4096) -> RescoredHead:
    """A ``RescoredHead`` of the matrix ``weight`` [N, K]: its int4 codes (RTN, group ``GROUP``, ``rows`` rows at a
    time: no float32 copy of the whole head) on ``device`` and its rows in host RAM (``kv.uva.PinnedRows``)."""
    parts = [awq_format.quantize_rtn(weight[r:r + rows].float(), GROUP) for r in range(0, weight.shape[0], rows)]
    codes, zeros, scales = (torch.cat([p[i].cpu() for p in parts]) for i in range(3))
    approx = Int4Linear.from_codes(codes, zeros, scales, GROUP, bias, device, int4_kernel)
    return RescoredHead(approx, uva.PinnedRows(weight, device), weight.data_ptr(), top)


def _check_linear(head, key: str) -> None:
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"lm_head: {key} quantizes a float nn.Linear output matrix; this model's is "
                         f"{type(head).__name__}")


def _q8_0_layer(head, device: torch.device, int4_kernel: str) -> "gguf_int4.Int4PairLinear":
    _check_linear(head, "int8")
    codes, zeros, scales = gguf_int4.q8_0_quantize(head.weight.detach())
    return gguf_int4.Int4PairLinear(
        Int4Linear.from_codes(codes, zeros, scales, gguf_int4.GROUP_SIZE, _bias(head), device, int4_kernel))


def _install(model, layer, device: torch.device) -> None:
    model.set_output_embeddings(layer)
    if hasattr(model.config, "tie_word_embeddings"):   # save_pretrained / resize must not re-tie a quantized head
        model.config.tie_word_embeddings = False
    if device.type == "cuda":   # the 16-bit head's memory back to the allocator
        torch.cuda.empty_cache()
