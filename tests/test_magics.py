"""The IPython layer, driven through an in-process shell: %%numguard, %numguard on/off/status/
compare, the other magics, what is displayed, what lands in the namespace, and that every exit
path leaves no hook and no event handler behind.
"""

import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from numguard_nb import BatchLimitReached, Frame, Guard, NonFiniteError, Report
from numguard_nb import magics as ng_magics
from numguard_nb.compare import Comparison
from numguard_nb.render import widget as ng_widget

# A float16 MLP; batch 4 is a glitched batch whose first Linear overflows 65504.
SETUP = """
import torch
from torch import nn
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
with torch.no_grad():
    net[0].weight.mul_(3)
net.half()
xs = [torch.randn(3, 4) for _ in range(6)]
xs[4] = xs[4] * 3e4
xs = [x.half() for x in xs]

def step(model, x):
    model(x).float().sum().backward()
"""

LOOP = "for x in xs:\n    step(net, x)"
CULPRIT = "0 (Linear) produced a non-finite value in forward (call 0 of batch 4)"


@pytest.fixture
def ip(shell):
    # as in a notebook: every format is computed (a terminal shell keeps only text/plain)
    formatter = shell.display_formatter
    active = list(formatter.active_types)
    formatter.active_types = list(formatter.format_types)
    shell.reset(new_session=False)
    result = shell.run_cell(SETUP)
    assert result.success
    yield shell
    magics = ng_magics._loaded.get(id(shell))
    if magics is not None:
        magics.close()
    if "numguard" not in shell.magics_manager.magics["line"]:
        shell.run_cell("%load_ext numguard_nb")
    formatter.active_types = active


def run(ip, cell):
    with capture_output() as captured:
        result = ip.run_cell(cell)
    return result, captured


def hook_count(module):
    count = 0
    for sub in module.modules():
        count += len(sub._forward_hooks) + len(sub._forward_pre_hooks)
        for param in sub.parameters(recurse=False):
            count += len(param._backward_hooks or {})
    return count


def event_handlers(ip):
    return [
        cb for event in ("pre_run_cell", "post_run_cell") for cb in ip.events.callbacks[event]
        if getattr(cb, "__self__", None).__class__ is ng_magics.NumguardMagics
    ]


def reports_displayed(captured):
    return [out.data for out in captured.outputs if 'class="ng-report' in out.data.get("text/html", "")]


def usage_error_line(captured):
    lines = [line for line in captured.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, captured.stderr
    assert lines[0].startswith("UsageError: ")
    return lines[0]


# ---- %%numguard ----------------------------------------------------------------------------
def test_detection_fails_the_cell_with_one_line_and_displays_the_report(ip):
    result, captured = run(ip, "%%numguard\n" + LOOP)
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError)
    # IPython shows _render_traceback_: the culprit and the batch, no traceback through the hooks
    lines = error._render_traceback_()
    assert len(lines) == 2
    assert lines[0] == f"NonFiniteError: {CULPRIT}: output holds +inf, which its inputs and weights did not hold"
    assert "_numguard" in lines[1]
    assert CULPRIT in captured.stdout
    assert "Traceback" not in captured.stdout and "guard.py" not in captured.stdout
    # the traceback no longer holds the hooks' frames (and with them the activations)
    tb = error.__traceback__
    while tb is not None:
        assert not tb.tb_frame.f_code.co_filename.endswith("guard.py")
        tb = tb.tb_next
    report = ip.user_ns["_numguard"]
    assert report is error.report and report.first_nonfinite.module_name == "0"
    assert report.batch_number == 4
    (bundle,) = reports_displayed(captured)
    assert bundle["text/plain"] == report.to_text()
    assert 'class="ng-node ng-culprit ng-culprit-node' in bundle["text/html"]
    assert ng_widget.WIDGET_MIME not in bundle  # no kernel here: no widget
    assert hook_count(ip.user_ns["net"]) == 0


def test_with_a_kernel_the_widget_is_displayed_with_its_html_fallback(ip, monkeypatch):
    monkeypatch.setattr(ng_widget, "use_widgets", lambda: True)
    result, captured = run(ip, "%%numguard net\n" + LOOP)
    assert isinstance(result.error_in_exec, NonFiniteError)
    (bundle,) = reports_displayed(captured)
    assert set(bundle) == {ng_widget.WIDGET_MIME, "text/html", "text/plain"}
    model_id = bundle[ng_widget.WIDGET_MIME]["model_id"]
    import ipywidgets

    registry = getattr(ipywidgets.widgets.widget, "_instances", None) or ipywidgets.Widget.widgets
    widget = registry[model_id]
    assert {"ng-report", "ng-widget"} <= set(widget._dom_classes)
    tree = widget.children[1]
    root = tree.children[0]
    assert {"ng-node", "ng-root", "ng-culprit", "ng-open"} <= set(root._dom_classes)


def test_a_clean_cell_returns_its_value_and_keeps_the_latest_frames(ip):
    result, captured = run(ip, "%%numguard -o run\nfor x in xs[:3]:\n    step(net, x)\n6 * 7")
    assert result.success and result.result == 42
    assert "numguard: no inf/nan in the last" in captured.stdout and "(batch 2)" in captured.stdout
    report = ip.user_ns["_numguard"]
    assert isinstance(report, Report) and report.ok and report is ip.user_ns["run"]
    assert report.batch_number == 2 and report.frames
    assert reports_displayed(captured) == []
    # -q: nothing printed, the report still stored
    result, captured = run(ip, "%%numguard -q\nstep(net, xs[0])")
    assert result.success and captured.stdout == "" and ip.user_ns["_numguard"].batch_number == 0
    for quiet in ("6 * 7;", "6 * 7;  # as in a plain cell, ';' shows no value"):
        assert run(ip, f"%%numguard -q\nstep(net, xs[0])\n{quiet}")[0].result is None


def test_output_name_and_quiet_on_detection(ip):
    result, captured = run(ip, "%%numguard -q -o bad\n" + LOOP)
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert reports_displayed(captured) == []
    assert ip.user_ns["bad"] is ip.user_ns["_numguard"] is result.error_in_exec.report
    assert "_numguard and bad" in result.error_in_exec._render_traceback_()[1]


def test_a_name_rebound_to_no_model_in_the_cell_is_said_once(ip):
    result, captured = run(ip, "%%numguard net\nnet = 5\nx = 1")
    assert result.success
    assert captured.stdout.count("net is a int, not a torch.nn.Module") == 1, captured.stdout
    assert captured.stdout.splitlines()[-1] == "numguard: no model was guarded at the end of this cell"


def test_a_model_not_called_says_so(ip):
    result, captured = run(ip, "%%numguard net\nx = 1")
    assert result.success
    assert "numguard: net (Sequential) was not called in this cell" in captured.stdout


