"""L3 at rest and under faults: sealed private files, corrupted/lost/unwritable pages never change an answer."""

import errno
import os
import stat

import pytest

from flashguard import CacheConfig, EngineConfig
from flashguard.engine import SamplingParams
from flashguard.engine.engine import Engine
from flashguard.kv.disk import L3Folder

pytestmark = pytest.mark.slow

DOC = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(70))
TURN1 = [{"role": "user", "content": DOC + "\nHow many marbles are in the blue boxes?"}]
PARAMS = SamplingParams(max_tokens=12)


def kv_config(tmp_path, **over):
    base = dict(page_size=32, l1_tokens=128, sink_tokens=32, l1_max_tokens=128, l2_tokens=128, policy="exact",
                l2_codec="fp16", l3_codec="fp16-zstd", l3_dir=str(tmp_path / "l3"))
    return CacheConfig(**{**base, **over})


def two_turns(engine, between=None):
    ids = engine.encode_messages(TURN1)
    first = engine.generate(ids, PARAMS).text
    if between:
        between(engine)
    msgs = TURN1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And in the red boxes?"}]
    return first, engine.generate(engine.encode_messages(msgs), PARAMS).text


@pytest.fixture(scope="module")
def clean(engine, tmp_path_factory):
    e = Engine(EngineConfig(kv_cache="tiered", kv=kv_config(tmp_path_factory.mktemp("clean"))), source=engine.source)
    out = two_turns(e)
    assert e.store.tier_counts()["l3_pages"] > 0
    return out


def page_files(e):
    return sorted(p for p in os.listdir(e.store.l3_dir) if p.endswith(".page"))


def test_bit_flips_truncation_and_deletion_are_caught_and_recomputed(engine, clean, tmp_path, caplog):
    def damage(e):
        files = [os.path.join(e.store.l3_dir, f) for f in page_files(e)]
        assert len(files) >= 3
        data = bytearray(open(files[0], "rb").read())
        data[len(data) // 2] ^= 0x10
        open(files[0], "wb").write(bytes(data))                           # a bit flip
        open(files[1], "r+b").truncate(os.path.getsize(files[1]) // 2)     # truncation
        os.remove(files[2])                                                # deletion

    e = Engine(EngineConfig(kv_cache="tiered", kv=kv_config(tmp_path)), source=engine.source)
    with caplog.at_level("WARNING", logger="flashguard"):
        assert two_turns(e, damage) == clean
    assert e.store.stats.corrupt_pages >= 1
    assert any("failed verification" in r.getMessage() for r in caplog.records)
    assert any("recomputing" in r.getMessage() for r in caplog.records)
    e.session.cache.check_integrity()


@pytest.mark.parametrize("code,text", [(errno.ENOSPC, "No space left on device"),
                                       (errno.EROFS, "Read-only file system")])
def test_a_full_or_read_only_disk_falls_back_to_host_ram(engine, clean, tmp_path, monkeypatch, caplog, code, text):
    def failing(self, key, payload):  # what the OS answers for a full disk or a read-only mount
        raise OSError(code, text)

    monkeypatch.setattr(L3Folder, "write", failing)
    e = Engine(EngineConfig(kv_cache="tiered", kv=kv_config(tmp_path)), source=engine.source)
    with caplog.at_level("WARNING", logger="flashguard"):
        assert two_turns(e) == clean
    assert e.store.stats.disk_errors > 0 and e.store.tier_counts()["l3_pages"] == 0
    assert sum(text in r.getMessage() for r in caplog.records) == 1  # warned once


def test_an_unusable_folder_falls_back_to_host_ram(engine, clean, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    e = Engine(EngineConfig(kv_cache="tiered", kv=kv_config(tmp_path, l3_dir=str(blocker / "l3"))), source=engine.source)
    with caplog.at_level("WARNING", logger="flashguard"):
        assert two_turns(e) == clean
    assert e.store.disk is None and any("cannot create the L3 folder" in r.getMessage() for r in caplog.records)


def test_files_are_sealed_private_and_removed_on_close(engine, tmp_path):
    e = Engine(EngineConfig(kv_cache="tiered", kv=kv_config(tmp_path, l2_codec="int8", l3_codec="int4-zstd")),
               source=engine.source)
    e.generate(e.encode_messages(TURN1), PARAMS)
    folder = e.store.l3_dir
    files = page_files(e)
    assert files
    for name in files:
        blob = open(os.path.join(folder, name), "rb").read()
        # sealed: an unsealed page would show its own magic (FGP1) or zstd's at its head; four given bytes turn up
        # by chance somewhere in megabytes of ciphertext (about once in a thousand runs), so only the head is read
        head = blob[4:68]
        assert blob.startswith(b"FGL3") and b"FGP1" not in head and b"\x28\xb5\x2f\xfd" not in head
        assert b"marbles" not in blob   # (seven bytes: by chance about never)
        if os.name == "posix":
            assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o600
    if os.name == "posix":
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(os.path.join(folder, "owner.pid")).st_mode) == 0o600
    e.store.close()
    assert not page_files(e)


def test_stale_folders_of_dead_processes_are_removed(tmp_path):
    import subprocess
    import sys
    import tempfile

    from flashguard.kv.disk import PREFIX, remove_stale_folders

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tempfile.mkdtemp(prefix=PREFIX)
    open(os.path.join(folder, "owner.pid"), "w").write(dead.stdout.strip())
    open(os.path.join(folder, "x.page"), "wb").write(b"left by a crash")
    assert remove_stale_folders() >= 1 and not os.path.exists(folder)
