"""The lm_head key (quant/lm_head.py): the output matrix as llama.cpp's Q8_0 codes, chosen at start."""

import numpy as np
import pytest
import torch

from tests import tiny
from flashguard.config import EngineConfig
from flashguard.errors import ConfigError
from flashguard.quant import awq_format, lm_head
from flashguard.quant.gguf_int4 import Int4PairLinear, q8_0_codes, q8_0_quantize
from flashguard.engine.sampling import SamplingParams
from flashguard.quant.int4_linear import quantize_linears_rtn


def test_q8_0_quantize_is_gguf_pys_q8_0_bit_for_bit():
    from gguf import GGMLQuantizationType, quants

    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 96, generator=g) * 0.05
    w[3, :32] = 0   # a block of zeros: scale 0, codes 0
    w[5, 40] = 0.5  # a block whose largest weight is one outlier
    got = q8_0_quantize(w, rows=16)   # several row chunks
    want = q8_0_codes(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0), tuple(w.shape))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    pair = awq_format.dequantize(*got, 32, torch.float32)
    ref = quants.dequantize(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert torch.equal(pair[:, :96] + pair[:, 96:], torch.from_numpy(np.asarray(ref).reshape(w.shape)))


def _int4(arch="qwen2"):
    net = tiny.model(arch)
    quantize_linears_rtn(net, group_size=32, backend="auto")
    return net


def test_auto_times_both_heads_and_keeps_the_faster(tmp_path):
    engine = tiny.engine(tmp_path, net=_int4())
    assert engine.lm_head_kind in ("int8", "float") and engine.lm_head_reason.startswith("auto: ")
    assert "ms as Q8_0" in engine.lm_head_reason and "in 16 bits here" in engine.lm_head_reason
    held = lm_head.kind_of(engine.model.get_output_embeddings())
    assert held == engine.lm_head_kind == engine.placement()["lm_head"]["weights"]


def test_auto_takes_the_fewest_device_bytes_when_the_budget_calls_for_it():
    net = _int4()
    kind, why = lm_head.apply("auto", net, "int4", torch.device("cpu"), budget_wins=True)
    assert kind == "int4" and "decoder layers stay on the GPU" in why   # (the CPU: its rows cost no device memory)
    assert isinstance(net.lm_head, lm_head.RescoredHead)


def test_auto_times_the_int4_head_too(tmp_path):
    engine = tiny.engine(tmp_path, net=_int4())
    assert "ms as int4 + top rows" in engine.lm_head_reason and "ms as Q8_0" in engine.lm_head_reason


def _rescored(top: int, bias: bool = False):
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(96, 400, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(400, 96, generator=g) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(400, generator=g))
    b = head.bias.detach() if bias else None
    return head, lm_head.rescored_head(head.weight.detach(), b, torch.device("cpu"), top=top)


@pytest.mark.parametrize("bias", [False, True])
def test_the_int4_head_recomputes_its_top_logits_from_the_heads_rows(bias):
    """The int4 codes rank every token; the ``top`` largest are the exact head's logits, the rest int4's; so the
    greedy token is the exact head's, for one position and for a prompt's many (several chunks)."""
    head, rescored = _rescored(top=12, bias=bias)
    assert lm_head.kind_of(rescored) == "int4"
    x = torch.randn(150, 96, generator=torch.Generator().manual_seed(6))   # > one chunk of positions
    with torch.inference_mode():
        exact, approx, got = head(x), rescored.approx(x), rescored(x)
    idx = torch.cat([approx.topk(12, -1).indices, torch.zeros(150, 1, dtype=torch.long)], -1)   # (+ kept: none)
    torch.testing.assert_close(got.gather(-1, idx), exact.gather(-1, idx), rtol=1e-5, atol=1e-4)
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(-1, idx, False)
    assert torch.equal(got[rest], approx[rest])
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert (approx.argmax(-1) != exact.argmax(-1)).any()   # int4 alone would change greedy tokens here
    one = rescored(x[:1].view(1, 1, 96))
    assert one.shape == (1, 1, 400) and torch.equal(one.view(-1).argmax(), exact[0].argmax())
    assert rescored.read_bytes() == rescored.approx.weight_bytes() + (12 + lm_head.KEPT) * 96 * 4


def test_the_int4_head_keeps_the_named_tokens_exact():
    """``keep_exact``: tokens a rail reads (its answers) are recomputed at every position, ranked or not."""
    head, rescored = _rescored(top=4)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        exact, approx = head(x), rescored.approx(x)
        low = [int(i) for i in approx[0].argsort()[:3]]   # among the least likely at the first position
        assert not torch.allclose(rescored(x)[0, low], exact[0, low], atol=1e-4)
        rescored.keep_exact(low)
        rescored.keep_exact(low[:1])   # again: the set only grows
        torch.testing.assert_close(rescored(x)[:, low], exact[:, low], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="at most"):
        rescored.keep_exact(range(1, lm_head.KEPT + 1))


def test_int4_on_a_gpu_that_cannot_read_host_ram_names_the_key(monkeypatch):
    """Its rows stay in host RAM only where the GPU reads them itself; elsewhere the key is refused (auto would
    hold Q8_0), before anything is built on the device."""
    monkeypatch.setattr(lm_head.uva, "available", lambda device: False)
    net = _int4()
    with pytest.raises(ConfigError, match=r"lm_head: int4: this GPU cannot read .* triton-windows"):
        lm_head.apply("int4", net, "int4", torch.device("cuda"))
    assert lm_head.int4_possible(torch.device("cpu"), torch.zeros(8, 40)) == \
        "the head's 40 inputs are not a multiple of 32"


def test_an_int4_head_in_an_engine_keeps_a_tied_table_and_the_greedy_tokens(tmp_path):
    """``lm_head: int4`` on a tied int4 model: the table stays the embedding (shared as the head's rows, not
    copied), the engine reports int4 and its bytes, and greedy generation is the 16-bit head's."""
    def tied():
        net = tiny.model("llama")
        net.lm_head.weight = net.get_input_embeddings().weight
        net.config.tie_word_embeddings = True
        quantize_linears_rtn(net, group_size=32, backend="auto")
        return net

    ref = tiny.engine(tmp_path / "a", net=tied(), lm_head="float")
    engine = tiny.engine(tmp_path / "b", net=tied(), lm_head="int4")
    head = engine.model.get_output_embeddings()
    assert engine.lm_head_kind == "int4" and engine.lm_head_reason == "lm_head: int4"
    assert isinstance(head, lm_head.RescoredHead) and engine.placement()["lm_head"]["weights"] == "int4"
    assert head.table.table.data_ptr() == engine.model.get_input_embeddings().weight.data_ptr()
    vocab, hidden = head.table.table.shape   # (a vocabulary under TOP: every row is recomputed)
    assert engine.decode_bytes()["lm_head"] == head.approx.weight_bytes() + (vocab + lm_head.KEPT) * hidden * 4
    ids = engine.encode_messages([{"role": "user", "content": tiny.text(40)}])
    params = SamplingParams(max_tokens=12)
    assert engine.generate(ids, params).text == ref.generate(ids, params).text


def test_an_int8_head_computes_the_q8_0_round_trip(tmp_path):
    net = _int4()
    w = net.lm_head.weight.detach().clone()
    engine = tiny.engine(tmp_path, net=net, lm_head="int8")
    assert engine.lm_head_kind == "int8" and engine.lm_head_reason == "lm_head: int8"
    assert isinstance(engine.model.get_output_embeddings(), Int4PairLinear)
    assert engine.weights_kind == "int4"   # the head's codes are not the decoder's
    assert engine.placement()["lm_head"]["weights"] == "int8"
    v, h = w.shape
    assert engine.decode_bytes()["lm_head"] == v * h + (2 * h // 32) * v * 4   # codes + fp16 scale and zero a group
    # the head computes the Q8_0 round trip of the 16-bit weights (the CPU kernel's bf16 rounding aside)
    x = torch.randn(3, h)
    want = x @ q8_0_engine_weight(w).T
    assert torch.allclose(engine.model.lm_head(x), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    # and generation runs on it, greedy and repeatable
    ids = engine.encode_messages([{"role": "user", "content": tiny.text(40)}])
    params = SamplingParams(max_tokens=8)
    assert engine.generate(ids, params).text == engine.generate(ids, params).text


def test_float_key_and_float_decoders_keep_the_16_bit_head(tmp_path):
    kept = tiny.engine(tmp_path / "a", net=_int4(), lm_head="float")
    assert kept.lm_head_kind == "float" and isinstance(kept.model.lm_head, torch.nn.Linear)
    assert kept.placement()["lm_head"]["weights"] == "float"
    plain = tiny.engine(tmp_path / "b")   # a float decoder: auto keeps the head as it is
    assert plain.lm_head_kind == "float" and isinstance(plain.model.lm_head, torch.nn.Linear)
    chosen = tiny.engine(tmp_path / "c", lm_head="int8")   # the user's call on a float decoder
    assert chosen.lm_head_kind == "int8" and chosen.weights_kind == "float"
    assert isinstance(chosen.model.lm_head, Int4PairLinear)


def test_a_tied_head_is_untied_and_the_table_kept(tmp_path):
    net = tiny.model("llama")
    net.lm_head.weight = net.get_input_embeddings().weight
    net.config.tie_word_embeddings = True
    table = net.get_input_embeddings().weight.detach().clone()
    quantize_linears_rtn(net, group_size=32, backend="auto")
    engine = tiny.engine(tmp_path, net=net, lm_head="int8")
    assert engine.lm_head_kind == "int8"
    assert torch.equal(engine.model.get_input_embeddings().weight, table)
    assert engine.weights_placement.shape().tied is False


def test_planned_kinds_and_a_wrong_value_names_the_key():
    assert lm_head.planned("auto", "int4") == "int8" and lm_head.planned("auto", "float") == "float"
    assert lm_head.planned("float", "int4") == "float" and lm_head.planned("int4", "float") == "int4"
    with pytest.raises(ConfigError, match="lm_head"):
        EngineConfig.from_parameters({"lm_head": "int2"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton matrix-vector kernel)")
def test_the_gpu_head_computes_the_q8_0_round_trip():
    """A 1.5B-shape head (vocab 151,936 x 1,536) on the Triton kernel, one token and a prompt's rows."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(1536, 151936, bias=False)
    head.weight.data = torch.randn(151936, 1536, generator=g) * 0.02
    net = torch.nn.Module()
    net.lm_head, net.config = head, type("Config", (), {})()
    net.get_output_embeddings = lambda: net.lm_head
    net.set_output_embeddings = lambda m: setattr(net, "lm_head", m)
    want_w = q8_0_engine_weight(head.weight.detach())
    lm_head.quantize(net, torch.device("cuda"))
    assert isinstance(net.lm_head, Int4PairLinear) and net.lm_head.inner.backend == "triton"
    for rows in (1, 5):
        x = torch.randn(rows, 1536, generator=g).half()
        got = net.lm_head(x.cuda()).float().cpu()
        want = x.float() @ want_w.T
        assert (got - want).abs().max() < 2e-3 * want.abs().max() + 1e-2


def q8_0_engine_weight(w: torch.Tensor) -> torch.Tensor:
    pair = awq_format.dequantize(*q8_0_quantize(w), 32, torch.float32)
    return pair.view(w.shape[0], 2, w.shape[1]).sum(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (zero-copy rows, the Triton kernel)")
def test_the_gpu_int4_head_reads_its_rows_from_host_ram_inside_a_cuda_graph():
    """A 1.5B-shape head (vocab 151,936 x 1,536) as ``lm_head: int4`` on CUDA: the rows stay in pinned host RAM
    (the device holds the codes only), and one token's logits, recorded as a CUDA graph and replayed on a new
    input, have the exact head's top logits and greedy token."""
    from flashguard.kv import uva

    if not uva.available(torch.device("cuda")):
        pytest.skip("zero-copy reads do not work on this GPU")
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(1536, 151936, bias=False, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        head.weight.copy_((torch.randn(151936, 1536, generator=g) * 0.02).half())
    layer = lm_head.rescored_head(head.weight.detach(), None, torch.device("cuda"))
    assert layer.table.reads_itself and layer.table.table.is_pinned()
    assert all(b.device.type == "cuda" for b in layer.buffers())
    x = torch.zeros(1, 1536, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        layer(x)   # warm-up (Triton compiles)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        for seed in (1, 2):
            x.copy_(torch.randn(1, 1536, generator=torch.Generator().manual_seed(seed)).half().cuda())
            graph.replay()
            exact = (x.float() @ head.weight.float().T)[0]
            top = layer.approx(x)[0].float().topk(layer.top).indices
            # the greedy token is the exact head's up to fp16 (this random head has near-ties: 0.001 apart)
            assert exact[int(out[0].float().argmax())] >= exact.max() - 4e-3
            torch.testing.assert_close(out[0].float()[top], exact[top], rtol=2e-3, atol=2e-3)


def test_a_tied_table_and_the_int4_heads_rows_are_one_host_copy():
    """``host_embedding.install`` after ``lm_head: int4`` on a tied model: the embedding lookup reads the head's
    own table (``kv.uva.PinnedRows``), not a second copy, and the logits stay the same."""
    from flashguard.engine.host_embedding import HostEmbedding, install

    net = tiny.model("llama")
    net.lm_head.weight = net.get_input_embeddings().weight
    net.config.tie_word_embeddings = True
    quantize_linears_rtn(net, group_size=32, backend="auto")
    lm_head.apply("int4", net, "int4", torch.device("cpu"))
    ids = torch.tensor([[1, 5, 7, 2]])
    with torch.inference_mode():
        before = net(input_ids=ids).logits
    assert install(net, torch.device("cpu")) > 0
    emb, head = net.get_input_embeddings(), net.get_output_embeddings()
    assert isinstance(emb, HostEmbedding) and emb.weight.data_ptr() == head.table.table.data_ptr()
    with torch.inference_mode():
        torch.testing.assert_close(net(input_ids=ids).logits, before)