def test_other_exceptions_propagate_unchanged(ip):
    result, captured = run(ip, "%%numguard\nstep(net, xs[0])\n1 / 0")
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    assert not hasattr(result.error_in_exec, "_render_traceback_")
    assert "ZeroDivisionError" in captured.stdout
    # the traceback points at the cell's own line numbers (line 3: the magic line is line 1)
    assert re.search(r"----> 3 1 / 0", captured.stdout)
    assert hook_count(ip.user_ns["net"]) == 0


@pytest.mark.parametrize("cell, error", [
    ("step(net, xs[0])", None),
    (LOOP, NonFiniteError),
    ("step(net, xs[0])\nraise KeyError('k')", KeyError),
    ("step(net, xs[0])\nraise KeyboardInterrupt", KeyboardInterrupt),
    ("net(xs[0].float())", RuntimeError),  # dtype mismatch raised inside the forward
    ("step(net, xs[0]) +", SyntaxError),
])
def test_every_exit_path_leaves_no_hook(ip, cell, error):
    net = ip.user_ns["net"]
    result, _ = run(ip, "%%numguard --sync --ops\n" + cell)
    if error is None:
        assert result.success
    elif error is SyntaxError:
        assert isinstance(result.error_before_exec or result.error_in_exec, SyntaxError)
    else:
        assert isinstance(result.error_in_exec, error)
    assert hook_count(net) == 0
    assert event_handlers(ip) == []


def test_abort_after_stops_with_one_line_and_traces_are_displayed(ip):
    result, captured = run(ip, "%%numguard --trace 3,4 --abort-after 4 -o run net\n" + LOOP)
    error = result.error_in_exec
    assert isinstance(error, BatchLimitReached)
    assert error._render_traceback_() == [
        "BatchLimitReached: numguard: stopped before batch 5 because "
        "abort_after_batch=4 (batches 0..4 ran)"
    ]
    shown = reports_displayed(captured)
    assert [b["text/plain"].splitlines()[0].strip() for b in shown] == [
        "*** Starting batch number=3 ***", "*** Starting batch number=4 ***",
    ]
    traces = ip.user_ns["_numguard_traces"]
    assert sorted(traces) == [3, 4]
    assert ip.user_ns["_numguard"] is traces[4] is ip.user_ns["run"]
    assert traces[4].first_nonfinite.module_name == "0"  # noted in the trace, not stopped on
    assert hook_count(ip.user_ns["net"]) == 0


def test_compare_points_at_the_first_module_that_differs(ip):
    run(ip, "%%numguard -q --trace 3,4 --abort-after 4 net\n" + LOOP)
    result, captured = run(ip, "%numguard compare _numguard_traces[3] _numguard_traces[4]")
    comparison = result.result
    assert isinstance(comparison, Comparison) and comparison
    assert (comparison.module_name, comparison.role) == ("0", "input[0]")
    assert comparison.ratio > 1000
    assert "first difference > 10x: 0 (Linear) forward call 0, input[0]" in captured.stdout
    ip.user_ns["good"], ip.user_ns["same"] = ip.user_ns["_numguard_traces"][3], ip.user_ns["_numguard_traces"][3]
    result, captured = run(ip, "%numguard compare good same --factor 2")
    assert not result.result and "no module's abs max differs by more than 2x" in captured.stdout
    result, captured = run(ip, "%numguard compare good net")
    assert isinstance(result.error_in_exec, UsageError)
    assert "net is a Sequential, not a numguard Report" in usage_error_line(captured)
    result, captured = run(ip, "%numguard compare _numguard_traces[3] _numguard_traces[2]")
    assert usage_error_line(captured).endswith(
        "batch 2 was not traced; the traced batches are 3, 4 (--trace B,B)")
    result, captured = run(ip, "%numguard compare good net.0")  # (Python reads no `.0`)
    assert "invalid syntax" not in usage_error_line(captured)
    assert usage_error_line(captured).endswith(
        "cannot read net.0: not a name or an expression; give two reports, such as good bad or "
        "_numguard_traces[149] _numguard_traces[150]")


# ---- which models are guarded --------------------------------------------------------------
def test_without_names_top_level_modules_and_trainers_are_guarded(ip):
    ip.run_cell(
        "layer = net[0]\n"  # a submodule of net: watched through net
        "_hidden = nn.Linear(2, 2)\n"  # private names are skipped
        "loss_fn = nn.MSELoss()\n"
        "class FakeTrainer:\n"
        "    def __init__(self, model):\n"
        "        self.model = model\n"
        "    def train(self):\n"
        "        for x in xs:\n"
        "            step(self.model, x)\n"
        "trainer = FakeTrainer(nn.Sequential(nn.Linear(4, 4)))\n"
        "same = FakeTrainer(net)\n"  # stands for net, already found
    )
    result, captured = run(ip, "%numguard on")
    assert result.success
    assert captured.stdout.strip() == (
        "numguard: on, guarding net (Sequential), loss_fn (MSELoss), trainer (Sequential) "
        "from here on, in every cell until %numguard off"
    )
    run(ip, "%numguard off")
    # a Trainer named explicitly stands for its model; names keep their prefixes in the report
    result, _ = run(ip, "%%numguard same\nsame.train()")
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert ip.user_ns["_numguard"].first_nonfinite.module_name == "0"
    result, _ = run(ip, "%%numguard net loss_fn\nfor x in xs:\n    loss_fn(net(x).float(), torch.zeros(3, 2)).backward()")
    assert ip.user_ns["_numguard"].first_nonfinite.module_name == "net.0"


