"""``python -m benchmarks.peer`` in its CPU mode (gloo, spawned page servers): every row measured and the same logits
as the resident row, and the dead-peer check; each run a command of its own, bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BOUND_S = 150          # a run that has not finished by then hangs
GLOO_TIMEOUT_S = 8.0   # what bounds every collective of the tier in these runs


def _bench(*args: str) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "benchmarks.peer", "--device", "cpu", *args], cwd=ROOT, env=env,
                          timeout=BOUND_S, stdout=subprocess.DEVNULL).returncode


@pytest.mark.slow
def test_bench_cpu_mode_measures_every_row_and_the_dead_peer(tmp_path):
    rc = _bench("--context", "1024", "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "rows.json"))
    dead_rc = _bench("--dead-peer", "--peer-timeout", str(GLOO_TIMEOUT_S), "--json", str(tmp_path / "dead.json"))
    out = json.loads((tmp_path / "rows.json").read_text())
    dead = json.loads((tmp_path / "dead.json").read_text())
    assert rc == 0 and out["check"]["ok"] and out["partial"] is None
    rows = {r["row"]: r for r in out["rows"]}
    assert set(rows) == {"l2", "peer", "resident", "split"} and not any("error" in r for r in rows.values())
    assert rows["l2"]["page_reads_per_step"] > 0 and rows["peer"]["page_reads_per_step"] == 0
    for name in ("peer", "split"):   # the same K/V in every row: the peer's pages give the resident logits
        assert rows[name]["max_abs_logit_diff_vs_resident"] < 1e-4 and rows[name]["peers"]["pages"] > 0
    assert dead_rc == 0 and dead["dead_peer"]["ok"]
