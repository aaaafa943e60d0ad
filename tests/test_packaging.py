"""The distribution's metadata agrees with itself, the README and CI's scripts.

The built wheel itself is installed and run by `.ci/wheel`, outside the source tree.
"""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import kups

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_the_distribution_name_is_not_the_kups_simulation_librarys():
    # `kups` on PyPI is kUPS, a molecular simulation library that also installs
    # the import package `kups`.
    assert PROJECT["name"] != "kups"
    # kups.__version__ comes from this distribution's metadata.
    assert importlib.metadata.version(PROJECT["name"]) == kups.__version__


def test_the_dev_extra_names_this_distribution():
    dev = PROJECT["optional-dependencies"]["dev"]
    assert f"{PROJECT['name']}[test,docs]" in dev
    assert any(re.match(r"build\b", requirement) for requirement in dev)


def test_the_readme_says_the_name_and_the_clash():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    intro = readme[: readme.index("## Quick start")]
    assert f"distributed as `{PROJECT['name']}` and imported as `kups`" in intro
    assert "kUPS" in intro and "molecular simulations" in intro
    assert "overwrites" in intro


def test_ci_suite_reads_the_jax_floor_from_pyproject():
    suite = (ROOT / ".ci" / "suite").read_text(encoding="utf-8")
    program = re.search(r"<<'PY'\n(.*?)\nPY\n", suite, re.S)
    assert program is not None
    floor = subprocess.run(
        [sys.executable, "-c", program[1]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    jax = next(d for d in PROJECT["dependencies"] if re.match(r"jax\b(?!lib)", d))
    assert floor == "0.10.0"
    assert f">={floor}" in jax


def test_version_comes_from_this_distribution():
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version(PROJECT["name"])
    except PackageNotFoundError:
        installed = "0+unknown"  # a source tree on PYTHONPATH, not installed
    assert kups.__version__ == installed
    if installed != "0+unknown":
        assert installed == PROJECT["version"]


def test_the_wheel_smoke_test_passes_on_the_source_tree(tmp_path):
    # `.ci/wheel` runs it against the installed wheel; here it runs against this
    # tree, so a change of the public API that breaks it fails the test suite too.
    result = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "wheel_smoke.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "smoke test passed" in result.stdout


def test_the_hosted_workflow_runs_every_script_of_ci_run():
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text(encoding="utf-8")
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    in_run = re.findall(r"^bash \.ci/(\w+)$", run, re.M)
    in_workflow = re.findall(r"^\s+- run: bash \.ci/(\w+)$", workflow, re.M)
    assert sorted(in_run) == sorted(in_workflow) == ["floor", "newest", "test", "wheel"]
    assert all((ROOT / ".ci" / script).is_file() for script in in_workflow)
    # `.ci/newest` needs a Python 3.13 on PATH (`.ci/python313`).
    newest = workflow[workflow.index("  newest:") : workflow.index("  wheel:")]
    assert 'python-version: "3.13"' in newest