@pytest.mark.parametrize("line, expected", [
    ("%%numguard nosuch\n1", "%%numguard: no variable named 'nosuch' in the namespace; define it first"),
    ("%%numguard nett\n1", "did you mean net?"),
    ("%%numguard xs\n1", "%%numguard: xs is a list, not a torch.nn.Module or a Trainer"),
    ("%%numguard net.nothing\n1", "net (Sequential) has no attribute 'nothing'"),
    ("%%numguard --frames 0\n1", "argument --frames: expected a positive integer, got '0'; see %%numguard?"),
    ("%%numguard --trace 1,x\n1", "argument --trace: expected batch numbers like 1,3 or 149-150"),
    ("%%numguard --limit-dtype int8\n1", "argument --limit-dtype: expected one of float16, bfloat16, "
                                          "float8_e4m3fn, float8_e5m2 (or fp16, bf16, e4m3, e5m2), "
                                          "got 'int8'"),
    ("%%numguard --bogus\n1", "unrecognized arguments: --bogus"),
    ("%%numguard -h\n1", "unrecognized arguments: -h"),
    ("%%numguard -o 1x\n1", "'1x' is not a Python variable name"),
    # -o never writes over the user's own data or model, nor Python's or IPython's names
    ("%%numguard -o net\n1", "%%numguard: -o net: net holds a Sequential of yours: pick a free name"),
    ("%numguard on -o xs", "%numguard on: -o xs: xs holds a list of yours"),
    ("%%numguard -o get_ipython\n1", "-o get_ipython: that name is Python's or IPython's own"),
    ("%%numguard -o len\n1", "-o len: that name is Python's or IPython's own"),
    ("%%numguard -o _numguard_history\n1", "-o _numguard_history: names starting _numguard_ are numguard's own"),
    ("%%numguard\nawait asyncio.sleep(0)", "%%numguard: a top-level await runs only in a plain cell"),
    ("%numguard on a+b", "%numguard on: 'a+b' is not a variable name"),
    # a near name is the user's, never the shell's own (its `open`)
    ("%numguard_check net xs --loss opn", "no variable named 'opn' in the namespace; define it first"),
    ("%%numguard 'net\n1", "No closing quotation"),
    ("%%numguard on\n1", "use the line magic %numguard on (one %)"),
    ("%numguard", "%numguard needs on, off, status or compare"),
    ("%numguard net", "unknown command 'net'"),
    ("%numguard off net", "%numguard off takes no names"),
    ("%numguard status net", "%numguard status takes no names"),
    # each form takes only its own options
    ("%numguard on --factor 3", "%numguard on: unrecognized arguments: --factor; see %numguard?"),
    ("%numguard off --frames 2", "%numguard off: unrecognized arguments: --frames; see %numguard?"),
    ("%numguard status -q", "%numguard status: unrecognized arguments: -q"),
    ("%numguard compare a b --trace 1", "%numguard compare: unrecognized arguments: --trace"),
    ("%%numguard --factor 3\n1", "%%numguard: unrecognized arguments: --factor; see %%numguard?"),
    ("%numguard --frames 2 on", "unknown command '--frames'"),
    ("%numguard compare _numguard", "%numguard compare needs two reports"),
    ("%numguard compare a+b c", "'a+b' is not a variable name"),
    ("%numguard_dist --nproc 0", "argument --nproc: expected a positive integer"),
    ("%numguard_check net", "check_pipeline(model, data) needs the training data"),
    ("%numguard_check", "the following arguments are required: NAME"),
    ("%numguard_replay", "%numguard_replay needs the bundle's path: %numguard_replay PATH"),
])
def test_bad_arguments_are_one_line_usage_errors(ip, line, expected):
    result, captured = run(ip, line)
    assert isinstance(result.error_in_exec, UsageError)
    assert expected in usage_error_line(captured)
    assert hook_count(ip.user_ns["net"]) == 0 and event_handlers(ip) == []


def test_the_hint_s_code_names_the_guarded_model_by_its_name_in_the_notebook(ip):
    ip.run_cell(
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(10, 10))\n"  # another model, whose [2] a fix must not touch
        "half = nn.Sequential(nn.Linear(10, 256), nn.ReLU(), nn.Linear(256, 10)).half()\n"
        "with torch.no_grad():\n"
        "    for p in half.parameters():\n"
        "        p.mul_(40)\n"
        "X = torch.randn(256, 10) * 60\n")
    result, captured = run(ip, "%%numguard half\nhalf(X.half()).float().pow(2).mean().backward()")
    hint = result.error_in_exec.report.hint
    assert "Keep `half[2]` in float32" in hint and "`half[2].float()`" in hint and "model[" not in hint


def test_a_cell_that_makes_no_model_runs_and_says_nothing_was_guarded(ip):
    ip.reset(new_session=False)
    result, captured = run(ip, "%%numguard\nx = 1")
    assert result.success and ip.user_ns["x"] == 1
    assert captured.stdout.strip() == (
        "numguard: nothing was guarded: the cell made a model in its last statement or not at all "
        "(a model is guarded from the statement after the one that makes it)")
    # a model the notebook keeps only inside a dict or an object: which name reaches it
    ip.run_cell("from torch import nn\nclass Experiment: pass\nexp = Experiment()\nexp.model = nn.Linear(2, 2)")
    result, captured = run(ip, "%%numguard\nx = 2")
    assert result.success and captured.stdout.strip() == (
        "numguard: nothing was guarded: no model stands under a name of its own, and exp.model "
        "holds one: name it: %%numguard exp.model")
    ip.run_cell("del exp\nmodels = {'a': nn.Linear(2, 2)}")
    result, captured = run(ip, "%numguard on")
    assert captured.stdout.startswith(
        "numguard: no model stands under a name of its own, and models['a'] holds one: give it a "
        "name of its own (net = models['a']) and guard that\n")
    ip.run_line_magic("numguard", "off")


BUILD_AND_TRAIN = (
    "import torch\n"
    "from torch import nn\n"
    "torch.manual_seed(0)\n"
    "{name} = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))\n"
    "x = torch.randn(8, 4)\n"
    "loss = torch.log({name}(x) - 100).mean()\n"
    "loss.backward()\n"
)


@pytest.mark.parametrize("namespace, line", [
    ("empty", ""), ("another model in it", ""), ("empty", "made"), ("another model in it", "made"),
])
def test_a_cell_that_makes_its_model_is_guarded_from_the_next_statement(ip, namespace, line):
    """Build and train in one cell (a Colab habit): the model the cell makes is guarded from
    the statement after, whether or not the namespace held a model before, named or not."""
    if namespace == "empty":
        ip.reset(new_session=False)
    result, captured = run(ip, f"%%numguard {line}\n" + BUILD_AND_TRAIN.format(name="made"))
    assert isinstance(result.error_in_exec, NonFiniteError)
    report = ip.user_ns["_numguard"]
    assert report.first_nonfinite.op == "aten.log.default" and report.batch_number == 0
    assert any(frame.module_name.endswith("0") and frame.module_class == "Linear"
               for frame in report.frames)
    said = "guarding made (Sequential) from here on" if namespace == "empty" or line else \
        "made is a new Sequential: guarding it"
    assert f"numguard: {said}" in captured.stdout
    assert hook_count(ip.user_ns["made"]) == 0 and event_handlers(ip) == []


def test_a_name_the_cell_does_not_make_is_still_refused_with_a_suggestion(ip):
    result, captured = run(ip, "%%numguard nett\nmade = 1")
    assert isinstance(result.error_in_exec, UsageError) and "did you mean net?" in usage_error_line(captured)
    assert "made" not in ip.user_ns  # refused before the cell ran


