"""``flashguard quantize``: activation-aware weight quantization (AWQ) to 4 bits, written in the AWQ gemm format.

Why hand-written: AutoAWQ is deprecated, needs triton (no Windows) and gives a broken model under transformers 5;
llm-compressor pins transformers 5.15-5.17 (flashguard declares a wider range) and crashes on CPU-only torch. The
method is small: per decoder layer, for each group of linears that read the same input (q/k/v after the input norm,
gate/up after the post-attention norm, down after up, o after v when their shapes match), search the per-input-channel
scale ``s = mean|x|^a / mean|w|^(1-a)`` over a grid of ``a`` that minimises the output error of the quantized
group, fold ``1/s`` into the producer (norm weight or previous linear) and ``s`` into the group's weights (exact in
float), optionally search a per-group clipping ratio, then round to nearest with per-group scale and zero point.

Contract: ``quantize(model, calibration_ids, group_size, clip=True)`` returns ``{linear name: (codes, zeros, scales)}``
for every linear of the decoder layers and leaves the model holding the *scaled float* weights;
``save_awq(model, tokenizer, params, group_size, dst)`` writes a checkpoint that ``load_awq`` (and
transformers+gptqmodel, vLLM) read. ``method="rtn"`` skips the search (the round-to-nearest baseline).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from . import awq_format

N_GRID = 20
SEARCH_TOKENS = 4096
CLIP_TOKENS = 512


class _Captured(Exception):
    pass


def _topics_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def calibration_text() -> str:
    """English prose present on every Python install: the help topics of ``pydoc_data`` (first 70%)."""
    text = _topics_text()
    return text[: int(len(text) * 0.7)]


def heldout_text() -> str:
    """The last 30% of the same topics, never seen by the calibration."""
    text = _topics_text()
    return text[int(len(text) * 0.7):]


def token_blocks(tokenizer, text: str, n_blocks: int, seqlen: int) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = min(n_blocks, ids.numel() // seqlen)
    if n == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one block of {seqlen}")
    return ids[: n * seqlen].view(n, seqlen)


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch: int = 4) -> float:
    nll, count = 0.0, 0
    device = next(model.parameters()).device
    for i in range(0, blocks.shape[0], batch):
        ids = blocks[i: i + batch].to(device)
        logits = model(input_ids=ids, use_cache=False).logits.float()
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                           reduction="sum")
        nll += loss.item()
        count += ids[:, 1:].numel()
    return float(torch.exp(torch.tensor(nll / count)))


def _decoder_layers(model) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers; flashguard quantizes Llama/Qwen2/Mistral-style "
                         "decoders")
    return layers


def _groups(layer) -> list[tuple[nn.Module, list[str], nn.Module | None]]:
    """(producer, consumer linear names, module whose output the search compares or None = the linears)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [(layer.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], None)]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # MHA only: with GQA the shapes differ
        groups.append((attn.v_proj, ["self_attn.o_proj"], None))
    groups.append((layer.post_attention_layernorm, ["mlp.gate_proj", "mlp.up_proj"], mlp))
    groups.append((mlp.up_proj, ["mlp.down_proj"], None))
    return groups


