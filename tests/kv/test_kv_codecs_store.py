"""Codecs and the PageStore (L2 host RAM, L3 disk)."""

import pytest
import torch

from flashguard import CacheConfig
from flashguard.kv import OUT_OF_MEMORY, codecs
from flashguard.kv.store import PageStore, page_key


def kv(seed=0, layers=2, heads=2, p=32, d=64):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, p, d, generator=g) * 3 + torch.randn(1, 1, 1, d, generator=g) * 5  # outlier channels
    v = torch.randn(layers, heads, p, d, generator=g)
    return k, v


@pytest.mark.parametrize("codec,tol", [("fp16", 1e-7), ("int8", 0.02), ("int4-zstd", 0.15)])
def test_roundtrip_error_is_bounded(codec, tol):
    k, v = kv()
    k2, v2 = codecs.decode(codecs.encode(k, v, codec), torch.float32)
    assert k2.shape == k.shape and v2.shape == v.shape
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(k2, k) < tol and rel(v2, v) < tol


@pytest.mark.parametrize("codec", ["int8", "int4-zstd"])
def test_quantizing_leaves_the_callers_pages_as_they_were(codec):
    """The codes are worked out in place on a float copy: a float32 page (a page read back and encoded again)
    must not be overwritten by its own codes."""
    k, v = kv(3)
    k0, v0 = k.clone(), v.clone()
    enc = codecs.encode(k, v, codec)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    k2, _ = codecs.decode(enc, torch.float32)
    assert ((k2 - k).norm() / k.norm()).item() < 0.15


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_lossless_bytes_roundtrip_keeps_dtype(dtype):
    k, v = kv(2)
    enc = codecs.encode(k.to(dtype), v.to(dtype), "fp16-zstd")
    back = codecs.from_bytes(codecs.to_bytes(enc))
    assert back["k"].dtype == dtype and torch.equal(back["k"], k.to(dtype)) and torch.equal(back["v"], v.to(dtype))


def test_bytes_roundtrip_and_compression_ratio(capsys):
    k, v = kv(1)
    enc = codecs.encode(k, v, "int4-zstd")
    blob = codecs.to_bytes(enc)
    back = codecs.from_bytes(blob)
    assert all(torch.equal(back[n], enc[n]) for n in enc)
    fp16 = (k.numel() + v.numel()) * 2
    with capsys.disabled():
        print(f"\nL3 int4+zstd page: {len(blob)} bytes vs {fp16} fp16 ({fp16 / len(blob):.2f}x)")
    assert fp16 / len(blob) > 3.0
    with pytest.raises(ValueError):
        codecs.from_bytes(b"nope" + blob[4:])


def test_page_keys_chain_and_namespace():
    a = page_key(b"root", [1, 2, 3], b"ns")
    assert a == page_key(b"root", [1, 2, 3], b"ns")
    assert a != page_key(b"root", [1, 2, 4], b"ns") and a != page_key(b"root", [1, 2, 3], b"other")
    assert page_key(a, [4], b"ns") != page_key(b"root", [4], b"ns")


def summary(k):
    return torch.stack([k.amin(dim=2), k.amax(dim=2)], dim=2)


def test_store_tiers_refcounts_and_integrity(tmp_path):
    cfg = CacheConfig(page_size=32, l1_tokens=64, l2_tokens=64, l3_tokens=1 << 16, l3_dir=str(tmp_path))
    store = PageStore(cfg)
    keys = []
    for i in range(5):
        k, v = kv(i)
        key = page_key(b"root", [i], b"ns")
        store.put(key, k, v, summary(k))
        keys.append(key)
    counts = store.tier_counts()
    assert counts["l2_pages"] == 2 and counts["l3_pages"] == 3
    assert len(list(tmp_path.glob("*.page"))) == 3
    store.check_integrity()
    cold = next(key for key in keys if store.pages[key].l2 is None)
    enc = store.get(cold, layer=1)
    assert store.stats.page_faults == 1 and enc["kq"].shape[0] == 2  # one layer: [heads, ...]
    k, v = kv(keys.index(cold))
    k2, _ = codecs.decode(enc, torch.float32)
    assert ((k2 - k[1]).norm() / k[1].norm()) < 0.05
    store.put(keys[0], *kv(0), summary(kv(0)[0]))
    assert store.pages[keys[0]].refs == 2 and store.stats.pages_shared == 1
    store.check_integrity()


