"""The notebooks in notebooks/ are committed with their outputs, so that they
read with their plots on the repository's page and in the docs site (which
renders them without executing them). The suite executes them with nbmake;
these tests only read the stored files, and fail when the outputs are missing,
partial or out of order, that is when a notebook was edited and not re-run.

To refresh a notebook's outputs after changing it:

    jupyter nbconvert --to notebook --execute --inplace \\
        --ExecutePreprocessor.record_timing=False notebooks/NAME.ipynb
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RERUN = (
    "re-run it top to bottom and commit it with its outputs: `jupyter nbconvert --to notebook "
    "--execute --inplace --ExecutePreprocessor.record_timing=False {path}`"
)
# What would differ from one run to the next, or from one machine to another.
VOLATILE = re.compile(r"/tmp/|/home/|ipykernel_\d+| at 0x[0-9a-fA-F]+")


def read(path: Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    return notebook


def code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def output_text(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    return "".join(
        value for key, value in output.get("data", {}).items() if key.startswith("text/")
    )


def test_there_are_at_least_three_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_setup(path):
    """The notebooks run on the default `python3` kernel and ask for their
    devices before JAX is imported."""
    notebook = read(path)
    assert notebook.metadata.kernelspec.name == "python3"
    first = "".join(code_cells(notebook)[0].source)
    assert first.index("XLA_FLAGS") < first.index("import jax")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_is_stored_with_its_outputs(path):
    """Every code cell ran, in order, in one kernel, without an error; every
    plot is stored; no output holds a timing, a temporary path or an address."""
    notebook = read(path)
    rerun = RERUN.format(path=path.relative_to(ROOT))
    cells = code_cells(notebook)
    counts = [cell.execution_count for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: execution counts {counts} are not 1 to {len(cells)}: {rerun}"
    )
    for number, cell in enumerate(cells, start=1):
        where = f"{path.name}, code cell {number}"
        assert "execution" not in cell.metadata, f"{where}: stores its timing: {rerun}"
        for output in cell.outputs:
            assert output.output_type != "error", f"{where}: stores an error: {rerun}"
            assert not VOLATILE.search(output_text(output)), (
                f"{where}: its output holds a path or an address that changes between runs"
            )
        if "plt.show()" in cell.source:
            assert any("image/png" in output.get("data", {}) for output in cell.outputs), (
                f"{where}: shows a plot but stores no image: {rerun}"
            )
