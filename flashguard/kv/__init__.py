"""The tiered, paged KV cache: pages, codecs, tiers, PageStore, TieredCache, attention over tiers."""
