"""What a cell shows around the magics, in an in-process IPython shell: each form's help, the
report before its error in both guarded forms, a syntax error as any cell shows it, and cells
named as IPython names them in replay locations.
"""

import re

import pytest
from IPython.utils.capture import capture_output

from numguard_nb import NonFiniteError
from numguard_nb import magics as ng_magics
from numguard_nb.render.replay import replay_result_text
from numguard_nb._util import cell_name
from numguard_nb.replay.location import CALL_SITE, RAISED, Location

# A float16 Linear whose output overflows 65504 on its first call.
SETUP = """
import torch
from torch import nn
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()
with torch.no_grad():
    net[0].weight.fill_(1.0)
x = torch.full((3, 4), 3e4).half()
"""
STEP = "net(x).float().sum().backward()"


@pytest.fixture
def ip(ipython):
    shell = ipython
    formatter = shell.display_formatter
    active = list(formatter.active_types)
    formatter.active_types = list(formatter.format_types)  # as in a notebook: HTML too
    shell.run_cell("%load_ext numguard_nb")
    shell.reset(new_session=False)
    assert shell.run_cell(SETUP).success
    yield shell
    shell.run_cell("%unload_ext numguard_nb")
    formatter.active_types = active


def run(ip, cell):
    with capture_output() as captured:
        result = ip.run_cell(cell)
    return result, captured


def test_each_form_has_its_own_help(ip):
    _, line_help = run(ip, "%numguard?")
    _, cell_help = run(ip, "%%numguard?")
    line, cell = line_help.stdout, cell_help.stdout
    assert line != cell
    # the line magic: its commands, the options of `on`, and compare's
    for text in ("%numguard on [options] [MODEL ...]", "%numguard off", "%numguard status",
                 "%numguard compare A B", "%numguard on [--frames N]", "--factor F"):
        assert text in line, text
    assert "  %%numguard [--frames N]" not in line
    # the cell magic: its options, and where the line forms are
    assert "%%numguard [options] [MODEL ...]" in cell and "  %%numguard [--frames N]" in cell
    assert "--factor" not in cell and "%numguard on [options]" not in cell
    assert "see %numguard?" in cell and "see %%numguard?" in line
    assert ip.find_line_magic("numguard").__doc__ in line
    assert ip.find_cell_magic("numguard").__doc__ != ip.find_line_magic("numguard").__doc__


class _Shown:
    """What the shell shows, in order: 'report' for a displayed report, 'error' for a traceback."""

    def __init__(self, shell, monkeypatch):
        self.seen = []
        publish, show_traceback = shell.display_pub.publish, shell._showtraceback

        def published(data, *args, **kwargs):
            if 'class="ng-report' in data.get("text/html", ""):
                self.seen.append("report")
            return publish(data, *args, **kwargs)

        def shown(etype, evalue, stb):
            self.seen.append("error")
            return show_traceback(etype, evalue, stb)

        monkeypatch.setattr(shell.display_pub, "publish", published)
        monkeypatch.setattr(shell, "_showtraceback", shown)


def test_the_report_comes_before_the_error_in_both_forms(ip, monkeypatch):
    shown = _Shown(ip, monkeypatch)
    result = ip.run_cell("%%numguard net\n" + STEP)
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert shown.seen == ["report", "error"]

    shown.seen.clear()
    assert ip.run_cell("%numguard on net").success
    result = ip.run_cell(STEP)
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert shown.seen == ["report", "error"]
    assert ip.user_ns["_numguard"] is result.error_in_exec.report
    # the error shown again (%tb) shows no report twice
    shown.seen.clear()
    ip.showtraceback((NonFiniteError, result.error_in_exec, None))
    assert shown.seen == ["error"]
    ip.run_cell("%numguard off")


@pytest.mark.parametrize("body", ["x = 1\ny = 2 +\n", "x = 1\ny = (2 +\n", "x = 1\n  y = 2\n",
                                  "y = 1\nreturn y\n", "y = 1\nbreak\n"])  # (the last: compiling)