def test_an_int4_page_comes_back_to_int8_exactly():
    k, v = kv(3)
    four = codecs.encode(k, v, "int4")
    eight = codecs.transcode(four, "int8")
    assert int(eight["bits"][0]) == 8 and eight["kq"].dtype == torch.uint8
    for a, b in zip(codecs.decode(four, torch.float32), codecs.decode(eight, torch.float32)):
        assert torch.equal(a, b)   # the same values: unpacked, not rounded again


def test_an_int4_file_unpacks_straight_into_the_int8_arena_rows():
    """The reader threads' path (numpy, no torch call) gives the bytes the general path gives; a file of another
    codec or shape is left to the general path, a truncated one is an error."""
    from flashguard.kv.store import L2Arena

    k, v = kv(4)
    arena = L2Arena(pin=False)
    arena.write(codecs.encode(k, v, "int8"))
    blob = codecs.to_bytes(codecs.encode(k, v, "int4"))
    fast = codecs.int4_as_int8_rows(blob, arena.layout, arena.row_bytes)
    slow = arena.rows(codecs.transcode(codecs.from_bytes(blob), "int8"))
    for name, t in arena.fields_of(slow).items():
        if name != "bits":
            assert torch.equal(arena.fields_of(fast)[name], t)
    slot = arena.write(fast)
    for a, b in zip(codecs.decode(arena.read(slot), torch.float32), codecs.decode(codecs.encode(k, v, "int4"),
                                                                                  torch.float32)):
        assert torch.equal(a, b)
    assert codecs.int4_as_int8_rows(codecs.to_bytes(codecs.encode(k, v, "int8")), arena.layout, arena.row_bytes) is None
    other = kv(4)[0][:, :, :16]   # fewer tokens a page: another layout
    assert codecs.int4_as_int8_rows(codecs.to_bytes(codecs.encode(other, other, "int4")), arena.layout,
                                    arena.row_bytes) is None
    raw = codecs.zstandard.ZstdDecompressor().decompress(blob[4:])
    with pytest.raises(ValueError):
        codecs.int4_as_int8_rows(codecs._MAGIC + codecs.zstandard.ZstdCompressor().compress(raw[:len(raw) // 2]),
                                 arena.layout, arena.row_bytes)


def test_prefetched_pages_come_to_l2_between_steps_and_a_bad_file_is_dropped(tmp_path):
    cfg = CacheConfig(page_size=32, l1_tokens=64, l2_tokens=64, l3_tokens=1 << 16, l3_dir=str(tmp_path))
    store = PageStore(cfg)
    keys = []
    for i in range(5):
        key = page_key(b"root", [i], b"ns")
        store.put(key, *kv(i), summary(kv(i)[0]))
        keys.append(key)
    cold = [key for key in keys if store.pages[key].l2 is None]
    assert len(cold) == 3
    with open(store.pages[cold[0]].l3, "r+b") as fh:   # one file altered on disk
        fh.seek(40)
        fh.write(b"\xff\x00\xff")
    assert store.prefetch(cold + [keys[-1]]) == 3 and store.prefetch(cold) == 0   # queued once, L2 pages skipped
    assert all(store.pages[key].l2 is None for key in cold[1:])                  # nothing moves until installed
    installed = store.install_prefetched(wait=True)
    assert installed == cold[1:] and cold[0] not in store.pages                  # the bad one dropped, not served
    assert store.stats.corrupt_pages == 1 and store.stats.page_faults == 2
    for key in cold[1:]:   # the values of a synchronous read
        k, _ = codecs.decode(store.get(key), torch.float32)
        k0, _ = kv(keys.index(key))
        assert ((k - k0).norm() / k0.norm()) < 0.1
    assert store.stats.page_faults == 2   # (get found them in L2: L2 went over budget for pages read now)
    store.check_integrity()
    store.close()


def test_without_disk_referenced_pages_are_kept_and_unreferenced_dropped():
    cfg = CacheConfig(page_size=32, l1_tokens=64, l2_tokens=64, l3_tokens=0)
    store = PageStore(cfg)
    k, v = kv()
    store.put(b"a" * 16, k, v, summary(k))
    store.release(b"a" * 16)                       # nobody holds it
    for name in (b"b", b"c", b"d"):
        store.put(name * 16, k, v, summary(k))     # held by their writer
    assert b"a" * 16 not in store.pages            # the unreferenced page went first
    assert all(n * 16 in store.pages for n in (b"b", b"c", b"d"))  # referenced pages stay, over budget
    store.check_integrity()


def test_a_released_conversations_pages_leave_l2_before_a_live_ones(tmp_path):
    """The live sequence's pages stay in L2; the released one's go to disk first, even where they were read more
    (heat) or read by decoding just before the release (``warm``: hot protection is for live sequences only), and
    also when the live one's prompt is prefilled inside ``deferred`` (trimmed at its end)."""
    cfg = CacheConfig(page_size=32, l1_tokens=64, l2_tokens=4 * 32, l3_tokens=1 << 16, l3_dir=str(tmp_path))
    for deferred in (False, True):
        store = PageStore(cfg)
        old = [page_key(b"old", [i, deferred], b"ns") for i in range(4)]
        for i, key in enumerate(old):
            k, v = kv(i)
            store.put(key, k, v, summary(k))
        for _ in range(3):
            store.slots(old)                           # read often: hot
        store.warm(old)                                # ... and by decoding, just now
        for key in old:
            store.release(key)                         # the conversation ends
        new = [page_key(b"new", [i, deferred], b"ns") for i in range(4)]
        with store.deferred() if deferred else torch.inference_mode():
            for i, key in enumerate(new):
                k, v = kv(10 + i)
                store.put(key, k, v, summary(k))
        store.check_integrity()
        assert all(store.pages[key].l2 is not None for key in new), deferred
        assert all(store.pages[key].l2 is None and store.pages[key].l3 is not None for key in old), deferred
        store.close()


def test_hot_pages_stay_in_l2_for_forwards_not_seconds(tmp_path, monkeypatch):
    """A live sequence's page decoding read stays in L2 over budget for ``TierPolicy.hot_steps`` forwards (the
    store's ``clock``), however long they take: CI's loaded 2-core machine once took over the old 2-second window
    between two reports and read a promoted page from disk a second time (test_l3_promotion_with_the_real_smollm2)."""
    import time

    cfg = CacheConfig(page_size=32, l1_tokens=64, l2_tokens=32, l3_tokens=1 << 16, l3_dir=str(tmp_path))
    store = PageStore(cfg)                                   # L2: one page
    keys = [page_key(b"live", [i], b"ns") for i in range(4)]
    with store.deferred():                                   # a prefill: all four in L2 until it ends
        for i, key in enumerate(keys):
            k, v = kv(i)
            store.put(key, k, v, summary(k))                 # (a put is the live sequence's reference)
        store.warm(keys)                                     # its decoding read all four
    later = time.monotonic() + 3600.0
    monkeypatch.setattr(time, "monotonic", lambda: later)    # an hour of wall time passes: nothing changes
    for _ in range(store.policy.hot_steps):                  # read exactly hot_steps forwards ago: still hot
        store.tick()
    store.put(page_key(b"live", [9], b"ns"), *kv(9), summary(kv(9)[0]))
    assert all(store.pages[key].l2 is not None for key in keys)
    store.warm(keys[:1])                                     # only the first read again, then one forward more
    store.tick()
    store.put(page_key(b"live", [10], b"ns"), *kv(10), summary(kv(10)[0]))
    assert store.pages[keys[0]].l2 is not None
    assert all(store.pages[key].l2 is None and store.pages[key].l3 is not None for key in keys[1:])
    assert store.arena.used() == store.l2_pages_max
    store.check_integrity()
    store.close()


def test_pages_that_do_not_fit_the_gpu_to_encode_are_encoded_in_halves(monkeypatch):
    """A batch whose encode runs out of GPU memory (the 128K crop on the H200) is encoded in halves down to one page:
    every page stored with the codes a plain store gives it, one reference each; where even one page does not fit,
    the error reaches the caller and the references of the batch's known pages are not taken."""
    cfg = CacheConfig(page_size=32, l1_tokens=64, l2_tokens=1 << 20, l3_tokens=0)
    pages = [kv(i) for i in range(6)]
    k = torch.stack([p[0] for p in pages], dim=2)   # [layers, heads, n, p, d]
    v = torch.stack([p[1] for p in pages], dim=2)
    bounds = torch.stack([summary(p[0]) for p in pages])
    keys = [page_key(b"root", [i], b"ns") for i in range(6)]
    plain = PageStore(cfg)
    plain.put_many(keys, k, v, bounds)

    encode, sizes = codecs.encode, []

    def tight(k, v, codec):   # the GPU holds the temporaries of at most two pages
        sizes.append(k.shape[2])
        if k.shape[2] > 2:
            raise OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 28.00 MiB")
        return encode(k, v, codec)

    monkeypatch.setattr(codecs, "encode", tight)
    store = PageStore(cfg)
    store.put_many(keys[:1], k[:, :, :1], v[:, :, :1], bounds[:1])
    store.put_many(keys, k, v, bounds)             # 5 new pages: 5 -> 2 + 3 -> 2 + 1 + 2
    assert sizes[1:] == [5, 2, 3, 1, 2]
    assert [store.pages[key].refs for key in keys] == [2, 1, 1, 1, 1, 1]
    for key in keys:
        got, want = store.get(key), plain.get(key)
        assert all(torch.equal(got[f], want[f]) for f in want)
    store.check_integrity()

    monkeypatch.setattr(codecs, "encode", lambda k, v, codec: (_ for _ in ()).throw(OUT_OF_MEMORY("no memory")))
    more = [page_key(b"more", [i], b"ns") for i in range(2)]
    with pytest.raises(OUT_OF_MEMORY):
        store.put_many([keys[0], more[0]], k[:, :, :2], v[:, :, :2], bounds[:2])
    assert store.pages[keys[0]].refs == 2 and more[0] not in store.pages


def test_an_l3_file_whose_gpu_codec_work_does_not_fit_is_written_from_the_cpu(tmp_path, monkeypatch):
    """The L3 writer does a page's codec work on the GPU's worker stream; where that runs out of memory (the H200's
    128K output rail with the allocator at its cap raised it through NeMo), the page is encoded on the CPU: the same
    page comes back from its file, and the prefill that waits for it goes on. (A CPU build has no GPU worker: the test stands one in whose
    every codec call runs out of memory.)"""
    import contextlib

    cfg = CacheConfig(page_size=32, l1_tokens=64, l2_tokens=2 * 32, l3_tokens=1 << 16, l3_dir=str(tmp_path / "a"))
    keys = [page_key(b"root", [i], b"ns") for i in range(5)]

    def fill(store):
        with store.deferred():
            for i, key in enumerate(keys):
                k, v = kv(i)
                store.put(key, k, v, summary(k))
        store.check_integrity()
        return {key: store.pages[key].l3 for key in keys}

    plain = PageStore(cfg)
    files = fill(plain)
    real, tried = PageStore._l3_blob, []

    def gpu_blob(self, rows, device):
        tried.append(device.type)
        if device.type != "cpu":
            raise OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real(self, rows, device)

    monkeypatch.setattr(PageStore, "_l3_blob", gpu_blob)
    monkeypatch.setattr(PageStore, "_worker_device", lambda self: contextlib.nullcontext(torch.device("meta")))
    store = PageStore(cfg.replace(l3_dir=str(tmp_path / "b")))
    written = fill(store)
    assert tried and tried[::2] == ["meta"] * (len(tried) // 2) and tried[1::2] == ["cpu"] * (len(tried) // 2)
    assert [k for k in keys if written[k]] == [k for k in keys if files[k]] and any(written.values())
    for key in keys:   # the same pages back (the files' bytes differ: each is encrypted with its own nonce)
        got, want = store.get(key), plain.get(key)
        assert all(torch.equal(got[f], want[f]) for f in want)
    plain.close()
    store.close()
