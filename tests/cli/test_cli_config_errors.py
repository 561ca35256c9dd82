"""A broken config under ``flashguard serve``, ``chat`` and ``generate``: one line on stderr naming what to fix,
exit status 2, no traceback (no model is loaded: each fails before the weights)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import make_config, run_all

pytestmark = pytest.mark.slow   # each case starts the CLI (NeMo's import) in a child process

MAIN = "models:\n  - type: main\n    engine: flashguard\n    model: x\n"
CASES = {
    "unknown parameter": (MAIN + "    parameters:\n      temperatur: 0.5\npassthrough: true\n",
                          "models[main].parameters.temperatur: unknown key 'temperatur'"),
    "bad YAML": (MAIN + "   parameters: [oops\n", "not valid YAML at line 5"),
    "wrong shape": ("models: 5\n", "NeMo Guardrails cannot read this config"),
}
COMMANDS = {"serve": ["serve", "--port", "1"], "generate": ["generate", "hi"], "chat": ["chat"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every case under every command, the 9 CLI processes started at once (each exits before loading a model)."""
    runs = {}
    for case, (yaml_text, _) in CASES.items():
        cfg = make_config(tmp_path_factory.mktemp("cfg"), yaml_text)
        for command, args in COMMANDS.items():
            runs[(case, command)] = ([sys.executable, "-m", "flashguard.cli", *args, "--config", str(cfg)],
                                     {"stdin": subprocess.DEVNULL})
    return run_all(runs, timeout=300)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", CASES)
def test_config_error_is_one_line_naming_it(results, command, case):
    _, needle = CASES[case]
    p = results[(case, command)]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("flashguard: ") and needle in lines[0], p.stderr
