"""Paths that exist only on a CUDA GPU (skipped elsewhere; run on the device machine): the fused attention
segments with their log-sum-exp, and CUDA-graph decode steps against the same steps run eagerly."""

import pytest
import torch

from flashguard import CacheConfig
from flashguard.kv import attention
from tests.tiny import forwarding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def small_qwen2(layers: int):
    """(config, fp16 random-weight model on the GPU) of a small Qwen2 with the 1.5B's head shape."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                      num_hidden_layers=layers, intermediate_size=1024, vocab_size=1000, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return cfg, Qwen2ForCausalLM(cfg).to(torch.float16).eval()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq", [1, 300])
def test_fused_segment_matches_the_einsum_path(causal, lq):
    if causal and lq == 1:
        pytest.skip("one query is never causal here")
    g = torch.Generator(device="cuda").manual_seed(0)
    kvh, grp, d, n = 2, 6, 128, lq if causal else 1000
    q = torch.randn(kvh, grp, lq, d, device="cuda", generator=g, dtype=torch.float16)
    k = torch.randn(kvh, n, d, device="cuda", generator=g, dtype=torch.float16)
    v = torch.randn(kvh, n, d, device="cuda", generator=g, dtype=torch.float16)
    mask = torch.ones(lq, n, dtype=torch.bool, device="cuda").tril_(n - lq) if causal else None
    o_ref, lse_ref = attention.partial_attention(q.float(), k.float(), v.float(), d ** -0.5, mask)
    o, lse = attention.segment(q, k, v, d ** -0.5, causal=causal)
    assert attention.KERNELS.get("segment", q.device.index, q.dtype) in ("flash", "efficient")
    torch.testing.assert_close(o.float(), o_ref, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse, lse_ref, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("lq, n", [(2048, 2048 + 4096), (300, 300), (37, 1000)])
def test_one_call_chunk_attention_equals_the_causal_reference(lq, n):
    g = torch.Generator(device="cuda").manual_seed(1)
    kvh, grp, d = 2, 6, 128
    q = torch.randn(kvh * grp, lq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(kvh, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(kvh, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    assert attention.one_call_chunks(q.device), attention.one_call_chunks.last_error
    got = attention.chunk_attention(q, k, v, d ** -0.5)
    mask = torch.ones(lq, n, dtype=torch.bool, device="cuda").tril_(n - lq)   # the chunk is the last lq keys
    want, _ = attention.partial_attention(q.reshape(kvh, grp, lq, d).float(), k.float(), v.float(), d ** -0.5, mask)
    torch.testing.assert_close(got.float(), want.reshape(kvh * grp, lq, d), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("policy", ["exact", "sparse"])
def test_graph_steps_match_eager_steps(policy):
    from transformers import DynamicCache

    from flashguard.engine.decode_step import DecodeStep
    from flashguard.kv.cache import TieredCache

    cfg, model = small_qwen2(6)
    tiers = CacheConfig(page_size=64, l1_tokens=256, sink_tokens=64, l1_max_tokens=512, budget_tokens=256,
                        l3_tokens=0, policy=policy)  # L2 only: the GPU machine lacks cryptography (L3 sealing)
    ids = torch.randint(0, 1000, (1, 3000), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    graphs, eager = DecodeStep(model), DecodeStep(model, graphs=False)
    outs, tokens = [], None
    for step in (graphs, eager):   # the eager path is fed the graph path's tokens: a near-tie cannot fork them
        cache = TieredCache(cfg, tiers).attach(model)
        with torch.inference_mode():
            for a in range(0, 3000, 1000):
                with forwarding(cache, ids[0, a:a + 1000].tolist()):
                    tok = int(model(input_ids=ids[:, a:a + 1000], past_key_values=cache).logits[0, -1].argmax())
        logits, fed = [], []
        for n in range(24):
            tok = tok if tokens is None else tokens[n]
            with forwarding(cache, [tok]):
                fed.append(tok)
                row = step.step(tok, cache).float()
            logits.append(row)
            tok = int(row.argmax())
        tokens = fed
        outs.append(torch.stack(logits))
        cache.check_integrity()
    assert eager.graphs is None and not eager.step_graphs
    if policy == "sparse":   # off the window, the whole sparse step is one graph (kv/sparse_step.py, with the step
        # kernels of kv/step_kernels.py), which merges two fp16 partial outputs where the eager path attends one
        # concatenated segment: rounding (the paths agree to 1e-4 in fp32, tests/kv/test_sparse_step.py and
        # tests/kv/test_step_kernels.py). Over 24 steps a near-tie in the page choice can pick another page at a late
        # step (on the H200: 128 of 24,000 logits past 6e-2, the largest 0.13 at step 22): nearly every logit
        # within the rounding, and none far off
        assert any(key.kind == "sparse" for key in graphs.step_graphs)
        diff = (outs[0] - outs[1]).abs()
        assert (diff <= 6e-2 + 2e-2 * outs[1].abs()).float().mean() >= 0.99 and diff.max() <= 0.25, diff.max()
    else:                    # exact: graphs between the attention calls, the very same kernels
        assert graphs.graphs is not None
        torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    dyn = DynamicCache(config=cfg)
    with torch.inference_mode():
        model(input_ids=ids[:, :2000], past_key_values=dyn)
    assert graphs.step(5, dyn).shape == (1000,)  # any Cache works under the graphs


def test_a_host_embedding_looks_up_device_ids_on_the_gpu():
    from flashguard.engine.host_embedding import HostEmbedding

    torch.manual_seed(0)
    emb = torch.nn.Embedding(1000, 96).to(torch.bfloat16)
    host = HostEmbedding(emb, torch.device("cuda"))
    assert host.zero_copy
    ids = torch.tensor([[3, 999, 0, 3], [7, 8, 9, 10]], device="cuda")
    torch.testing.assert_close(host(ids).cpu(), emb.weight.detach()[ids.cpu()], rtol=0, atol=0)
    assert host(ids).device.type == "cuda" and host.rows(ids.cpu()).device.type == "cuda"


def test_zero_copy_reads_match_host_gathers():
    from flashguard.kv import uva

    assert uva.available(torch.device("cuda")), uva.available.last_error
    host = torch.randint(0, 255, (300, 4096), dtype=torch.uint8).pin_memory()
    rows = torch.tensor([7, 299, 0, 7, 150], device="cuda")
    assert torch.equal(uva.gather_rows(host, rows, torch.device("cuda")).cpu(), host[rows.cpu()])


def test_sparse_zero_copy_equals_host_path():
    """The same query on the same cache state: the pages read on the GPU straight from pinned RAM and the pages
    brought by the host (hot set + host gather) give the same attention (page order aside: fp16 rounding)."""
    from flashguard.kv.cache import TieredCache

    cfg, model = small_qwen2(4)
    ids = torch.randint(0, 1000, (1, 4000), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    cache = TieredCache(cfg, CacheConfig(page_size=64, l1_tokens=256, sink_tokens=64, l1_max_tokens=512,
                                         budget_tokens=256, l3_tokens=0)).attach(model)
    with torch.inference_mode():
        for a in range(0, 4000, 1000):
            with forwarding(cache, ids[0, a:a + 1000].tolist()):
                model(input_ids=ids[:, a:a + 1000], past_key_values=cache)
    assert cache.zero_copy(torch.device("cuda"))
    layer = cache.layers[2]
    first, last = 1, layer.win_start // 64
    q = torch.randn(2, 2, 1, 128, device="cuda", dtype=torch.float16, generator=torch.Generator("cuda").manual_seed(3))
    k1, v1 = layer._sparse(q, first, last)
    cache.zero_copy = lambda device, upto=None: False   # the host path on the same state
    k2, v2 = layer._sparse(q, first, last)
    assert k1.shape == k2.shape == (2, 2 * 4 * 64, 128)   # kv_heads x budget pages of 64 tokens
    o1, lse1 = attention.segment(q, k1, v1, 128 ** -0.5)
    o2, lse2 = attention.segment(q, k2, v2, 128 ** -0.5)
    torch.testing.assert_close(o1.float(), o2.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse1, lse2, atol=2e-3, rtol=2e-3)
    cache.check_integrity()


def test_prefill_streams_the_same_pages_zero_copy_as_through_the_host():
    """A prefill chunk past the pool attends every page that left it: read on the GPU straight from pinned L2,
    the blocks are the very K/V the host gather brings."""
    from flashguard.kv.cache import TieredCache

    cfg, model = small_qwen2(2)
    ids = torch.randint(0, 1000, (1, 3000), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    cache = TieredCache(cfg, CacheConfig(page_size=64, l1_tokens=256, sink_tokens=64, l1_max_tokens=512,
                                         l3_tokens=0, policy="exact")).attach(model)
    with torch.inference_mode():
        for a in range(0, 3000, 1000):
            with forwarding(cache, ids[0, a:a + 1000].tolist()):
                model(input_ids=ids[:, a:a + 1000], past_key_values=cache)
    cache.stats()
    layer = cache.layers[1]
    pages = list(range(1, layer.win_start // 64))
    assert cache.zero_copy(torch.device("cuda")) and len(pages) > 20
    direct = [tuple(t.clone() for t in kv) for kv in layer._stream_pages(pages, 16)]
    cache.zero_copy = lambda device, upto=None: False
    hosted = [tuple(t.clone() for t in kv) for kv in layer._stream_pages(pages, 16)]
    assert len(direct) == len(hosted) == -(-len(pages) // 16)
    for (k1, v1), (k2, v2) in zip(direct, hosted):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7])
def test_triton_int4_linear_matches_the_reference(dtype, tokens):
    """Int4Linear's triton backend (auto's pick where the kernels pass their self-check): one token through the
    matrix-vector kernel, replayed in a CUDA graph too; several through the dequantization + cuBLAS."""
    from flashguard.quant import awq_format, int4_triton
    from flashguard.quant.int4_linear import Int4Linear

    assert int4_triton.available(torch.device("cuda")), int4_triton.available.last_error
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(8960, 1536, device="cuda", generator=g) * 0.02
    codes, zeros, scales = awq_format.quantize_rtn(w, 128)
    bias = torch.randn(8960, device="cuda", generator=g, dtype=dtype)
    layer = Int4Linear.from_codes(codes, zeros, scales, 128, bias, torch.device("cuda"), "auto")
    assert layer.backend == "triton"
    x = torch.randn(1, tokens, 1536, device="cuda", generator=g, dtype=dtype)
    want = x.float() @ awq_format.dequantize(codes, zeros, scales, 128).t() + bias.float()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (1, tokens, 8960)
    torch.testing.assert_close(got.float(), want, atol=0.02 * want.abs().max().item(), rtol=0.02)
    if tokens == 1:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = layer(x)
        graph.replay()
        assert torch.equal(replayed, got)


def test_prefix_attention_reads_only_the_used_keys():
    """flash's varlen kernel with a device-side key count (the one-graph step's attention) = exact attention over
    the used prefix; garbage past it changes nothing."""
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(2, 33000, 128, device="cuda", generator=g, dtype=torch.float16)
    v = torch.randn(2, 33000, 128, device="cuda", generator=g, dtype=torch.float16)
    q = torch.randn(12, 128, device="cuda", generator=g, dtype=torch.float16)
    for used in (1, 700, 32769):
        n = torch.tensor([used], dtype=torch.int32, device="cuda")
        got = attention.prefix_attention(q, k, v, n, 128 ** -0.5)
        want, _ = attention.partial_attention(q.float().view(2, 6, 1, 128), k[:, :used].float(),
                                              v[:, :used].float(), 128 ** -0.5)
        torch.testing.assert_close(got.float(), want.reshape(12, 128), atol=3e-3, rtol=3e-3)
    assert attention.KERNELS.get("prefix", q.device.index, q.dtype) == "flash"


def test_prefix_segment_gives_the_output_and_log_sum_exp_of_the_used_keys():
    """The sparse step's L1 part: flash's varlen kernel with a device-side key count, its log-sum-exp included
    (what the merge with the pages' part needs), = the einsum path over the used prefix."""
    g = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(2, 9000, 128, device="cuda", generator=g, dtype=torch.float16)
    v = torch.randn(2, 9000, 128, device="cuda", generator=g, dtype=torch.float16)
    q = torch.randn(2, 6, 1, 128, device="cuda", generator=g, dtype=torch.float16)
    for used in (1, 4097, 9000):
        n = torch.tensor([used], dtype=torch.int32, device="cuda")
        o, lse = attention.prefix_segment(q, k, v, n, 128 ** -0.5)
        want_o, want_lse = attention.partial_attention(q.float(), k[:, :used].float(), v[:, :used].float(),
                                                       128 ** -0.5)
        torch.testing.assert_close(o.float(), want_o, atol=3e-3, rtol=3e-3)
        torch.testing.assert_close(lse.float(), want_lse, atol=3e-3, rtol=3e-3)


def test_static_kv_one_graph_step_matches_the_models_forward():
    from transformers import DynamicCache

    from flashguard.engine.decode_step import DecodeStep, StaticKV

    cfg, model = small_qwen2(6)
    ids = torch.randint(0, 1000, (1, 1000), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    cache = DynamicCache(config=cfg)
    with torch.inference_mode():
        token = int(model(input_ids=ids, past_key_values=cache).logits[0, -1].argmax())
    kv, step, ours, theirs = StaticKV.from_cache(cache, 1088), DecodeStep(model), [], []
    for _ in range(24):   # teacher-forced by the model's forward: both see the same tokens
        ours.append(step.step(token, kv).float())
        with torch.inference_mode():
            tok = torch.tensor([[token]], device="cuda")
            theirs.append(model(input_ids=tok, past_key_values=cache).logits[0, -1].float())
        token = int(theirs[-1].argmax())
    assert step.step_graphs and kv.length == 1024
    torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), atol=2e-2, rtol=2e-2)


