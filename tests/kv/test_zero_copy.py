"""The sparse GPU path (pages picked on the device, rows gathered by the Triton kernel of kv/uva.py) against the
host path (hot set + host gather), on the CPU through Triton's interpreter: same pages read, same logits."""

import os

import pytest
import torch

from flashguard import CacheConfig
from flashguard.engine.decode_step import DecodeStep
from flashguard.kv import uva
from flashguard.kv.cache import TieredCache
from tests.tiny import forwarding

pytest.importorskip("triton")


@pytest.fixture
def interpreted(monkeypatch):
    """Triton's interpreter runs the kernel on CPU tensors (it is read when the kernel is built)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(uva, "_kernel", None)
    yield
    uva._kernel = None


def test_device_picked_pages_match_the_host_path(interpreted, monkeypatch):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert os.environ["TRITON_INTERPRET"] == "1"
    cfg = Qwen2Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_hidden_layers=2, intermediate_size=512, vocab_size=1000, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, 4000), generator=torch.Generator().manual_seed(2))
    step, outs, reads = DecodeStep(model, graphs=False), [], []
    host_path = TieredCache.zero_copy
    for device_path in (True, False):
        monkeypatch.setattr(TieredCache, "zero_copy", (lambda self, d, upto=None: True) if device_path else host_path)
        cache = TieredCache(cfg, CacheConfig(page_size=64, l1_tokens=256, sink_tokens=64, l1_max_tokens=512,
                                             budget_tokens=256, l3_tokens=0)).attach(model)
        with torch.inference_mode():
            for a in range(0, 4000, 1000):
                with forwarding(cache, ids[0, a:a + 1000].tolist()):
                    tok = int(model(input_ids=ids[:, a:a + 1000], past_key_values=cache).logits[0, -1].argmax())
        before, rows = cache.page_reads, []
        for t in [tok] + ids[0, :15].tolist():   # teacher-forced: both runs see the same tokens
            with forwarding(cache, [t]):
                rows.append(step.step(t, cache).float())
        outs.append(torch.stack(rows))
        reads.append(cache.page_reads - before)
        assert (cache.layers[0].hot_k is None) == device_path   # the device path keeps no hot set
        cache.check_integrity()
    assert reads[0] == reads[1] == 16 * 2 * 2 * 4   # steps x layers x kv heads x budget pages
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
