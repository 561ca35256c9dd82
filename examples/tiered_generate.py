"""The tiered KV cache under plain transformers ``generate`` on the embedded model.

    python examples/tiered_generate.py
"""

import pydoc_data.topics as topics
import torch

from flashguard import CacheConfig, EngineConfig, get_engine
from flashguard.kv.cache import TieredCache

engine = get_engine(EngineConfig())  # the embedded SmolLM2, loaded once
model, tok = engine.model, engine.tokenizer
text = "".join(topics.topics[k] for k in ("if", "while", "for", "try", "with", "function")) + "\nSummary:"
ids = torch.tensor([tok(text)["input_ids"]])
cache = TieredCache(model.config, CacheConfig(page_size=32, l1_tokens=256, l2_tokens=512)).attach(model)
out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=40,
                     do_sample=False)
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print({k: v for k, v in cache.stats().items() if k != "store"})
print(cache.stats()["store"])
