"""The L3 tier on disk: private folder, sealed page files, atomic writes, verified reads.

Contract:
- ``L3Folder(path=None, encrypt=True)``: ``path=None`` makes a private folder in the user's temp folder
  (``mkdtemp``: mode 0700 on POSIX; on Windows the per-user temp folder is already private). A given path is
  created 0700 on POSIX; on Windows (where a mode means nothing) ``make_private`` gives it an ACL that lets only
  the current user in (``icacls``), or logs a warning where that cannot be done. Folders flashguard made for processes that are no longer alive are removed at start (crash
  leftovers), and the folder is removed on normal exit (``close``, ``atexit``).
- ``write(key, payload)`` seals the payload: AES-256-GCM under a key that exists only in this process's memory
  (``cryptography``), with the page key as associated data, so a file cannot be swapped for another page's file;
  or, with ``encrypt=False``, a BLAKE2b checksum. Written to ``name.tmp`` then renamed: a crash mid-write never
  leaves a file that looks complete. Files are created 0600.
- ``read(key, path)`` returns the payload, or raises ``PageLost`` for a missing, truncated, altered or
  foreign file. Nothing unverified is ever returned.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile

log = logging.getLogger("flashguard")

PREFIX = "flashguard-l3-"
_MAGIC_AEAD, _MAGIC_SUM = b"FGL3", b"FGL3C"


class PageLost(RuntimeError):
    """A page cannot be used: its L3 file is missing, truncated, altered or foreign, it does not decode, or the
    store no longer has it. The one error for that failure, from the disk up: the store drops such a page, a
    cache that needs it raises this too, and the engine recomputes the tokens (never uses the page)."""


class L3Folder:
    def __init__(self, path: str | None = None, encrypt: bool = True):
        self.encrypt = encrypt
        # this process's AES-256 key; the cipher (cryptography's AESGCM, 0.4 s to import) is made at the first page,
        # the package looked for now: where it is missing the store says so here (kv/store.py), not at a page write
        if encrypt and importlib.util.find_spec("cryptography") is None:
            raise ImportError("No module named 'cryptography'", name="cryptography")
        self._key = os.urandom(32) if encrypt else None
        self._cipher = None
        remove_stale_folders()
        self.owned = path is None
        if path is None:
            path = tempfile.mkdtemp(prefix=PREFIX)
        else:
            os.makedirs(path, mode=0o700, exist_ok=True)
            if os.name == "nt":
                make_private_on_windows(path)
        self.path = path
        fd = os.open(os.path.join(path, "owner.pid"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:   # (0600, as the pages: the folder's files are the user's alone)
            fh.write(str(os.getpid()))
        atexit.register(self.close)

    def file_for(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + ".page")

    def _aead(self):
        if self._cipher is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._cipher = AESGCM(self._key)
        return self._cipher

    def write(self, key: bytes, payload: bytes) -> str:
        if self.encrypt:
            nonce = os.urandom(12)
            blob = _MAGIC_AEAD + nonce + self._aead().encrypt(nonce, payload, key)
        else:
            blob = _MAGIC_SUM + hashlib.blake2b(key + payload, digest_size=32).digest() + payload
        path = self.file_for(key)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
        return path

    def read(self, key: bytes, path: str) -> bytes:
        try:
            with open(path, "rb") as fh:
                blob = fh.read()
        except OSError as exc:
            raise PageLost(f"cannot read {path}: {exc.strerror}") from exc
        if self.encrypt:
            from cryptography.exceptions import InvalidTag

            if not blob.startswith(_MAGIC_AEAD) or len(blob) < len(_MAGIC_AEAD) + 12 + 16:
                raise PageLost(f"{path} is not a sealed page")
            nonce, sealed = blob[4:16], blob[16:]
            try:
                return self._aead().decrypt(nonce, sealed, key)
            except InvalidTag:
                raise PageLost(f"{path} failed authentication (altered, truncated or foreign)") from None
        if not blob.startswith(_MAGIC_SUM) or len(blob) < 5 + 32:
            raise PageLost(f"{path} is not a checksummed page")
        digest, payload = blob[5:37], blob[37:]
        if hashlib.blake2b(key + payload, digest_size=32).digest() != digest:
            raise PageLost(f"{path} failed its checksum")
        return payload

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            for name in os.listdir(self.path) if os.path.isdir(self.path) else []:
                if name.endswith((".page", ".tmp")) or name == "owner.pid":
                    self.remove(os.path.join(self.path, name))


def remove_stale_folders() -> int:
    """Remove L3 folders left by flashguard processes that died without cleaning up; returns how many."""
    import psutil

    removed = 0
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        if not name.startswith(PREFIX):
            continue
        folder = os.path.join(base, name)
        try:
            with open(os.path.join(folder, "owner.pid")) as fh:
                pid = int(fh.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not psutil.pid_exists(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed += 1
    return removed


def make_private_on_windows(path: str) -> bool:
    """Let only the current user (by SID) into ``path`` and everything made in it: ``icacls`` drops the inherited
    and explicit entries and grants the user full control, inherited by files and subfolders. Returns whether it
    worked; where it cannot be done (no icacls, a FAT drive, a share), logs one warning saying what to do."""
    try:
        sid = _current_user_sid()
        for args in (["/reset"], ["/inheritance:r", "/grant:r", f"*{sid}:(OI)(CI)F"]):
            subprocess.run(["icacls", path, *args], check=True, capture_output=True, text=True, timeout=60)
        return True
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("flashguard: could not make the L3 folder %s private to this user (%s); other users of this "
                    "machine may read its sealed KV pages: use a folder inside your user profile for kv.l3_dir, "
                    "or leave kv.l3_dir unset", path, str(detail).strip())
        return False


def _current_user_sid() -> str:
    """The current Windows user's SID (``whoami /user``), e.g. ``S-1-5-21-...``."""
    out = subprocess.run(["whoami", "/user", "/fo", "csv", "/nh"], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    sid = out.strip().rsplit(",", 1)[-1].strip().strip('"')
    if not sid.startswith("S-"):
        raise ValueError(f"whoami did not give a SID: {out.strip()!r}")
    return sid