def test_options_reach_the_guard(ip, monkeypatch):
    from numguard_nb import session

    seen = {}
    original = session.Guard  # the session builds the guard of a run

    def spy(models, **kwargs):
        seen.update(kwargs, models=models)
        return original(models, **kwargs)

    monkeypatch.setattr(session, "Guard", spy)
    result, _ = run(ip, "%%numguard net --frames 5 --trace 1-2,7 --abort-after 9 --no-backward --sync "
                        "--ops --limit-dtype bfloat16 --no-capture --allow-inf '*.attn*' 'x?'\nstep(net, xs[0])")
    assert result.success
    assert seen["models"] is ip.user_ns["net"]
    assert {k: seen[k] for k in ("max_frames", "trace_batches", "abort_after_batch", "backward", "sync",
                                 "ops", "limit_dtype", "capture", "allow_inf")} == {
        "max_frames": 5, "trace_batches": frozenset({1, 2, 7}), "abort_after_batch": 9, "backward": False,
        "sync": True, "ops": True, "limit_dtype": torch.bfloat16, "capture": False,
        "allow_inf": ("*.attn*", "x?"),
    }
    run(ip, "%%numguard net --allow-inf\nstep(net, xs[0])")
    assert seen["allow_inf"] is True and seen["capture"] is False  # CPU model: no capture by default
    run(ip, "%%numguard net --trace 1 --trace 3,1\nstep(net, xs[0])")  # given twice: both kept
    assert seen["trace_batches"] == frozenset({1, 3})
    ip.run_cell("loss = nn.MSELoss()")
    run(ip, "%%numguard net loss\nstep(net, xs[0])")
    assert list(seen["models"]) == ["net", "loss"]


def test_stop_at_limit_stops_at_a_predicted_overflow_in_a_float32_run(ip):
    ip.run_cell("net.float()\nxs32 = [x.float() for x in xs]")
    result, _ = run(ip, "%%numguard net\nfor x in xs32:\n    step(net, x)")
    assert result.success
    result, _ = run(ip, "%%numguard net --limit-dtype float16 --stop-at-limit\n"
                        "for x in xs32:\n    step(net, x)")
    assert isinstance(result.error_in_exec, NonFiniteError)
    report = ip.user_ns["_numguard"]
    assert report.limit_dtype == "float16" and report.batch_number == 4
    assert any(row.predicted_overflow for row in report.first_nonfinite.flagged_rows)


def headroom_views(captured):
    return [out.data for out in captured.outputs if 'class="ng-headroom"' in out.data.get("text/html", "")]


def test_limit_dtype_runs_the_cell_to_the_end_and_shows_the_headroom(ip):
    ip.run_cell("net.float()\nxs32 = [x.float() for x in xs]")
    result, captured = run(ip, "%%numguard net --limit-dtype float16\nfor x in xs32:\n    step(net, x)")
    assert result.success and reports_displayed(captured) == []
    (view,) = headroom_views(captured)
    assert view["text/plain"].startswith("in float16, 2 values would overflow (beyond its largest value 65504)")
    assert "first overflow: 0 (Linear) forward output in batch 4" in view["text/plain"]
    assert [(e.module_name, e.phase, e.role, e.batch_number) for e in ip.user_ns["_numguard_headroom"]] == [
        ("2", "backward", "weight.grad", 4), ("0", "forward", "output", 4)]
    _, captured = run(ip, "%%numguard net --limit-dtype bfloat16\nfor x in xs32:\n    step(net, x)")
    (view,) = headroom_views(captured)
    assert "every value fits" in view["text/plain"]
    _, captured = run(ip, "%%numguard net\nfor x in xs32:\n    step(net, x)")
    assert headroom_views(captured) == []  # no limit_dtype: no headroom


def test_on_with_limit_dtype_shows_the_headroom_after_each_cell_that_ran_and_status_counts(ip):
    ip.run_cell("net.float()\nxs32 = [x.float() for x in xs]")
    run(ip, "%numguard on net --limit-dtype float16")
    _, captured = run(ip, "for x in xs32[:3]:\n    step(net, x)")
    (view,) = headroom_views(captured)
    assert "every value fits" in view["text/plain"]
    _, captured = run(ip, "y = 1")  # no batch ran: nothing new to show
    assert headroom_views(captured) == []
    _, captured = run(ip, "for x in xs32[3:]:\n    step(net, x)")
    (view,) = headroom_views(captured)
    assert "2 values would overflow" in view["text/plain"]
    _, captured = run(ip, "%numguard status")
    assert captured.stdout.strip().endswith(
        "; in float16, 2 predicted overflow(s) and 0 underflow(s) in _numguard_headroom")


def test_limit_dtype_takes_float8_names_and_rejects_others(ip):
    ip.run_cell("net.float()")
    result, captured = run(ip, "%%numguard net --limit-dtype float8_e4m3fn\nstep(net, xs[0].float())")
    assert result.success and "in float8_e4m3fn" in headroom_views(captured)[0]["text/plain"]
    result, captured = run(ip, "%%numguard net --limit-dtype fp8\n1")
    assert "got 'fp8'" in usage_error_line(captured)
    result, captured = run(ip, "%%numguard net --limit-dtype E4M3\nstep(net, xs[0].float())")
    assert result.success and "in float8_e4m3fn" in headroom_views(captured)[0]["text/plain"]
    assert "--stop-at-limit" in ip.find_cell_magic("numguard").__doc__


def test_without_names_batches_are_counted_by_the_first_model_called(ip):
    # a loss module and an old model defined before the model trained (the namespace's order)
    ip.reset(new_session=False)
    assert ip.run_cell("import torch\nfrom torch import nn\nold = nn.Linear(3, 3)\n"
                       "crit = nn.MSELoss()\n" + SETUP).success
    cell = ("for x in xs[:4]:\n"
            "    crit(net(x).float(), torch.zeros(3, 2)).backward()")
    result, captured = run(ip, "%%numguard --trace 2\n" + cell)
    assert result.success, result.error_in_exec
    assert list(ip.user_ns["_numguard_traces"]) == [2]
    assert {frame.batch_number for frame in ip.user_ns["_numguard_traces"][2].frames} == {2}
    result, _ = run(ip, "%%numguard\n" + cell.replace("xs[:4]", "xs"))
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert result.error_in_exec.report.batch_number == 4  # the glitched batch
    # named, the first name counts (as with Guard({...}))
    result, _ = run(ip, "%%numguard net crit\n" + cell)
    assert result.success and ip.user_ns["_numguard"].batch_number == 3


def test_a_nan_the_cell_s_own_code_makes_fails_the_cell_as_a_with_block_does(ip):
    # no backward follows: the loss watch's culprit is raised when the cell ends
    cell = "loss = torch.log(net(xs[0]).float() - 100).mean()"
    result, captured = run(ip, "%%numguard\n" + cell)
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError), error
    assert error.report.cause == "outside" and error.report is ip.user_ns["_numguard"]
    assert len(reports_displayed(captured)) == 1
    assert hook_count(ip.user_ns["net"]) == 0
    # the same cell under %numguard on: reported, and the cell failed, when it goes off at the
    # latest (quiet: the one-line error alone)
    for quiet in ("", " -q"):
        run(ip, "%numguard on net" + quiet)
        result, captured = run(ip, cell)
        assert result.success
        result, captured = run(ip, "%numguard off")
        assert len(reports_displayed(captured)) == (0 if quiet else 1)
        assert isinstance(result.error_in_exec, NonFiniteError), result.error_in_exec
        assert result.error_in_exec.report is ip.user_ns["_numguard"]
        assert ip.user_ns["_numguard"].cause == "outside"
        assert "numguard: off (guarded net (Sequential) up to batch 0)" in captured.stdout
        assert hook_count(ip.user_ns["net"]) == 0


