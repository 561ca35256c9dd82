"""Windows behaviour, checked on any OS: UTF-8 output whatever the code page, and a user-given ``kv.l3_dir``
made private with an ACL (``icacls``; the platform and the Windows tools are stood in for where they differ)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_output_is_utf8_whatever_the_code_page(monkeypatch):
    from flashguard.cli import utf8_output

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="cp1252", errors="strict")  # a Windows pipe in a Western code page
    monkeypatch.setattr(sys, "stdout", out)
    utf8_output()
    print("Paris — 日本 ✓")
    sys.stdout.flush()
    assert raw.getvalue().decode("utf-8") == "Paris — 日本 ✓\n"


@pytest.mark.slow
def test_the_cli_writes_utf8_under_a_legacy_code_page(tmp_path):
    missing = tmp_path / "日本"
    env = dict(os.environ, PYTHONIOENCODING="cp1252")  # what Python picks for a redirected stream on Windows
    p = subprocess.run([sys.executable, "-m", "flashguard.cli", "generate", "hi", "--config", str(missing)],
                       capture_output=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode != 0 and "日本".encode("utf-8") in p.stderr and b"Traceback" not in p.stderr


class _Windows:
    """Stands in for whoami and icacls: records the command lines."""

    def __init__(self, fail: BaseException | None = None):
        self.calls, self.fail = [], fail

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        if cmd[0] == "whoami":
            return subprocess.CompletedProcess(cmd, 0, stdout='"laptop\\\\ana","S-1-5-21-11-22-33-1001"\r\n')
        if self.fail is not None:
            raise self.fail
        return subprocess.CompletedProcess(cmd, 0, stdout="processed 1 file")


def test_a_given_l3_dir_gets_an_acl_for_the_user_only(tmp_path, monkeypatch):
    from flashguard.kv import disk

    windows = _Windows()
    monkeypatch.setattr(disk.subprocess, "run", windows)
    monkeypatch.setattr(disk.os, "name", "nt")
    folder = disk.L3Folder(str(tmp_path / "pages"), encrypt=False)
    monkeypatch.undo()
    path = str(tmp_path / "pages")
    assert windows.calls == [["whoami", "/user", "/fo", "csv", "/nh"],
                             ["icacls", path, "/reset"],
                             ["icacls", path, "/inheritance:r", "/grant:r", "*S-1-5-21-11-22-33-1001:(OI)(CI)F"]]
    written = folder.write(b"k" * 16, b"payload")
    assert folder.read(b"k" * 16, written) == b"payload"
    folder.close()


def test_an_acl_that_cannot_be_set_is_a_warning(tmp_path, monkeypatch, caplog):
    from flashguard.kv import disk

    monkeypatch.setattr(disk.subprocess, "run", _Windows(fail=FileNotFoundError(2, "no such file", "icacls")))
    with caplog.at_level(logging.WARNING, logger="flashguard"):
        assert disk.make_private_on_windows(str(tmp_path)) is False
    assert "could not make the L3 folder" in caplog.text and "kv.l3_dir" in caplog.text


def test_posix_does_not_run_windows_tools(tmp_path, monkeypatch):
    from flashguard.kv import disk

    windows = _Windows()
    monkeypatch.setattr(disk.subprocess, "run", windows)
    folder = disk.L3Folder(str(tmp_path / "pages"), encrypt=False)
    assert windows.calls == [] and (os.stat(folder.path).st_mode & 0o777) == 0o700
    folder.close()
