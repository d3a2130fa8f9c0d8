"""The example notebooks run top to bottom in a real kernel (nbclient), each in under a minute,
and show what they promise: the detection, the report (static tree and text: a headless run gets
no widget), the traces and their comparison, the pipeline doctor's verdicts.

A cell that is meant to fail carries the `raises-exception` tag; any other error fails the run.
The notebooks are committed executed: a fresh run must still say what their outputs say.
"""

import copy
import html as html_module
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
    assert not found, (f"{name} is stale: run python scripts/execute_notebooks.py {name} with the "
                       f"packages of constraints.txt{_unlocked()}\n  " + "\n  ".join(found))


def _unlocked() -> str:
    """The installed packages whose version is not the lock's (constraints.txt), as a clause."""
    from importlib.metadata import PackageNotFoundError, version

    off = []
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, _, locked = line.partition("==")
        if line.startswith("#") or not locked:
            continue
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        if installed.split("+")[0] != locked:
            off.append(f"{name} {installed} (locked {locked})")
    return f" (installed here, not the lock's: {', '.join(off)})" if off else ""


# ---- the staleness check itself, on hand-made outputs (no kernel) ------------------------------
# A report's text as 01_quickstart shows it, with what a library decides in {braces}: a frame dump
# whose T5 modules take keyword arguments, the culprit and its hint.
_REPORT = """Detected inf/nan during batch_number=0
Last 21 forward frames:
abs min  abs max  metadata
                  encoder.block.0 T5Block
0.00e+00 3.96e+00 input[0]
             None input[1]
             None input[{kwarg}]
0.00e+00 5.41e+00 output[0]
                  encoder.block.1.layer.0.SelfAttention T5Attention
0.00e+00 3.16e+00 input[0]
             None input[mask]
2.11e-03 2.57e-01 input[position_bias]
             None input[{kwarg}]
1.05e-04 1.80e+00 output[0]
                  {culprit} Linear
5.90e-05 1.08e+01 weight
0.00e+00 {input_max} input[0]
7.96e+00      inf output

{culprit} (Linear) produced a non-finite value in forward (call 0 of batch 0): output holds +inf and -inf
hint: The {op} of {culprit} (Linear) passed float16's largest value 65504; its input reached {reached} and its weight {weight}. Keep this layer in float32.
called from: /home/ci/.venv/lib/python3.11/site-packages/transformers/models/t5/modeling_t5.py:{line}: {code}
"""
# A pipeline check whose collate step failed, as 04_pipeline_doctor shows it: the traceback runs
# through numguard_nb and transformers' collator.
_CHECK = """<div class="ng-doctor">Pipeline check for BertForSequenceClassification: failed at 'collate'
<div>&#10007; collate cannot stack the samples into a batch: input_ids has lengths 10, 12, 13, 15</div>
<details><summary>traceback</summary><pre style='white-space:pre-wrap'>Traceback (most recent call last):
  File &quot;{checkout}/numguard_nb/doctor/run.py&quot;, line {run_line}, in check_collate
    batch = self.settings.collate_fn(pieces)
            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
{library_frames}ValueError: expected sequence of length {length} at dim 1 (got 10)
</pre></details></div>"""
_COLLATOR_FRAMES = {
    "committed": """  File &quot;/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/transformers/data/data_collator.py&quot;, line 89, in default_data_collator
    return torch_default_data_collator(features)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File &quot;/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/transformers/data/data_collator.py&quot;, line 153, in torch_default_data_collator
    batch[k] = torch.tensor([f[k] for f in features])
               ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
""",
    # a newer transformers, elsewhere, under another Python: other lines, names, frames, carets
    "newer": """  File &quot;/work/ci/.venv-ci/lib/python3.13/site-packages/transformers/data/data_collator.py&quot;, line 90, in default_data_collator
    return _torch_collate(features)
  File &quot;/work/ci/.venv-ci/lib/python3.13/site-packages/transformers/data/_collate.py&quot;, line 12, in _torch_collate
    return torch_default_data_collator(features, return_tensors=&quot;pt&quot;)
           ~~~~~~~~~~~~~~~~~~~~~~~~~~~^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File &quot;/work/ci/.venv-ci/lib/python3.13/site-packages/transformers/data/data_collator.py&quot;, line 154, in torch_default_data_collator
    batch[key] = torch.tensor([f[key] for f in features])
""",
}
_COMMITTED = dict(kwarg="past_key_values", culprit="encoder.block.1.layer.1.DenseReluDense.wo", op="matmul",
                  input_max="7.99e+03", reached="7992", weight="10.8", line="122",
                  code="hidden_states = self.wo(hidden_states)", checkout="/work/main", run_line="192",
                  library_frames=_COLLATOR_FRAMES["committed"], length="12")


