"""The command line sets OpenMP's wait policy to PASSIVE before torch loads (cli.py): idle OpenMP threads sleep
instead of spinning on cores other work shares. A user's own setting is kept."""

import os
import subprocess
import sys

CHECK = ("import flashguard.cli, os, sys; assert 'torch' not in sys.modules, 'torch before the policy'; "
         "print(os.environ['OMP_WAIT_POLICY'])")


def run(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_the_cli_sets_passive_before_torch_loads():
    assert run({}) == "PASSIVE"


def test_a_users_own_policy_is_kept():
    assert run({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