def test_numguard_off_does_not_raise_what_an_earlier_detach_found(ip, deferred_on_host):
    # A sentinel's check still unread (a GPU's) when the session guard detached to follow a
    # rebuilt model: shown then or not, it is not the error of the cells that ran since.
    run(ip, "%numguard on net --sentinel")
    run(ip, "_ = net(torch.full((2, 4), float('nan')).half())")  # no backward: unread after it
    run(ip, "net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).half()")
    result, _ = run(ip, "for x in xs[:2]:\n    step(net, x)")
    assert result.success
    result, captured = run(ip, "%numguard off")
    assert result.success, result.error_in_exec
    assert "numguard: off (guarded net (Sequential)" in captured.stdout


def test_a_sentinel_cell_whose_batches_all_ran_with_the_full_hooks_says_what_it_saw(ip):
    result, captured = run(ip, "%%numguard --sentinel --history-every 1\nfor x in xs[:3]:\n    step(net, x)")
    assert result.success
    assert "was not called" not in captured.stdout
    assert "numguard: no inf/nan in the last" in captured.stdout
    assert "3 batches watched with the full hooks" in captured.stdout


# ---- %numguard on / off / status -----------------------------------------------------------
def test_on_takes_a_comment_and_names_a_near_miss_it_waits_for(ip):
    result, captured = run(ip, "%numguard on net  # the training loop")
    assert result.success
    assert captured.stdout.strip() == "numguard: on, guarding net (Sequential) from here on, in every cell until %numguard off"
    run(ip, "%numguard off")
    result, captured = run(ip, "%numguard on nett")
    assert result.success
    assert captured.stdout.splitlines()[0] == "numguard: no variable named 'nett' yet; did you mean net?"
    run(ip, "%numguard off")

def test_on_guards_a_loop_split_across_cells_until_off(ip):
    net = ip.user_ns["net"]
    result, captured = run(ip, "%numguard on net")
    assert result.success and len(event_handlers(ip)) == 2
    assert captured.stdout.strip() == "numguard: on, guarding net (Sequential) from here on, in every cell until %numguard off"
    result, captured = run(ip, "for x in xs[:3]:\n    step(net, x)")
    assert result.success and reports_displayed(captured) == []
    _, captured = run(ip, "%numguard status")
    assert captured.stdout.strip() == "numguard: on, guarding net (Sequential), at batch 2"
    # batches keep counting across cells: the glitch is batch 4, the second of this cell
    result, captured = run(ip, "for x in xs[3:]:\n    step(net, x)")
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError) and error.report.batch_number == 4
    assert error._render_traceback_()[0].endswith(
        f"{CULPRIT}: output holds +inf, which its inputs and weights did not hold")
    assert "Traceback" not in captured.stdout
    (bundle,) = reports_displayed(captured)
    assert ip.user_ns["_numguard"] is error.report
    assert error.__traceback__ is None  # dropped: it held the activations
    _, captured = run(ip, "%numguard status")
    assert "a detection is in _numguard" in captured.stdout
    result, captured = run(ip, "%numguard off")
    assert captured.stdout.strip() == "numguard: off (guarded net (Sequential) up to batch 4)"
    assert event_handlers(ip) == [] and hook_count(net) == 0
    result, captured = run(ip, LOOP)
    assert result.success  # no longer guarded
    _, captured = run(ip, "%numguard status")
    assert captured.stdout.startswith("numguard: off")
    _, captured = run(ip, "%numguard off")
    assert captured.stdout.strip() == "numguard: already off"


def test_on_keeps_guarding_when_the_capture_stops_fitting_in_memory(ip, monkeypatch):
    from numguard_nb import _util

    result, _ = run(ip, "%numguard on --capture net")
    assert result.success
    monkeypatch.setattr(_util, "host_memory_available", lambda: 100)  # net takes 116 bytes
    assert run(ip, "net = nn.Sequential(*net)")[0].success  # hooked anew from the next cell
    net = ip.user_ns["net"]
    result, captured = run(ip, "for x in xs:\n    step(net, x)")
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError) and error.report.batch_number == 4
    assert captured.stdout.startswith(
        "numguard: no CPU replay after a CUDA error from now on: capture refused: the weights'")
    run(ip, "%numguard off")
    assert hook_count(net) == 0 and event_handlers(ip) == []


def test_on_recovers_from_an_interrupted_pass(ip):
    ip.run_cell(
        "class Flaky(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.inner = net\n"
        "        self.fail = False\n"
        "    def forward(self, x):\n"
        "        h = self.inner(x)\n"
        "        if self.fail:\n"
        "            raise KeyboardInterrupt\n"
        "        return h\n"
        "flaky = Flaky()"
    )
    run(ip, "%numguard on -q flaky")
    result, _ = run(ip, "flaky.fail = True\nstep(flaky, xs[0])")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    result, _ = run(ip, "flaky.fail = False\nfor x in xs[1:]:\n    step(flaky, x)")
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError)
    culprit = error.report.first_nonfinite
    assert (culprit.module_name, culprit.call_index, error.report.batch_number) == ("inner.0", 0, 4)
    run(ip, "%numguard off")
    assert hook_count(ip.user_ns["flaky"]) == 0


def test_on_steps_aside_for_a_numguard_cell(ip):
    run(ip, "%numguard on net")
    result, captured = run(ip, "%%numguard net --frames 3\n" + LOOP)
    assert isinstance(result.error_in_exec, NonFiniteError)
    (bundle,) = reports_displayed(captured)  # one guard, one report
    assert len(ip.user_ns["_numguard"].frames) == 3
    _, captured = run(ip, "%numguard status")
    assert captured.stdout.startswith("numguard: on") and "detection" not in captured.stdout
    run(ip, "%numguard off")
    assert hook_count(ip.user_ns["net"]) == 0


def test_on_with_traces_displays_each_traced_batch_once_per_cell(ip):
    run(ip, "%numguard on net --trace 1,3")
    _, captured = run(ip, "for x in xs[:2]:\n    step(net, x)")
    assert [b["text/plain"].split("***")[1].strip() for b in reports_displayed(captured)] == ["Starting batch number=1"]
    _, captured = run(ip, "for x in xs[2:4]:\n    step(net, x)")
    assert [b["text/plain"].split("***")[1].strip() for b in reports_displayed(captured)] == ["Starting batch number=3"]
    assert sorted(ip.user_ns["_numguard_traces"]) == [1, 3]
    run(ip, "%numguard off")


REBUILD = """
def rebuild():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.mul_(3)
    return model.half()
"""


