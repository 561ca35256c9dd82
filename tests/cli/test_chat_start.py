"""``flashguard chat`` prompts while the weights load (cli_chat.RailsLoading): the prompt comes once the model's loading
line is out, the first reply waits for the rest, and a failure is reported as before (one line, exit status 2):
before the prompt when it comes first, at the next message otherwise. Fast: the load is a stand-in, no model."""

from __future__ import annotations

import builtins
import logging
import sys
import threading

import pytest

from flashguard import cli, cli_chat, notice
from flashguard.errors import ConfigError, ModelLoadError
from tests.conftest import FLASH


class StandInRails:
    async def stream_async(self, messages, **kwargs):
        yield f"echo: {messages[-1]['content']}"


@pytest.fixture
def chat(monkeypatch):
    """Runs ``flashguard chat`` with ``load`` as its ``load_rails`` and ``lines`` as what the user types (a
    callable line: called when the prompt asks for it)."""
    notices = logging.getLogger("flashguard.notice")
    monkeypatch.setattr(notices, "level", logging.INFO)
    for handler in [h for h in notices.handlers if isinstance(h, notice._Stderr)]:   # (not a stream an earlier
        # test's capture closed: setStream flushes it)
        monkeypatch.setattr(handler, "stream", sys.stderr)

    def run(load, lines):
        monkeypatch.setattr(cli_chat, "load_rails", load)   # (RailsLoading's, in flashguard/cli_chat.py)
        typed = iter(lines)

        def fake_input(prompt=""):
            print(prompt, end="")
            line = next(typed, None)
            if line is None:
                raise EOFError
            return line() if callable(line) else line

        monkeypatch.setattr(builtins, "input", fake_input)
        return cli.main(["chat", "--config", str(FLASH)])

    return run


def test_the_prompt_comes_while_the_weights_load(chat, capsys):
    release, order = threading.Event(), []

    def load(config_dir, check=None, status=True):
        notice.say("flashguard: loading the stand-in model")
        release.wait(30)   # (the rest of the load: the weights)
        order.append("loaded")
        return StandInRails()

    def first_message():
        order.append("prompted")   # the user types while the load goes on
        release.set()
        return "hi"

    assert chat(load, [first_message, "/quit"]) == 0
    assert order == ["prompted", "loaded"]
    out, err = capsys.readouterr()
    assert "you> bot> echo: hi" in out
    assert "flashguard: loading the stand-in model" in err


def test_an_error_before_the_loading_line_comes_before_the_prompt(chat, capsys):
    def load(config_dir, check=None, status=True):
        raise ConfigError("config.yml: models[main].parameters.temperatur: unknown key 'temperatur'")

    def never():
        raise AssertionError("prompted although the config is broken")

    assert chat(load, [never]) == 2
    out, err = capsys.readouterr()
    assert "you> " not in out and err.strip().startswith("flashguard: ") and "temperatur" in err


def test_an_error_after_the_prompt_is_reported_at_the_next_message(chat, capsys):
    prompted = threading.Event()

    def load(config_dir, check=None, status=True):
        notice.say("flashguard: loading the stand-in model")
        prompted.wait(30)
        raise ModelLoadError("cannot load the stand-in: its file is truncated", key="model_path")

    def first_message():
        prompted.set()
        return "hi"

    assert chat(load, [first_message]) == 2
    out, err = capsys.readouterr()
    assert "you> " in out and "bot> " not in out, (out, err)
    assert "cannot load the stand-in" in err


def test_quitting_while_the_weights_load_waits_for_them(chat):
    """No load thread is left running at exit (torch's threads at interpreter shutdown)."""
    finished = threading.Event()

    def load(config_dir, check=None, status=True):
        notice.say("flashguard: loading the stand-in model")
        threading.Event().wait(0.5)
        finished.set()
        return StandInRails()

    assert chat(load, ["/quit"]) == 0
    assert finished.is_set()
