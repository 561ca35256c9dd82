"""``flashguard generate`` and ``chat`` as a user runs them: the line that says a reply was cut at max_tokens, and
``-v`` after the command showing flashguard's own lines, not NeMo Guardrails' event dumps."""

import sys

import pytest

from tests.conftest import run_all

pytestmark = pytest.mark.slow

CUT = "[cut at 8 tokens: raise --max-tokens]"


@pytest.fixture(scope="module")
def runs() -> dict:
    cli = [sys.executable, "-m", "flashguard.cli"]
    return run_all({
        "generate": (cli + ["generate", "Give me a simple pancake recipe.", "--max-tokens", "8", "-v"], {}),
        "chat": (cli + ["chat", "--max-tokens", "8"], {"input": "Give me a simple pancake recipe.\n/quit\n"}),
    })


def test_generate_says_on_stderr_that_the_reply_was_cut(runs):
    p = runs["generate"]
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() and CUT not in p.stdout   # the answer alone on stdout
    assert p.stderr.rstrip().splitlines()[-1] == CUT, p.stderr


def test_v_after_the_command_shows_flashguards_lines_not_nemos(runs):
    err = runs["generate"].stderr
    assert "INFO flashguard: flashguard input moderation: allow" in err   # a verdict and its time
    assert "INFO flashguard: flashguard moderation: allow" in err
    # the load line names the weights kind (not the activations' dtype alone)
    assert "on cpu, int4 weights (float32 activations)" in err
    assert "nemoguardrails" not in err and "INFO root" not in err, err   # no event dumps
    assert len(err.splitlines()) < 15, err


def test_chat_says_the_reply_was_cut_on_its_own_line(runs):
    p = runs["chat"]
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    reply = next(i for i, line in enumerate(lines) if "bot> " in line)
    assert CUT in lines[reply + 1:], p.stdout
    assert CUT not in lines[reply]