def test_on_follows_a_model_rebuilt_in_a_later_cell(ip):
    ip.run_cell(REBUILD)
    old = ip.user_ns["net"]
    run(ip, "%numguard on net")
    run(ip, "for x in xs[:2]:\n    step(net, x)")
    result, captured = run(ip, "net = rebuild()")
    assert result.success
    assert captured.stdout.splitlines()[0] == "numguard: net is a new Sequential: guarding it"
    assert hook_count(old) == 0
    result, captured = run(ip, LOOP)
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError)  # the new model is guarded; batches go on counting
    assert (error.report.first_nonfinite.module_name, error.report.batch_number) == ("0", 2 + 4)
    (bundle,) = reports_displayed(captured)
    assert hook_count(ip.user_ns["net"]) > 0
    _, captured = run(ip, "%numguard status")
    assert captured.stdout.strip() == "numguard: on, guarding net (Sequential), at batch 6; a detection is in _numguard"
    run(ip, "%numguard off")
    assert hook_count(ip.user_ns["net"]) == 0


def test_on_names_a_submodule_replaced_in_a_later_cell(ip):
    ip.run_cell("class Overflow(nn.Module):\n    def forward(self, x):\n        return x * 1e5")
    run(ip, "%numguard on net")
    run(ip, "step(net, xs[0])")
    result, captured = run(ip, "net[1] = Overflow()")
    assert captured.stdout.splitlines()[0] == "numguard: net has new modules or parameters: guarding them"
    result, _ = run(ip, "step(net, xs[2])")
    culprit = result.error_in_exec.report.first_nonfinite
    assert (culprit.module_name, culprit.module_class) == ("1", "Overflow")
    run(ip, "%numguard off")
    assert hook_count(ip.user_ns["net"]) == 0


def test_a_numguard_cell_that_rebuilds_the_model_guards_the_new_one(ip):
    ip.run_cell(REBUILD + "ran = []")
    old = ip.user_ns["net"]
    result, captured = run(ip, "%%numguard net\nran.append(1)\nnet = rebuild()\n" + LOOP)
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError)
    assert (error.report.first_nonfinite.module_name, error.report.batch_number) == ("0", 4)
    assert captured.stdout.startswith("numguard: net is a new Sequential: guarding it\n")
    assert ip.user_ns["ran"] == [1]  # each statement ran once
    assert hook_count(old) == 0 and hook_count(ip.user_ns["net"]) == 0
    # the last expression, whose value the cell returns, runs on the model of the statement before
    result, captured = run(ip, "%%numguard -q net\nnet = rebuild()\nnet(xs[4]).float().sum().item()")
    assert isinstance(result.error_in_exec, NonFiniteError) and "guarding it" not in captured.stdout
    result, _ = run(ip, "%%numguard net\nnet = rebuild()\nnet(xs[0]).shape[-1]")
    assert result.success and result.result == 2


def test_unload_removes_hooks_handlers_and_magics(shell):
    shell.reset(new_session=False)
    shell.run_cell(SETUP)
    run(shell, "%numguard on net")
    assert len(event_handlers(shell)) == 2
    shell.run_cell("step(net, xs[0])")
    result, _ = run(shell, "%unload_ext numguard_nb")
    assert result.success
    assert event_handlers(shell) == [] and hook_count(shell.user_ns["net"]) == 0
    for kind, names in (("line", ["numguard", "numguard_dist", "numguard_check", "numguard_replay"]),
                        ("cell", ["numguard"])):
        for name in names:
            assert name not in shell.magics_manager.magics[kind]
    result, captured = run(shell, "%numguard status")
    assert isinstance(result.error_in_exec, UsageError)
    result, _ = run(shell, "%load_ext numguard_nb")
    _, captured = run(shell, "%numguard status")
    assert captured.stdout.startswith("numguard: off")


def test_magics_document_their_options(ip):
    line_doc = ip.find_line_magic("numguard").__doc__
    cell_doc = ip.find_cell_magic("numguard").__doc__
    for doc in (line_doc, cell_doc):
        for option in ("--frames", "--trace", "--abort-after", "--no-backward", "--sync", "--allow-inf",
                       "--ops", "--limit-dtype", "--capture", "--no-capture", "-q", "-o NAME", "compare"):
            assert option in doc
    _, captured = run(ip, "%numguard?")
    assert "%numguard on [options] [MODEL ...]" in captured.stdout
    for name, option in (("numguard_dist", "--nproc"), ("numguard_check", "DATA"), ("numguard_replay", "PATH")):
        assert option in ip.find_line_magic(name).__doc__


# ---- the other magics ----------------------------------------------------------------------
def test_dist_magic_shows_distcheck_table(ip, monkeypatch):
    from numguard_nb import distcheck

    calls = []

    def fake_run(**kwargs):
        calls.append(kwargs)
        table = pd.DataFrame([{"rank": 0, "ok": True, "error": None}])
        table.attrs["summary"] = "distcheck OK: 1/1 ranks (gloo)"
        return table

    monkeypatch.setattr(distcheck, "run", fake_run)
    result, captured = run(ip, "%numguard_dist --nproc 3 --backend gloo --timeout 5 --size 2")
    assert result.success
    assert calls == [{"nproc": 3, "backend": "gloo", "timeout": 5.0, "size_mb": 2.0}]
    assert captured.stdout.startswith("distcheck OK: 1/1 ranks (gloo)")
    assert ip.user_ns["_numguard_dist"]["rank"].tolist() == [0]
    assert any("text/html" in out.data for out in captured.outputs)
    monkeypatch.setattr(distcheck, "run", lambda **kw: (_ for _ in ()).throw(ValueError("bad backend\nmore")))
    result, captured = run(ip, "%numguard_dist")
    assert usage_error_line(captured) == "UsageError: %numguard_dist: bad backend"


def test_dist_magic_turns_distcheck_argument_errors_into_usage_errors(ip):
    backend = "gloo" if torch.cuda.is_available() else "nccl"
    if backend == "nccl":
        result, captured = run(ip, "%numguard_dist --nproc 1 --backend nccl")
        assert "backend 'nccl' needs CUDA" in usage_error_line(captured)
    else:
        result, captured = run(ip, f"%numguard_dist --nproc {torch.cuda.device_count() + 1} --backend nccl")
        assert "GPU(s) are visible" in usage_error_line(captured)


def test_check_magic_runs_the_pipeline_check(ip):
    ip.run_cell(
        "model32 = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))\n"
        "data = [(torch.randn(4), torch.randn(1)) for _ in range(8)]\n"
    )
    result, captured = run(ip, "%numguard_check model32 data")
    assert result.success  # the check's failure is its report, not an error of the magic
    report = ip.user_ns["_numguard_check"]
    assert type(report).__name__ == "PipelineReport" and report.failed_step.name == "data"
    assert [out.data["text/plain"] for out in captured.outputs] == [report.to_text()]
    assert "no loss_fn" in captured.outputs[0].data["text/html"]
    assert "--loss criterion" in captured.outputs[0].data["text/plain"]  # the fix in the magic's words too
    result, captured = run(ip, "%numguard_check model32 data --loss nn.functional.mse_loss")
    assert result.success and ip.user_ns["_numguard_check"].ok
    assert "all 7 steps passed" in captured.outputs[0].data["text/plain"]


