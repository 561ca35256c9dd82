"""The command line's small things, fast (no model loads): ``-v`` before or after the command and what each level
logs, the sampling options, the cut marker, ``plan`` on the machine it runs on, ``smi`` in plain units."""

import json
import logging
import os

import pytest

from flashguard import cli


@pytest.fixture
def captured(monkeypatch):
    """The parsed arguments of each command run through ``cli.main`` (the command itself replaced)."""
    seen = []
    for name in ("cmd_generate", "cmd_chat", "cmd_serve"):
        monkeypatch.setattr(cli, name, lambda args: seen.append(args) or 0)
    root, ours, nemo = (logging.getLogger(n) for n in ("", "flashguard", "nemoguardrails"))
    levels = root.level, ours.level, nemo.level
    yield seen
    root.setLevel(levels[0])
    ours.setLevel(levels[1])
    nemo.setLevel(levels[2])


@pytest.mark.parametrize("argv, level", [
    (["generate", "hi"], 0),
    (["-v", "generate", "hi"], 1),
    (["generate", "hi", "-v"], 1),
    (["generate", "-v", "hi"], 1),
    (["-v", "generate", "hi", "-v"], 2),
    (["generate", "hi", "-vv"], 2),
    (["chat", "--verbose"], 1),
    (["serve", "-v"], 1),
    (["-v", "serve"], 1),
])
def test_verbose_works_before_or_after_the_command(captured, argv, level):
    assert cli.main(argv) == 0
    assert captured[-1].verbose == level


def test_one_v_logs_flashguards_lines_and_two_add_nemos(captured):
    cli.main(["generate", "hi", "-v"])
    assert logging.getLogger("flashguard").getEffectiveLevel() == logging.INFO
    assert logging.getLogger("flashguard.rails").isEnabledFor(logging.INFO)   # the verdicts
    assert not logging.getLogger("nemoguardrails").isEnabledFor(logging.INFO)   # no event dumps
    assert not logging.getLogger("nemoguardrails.colang.v1_0.runtime").isEnabledFor(logging.INFO)
    cli.main(["generate", "hi", "-vv"])
    assert logging.getLogger("nemoguardrails.colang.v1_0.runtime").isEnabledFor(logging.INFO)
    cli.main(["generate", "hi"])
    assert not logging.getLogger("flashguard").isEnabledFor(logging.INFO)


def test_sampling_options_become_the_calls_llm_params(captured):
    cli.main(["generate", "hi", "--max-tokens", "5", "--temperature", "0.5", "--seed", "3"])
    assert cli.llm_params(captured[-1]) == {"max_tokens": 5, "temperature": 0.5, "seed": 3}
    cli.main(["chat", "--max-tokens", "64"])
    assert cli.llm_params(captured[-1]) == {"max_tokens": 64}   # the rest: the config's
    cli.main(["generate", "hi"])
    assert cli.llm_params(captured[-1]) == {}


@pytest.mark.parametrize("argv", [["generate", "hi", "--max-tokens", "0"], ["chat", "--temperature", "-1"],
                                  ["generate", "hi", "--seed", "x"]])
def test_bad_sampling_options_are_usage_errors(captured, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and argv[2] in capsys.readouterr().err


def test_the_cut_marker_says_a_reply_hit_max_tokens():
    from flashguard.guardrails.server import RequestUsage

    usage = RequestUsage()
    usage.add(30, 256, "length")
    assert cli.cut_note(usage) == "[cut at 256 tokens: raise --max-tokens]"
    usage.add(0, 0, "stop")
    assert cli.cut_note(usage) is None
    assert cli.cut_note(RequestUsage()) is None   # no LLM call (an input rail's block)


def test_plan_on_a_cpu_only_machine_plans_its_cpu_and_the_weights_chat_loads(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    first, second = out.splitlines()[:2]
    assert first.startswith("model: SmolLM2-135M-Instruct (the embedded model")
    assert "weights: int4 (auto: the GGUF's own Q4 codes on the CPU" in first   # what chat loads here, not float
    assert second.startswith("planned for this machine's CPU") and "GPU of" not in out and "4GiB" in second
    assert "| KV cache (the whole context, float32) |" in out and "of RAM available now" in out
    assert cli.main(["plan", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu" and report["weights"] == "int4" and report["fits"]
    # weights: the int4 codes (0.066 GB) + the float32 table (0.113) + the Q8_0 head (0.035) + norms, as loaded
    assert abs(report["host"]["weights (int4 decoder linears, float32 embedding table, int8 lm_head)"]
               - 215131648) < 2**20
    # told otherwise: a GPU of --gpu-mem
    assert cli.main(["plan", "--gpu-mem", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "planned for a GPU of 4GiB" in out and "without --gpu-mem, plan plans its CPU" in out


def test_plan_on_a_gpu_machine_plans_its_gpu(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (6 * 2**30, 8 * 2**30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Test GPU")
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    # the free memory with this process's CUDA context counted back in, less the margin: vram_budget auto
    assert "planned for a GPU of 5.89GiB (this machine's Test GPU: its free memory less 0.5 GiB" in out, out
    assert "weights: float (auto: float on a GPU" in out.splitlines()[0]


def _engine_report(pid: int) -> dict:
    return {"model": "m", "device": "cpu", "pid": pid, "gpu": None, "cpu_weights": 2**30, "cpu_kv cache": 2**29,
            "host": {"L2 pages": 1, "L2 bytes": 2**20, "L3 pages": 7, "L3 disk bytes": 3 * 2**20,
                     "process RSS": 2**31},
            "info": {"weights": "int4", "int4_kernel": "cpu", "cache": "tiered", "context": 8192, "vram_budget": None,
                     "tiers": {"pool": {"tokens": 8192, "codec": "fp16", "bytes": 2**29},
                               "l2": {"tokens": 8192, "codec": "int8", "pages_now": 1, "bytes_now": 2**20},
                               "l3": {"tokens": 1 << 20, "codec": "int4-zstd", "pages_now": 7, "dir": "/tmp/x",
                                      "error": None}}}}


def test_smi_tables_hold_sizes_in_gib_and_counts_in_words():
    from flashguard.vram.accounting import render

    text = render({"engines": [_engine_report(1)]})
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| memory")]
    assert rows and all(float(line.split("|")[2]) >= 0 for line in rows)   # every value a size in GiB
    assert "| L2 pages in host RAM | 0.001 |" in text and "| CPU KV cache | 0.500 |" in text
    assert "pages | " not in text and "| 1 |" not in text and "| 7 |" not in text   # no counts in the GiB column
    assert "L2 (host RAM): up to 8192 tokens in int8; now 1 pages, 0.001 GiB" in text
    assert "L3 (disk): up to 1048576 tokens in int4-zstd; now 7 pages in /tmp/x" in text
    assert "context 8192 tokens" in text and "weights int4 (cpu kernel)" in text


def test_smi_lists_only_its_own_processes_l3_folders(monkeypatch, tmp_path):
    import tempfile

    from flashguard.vram.accounting import machine_memory

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    for name, pid in (("flashguard-l3-mine", os.getpid()), ("flashguard-l3-server", 4242),
                      ("flashguard-l3-other", 777), ("flashguard-l3-nopid", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.page").write_bytes(b"x" * 10)
        if pid is not None:
            (tmp_path / name / "owner.pid").write_text(str(pid))
    assert list(machine_memory()["l3_folders"]) == [str(tmp_path / "flashguard-l3-mine")]
    assert sorted(machine_memory({4242, os.getpid()})["l3_folders"]) == [
        str(tmp_path / "flashguard-l3-mine"), str(tmp_path / "flashguard-l3-server")]