def test_a_syntax_error_shows_as_in_a_plain_cell(ip, body):
    plain, plain_shown = run(ip, "# a plain cell\n" + body)  # the same line numbers
    guarded, guarded_shown = run(ip, "%%numguard net\n" + body)
    assert isinstance(guarded.error_before_exec, SyntaxError) and guarded.error_in_exec is None
    assert type(guarded.error_before_exec) is type(plain.error_before_exec)
    # IPython 7 names a cell's code by a hash of it: the two cells differ there only
    unnamed = re.compile(r"<ipython-input-\d+-[0-9a-f]+>")
    assert unnamed.sub("<cell>", guarded_shown.stdout) == unnamed.sub("<cell>", plain_shown.stdout)
    assert "line 3" in guarded_shown.stdout and "Traceback" not in guarded_shown.stdout
    assert "magics.py" not in guarded_shown.stdout
    # code that compiles is the magic's to run
    assert ip.run_cell("%%numguard net\nnet(x[:, :0].float().half() if False else x * 0)").success


def test_replay_locations_name_cells_as_ipython_does(ip):
    cell_number = ip.execution_count
    assert ip.run_cell("def fails():\n    pass\n    return 1 / 0\n", store_history=True).success
    filename = ip.user_ns["fails"].__code__.co_filename
    name = f"Cell In[{cell_number}]"
    if not hasattr(ip.compile, "format_code_name"):  # IPython 7 shows the file name itself
        name = None
    assert cell_name(filename) == name
    where = f"{name}, line 3" if name else f"{filename}:3"
    raised = Location.of(filename, 3, "fails", RAISED)
    assert raised.where == where and str(raised) == f"{where} in fails: return 1 / 0"

    class Result:  # what render.replay reads of a replay's result
        device, exception, module, output, replayed, notes = "cpu", ZeroDivisionError("x"), "", None, "", []
        location = Location.of(filename, 3, "<module>", CALL_SITE)

    text = replay_result_text(Result())
    assert f"in the call made at {where} in <module>" in text
    assert (filename in text) == (name is None)
    # a captured call says where it was made the same way
    capture_cell = ip.execution_count
    assert ip.run_cell("import torch\nfrom numguard_nb import Guard\n_m = torch.nn.Linear(2, 2)\n"
                       "with Guard(_m, capture=True) as _g:\n    _m(torch.ones(1, 2))\n",
                       store_history=True).success
    made_at = f"Cell In[{capture_cell}], line 5" if name else ">:5"  # <ipython-input-...>:5
    assert made_at in repr(ip.user_ns["_g"].capture)
    # a file is named by its path; a cell as IPython names it, with the extension loaded or not
    assert Location.of(__file__, 1).where == f"{__file__}:1"
    ip.run_cell("%unload_ext numguard_nb")
    assert cell_name(filename) == name and raised.where == where
    ip.run_cell("%load_ext numguard_nb")


def test_unload_leaves_no_transformer(ip):
    magics = ng_magics._loaded[id(ip)]
    assert magics.syntax_check in ip.input_transformers_cleanup
    ip.run_cell("%unload_ext numguard_nb")
    assert magics.syntax_check not in ip.input_transformers_cleanup
    ip.run_cell("%load_ext numguard_nb")


# ---- an uncaught NonFiniteError of the Python API ------------------------------------------
API_CELL = """import numguard_nb as ng
with ng.Guard(net, ops=True):
    out = net(x)
"""


def cell_line(ip, number: int, line: int) -> str:
    """How the line of cell `number` is written: 'Cell In[4], line 3' (IPython 8 and later), or
    the file name IPython 7 compiles the cell under ('<ipython-input-4-...>:3')."""
    if hasattr(ip.compile, "format_code_name"):
        return f"Cell In[{number}], line {line}"
    return f"<ipython-input-{number}-"


class _Traceback:
    """The lines the shell shows for the error of the last cell."""

    def __init__(self, shell, monkeypatch):
        self.lines = []
        show_traceback = shell._showtraceback

        def shown(etype, evalue, stb):
            self.lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in stb]
            return show_traceback(etype, evalue, stb)

        monkeypatch.setattr(shell, "_showtraceback", shown)