def _run_layer(layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def _search_scale(layer, producer, names, inspect, x: torch.Tensor, group_size: int) -> torch.Tensor:
    linears = [layer.get_submodule(n) for n in names]
    weights = [lin.weight.data.clone() for lin in linears]
    x_mean = x.abs().view(-1, x.shape[-1]).float().mean(0)
    w = torch.cat(weights, 0).float()
    wg = w.abs().view(w.shape[0], -1, group_size)
    w_mean = (wg / wg.amax(-1, keepdim=True).clamp(min=1e-6)).view(w.shape[0], -1).mean(0)
    xs = x.view(-1, x.shape[-1])
    if xs.shape[0] > SEARCH_TOKENS:
        xs = xs[torch.randperm(xs.shape[0], generator=torch.Generator().manual_seed(0))[:SEARCH_TOKENS]]

    def outputs() -> torch.Tensor:
        if inspect is not None:
            return inspect(xs)
        return torch.cat([lin(xs) for lin in linears], -1)

    reference = outputs()
    best, best_loss = torch.ones_like(x_mean), float("inf")
    for i in range(N_GRID):
        ratio = i / N_GRID
        s = (x_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        for lin, orig in zip(linears, weights):
            lin.weight.data = awq_format.fake_quantize(orig * s, group_size) / s
        loss = (outputs() - reference).float().pow(2).mean().item()
        if loss < best_loss:
            best, best_loss = s, loss
    for lin, orig in zip(linears, weights):
        lin.weight.data = orig
    return best.to(weights[0].dtype)


@torch.no_grad()
def _apply_scale(layer, producer, names, s: torch.Tensor) -> None:
    if isinstance(producer, nn.Linear):
        producer.weight.data.div_(s.view(-1, 1))
        if producer.bias is not None:
            producer.bias.data.div_(s)
    else:
        producer.weight.data.div_(s)
    for n in names:
        layer.get_submodule(n).weight.data.mul_(s.view(1, -1))


@torch.no_grad()
def _search_clip(weight: torch.Tensor, x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per (output channel, group) clipping of the weight's range that minimises that group's output error."""
    n, k = weight.shape
    xs = x.view(-1, k)
    xs = xs[torch.randperm(xs.shape[0], generator=torch.Generator().manual_seed(1))[:CLIP_TOKENS]].float()
    xg = xs.view(xs.shape[0], k // group_size, group_size)
    wg = weight.float().view(n, k // group_size, group_size)
    reference = torch.einsum("tgk,ngk->ntg", xg, wg)
    org_max = wg.abs().amax(-1, keepdim=True)
    best_max, best_err = org_max.clone(), torch.full(org_max.shape, float("inf"))
    for i in range(N_GRID // 2):
        cur = org_max * (1 - i / N_GRID)
        q = awq_format.fake_quantize(torch.max(torch.min(wg, cur), -cur).view(n, k), group_size)
        err = (torch.einsum("tgk,ngk->ntg", xg, q.view(n, -1, group_size)) - reference).pow(2).mean(1, keepdim=True)
        err = err.permute(0, 2, 1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, cur, best_max)
    return torch.max(torch.min(wg, best_max), -best_max).view(n, k).to(weight.dtype)


@torch.no_grad()
def quantize(model, calibration_ids: torch.Tensor, group_size: int = 64, clip: bool = True, method: str = "awq",
             progress=None) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    layers = _decoder_layers(model)
    captured: dict = {}

    def grab(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Captured

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(input_ids=calibration_ids, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    hidden, kwargs = captured["hidden"], captured["kwargs"]
    kwargs["use_cache"] = False
    kwargs.pop("past_key_values", None)
    kwargs.pop("past_key_value", None)
    params: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for index, layer in enumerate(layers):
        inputs: dict[str, torch.Tensor] = {}
        hooks = [layer.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: inputs.__setitem__(n, a[0].detach()))
            for _, names, _ in _groups(layer) for n in names[:1]]
        hooks.append(layer.self_attn.o_proj.register_forward_hook(
            lambda m, a, o: inputs.__setitem__("self_attn.o_proj", a[0].detach())))
        next_hidden = _run_layer(layer, hidden, kwargs)
        for h in hooks:
            h.remove()
        if method == "awq":
            for producer, names, inspect in _groups(layer):
                s = _search_scale(layer, producer, names, inspect, inputs[names[0]], group_size)
                _apply_scale(layer, producer, names, s)
                inputs[names[0]] = inputs[names[0]] / s  # what the consumers now see
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            weight = module.weight.data
            if method == "awq" and clip and not name.endswith(("q_proj", "k_proj")):
                source = name if name in inputs else {"self_attn.k_proj": "self_attn.q_proj",
                                                       "self_attn.v_proj": "self_attn.q_proj",
                                                       "mlp.up_proj": "mlp.gate_proj"}.get(name)
                weight = _search_clip(weight, inputs[source], group_size)
            params[f"model.layers.{index}.{name}"] = awq_format.quantize_rtn(weight, group_size)
        hidden = next_hidden
        if progress is not None:
            progress(index + 1, len(layers))
    return params


def save_awq(model, tokenizer, params: dict, group_size: int, dst: str | os.PathLike) -> None:
    """Write ``dst`` (config.json, model.safetensors, tokenizer) atomically: a folder that exists is complete."""
    from safetensors.torch import save_file

    dst = Path(dst)
    state = {}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        base = name.rsplit(".", 1)[0]
        if base in params or (tied and name == "lm_head.weight"):
            continue
        state[name] = tensor.to(torch.float16) if tensor.is_floating_point() else tensor
    for name, (codes, zeros, scales) in params.items():
        qweight, qzeros = awq_format.pack(codes, zeros)
        state[name + ".qweight"] = qweight
        state[name + ".qzeros"] = qzeros
        state[name + ".scales"] = scales.t().contiguous().to(torch.float16)
        bias = model.get_submodule(name).bias
        if bias is not None:
            state[name + ".bias"] = bias.detach().to(torch.float16)
    state = {k: v.contiguous() for k, v in state.items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config["torch_dtype"] = config["dtype"] = "float16"
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private; the result is an ordinary folder
        for child in tmp.iterdir():
            os.chmod(child, 0o666 & ~umask)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def quantize_folder(src_folder: str, dst: str | os.PathLike, group_size: int = 64, method: str = "awq",
                    clip: bool = True, samples: int = 32, seqlen: int = 512, label: str | None = None) -> dict:
    """Quantize the float HF model in ``src_folder`` into ``dst`` with a progress bar; returns timings."""
    import time

    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(src_folder)
    model = AutoModelForCausalLM.from_pretrained(src_folder, dtype=torch.float32)
    model.eval()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers.") and module.in_features % group_size:
            raise ValueError(f"{name} has {module.in_features} input features, not a multiple of group size "
                             f"{group_size}; choose --group-size 32")
    blocks = token_blocks(tokenizer, calibration_text(), samples, seqlen)
    with tqdm(total=model.config.num_hidden_layers, desc=f"AWQ int4 {label or Path(src_folder).name}",
              unit="layer") as bar:
        params = quantize(model, blocks, group_size, clip=clip, method=method,
                          progress=lambda done, total: bar.update(done - bar.n))
    save_awq(model, tokenizer, params, group_size, dst)
    return {"seconds": time.perf_counter() - t0, "layers": model.config.num_hidden_layers,
            "calibration_tokens": int(blocks.numel())}
