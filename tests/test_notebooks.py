"""The example notebooks run top to bottom in a real kernel (nbclient), each in under a minute,
and show what they promise: the detection, the report (static tree and text: a headless run gets
no widget), the traces and their comparison, the pipeline doctor's verdicts.

A cell that is meant to fail carries the `raises-exception` tag; any other error fails the run.
The notebooks are committed executed: a fresh run must still say what their outputs say.
"""

import copy
import importlib.util
import re

import nbformat
import pytest
from notebook_support import (  # noqa: F401 (fixtures)
    NOTEBOOKS, REPO, WIDGET_MIME, cell_with, code_cells, outputs, python3_kernel, reports, run_notebook,
)


def check_common(notebook):
    for cell in code_cells(notebook):
        errors = outputs(cell, "error")
        tagged = "raises-exception" in cell.metadata.get("tags", [])
        assert bool(errors) == tagged, (cell.source, [(e.ename, e.evalue) for e in errors])
        for error in errors:
            # the short display: the exception and the culprit, no traceback through the hooks
            assert len(error.traceback) <= 2 and error.traceback[0].startswith("\x1b[0;31m" + error.ename)
    # a headless run makes a document: every report is its static tree and its text, no widget
    # (whose view an export could show only with the widget manager's script from a CDN)
    assert "widgets" not in notebook.metadata
    for cell in code_cells(notebook):
        for bundle in reports(cell):
            assert set(bundle) == {"text/html", "text/plain"}


def test_quickstart_finds_the_overflowing_feed_forward(run_notebook):
    notebook = run_notebook("01_quickstart.ipynb")
    check_common(notebook)
    culprit = "encoder.block.1.layer.1.DenseReluDense.wo"
    cell = cell_with(notebook, "%%numguard\n")
    (error,) = outputs(cell, "error")
    assert error.ename == "NonFiniteError"
    assert f"{culprit} (Linear) produced a non-finite value in forward (call 0 of batch 0)" in error.evalue
    (bundle,) = reports(cell)
    assert bundle["text/plain"].startswith("Detected inf/nan during batch_number=0")
    html = bundle["text/html"]
    assert re.search(rf'<details class="[^"]*ng-culprit-node[^"]*" open data-path="{re.escape(culprit)}"', html)
    assert '<svg class="ng-chart"' in html and "float16 max 65504" in html
    summary = cell_with(notebook, "report = _numguard")
    assert culprit in outputs(summary, "stream")[0].text
    text = cell_with(notebook, "print('\\n'.join(report.to_text()")
    assert f"{culprit} Linear" in outputs(text, "stream")[0].text
    predicted = cell_with(notebook, "%%numguard --limit-dtype float16 model32")
    (headroom,) = [out.data for out in outputs(predicted, "display_data")
                   if 'class="ng-headroom"' in out.data.get("text/html", "")]
    assert "would overflow (beyond its largest value 65504)" in headroom["text/plain"]
    assert f"first overflow: {culprit} (Linear) forward output" in headroom["text/plain"]


def test_tracing_notebook_compares_the_batch_that_worked_with_the_one_that_failed(run_notebook):
    notebook = run_notebook("02_tracing.ipynb")
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
    # the report, then the error: under %numguard on as in a %%numguard cell
    for cell in (failed, split):
        assert [out.output_type for out in cell.outputs] == ["display_data", "error"]
    off = cell_with(notebook, "%numguard off")
    assert outputs(off, "stream")[0].text.startswith("numguard: off")


def test_doctor_notebook_catches_the_course_bugs_at_their_steps(run_notebook):
    notebook = run_notebook("04_pipeline_doctor.ipynb")
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


# ---- the committed outputs -------------------------------------------------------------------
def _script():
    """scripts/execute_notebooks.py, which writes the committed outputs and compares them."""
    spec = importlib.util.spec_from_file_location("execute_notebooks", REPO / "scripts" / "execute_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(path.name for path in NOTEBOOKS.glob("*.ipynb")))
def test_committed_outputs_are_those_of_a_fresh_run(run_notebook, name):
    """Each notebook is committed executed, and what its outputs say still holds: the same culprits
    and modules, the same figures within 5% (scripts/execute_notebooks.py rewrites them)."""
    script = _script()
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = code_cells(committed)
    assert all(cell.execution_count for cell in code), f"{name} is committed without its outputs"
    # nothing that changes from run to run without meaning, and no widget state
    assert script.clean(copy.deepcopy(committed)) == committed
    assert not any(WIDGET_MIME in out.get("data", {}) for cell in code for out in cell.outputs)
    found = script.differences(committed, script.clean(run_notebook(name)))
    assert not found, (f"{name} is stale: run python scripts/execute_notebooks.py {name}\n  "
                       + "\n  ".join(found))