def _embedding_and_a_gpu_step(ip, tmp_path, monkeypatch) -> None:
    """`emb`, `ids` past its vocabulary, and `gpu_step`, which reports the IndexError as a GPU
    would: late, as a CUDA error at the wrong line. Bundles are written in `tmp_path`."""
    monkeypatch.chdir(tmp_path)  # the bundle is written next to the notebook
    ip.run_cell(
        "emb = nn.Embedding(10, 4)\n"
        "ids = torch.tensor([[1, 2, 12]])\n"  # 12 is past the vocabulary
        "def gpu_step(model, ids):\n"
        "    try:\n"
        "        return model(ids)\n"
        "    except IndexError:\n"
        "        raise RuntimeError('CUDA error: device-side assert triggered') from None\n"
    )


def test_a_device_error_is_replayed_on_cpu_and_its_bundle_replays(ip, tmp_path, monkeypatch):
    _embedding_and_a_gpu_step(ip, tmp_path, monkeypatch)
    result, captured = run(ip, "%%numguard --capture emb\ngpu_step(emb, ids)")
    error = result.error_in_exec
    assert isinstance(error, RuntimeError) and str(error) == "CUDA error: device-side assert triggered"
    outcome = ip.user_ns["_numguard_replay"]
    assert isinstance(outcome.result.exception, IndexError)  # on CPU: raised at once, at the real line
    assert [out.data["text/plain"] for out in captured.outputs] == [repr(outcome)]
    assert "text/html" in captured.outputs[0].data
    bundle = Path(outcome.path)
    assert bundle.parent == tmp_path and bundle.exists()
    assert hook_count(ip.user_ns["emb"]) == 0
    # later, in a fresh session: the model built again, the bundle replayed
    ip.run_cell("fresh = nn.Embedding(10, 4)")
    result, captured = run(ip, f"%numguard_replay {bundle.name} fresh")
    assert result.success
    replayed = ip.user_ns["_numguard_replay"]
    assert isinstance(replayed.exception, IndexError)
    assert [out.data["text/plain"] for out in captured.outputs] == [repr(replayed)]
    result, captured = run(ip, "%numguard_replay missing.pt fresh")
    assert "%numguard_replay: no replay bundle at missing.pt" in usage_error_line(captured)


def test_under_numguard_on_a_device_error_is_replayed_on_cpu_too(ip, tmp_path, monkeypatch):
    _embedding_and_a_gpu_step(ip, tmp_path, monkeypatch)
    try:
        assert run(ip, "%numguard on --capture -q emb")[0].success
        result, captured = run(ip, "gpu_step(emb, ids)")
        assert isinstance(result.error_in_exec, RuntimeError)
        outcome = ip.user_ns["_numguard_replay"]  # as a %%numguard --capture cell gives
        assert isinstance(outcome.result.exception, IndexError)
        assert repr(outcome) in [out.data["text/plain"] for out in captured.outputs]
        assert Path(outcome.path).parent == tmp_path and Path(outcome.path).exists()
        # a %%numguard --capture cell meanwhile replays its own call, once: the session's
        # guard stepped aside for it
        ip.run_cell("emb(torch.tensor([[1, 2, 3]]))")
        result, captured = run(ip, "%%numguard --capture -q emb\ngpu_step(emb, ids)")
        replays = [out for out in captured.outputs if "replayed" in out.data["text/plain"]]
        assert len(replays) == 1 and repr(ip.user_ns["_numguard_replay"]) == replays[0].data["text/plain"]
        assert isinstance(ip.user_ns["_numguard_replay"].result.exception, IndexError)
    finally:
        ip.run_line_magic("numguard", "off")


def test_replay_magic_without_names_finds_the_model_by_its_class_and_errs_in_one_line(ip, tmp_path):
    emb = nn.Embedding(10, 4)
    with pytest.raises(IndexError), Guard(emb, capture=True) as guard:
        emb(torch.tensor([[1, 12]]))  # 12 is past the vocabulary
    path = guard.capture.save(tmp_path / "bundle.pt")
    # a fresh notebook: the model and, as usual, a loss (and the fixture's own models)
    ip.run_cell("fresh = nn.Embedding(10, 4)\nloss_fn = nn.CrossEntropyLoss()")
    result, captured = run(ip, f"%numguard_replay {path}")
    assert result.success and isinstance(ip.user_ns["_numguard_replay"].exception, IndexError)
    ip.run_cell("other = nn.Embedding(10, 4)")  # two of the class: which one is not guessed
    result, captured = run(ip, f"%numguard_replay {path}")
    assert usage_error_line(captured).endswith("(or name the model: %numguard_replay PATH MODEL)")
    ip.run_cell("import threading\nother.lock = threading.Lock()")  # cannot be copied to replay
    result, captured = run(ip, f"%numguard_replay {path} other")
    assert "could not rebuild" in usage_error_line(captured)


def test_without_capture_a_device_error_just_propagates(ip):
    ip.run_cell("def boom(x):\n    net(x)\n    raise RuntimeError('CUDA error: an illegal memory access')")
    result, captured = run(ip, "%%numguard net\nboom(xs[0])")
    assert isinstance(result.error_in_exec, RuntimeError)
    assert "_numguard_replay" not in ip.user_ns and captured.outputs == []


def test_short_traceback_is_the_exception_and_its_summary_red_as_ipython_s_own(ip):
    culprit = Frame("x", "Linear", "forward", 3, 0, [])
    report = Report(frames=[culprit], first_nonfinite=culprit, batch_number=3,
                    reason="x (Linear) produced a non-finite value")
    error = NonFiniteError(report)
    colours = ip.colors
    try:
        ip.run_line_magic("colors", "nocolor")  # logs, a terminal without colours: no escapes
        assert ng_magics.short_traceback(error) == [
            "NonFiniteError: x (Linear) produced a non-finite value"]
        plain = ng_magics._make_short(RuntimeError("boom"), "hint")
        assert plain._render_traceback_() == ["RuntimeError: boom", "hint"]
        assert error._render_traceback_()[0].startswith("NonFiniteError: x (Linear)")
        ip.run_line_magic("colors", "neutral")
        assert ng_magics.short_traceback(error)[0].startswith("\x1b[0;31mNonFiniteError\x1b[0m: x")
        assert error._render_traceback_()[0].startswith("\x1b[0;31mNonFiniteError\x1b[0m: x")
    finally:
        ip.run_line_magic("colors", colours)


def test_capture_that_would_not_fit_in_host_memory_is_a_usage_error(ip, monkeypatch):
    from numguard_nb import _util

    monkeypatch.setattr(_util, "host_memory_available", lambda: 100)  # net takes 116 bytes
    result, captured = run(ip, "%%numguard --capture net\nstep(net, xs[0])")
    line = usage_error_line(captured)
    assert "--capture refused: the weights' host copy (116 B) would take more than half of the 100 B" in line
    assert "net" in ip.user_ns and hook_count(ip.user_ns["net"]) == 0