def _outputs_notebook(**changes) -> nbformat.NotebookNode:
    """A notebook whose cells hold _REPORT (display and error) and _CHECK, with `changes` made."""
    say = {**_COMMITTED, **changes}
    report = _REPORT.format(**say)
    culprit_line = report.split("\n\n")[1].splitlines()[0]
    new = nbformat.v4
    return new.new_notebook(cells=[
        new.new_markdown_cell("# hand-made"),
        new.new_code_cell("%%numguard\nloss = model(**batch).loss", execution_count=1, outputs=[
            new.new_output("display_data", data={"text/plain": report,
                                                 "text/html": f"<pre>{html_module.escape(report)}</pre>"}),
            new.new_output("error", ename="NonFiniteError", evalue=culprit_line, traceback=["..."]),
        ]),
        new.new_code_cell("%numguard_check trainer", execution_count=2, outputs=[
            new.new_output("display_data", data={"text/plain": "Pipeline check: failed at 'collate'",
                                                 "text/html": _CHECK.format(**say)}),
        ]),
    ])


def test_staleness_check_ignores_a_library_s_line_numbers_and_argument_names():
    """A newer transformers (T5's `past_key_values` argument renamed `cache`, the collator's lines
    moved and split in two functions), another checkout, another Python (its carets): what the
    notebook teaches is the same, so the committed outputs are not stale."""
    script = _script()
    newer = _outputs_notebook(kwarg="cache", line="131", checkout="/tmp/ci", run_line="197",
                              library_frames=_COLLATOR_FRAMES["newer"],
                              input_max="8.02e+03", weight="10.6")  # figures within 5%
    assert script.differences(_outputs_notebook(), newer) == []


@pytest.mark.parametrize("change, shown", [
    ({"culprit": "encoder.block.1.layer.1.DenseReluDense.wi_1"}, "DenseReluDense.wi_1"),
    ({"op": "addmm"}, "addmm"),  # the op of the hint
    ({"reached": "9100"}, "7992 -> 9100"),  # a figure beyond 5%
    ({"weight": "12.5"}, "10.8 -> 12.5"),  # also one that ends a sentence
    ({"code": "hidden_states = self.wi(hidden_states)"}, "self.wi(hidden_states)"),  # the culprit's line
    ({"length": "13"}, "12 -> 13"),  # the error at the end of a library's traceback
    ({"kwarg": "0"}, "input[0]"),  # a positional argument is no keyword
])
def test_staleness_check_catches_a_changed_culprit_op_figure_or_error(change, shown):
    script = _script()
    found = script.differences(_outputs_notebook(), _outputs_notebook(**change))
    assert found, change
    assert any(shown in message for message in found), found


def test_staleness_message_shows_the_differing_words_far_into_a_long_text():
    """Not the first 400 characters of both texts (identical there): the words that differ, in
    their context, wherever they are."""
    script = _script()
    rows = "".join(f"                  encoder.block.{n} T5Block\n0.00e+00 {n + 3}.00e+00 output\n"
                   for n in range(300))
    new = nbformat.v4

    def notebook(culprit, figure):
        text = f"Last 300 forward frames:\n{rows}{culprit} (Linear) produced a non-finite value; its input reached {figure}.\n"
        return new.new_notebook(cells=[new.new_code_cell("report", execution_count=1, outputs=[
            new.new_output("stream", name="stdout", text=text)])])

    (found,) = script.differences(notebook("decoder.block.1.wo", 7992), notebook("decoder.block.1.wi", 7992))
    assert "decoder.block.1.wo" in found and "decoder.block.1.wi" in found, found
    assert "produced a non-finite value" in found  # the context after it
    assert len(found) < 2000, found
    (found,) = script.differences(notebook("decoder.block.1.wo", 7992), notebook("decoder.block.1.wo", 9500))
    assert "7992 -> 9500" in found and "its input reached" in found, found