def test_an_uncaught_error_of_the_python_api_shows_its_report_and_is_kept(ip, monkeypatch):
    shown, traceback = _Shown(ip, monkeypatch), _Traceback(ip, monkeypatch)
    ip.user_ns.pop("_numguard", None)
    cell_number = ip.execution_count
    result = ip.run_cell(API_CELL, store_history=True)
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError)
    assert shown.seen == ["report", "error"]  # the report, as a %%numguard cell shows it
    assert ip.user_ns["_numguard"] is error.report
    text = "\n".join(traceback.lines)
    assert traceback.lines[0].startswith("NonFiniteError: 0 (Linear) produced a non-finite value")
    assert "hint: " in text and "first non-finite op: aten.addmm.default" in text
    assert f"called from: {cell_line(ip, cell_number, 3)}" in text and "out = net(x)" in text
    assert "numguard: the frames that led to it are in _numguard" in text
    shown.seen.clear()
    ip.showtraceback((NonFiniteError, error, None))  # %tb: no second report
    assert shown.seen == ["error"]


def test_without_the_extension_an_uncaught_error_still_shows_the_op_the_line_and_the_hint(
        ip, monkeypatch):
    ip.run_cell("%unload_ext numguard_nb")
    try:
        shown, traceback = _Shown(ip, monkeypatch), _Traceback(ip, monkeypatch)
        ip.user_ns.pop("_numguard", None)
        cell_number = ip.execution_count
        result = ip.run_cell(API_CELL, store_history=True)
        assert isinstance(result.error_in_exec, NonFiniteError)
        assert shown.seen == ["error"] and "_numguard" not in ip.user_ns
        text = "\n".join(traceback.lines)
        assert "hint: " in text and "first non-finite op: aten.addmm.default" in text
        assert f"called from: {cell_line(ip, cell_number, 3)}" in text and "out = net(x)" in text
        assert "err.report after `except numguard_nb.NonFiniteError as err`" in text
    finally:
        ip.run_cell("%load_ext numguard_nb")


@pytest.mark.parametrize("guarded", ["%%numguard net\n", "import numguard_nb as ng\nwith ng.Guard(net):\n"])
def test_a_users_error_shows_no_frame_of_the_guard(ip, monkeypatch, guarded):
    traceback = _Traceback(ip, monkeypatch)
    body = "import torch.nn.functional as F\nF.cross_entropy(net(x * 0).float(), torch.tensor([7, 7, 7]))\n"
    if guarded.startswith("import"):
        body = "".join("    " + line for line in body.splitlines(True))
    result = ip.run_cell(guarded + body)
    assert isinstance(result.error_in_exec, IndexError)
    text = "\n".join(traceback.lines)
    assert "F.cross_entropy(net(x * 0).float(), torch.tensor([7, 7, 7]))" in text  # the user's line
    assert "numguard_nb" not in text, text


def test_numguard_on_guards_the_rest_of_its_own_cell(ip):
    # A first-hour cell: `%numguard on` then the training code. The rest of the cell ran
    # unguarded (hooks came with the next cell) and its overflow went by in silence.
    result, captured = run(ip, "%numguard on net\n" + STEP)
    assert isinstance(result.error_in_exec, NonFiniteError), captured.stdout
    assert "guarding net (Sequential) from here on" in captured.stdout
    ip.run_cell("%numguard off")


def test_a_guarded_cell_inside_another_cell_magic_runs_alone_under_numguard_on(ip):
    # `%%time` then `%%numguard --ops` under `%numguard on`: the session's guard stepped aside
    # only for cells that begin with %%numguard, so both hooked every module and the session's
    # caught the overflow, without the cell's options (no op named).
    assert ip.run_cell("%numguard on net").success
    hooks = "print('hooks', [len(m._forward_hooks) for m in net.modules()])\n"
    result, captured = run(ip, "%%time\n%%numguard net --ops\n" + hooks + STEP)
    assert "hooks [1, 1, 1, 1]" in captured.stdout
    # (IPython 7's %%time shows the cell's error itself: the report is the cell's, with its op)
    assert ip.user_ns["_numguard"].first_nonfinite.op is not None
    assert "a detection" not in run(ip, "%numguard status")[1].stdout  # not the session's
    assert ip.run_cell(hooks).success  # the next cell: the session's guard again
    ip.run_cell("%numguard off")
