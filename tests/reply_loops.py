"""When a reply "loops": the measure benchmarks/replies.py tables and tests/engine/test_replies_end.py asserts."""

from __future__ import annotations

from collections import Counter

NGRAM, TIMES = 4, 3   # a reply "loops" when some NGRAM-gram of its tokens occurs TIMES or more


def repeated_ngram(ids: list[int], n: int = NGRAM, times: int = TIMES) -> tuple[int, ...] | None:
    """The most frequent n-gram of ``ids`` when it occurs ``times`` or more, else None."""
    counts = Counter(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    if not counts:
        return None
    gram, k = counts.most_common(1)[0]
    return gram if k >= times else None
