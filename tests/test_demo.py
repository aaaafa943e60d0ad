"""`python -m kups`: the demo runs in a fresh process, sets up its own devices,
shows what each effect sees, and verifies it (exit status 0)."""

import os
import subprocess
import sys

import pytest


def run_demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    # The demo must set up its devices itself: no XLA_FLAGS or JAX_PLATFORMS from
    # the test environment (conftest.py sets both).
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["NO_COLOR"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "kups", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def test_help_lists_the_options():
    result = run_demo("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for option in ("--steps", "--devices", "--section", "--no-color", "--nan-shard"):
        assert option in result.stdout
    assert "{counts,reap,checks,nans,all}" in result.stdout


@pytest.mark.parametrize("args", [("--steps", "0"), ("--bad-shard", "8"), ("--section", "x")])
def test_usage_errors_exit_2(args):
    result = run_demo(*args, timeout=60)
    assert result.returncode == 2
    assert "error" in result.stderr


@pytest.mark.slow
def test_demo_runs_and_verifies_itself():
    result = run_demo()
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "8 CPU devices" in out
    assert "\033[" not in out  # NO_COLOR, and not a terminal
    # count_primitives: a table with per-shard and total counts.
    assert "primitive" in out and "per shard and step" in out
    assert "5 dot_generals per shard and step" in out
    # reap: one row per step, one column per shard.
    assert "step  data=0  data=1" in out
    assert out.count("\n  7   ") == 1
    # checks: the message names the step and the shard.
    assert "input out of range: max |x| = 1000.0 at iteration 3 on shard data=5 (_demo.py:" in out
    assert "learning rate must be positive, got -0.1" in out
    # find_nans: the division, at the injected step and shard.
    assert "NanReport(found=True, kind=nan, primitive=div" in out
    assert "iteration=5, shard=data=0" in out
    assert "[FAIL]" not in out
    assert "verifications passed" in out.splitlines()[-1]


def test_one_section_with_other_sizes():
    result = run_demo("--section", "checks", "--devices", "4", "--steps", "2", "--no-color")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 CPU devices" in result.stdout
    # The defaults move into range: the last step, shard 3 of 4 (the 6th is absent).
    assert "at iteration 1 on shard data=3" in result.stdout
    assert "count_primitives" not in result.stdout


@pytest.mark.slow
def test_nan_on_another_shard_is_found_with_its_line():
    # The NaN spreads to every shard through the gradient's psum; the report
    # names the shard and line that made it.
    result = run_demo("--section", "nans", "--nan-shard", "3", "--no-color")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "primitive=div, source=_demo.py:" in result.stdout
    assert "shard=data=3" in result.stdout
