"""The example notebooks run top to bottom in a real kernel (nbclient), each in under a minute,
and show what they promise: the detection, the report widget with its HTML and text fallbacks,
the traces and their comparison, the pipeline doctor's verdicts.

A cell that is meant to fail carries the `raises-exception` tag; any other error fails the run.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


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


_executed = {}


def execute(name, kernel):
    if name not in _executed:
        notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
        client = NotebookClient(notebook, kernel_name=kernel, timeout=120,
                                resources={"metadata": {"path": str(NOTEBOOKS)}})
        client.execute()
        _executed[name] = notebook
    return _executed[name]


def code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def cell_with(notebook, source_start):
    (cell,) = [c for c in code_cells(notebook) if c.source.startswith(source_start)]
    return cell


def outputs(cell, kind):
    return [out for out in cell.outputs if out.output_type == kind]


def reports(cell):
    return [out.data for out in outputs(cell, "display_data") if WIDGET_MIME in out.get("data", {})]


def check_common(notebook):
    for cell in code_cells(notebook):
        errors = outputs(cell, "error")
        tagged = "raises-exception" in cell.metadata.get("tags", [])
        assert bool(errors) == tagged, (cell.source, [(e.ename, e.evalue) for e in errors])
        for error in errors:
            # the short display: the exception and the culprit, no traceback through the hooks
            assert len(error.traceback) <= 2 and error.traceback[0].startswith("\x1b[0;31m" + error.ename)
    # every report widget exists in the kernel's saved widget state
    state = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in code_cells(notebook):
        for bundle in reports(cell):
            assert bundle[WIDGET_MIME]["model_id"] in state
            assert 'class="ng-report' in bundle["text/html"]


def test_quickstart_finds_the_overflowing_feed_forward(python3_kernel):
    notebook = execute("01_quickstart.ipynb", python3_kernel)
    check_common(notebook)
    culprit = "encoder.block.1.layer.1.DenseReluDense.wo"
    cell = cell_with(notebook, "%%numguard\n")
    (error,) = outputs(cell, "error")
    assert error.ename == "NonFiniteError"
    assert f"{culprit} (Linear) produced a non-finite value in forward (call 0 of batch 0)" in error.evalue
    (bundle,) = reports(cell)
    assert set(bundle) == {WIDGET_MIME, "text/html", "text/plain"}
    assert bundle["text/plain"].startswith("Detected inf/nan during batch_number=0")
    html = bundle["text/html"]
    assert re.search(rf'<details class="[^"]*ng-culprit-node[^"]*" open data-path="{re.escape(culprit)}"', html)
    assert '<svg class="ng-chart"' in html and "float16 max 65504" in html
    summary = cell_with(notebook, "report = _numguard")
    assert culprit in outputs(summary, "stream")[0].text
    text = cell_with(notebook, "print('\\n'.join(report.to_text()")
    assert f"{culprit} Linear" in outputs(text, "stream")[0].text
    predicted = cell_with(notebook, "%%numguard --limit-dtype float16 model32")
    (error,) = outputs(predicted, "error")
    assert "predicted overflow" in error.evalue and culprit in error.evalue
    assert len(reports(predicted)) == 1


def test_tracing_notebook_compares_the_batch_that_worked_with_the_one_that_failed(python3_kernel):
    notebook = execute("02_tracing.ipynb", python3_kernel)
    check_common(notebook)
    failed = cell_with(notebook, "%%numguard\n")
    (error,) = outputs(failed, "error")
    assert "4 (Linear) produced a non-finite gradient in backward (call 0 of batch 6)" in error.evalue
    traced = cell_with(notebook, "%%numguard --trace 5,6 model")
    shown = reports(traced)
    assert [b["text/plain"].split("***")[1].strip() for b in shown] == [
        "Starting batch number=5", "Starting batch number=6"]
    # the trace of batch 6 notes where it would have stopped
    culprit_node = re.compile(r'<details class="[^"]*ng-culprit-node[^"]*" open data-path="4"')
    assert culprit_node.search(shown[1]["text/html"]) and not culprit_node.search(shown[0]["text/html"])
    compared = cell_with(notebook, "%numguard compare good bad")
    (result,) = outputs(compared, "execute_result")
    assert "first difference > 10x: 0 (Linear) forward call 0, input[0]" in result.data["text/plain"]
    assert "batch 5" in result.data["text/html"] and "batch 6" in result.data["text/html"]
    split = cell_with(notebook, "train(model, opt, batches[4:])")
    (error,) = outputs(split, "error")
    assert "(call 0 of batch 6)" in error.evalue  # batches counted across the cells
    assert len(reports(split)) == 1
    off = cell_with(notebook, "%numguard off")
    assert outputs(off, "stream")[0].text.startswith("numguard: off")


def test_doctor_notebook_catches_the_course_bugs_at_their_steps(python3_kernel):
    notebook = execute("04_pipeline_doctor.ipynb", python3_kernel)
    check_common(notebook)
    expected = {
        "trainer = trainer_for(bert(num_labels=3), raw_datasets)": "failed at 'data'",
        "trainer = trainer_for(bert(num_labels=3), tokenized_datasets)\n": "failed at 'collate'",
        "collator = transformers.DataCollatorWithPadding": "failed at 'forward'",
        "trainer = trainer_for(bert(num_labels=3), tokenized_datasets, data_collator": "all 7 steps passed",
    }
    for start, verdict in expected.items():
        cell = cell_with(notebook, start)
        (shown,) = [out.data for out in outputs(cell, "display_data")]
        assert verdict in shown["text/plain"], shown["text/plain"]
        assert "<" in shown["text/html"]  # the checklist's HTML view
    fix = cell_with(notebook, "collator = transformers.DataCollatorWithPadding")
    text = [out.data for out in outputs(fix, "display_data")][0]["text/plain"]
    assert "num_labels=3" in text
    assert "all steps passed: True" in outputs(cell_with(notebook, "trainer = trainer_for(bert(num_labels=3), tokenized_datasets, data_collator"), "stream")[0].text