@pytest.mark.parametrize("names", ["", " model"])
def test_numguard_on_before_the_model_exists_guards_it_once_it_does(ip, names):
    ip.reset(new_session=False)
    result, armed = run(ip, f"%numguard on{names}")
    assert result.success
    waiting = "model" if names else "a model"
    assert armed.stdout.strip() == ("numguard: on; no model yet: guarding starts with the first cell run "
                                    f"after {waiting} exists (the cell that creates it is not guarded)")
    assert run(ip, "%numguard status")[1].stdout.startswith(f"numguard: on, waiting for {waiting}")
    assert run(ip, "y = 1")[1].stdout == ""  # nothing said again while it waits
    assert run(ip, SETUP.replace("net", "model"))[0].success
    result, started = run(ip, "model(xs[0]).float().sum().backward()")
    assert result.success and hook_count(ip.user_ns["model"]) > 0
    assert started.stdout.splitlines()[0] == ("numguard: guarding model (Sequential) from this cell on, "
                                              "until %numguard off")
    result, caught = run(ip, LOOP.replace("net", "model"))
    assert isinstance(result.error_in_exec, NonFiniteError) and len(reports_displayed(caught)) == 1
    assert "numguard: off (guarded model" in run(ip, "%numguard off")[1].stdout
    assert hook_count(ip.user_ns["model"]) == 0 and event_handlers(ip) == []


def test_an_armed_numguard_on_refuses_bad_options_at_once_and_turns_off_cleanly(ip):
    ip.reset(new_session=False)
    result, captured = run(ip, "%numguard on --stop-at-limit")  # refused by the options' check
    assert "--stop-at-limit needs --limit-dtype" in usage_error_line(captured)
    result, captured = run(ip, "%numguard on --sentinel --limit-dtype float16")
    assert "--limit-dtype is measured by the full hooks, which --sentinel does not run" in (
        usage_error_line(captured))
    assert run(ip, "%numguard on")[0].success
    assert run(ip, "%numguard off")[1].stdout.strip() == "numguard: off (no model was guarded)"
    assert event_handlers(ip) == []


def test_numguard_on_guards_a_model_made_in_a_later_cell_from_the_next_cell(ip):
    run(ip, "%numguard on")
    try:
        result, captured = run(ip, "other = nn.Sequential(nn.Linear(4, 4))")
        assert result.success and "numguard: other is a new Sequential: guarding it" in captured.stdout
        result, captured = run(ip, "torch.log(other(torch.randn(2, 4)) - 100).sum().backward()")
        assert isinstance(result.error_in_exec, NonFiniteError)
        assert ip.user_ns["_numguard"].first_nonfinite.op == "aten.log.default"
    finally:
        run(ip, "%numguard off")
    assert hook_count(ip.user_ns["other"]) == 0 and event_handlers(ip) == []


LOG_OF_NEGATIVE = (
    "class Log(nn.Module):\n"
    "    def forward(self, x):\n"
    "        return torch.log(x)\n"
    "logged = nn.Sequential(nn.Linear(4, 4), Log())\n"
)


def test_hints_in_a_notebook_say_how_to_name_the_op_with_the_magic(ip):
    result, captured = run(ip, "%%numguard\n" + LOG_OF_NEGATIVE + "logged(torch.randn(3, 4)).sum()")
    assert isinstance(result.error_in_exec, NonFiniteError)
    hint = ip.user_ns["_numguard"].hint
    assert "Rerun the cell with `%%numguard --ops` to name the op and the line." in hint
    assert "Guard(model, ops=True)" not in hint + captured.stdout + captured.stderr
    run(ip, "%numguard on")
    try:
        run(ip, "logged(torch.randn(3, 4)).sum()")
        assert "`%numguard on --ops`" in ip.user_ns["_numguard"].hint
    finally:
        run(ip, "%numguard off")


def test_unloading_the_extension_under_numguard_on_says_guarding_stopped(ip):
    run(ip, "%numguard on")
    result, captured = run(ip, "%unload_ext numguard_nb")
    assert result.success
    assert captured.stdout.strip() == (
        "numguard: off (guarded net (Sequential) up to batch 0); the extension is unloaded")
    assert hook_count(ip.user_ns["net"]) == 0 and event_handlers(ip) == []
    ip.run_cell("%load_ext numguard_nb")
    result, captured = run(ip, "%unload_ext numguard_nb")
    assert captured.stdout.strip() == ""  # nothing was on: nothing to say
    ip.run_cell("%load_ext numguard_nb")


@pytest.mark.parametrize("line, cell", [
    # the cell makes the scaler it names after the model
    ("--scaler sc", "made = nn.Linear(4, 1)\nsc = torch.amp.GradScaler('cpu')\n"),
    # the name stands for something else first
    ("made", "made = None\nmade = nn.Linear(4, 1)\n"),
])
def test_a_cell_whose_model_is_not_ready_at_first_waits_for_it_and_runs_every_statement(ip, line, cell):
    ip.reset(new_session=False)
    ip.run_cell("import torch\nfrom torch import nn")
    result, captured = run(ip, f"%%numguard {line}\n{cell}ran = True\n"
                               "torch.log(made(torch.randn(2, 4)) - 100).sum().backward()")
    assert ip.user_ns.get("ran") is True  # no statement was skipped
    assert isinstance(result.error_in_exec, NonFiniteError), captured.stderr
    assert "numguard: guarding made (Linear) from here on" in captured.stdout
    assert hook_count(ip.user_ns["made"]) == 0 and event_handlers(ip) == []


def test_a_cell_looks_for_new_models_only_among_the_names_it_assigns(ip, monkeypatch):
    """Without names a cell follows models it makes, looking before each statement at the names
    it assigns, not through the whole namespace (a notebook can hold tens of thousands)."""
    from numguard_nb import session

    for i in range(2000):
        ip.user_ns[f"value{i}"] = i
    looked_at = []
    model_of = session.model_of
    monkeypatch.setattr(session, "model_of", lambda obj: looked_at.append(obj) or model_of(obj))
    result, _ = run(ip, "%%numguard\n" + "x = 1\n" * 40 + "other = nn.Linear(4, 4)\nother(torch.randn(1, 4))")
    assert result.success
    assert len(looked_at) < 3 * 2000 + 40 * 5, len(looked_at)  # scans to start, then a few names
    assert ip.user_ns["_numguard"].frames[-1].module_name == "other"


def test_a_part_of_a_guarded_model_bound_to_a_name_in_the_cell_is_no_new_model(ip):
    result, captured = run(ip, "%%numguard\npart = net[0]\n" + LOOP)
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert "part" not in captured.stdout  # guarded through net, nothing to say
    assert ip.user_ns["_numguard"].first_nonfinite.module_name == "0"  # net's, not part's
