"""The host heap's free pages go back to the OS after an engine task (flashguard/vram/host_heap.py)."""

import sys

import psutil
import pytest

from flashguard.vram import host_heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim; elsewhere trim() does nothing")
def test_trim_gives_freed_heap_memory_back():
    proc = psutil.Process()
    blocks = [bytearray(4000) for _ in range(50_000)]   # ~200 MB of small blocks: heap, not mmap
    keep = blocks[-1]                                    # the top of the heap stays in use: no automatic trim
    del blocks
    before = proc.memory_info().rss
    assert host_heap.trim() is True
    after = proc.memory_info().rss
    assert before - after > 100 * 2**20, (before, after)
    del keep


def test_trim_is_safe_to_call_anywhere():
    for _ in range(3):
        assert host_heap.trim() in (True, False)


def test_an_engine_task_trims_the_heap_on_the_cpu(monkeypatch, tmp_path):
    from flashguard.engine.sampling import SamplingParams
    from tests import tiny

    e = tiny.engine(tmp_path / "model")
    calls = []
    monkeypatch.setattr(host_heap, "trim", lambda: calls.append(1) or True)
    ids = e.tokenizer(tiny.text(100, seed=1))["input_ids"][:40]
    e.generate(ids, SamplingParams(max_tokens=3))
    assert len(calls) == 1
    e.next_token_state(ids + [5], task="moderation")
    assert len(calls) == 2
