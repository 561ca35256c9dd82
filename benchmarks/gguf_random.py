"""A random-weight Q4_K_M GGUF of a Qwen2 / Llama shape, written directly: llama.cpp's side of ``bench.big``.

    PYTHONPATH=llama.cpp/gguf-py python -m benchmarks.gguf_random VOCAB.gguf OUT.gguf [--layers N]

``VOCAB.gguf`` is what ``convert_hf_to_gguf.py HF_DIR --vocab-only`` writes for a folder holding the shape's
config.json and the real tokenizer: the model's metadata (shape, rope, norms) and tokenizer, no tensors. This adds
the tensors as random Q4_K / Q6_K blocks in llama-quantize's Q4_K_M mix (token_embd Q4_K, output Q6_K, attn_v and
ffn_down Q6_K on the layers ``use_more_bits`` picks, every other matrix Q4_K; norms and biases F32), with sane
block scales, so llama.cpp runs it like a quantized real model: seconds, where converting a 15 GB fp16 checkpoint
and quantizing it take minutes. Random bytes are drawn once per tensor shape and XOR-ed per layer.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

QK = 256
Q4_K_BYTES, Q6_K_BYTES = 144, 210


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the Q4_K_M layers that get Q6_K for attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _blocks(kind: str, rows: int, k: int, base: dict, salt: int, rng) -> np.ndarray:
    """``rows`` x ``k`` weights as random ``kind`` blocks (uint8 [rows, k / 256 * block bytes])."""
    size = Q4_K_BYTES if kind == "Q4_K" else Q6_K_BYTES
    key = (kind, rows, k)
    if key not in base:
        b = rng.integers(0, 256, size=(rows, k // QK, size), dtype=np.uint8)
        if kind == "Q4_K":   # d, dmin (f16) then 12 bytes of 6-bit scales/mins, 128 bytes of codes
            b[..., 0:4] = np.frombuffer(np.array([1e-4, 1e-4], dtype=np.float16).tobytes(), dtype=np.uint8)
        else:                # 128 ql, 64 qh, 16 int8 scales, d (f16)
            b[..., 192:208] = 8
            b[..., 208:210] = np.frombuffer(np.array([8e-5], dtype=np.float16).tobytes(), dtype=np.uint8)
        base[key] = b
    b = base[key]
    if salt:
        b = b.copy()
        if kind == "Q4_K":
            b[..., 16:] ^= np.uint8(salt)
        else:
            b[..., :192] ^= np.uint8(salt)
    return b.reshape(rows, -1)


def write(vocab_path: str, out_path: str, layers: int | None = None, seed: int = 0) -> dict:
    import gguf

    reader = gguf.GGUFReader(vocab_path)
    fields = {f.name: f for f in reader.fields.values()}
    arch = fields["general.architecture"].contents()

    def hp(name):
        return int(fields[f"{arch}.{name}"].contents())

    n_layer = hp("block_count")
    hidden, inter = hp("embedding_length"), hp("feed_forward_length")
    heads, kv_heads = hp("attention.head_count"), hp("attention.head_count_kv")
    head_dim = int(fields[f"{arch}.attention.key_length"].contents()) if f"{arch}.attention.key_length" in fields \
        else hidden // heads
    vocab = len(fields["tokenizer.ggml.tokens"].contents())
    if layers:
        n_layer = layers
    writer = gguf.GGUFWriter(out_path, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
        elif field.name == f"{arch}.block_count":
            value = n_layer
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    rng = np.random.default_rng(seed)
    base: dict = {}
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    qdim, kvdim = heads * head_dim, kv_heads * head_dim

    def add(name, kind, rows, k, salt=0):
        writer.add_tensor(name, _blocks(kind, rows, k, base, salt, rng), raw_dtype=q4 if kind == "Q4_K" else q6)

    add("token_embd.weight", "Q4_K", vocab, hidden)
    for i in range(n_layer):
        salt = (i * 37 + 1) % 256
        more = "Q6_K" if use_more_bits(i, n_layer) else "Q4_K"
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(f"blk.{i}.attn_q.weight", "Q4_K", qdim, hidden, salt)
        add(f"blk.{i}.attn_k.weight", "Q4_K", kvdim, hidden, salt)
        add(f"blk.{i}.attn_v.weight", more, kvdim, hidden, salt)
        if arch == "qwen2":
            for part, n in (("q", qdim), ("k", kvdim), ("v", kvdim)):
                writer.add_tensor(f"blk.{i}.attn_{part}.bias", (rng.standard_normal(n) * 0.02).astype(np.float32))
        add(f"blk.{i}.attn_output.weight", "Q4_K", hidden, qdim, salt)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(f"blk.{i}.ffn_gate.weight", "Q4_K", inter, hidden, salt)
        add(f"blk.{i}.ffn_up.weight", "Q4_K", inter, hidden, salt)
        add(f"blk.{i}.ffn_down.weight", more, hidden, inter, salt)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    add("output.weight", "Q6_K", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"arch": arch, "layers": n_layer, "hidden": hidden, "vocab": vocab, "path": out_path}


def main(argv=None) -> int:
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vocab")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many decoder layers")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    info = write(args.vocab, args.out, args.layers)
    print(f"{args.out}: {info['arch']}, {info['layers']} layers, hidden {info['hidden']}, vocab {info['vocab']}, "
          f"{os.path.getsize(args.out) / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
