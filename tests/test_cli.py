"""The README's main job: ``flashguard chat`` (and ``generate``) as a user runs them."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def flashguard(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "flashguard.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_chat_streams_a_guarded_answer_and_keeps_history():
    p = flashguard("chat", stdin="What is the capital of France?\n/stats\n/reset\n/quit\n")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout and '"moderation"' in p.stdout
    assert "using the embedded default" in p.stderr  # the one log line that says which model runs


def test_generate_one_answer():
    p = flashguard("generate", "What is the capital of France?")
    assert p.returncode == 0 and "Paris" in p.stdout


def test_missing_config_folder_is_a_clear_error(tmp_path):
    p = flashguard("generate", "hi", "--config", str(tmp_path))
    assert p.returncode != 0 and "no config.yml" in p.stderr