def test_an_int8_pool_without_the_step_kernels_reads_its_codes_with_the_split_kernel():
    """Step kernels off (``kernels=False``: a model they do not compute): the one-graph step over an int8 StaticKV
    attends the codes with step_kernels' split-K attention (``DecodeStep.split_kernel``), recorded as a graph, and
    predicts what the model's forward over the 16-bit cache predicts, to int8 rounding."""
    from transformers import DynamicCache

    from flashguard.engine.decode_step import DecodeStep, StaticKV

    cfg, model = small_qwen2(4)
    ids = torch.randint(0, 1000, (1, 700), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    cache = DynamicCache(config=cfg)
    with torch.inference_mode():
        token = int(model(input_ids=ids, past_key_values=cache).logits[0, -1].argmax())
    kv = StaticKV.from_cache(cache, 768).quantized()
    step = DecodeStep(model, kernels=False)
    assert not step.kernels and step.split_kernel
    ours, theirs = [], []
    for _ in range(12):
        ours.append(step.step(token, kv).float())
        with torch.inference_mode():
            theirs.append(model(input_ids=torch.tensor([[token]], device="cuda"), past_key_values=cache).logits[0, -1]
                          .float())
        token = int(theirs[-1].argmax())
    assert step.step_graphs and kv.length == 712
    ours, theirs = torch.stack(ours), torch.stack(theirs)
    assert ((ours - theirs).abs().amax(1) <= 0.15 * theirs.std(1)).all()


@pytest.mark.parametrize("kvh,g", [(2, 6), (4, 7)])
def test_int8_pool_decode_kernel_reads_only_the_used_codes(kvh, g):
    """The Triton split-K kernel (step_kernels) over int8 codes + group scales = exact attention over the
    dequantized prefix; garbage past ``used`` changes nothing; inside a CUDA graph with ``used`` changed between
    replays too."""
    from flashguard.kv import int8_pool, step_kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(kvh, 33000, 128, device="cuda", generator=gen, dtype=torch.float16)
    v = torch.randn(kvh, 33000, 128, device="cuda", generator=gen, dtype=torch.float16)
    kc, ks = int8_pool.quantize(k)
    vc, vs = int8_pool.quantize(v)
    kd, vd = int8_pool.dequantize(kc, ks, torch.float32), int8_pool.dequantize(vc, vs, torch.float32)
    q = torch.randn(kvh * g, 128, device="cuda", generator=gen, dtype=torch.float16)
    used = torch.tensor([1], dtype=torch.int32, device="cuda")
    step_kernels.decode_attention(q, kc, vc, used, 128 ** -0.5, ks, vs)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step_kernels.decode_attention(q, kc, vc, used, 128 ** -0.5, ks, vs)
    for n in (1, 700, 32769):
        used.fill_(n)
        graph.replay()
        want, _ = attention.partial_attention(q.float().view(kvh, g, 1, 128), kd[:, :n], vd[:, :n], 128 ** -0.5)
        torch.testing.assert_close(out.float(), want.reshape(kvh * g, 128), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("kvh,g,int8", [(2, 6, False), (4, 7, False), (2, 6, True)])
def test_step_kernels_in_a_graph_equal_the_reference(kvh, g, int8):
    """kv/step_kernels.py on the GPU: rotary + pool write at a device position, then split-K attention over a
    device count, recorded once in a CUDA graph and replayed with both changed; = the torch reference."""
    from flashguard.kv import int8_pool, step_kernels

    assert step_kernels.available(torch.device("cuda")), step_kernels.available.last_error
    gen = torch.Generator(device="cuda").manual_seed(2)
    d, cap = 128, 33000
    k = torch.randn(kvh, cap, 128, device="cuda", generator=gen, dtype=torch.float16)
    v = torch.randn(kvh, cap, 128, device="cuda", generator=gen, dtype=torch.float16)
    q, kn, vn = (torch.randn(h * d, device="cuda", generator=gen, dtype=torch.float16) for h in (kvh * g, kvh, kvh))
    angle = torch.rand(d // 2, device="cuda", generator=gen).repeat(2) * 3
    cos, sin = angle.cos().half(), angle.sin().half()
    pool = (*int8_pool.quantize(k), *int8_pool.quantize(v)) if int8 else (k, None, v, None)
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    used = torch.ones(1, dtype=torch.int32, device="cuda")

    def step():
        qr = step_kernels.rope_write(q, kn, vn, cos, sin, pos, pool[0], pool[2], pool[1], pool[3])
        return qr, step_kernels.decode_attention(qr, pool[0], pool[2], used, d ** -0.5, pool[1], pool[3])

    step()   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qr, out = step()
    half = d // 2
    for n in (1, 700, 32769):
        pos.fill_(n - 1)
        used.fill_(n)
        graph.replay()
        x = q.view(-1, d).float()
        torch.testing.assert_close(qr.float(), x * cos.float() + torch.cat([-x[:, half:], x[:, :half]], -1) *
                                   sin.float(), atol=3e-3, rtol=3e-3)
        keys = int8_pool.dequantize(pool[0], pool[1], torch.float32) if int8 else pool[0].float()
        values = int8_pool.dequantize(pool[2], pool[3], torch.float32) if int8 else pool[2].float()
        assert torch.allclose(values[:, n - 1], vn.view(kvh, d).float(), atol=3e-2)
        want, _ = attention.partial_attention(qr.float().view(kvh, g, 1, d), keys[:, :n], values[:, :n], d ** -0.5)
        torch.testing.assert_close(out.float(), want.reshape(kvh * g, d), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("cache", ["dynamic", "tiered", "default", "int8-pool"])
def test_int4_engine_decodes_what_the_models_forward_predicts(cache, tmp_path):
    """The product's int4 path end to end on the GPU: `auto` int4 (Triton where it passes its self-check) in the
    Engine, prompt by dequantize + cuBLAS, steps by the matrix-vector kernel inside DecodeStep's graphs, over a
    DynamicCache or the tiered cache with pages off the window. Every generated token is the top token of one
    plain forward over prompt + output (up to fp16 near-ties)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from flashguard import EngineConfig
    from flashguard.engine.engine import Engine
    from flashguard.engine.loader import ModelSource
    from flashguard.engine.sampling import SamplingParams
    from flashguard.quant import int4_triton
    from flashguard.quant.int4_linear import quantize_linears_rtn

    cfg, model = small_qwen2(4)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)   # peaked next-token distributions: greedy choices are not near-ties
    quantize_linears_rtn(model, 128)
    backends = {m.backend for m in model.modules() if hasattr(m, "backend")}   # every layer, not only the first
    assert backends == {"triton"}, int4_triton.available.last_error
    vocab = {f"t{i}": i for i in range(1000)} | {"</s>": 1000}   # an end token the model cannot produce
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        eos_token="</s>", unk_token="t0")
    tiers = CacheConfig(page_size=64, l1_tokens=256, sink_tokens=64, l1_max_tokens=512, l3_tokens=0,
                        policy="exact")
    if cache == "default":
        config = EngineConfig(device="cuda", prefill_chunk=256)
    elif cache == "int8-pool":
        config = EngineConfig(device="cuda", prefill_chunk=256, kv=CacheConfig(l1_codec="int8"))
    else:
        config = EngineConfig(device="cuda", kv_cache=cache, kv=tiers, prefill_chunk=256)
    engine = Engine(config,
                    ModelSource(str(tmp_path), None, "random-qwen2-int4"), model=model, tokenizer=tokenizer)
    prompt = torch.randint(0, 1000, (1500,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.generate(prompt, SamplingParams(max_tokens=40))
    out = list(engine.turns[-1].output_ids)
    assert len(out) == 40
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + out], device="cuda")).logits[0, len(prompt) - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
    gap = logits.max(1).values - chosen            # 0 where the engine took the forward's top token
    assert (gap <= (0.15 if cache == "int8-pool" else 0.05) * logits.std(1)).all(), gap   # int8 KV: rounding
    assert engine.embedding_on_host   # int4 weights on CUDA: the untied table lives in host RAM
    if cache == "tiered":
        assert engine.session.cache.layers[0].win_start > 64   # pages had left the window
    if cache in ("default", "int8-pool"):   # every token resident, the whole step one CUDA graph
        assert engine.session.cache.layers[0].resident and engine.decode_step.step_graphs
    if cache == "int8-pool":
        assert engine.session.cache.layers[0].l1_k.dtype == torch.int8
    if cache in ("default", "int8-pool"):   # a new session runs on the same pool buffers and replays the same step graphs
        graphs = dict(engine.decode_step.step_graphs)
        ptrs = [layer.l1_k.data_ptr() for layer in engine.session.cache.layers]
        engine.reset_session()
        engine.generate(prompt, SamplingParams(max_tokens=40))
        assert list(engine.turns[-1].output_ids) == out
        assert [layer.l1_k.data_ptr() for layer in engine.session.cache.layers] == ptrs
        assert graphs and set(engine.decode_step.step_graphs) == set(graphs)   # nothing recorded anew
        assert all(engine.decode_step.step_graphs[key] is entry for key, entry in graphs.items())
