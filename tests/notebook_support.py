"""Fixtures and helpers for the tests that run the example notebooks in a real kernel: a `python3`
kernel spec that imports this checkout, and each notebook executed once per test session with
nbclient's default settings, shared by the tests that read it (test_notebooks, test_export).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="session")
def python3_kernel():
    """A `python3` kernel spec (CI images may lack one) whose kernel imports this checkout."""
    from jupyter_client.kernelspec import find_kernel_specs

    if "python3" not in find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", "python3"],
                       check=True, capture_output=True)
    assert "python3" in find_kernel_specs()
    with pytest.MonkeyPatch.context() as patch:
        path = os.environ.get("PYTHONPATH")
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), path])))
        yield "python3"


# name -> the executed notebook. Module-wide: each test module that imports the fixture gets a
# fixture of its own, and the notebooks still run once per session.
_executed: dict = {}


@pytest.fixture(scope="session")
def run_notebook(python3_kernel, tmp_path_factory):
    """`run_notebook(name)`: notebooks/<name> run top to bottom in a fresh kernel with nbclient's
    default settings (as `jupyter nbconvert --execute` runs it), in a temporary working directory
    (what the notebook writes lands there); once per session, a copy for each caller."""
    executed = _executed

    def run(name: str) -> nbformat.NotebookNode:
        if name not in executed:
            workdir = tmp_path_factory.mktemp("notebook")
            notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
            for cell in notebook.cells:
                if cell.cell_type == "code":  # the committed outputs: "ran" must mean ran here
                    cell.outputs, cell.execution_count = [], None
            client = NotebookClient(notebook, kernel_name=python3_kernel, timeout=120,
                                    resources={"metadata": {"path": str(workdir)}})
            client.execute()
            executed[name] = notebook
        return copy.deepcopy(executed[name])

    return run


def code_cells(notebook) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def cell_with(notebook, source_start: str):
    (cell,) = [c for c in code_cells(notebook) if c.source.startswith(source_start)]
    return cell


def outputs(cell, kind: str) -> list:
    return [out for out in cell.outputs if out.output_type == kind]


def reports(cell) -> list:
    """The mimebundles of the numguard reports a cell displayed."""
    return [out.data for out in outputs(cell, "display_data")
            if 'class="ng-report' in out.get("data", {}).get("text/html", "")]
