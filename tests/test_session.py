"""The notebook session without IPython: a dict stands for the user namespace. Looking models up
by name, the guard of a run and the reports it keeps, `%numguard on` .. `off` driven through
`before_cell` / `after_cell` the way IPython's events drive it."""

import sys

import pytest
import torch
from torch import nn

from numguard_nb import NonFiniteError, Report
from numguard_nb.guard import GuardOptions
from numguard_nb import _util
from numguard_nb.session import (REPORT_NAME, TRACES_NAME, GuardedRun, Session, choose_capture,
                                 find_models, lookup)

GLITCH = 3  # the batch whose input overflows in Scale


class Scale(nn.Module):
    def __init__(self, factor=1e30):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class FakeTrainer:
    def __init__(self, model):
        self.model = model

    def train(self):
        pass


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Scale(), nn.Linear(4, 2))


def batches(count=5):
    torch.manual_seed(1)
    xs = [torch.randn(3, 4) for _ in range(count)]
    xs[GLITCH] = xs[GLITCH] * 1e10  # 1e10 * 1e30 overflows float32
    return xs


def step(model, x):
    model(x).sum().backward()


def hook_count(module):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


@pytest.fixture
def ns():
    return {"net": build(), "xs": batches(), "loss_fn": nn.MSELoss()}


def start_session(ns, names=("net",), **keywords):
    session = Session()
    quiet = keywords.pop("quiet", False)
    run = GuardedRun(ns, find_models(ns, names), GuardOptions(**keywords), quiet=quiet)
    session.start(run)
    return session


def run_cell(session, cell, source="# a cell"):
    """What IPython does around a cell: pre_run_cell, the cell, post_run_cell."""
    shown = [session.before_cell(source)]
    error = None
    try:
        cell()
    except Exception as raised:
        error = raised
    shown.append(session.after_cell(error is None, error))
    return error, shown


# ---- looking models up ---------------------------------------------------------------------
def test_lookup_follows_attribute_paths_and_says_what_is_wrong(ns):
    ns["trainer"] = FakeTrainer(ns["net"])
    assert lookup(ns, "trainer.model") is ns["net"]
    for name, message in [
        ("nett", "no variable named 'nett' in the namespace; did you mean net?"),
        ("nothing", "no variable named 'nothing' in the namespace; define it first (run its cell)"),
        ("net.nothing", "net (Sequential) has no attribute 'nothing'"),
        ("net[0]", "'net[0]' is not a variable name"),
    ]:
        with pytest.raises(LookupError) as caught:
            lookup(ns, name)
        assert str(caught.value).startswith(message)


def test_find_models_named_or_all_top_level_ones(ns):
    ns.update(layer=ns["net"][0], _private=nn.Linear(2, 2), trainer=FakeTrainer(nn.Linear(4, 4)),
              same=FakeTrainer(ns["net"]), hidden_model=nn.Linear(1, 1))
    found = find_models(ns, hidden={"hidden_model": ns["hidden_model"]})
    assert list(found) == ["net", "loss_fn", "trainer"]
    assert found["trainer"] is ns["trainer"].model
    assert list(find_models(ns, ["same", "layer"])) == ["same"]  # layer is inside net
    with pytest.raises(LookupError, match="xs is a list, not a torch.nn.Module or a Trainer"):
        find_models(ns, ["xs"])
    with pytest.raises(LookupError, match=r"no torch.nn.Module \(or Trainer\) in the namespace"):
        find_models({"x": 1})


def test_capture_is_on_by_default_only_for_cuda_models_and_where_it_fits(ns, monkeypatch):
    models = {"net": ns["net"]}
    assert choose_capture(None, models) == (False, "")  # a CPU model: no asynchronous errors
    assert choose_capture(True, models) == (True, "")
    assert choose_capture(False, models) == (False, "")
    monkeypatch.setattr(_util, "host_memory_available", lambda: 100)
    capture, why = choose_capture(True, models)
    assert not capture and why.startswith("the weights' host copy (")


# ---- the guard of a run --------------------------------------------------------------------
def test_a_run_keeps_its_detection_and_shortens_the_error(ns):
    shortened = []

    def shorten(error, hint):
        shortened.append(hint)
        return error

    run = GuardedRun(ns, find_models(ns, ["net"]), output="bad", shorten=shorten)
    with pytest.raises(NonFiniteError) as caught:
        with run.guard:
            for x in ns["xs"]:
                step(ns["net"], x)
    assert shortened == ["numguard: the frames that led to it are in _numguard and bad"]
    shown = run.finish_cell(failed=True)
    assert shown.lines == [] and shown.reports == [caught.value.report]
    assert ns[REPORT_NAME] is ns["bad"] is caught.value.report
    assert caught.value.report.first_nonfinite.module_name == "1"
    assert run.collect() == []  # shown once


def test_a_clean_cell_keeps_the_latest_frames_and_says_so(ns):
    run = GuardedRun(ns, find_models(ns, ["net", "loss_fn"]))
    assert run.describe() == "net (Sequential), loss_fn (MSELoss)"
    with run.guard:
        step(ns["net"], ns["xs"][0])
    (line,) = run.finish_cell(failed=False).lines
    assert line.startswith("numguard: no inf/nan in the last") and isinstance(ns[REPORT_NAME], Report)
    quiet = GuardedRun(ns, find_models(ns, ["net"]), quiet=True)
    assert quiet.finish_cell(failed=False).lines == []
    assert ns[REPORT_NAME].frames == []  # kept all the same
    assert GuardedRun(ns, find_models(ns, ["net"])).finish_cell(False).lines == [
        "numguard: net (Sequential) was not called in this cell"]
    assert GuardedRun(ns, find_models(ns, ["net", "loss_fn"])).finish_cell(False).lines == [
        "numguard: net (Sequential), loss_fn (MSELoss) were not called in this cell"]


def test_traces_are_collected_once_per_growth_and_kept_by_batch(ns):
    run = GuardedRun(ns, find_models(ns, ["net"]), GuardOptions(trace_batches=[1, GLITCH]))
    with run.guard:
        for x in ns["xs"][:2]:
            step(ns["net"], x)
        assert [r.batch_number for r in run.show_collected().reports] == [1]
        for x in ns["xs"][2:]:
            step(ns["net"], x)
    assert [r.batch_number for r in run.collect()] == [GLITCH]
    assert sorted(ns[TRACES_NAME]) == [1, GLITCH]


def test_the_runs_guard_gets_the_options_and_the_runs_callbacks(ns):
    run = GuardedRun(ns, find_models(ns, ["net"]), GuardOptions(max_frames=3, sync=True))
    assert run.guard.max_frames == 3 and run.guard.sync is True
    assert run.guard.options.on_detect == run._on_detect


# ---- %numguard on .. off -------------------------------------------------------------------
def test_the_session_guards_every_cell_until_it_is_stopped(ns):
    net, xs = ns["net"], ns["xs"]
    session = Session()
    assert session.status() == "numguard: off (%numguard on [MODEL ...] guards every following cell)"
    run = GuardedRun(ns, find_models(ns, ["net"]))
    assert session.start(run).lines == [
        "numguard: on, guarding net (Sequential) from here on, in every cell until %numguard off"]
    assert hook_count(net) > 0  # the rest of the cell that started it is guarded too
    error, _ = run_cell(session, lambda: [step(net, x) for x in xs[:2]])
    assert error is None and hook_count(net) > 0  # hooked from the first cell on
    assert session.status() == "numguard: on, guarding net (Sequential), at batch 1"
    error, (_, after) = run_cell(session, lambda: [step(net, x) for x in xs[2:]])
    assert isinstance(error, NonFiniteError) and error.report.batch_number == GLITCH
    assert after.reports == [error.report] and ns[REPORT_NAME] is error.report
    assert error.__traceback__ is None  # it held the activations
    assert session.status().endswith(f"at batch {GLITCH}; a detection is in _numguard")
    assert session.stop() == f"numguard: off (guarded net (Sequential) up to batch {GLITCH})"
    assert hook_count(net) == 0 and session.run is None
    assert session.stop() == "numguard: already off"
    error, shown = run_cell(session, lambda: step(net, xs[0]))
    assert error is None and hook_count(net) == 0
    assert all(not (s.lines or s.reports) for s in shown)


def test_the_session_drops_the_traceback_the_shell_keeps(ns):
    session = start_session(ns)
    session.before_cell("")
    try:
        for x in ns["xs"]:
            step(ns["net"], x)
    except NonFiniteError as raised:
        error, traceback = raised, raised.__traceback__
    sys.last_value, sys.last_traceback = error, traceback  # as the shell keeps them for %debug
    try:
        session.after_cell(False, error)
        assert sys.last_traceback is None and error.__traceback__ is None
    finally:
        del sys.last_value, sys.last_traceback
    session.stop()


def test_the_session_steps_aside_for_a_numguard_cell(ns):
    net = ns["net"]
    session = start_session(ns, quiet=True)
    run_cell(session, lambda: step(net, ns["xs"][0]))
    hooks = hook_count(net)
    before = session.before_cell("%%numguard net\nstep(net, x)")
    assert before.lines == [] and hook_count(net) == 0  # that cell brings its own guard
    assert session.after_cell(True, None).reports == []
    run_cell(session, lambda: step(net, ns["xs"][1]))
    assert hook_count(net) == hooks
    assert session.status() == "numguard: on, guarding net (Sequential), at batch 1"
    session.stop()


def test_an_interrupted_pass_does_not_leak_into_the_next_cell(ns, monkeypatch):
    class Flaky(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.fail = False

        def forward(self, x):
            h = self.inner(x)
            if self.fail:
                raise KeyboardInterrupt
            return h

    ns["flaky"] = Flaky(ns["net"])
    session = start_session(ns, ("flaky",))
    guard = session.run.guard
    resets = []
    monkeypatch.setattr(guard, "reset", lambda: resets.append(guard.batch_number) or type(guard).reset(guard))
    ns["flaky"].fail = True
    session.before_cell("")
    with pytest.raises(KeyboardInterrupt):
        step(ns["flaky"], ns["xs"][0])
    session.after_cell(False, None)
    assert resets == [0]  # a failed cell forgets its unfinished pass
    session.after_cell(True, None)
    assert resets == [0]
    ns["flaky"].fail = False
    error, _ = run_cell(session, lambda: [step(ns["flaky"], x) for x in ns["xs"][1:]])
    culprit = error.report.first_nonfinite
    assert (culprit.module_name, culprit.call_index, error.report.batch_number) == ("inner.1", 0, GLITCH)
    session.stop()


def test_the_capture_is_dropped_when_it_stops_fitting(ns, monkeypatch):
    session = Session()
    monkeypatch.setattr(_util, "host_memory_available", lambda: 100)
    _, line = session.start(GuardedRun(ns, find_models(ns, ["net"]), GuardOptions(capture=True))).lines
    assert line.startswith("numguard: no CPU replay after a CUDA error from now on: capture refused")
    assert session.run.guard.attached and not session.run.guard.capture_enabled
    session.stop()


# ---- following the names from cell to cell -------------------------------------------------
class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_a_model_rebuilt_in_a_later_cell_is_guarded_and_the_status_says_so(ns):
    old = ns["net"]
    session = start_session(ns)
    run_cell(session, lambda: [step(old, x) for x in ns["xs"][:2]])
    ns["net"] = Wrapper(build())  # a cell rebuilds the model (and its class)
    before = session.before_cell("")
    assert before.lines == ["numguard: net is a new Wrapper: guarding it"]
    assert hook_count(old) == 0 and hook_count(ns["net"]) > 0
    assert session.status() == "numguard: on, guarding net (Wrapper), at batch 1"
    error, (_, after) = run_cell(session, lambda: [step(ns["net"], x) for x in ns["xs"]])
    assert isinstance(error, NonFiniteError) and after.reports == [error.report]
    # the batches go on counting from the run's start; the report names the new model's modules
    assert error.report.batch_number == 2 + GLITCH
    assert error.report.first_nonfinite.module_name == "inner.1"
    session.stop()
    assert hook_count(ns["net"]) == 0


def test_a_new_name_for_the_model_a_name_held_is_said_to_be_that_model(ns):
    old = ns["net"]
    session = Session()
    session.start(GuardedRun(ns, find_models(ns, ()), GuardOptions(), every_model=True))
    run_cell(session, lambda: step(old, ns["xs"][0]))
    ns["before"], ns["net"] = old, build()  # `before = net; net = build()`
    lines = session.before_cell("").lines
    assert lines == ["numguard: net is a new Sequential: guarding it",
                     "numguard: before is the Sequential net was: still guarding it"]
    assert hook_count(old) > 0 and hook_count(ns["net"]) > 0
    session.stop()


def test_a_submodule_replaced_in_a_later_cell_is_named_in_the_detection(ns):
    net = ns["net"]
    session = start_session(ns)
    run_cell(session, lambda: step(net, ns["xs"][0]))
    net[1] = Scale(1e30)  # a new module where Scale was: unhooked until the session looks again
    assert session.before_cell("").lines == ["numguard: net has new modules or parameters: guarding them"]
    error, _ = run_cell(session, lambda: [step(net, x) for x in ns["xs"]])
    culprit = error.report.first_nonfinite
    assert (culprit.module_name, culprit.module_class) == ("1", "Scale")
    assert session.before_cell("").lines == []  # nothing changed since
    session.stop()


def test_a_parameter_unfrozen_in_a_later_cell_gets_its_gradient_hook(ns):
    net = ns["net"]
    net[2].weight.requires_grad_(False)
    session = start_session(ns)
    run_cell(session, lambda: step(net, ns["xs"][0]))
    assert not net[2].weight._backward_hooks
    net[2].weight.requires_grad_(True)
    assert session.before_cell("").lines == ["numguard: net has new modules or parameters: guarding them"]
    assert len(net[2].weight._backward_hooks) == 1
    session.stop()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_model_deleted_from_the_namespace_is_let_go_while_on(ns, mode):
    """`del net` (or `%reset -f`) under `%numguard on`: its weights and gradients can be freed
    at once (a bigger model comes next), not at `%numguard off`."""
    import gc
    import weakref

    session = start_session(ns, mode=mode)
    run_cell(session, lambda: step(ns["net"], ns["xs"][0]))
    gone = weakref.ref(ns.pop("net"))
    assert session.before_cell("").lines == ["numguard: net is gone from the namespace: not guarded"]
    gc.collect()
    assert gone() is None
    session.stop()


def test_a_name_that_stands_for_no_model_is_said_once_and_followed_when_it_is_back(ns):
    session = start_session(ns, ("net", "loss_fn"))
    session.before_cell("")
    net = ns.pop("net")
    assert session.before_cell("").lines == ["numguard: net is gone from the namespace: not guarded"]
    assert hook_count(net) == 0 and session.before_cell("").lines == []
    assert session.status() == ("numguard: on, guarding loss_fn (MSELoss) (net is gone from the "
                                "namespace: not guarded), at batch 0")
    ns["loss_fn"] = "not a model"
    assert session.before_cell("").lines == [
        "numguard: loss_fn is a str, not a torch.nn.Module or a Trainer: not guarded"]
    assert session.status().startswith("numguard: on, guarding nothing (")
    ns["net"] = net
    assert session.before_cell("").lines == ["numguard: net is a Sequential again: guarding it"]
    error, _ = run_cell(session, lambda: [step(net, x) for x in ns["xs"]])
    assert error.report.first_nonfinite.module_name == "1"  # one model again: no prefix
    session.stop()


def test_a_change_during_a_cell_is_said_after_it_and_followed_from_the_next_cell(ns):
    session = start_session(ns)

    def rebuild_and_train():
        ns["net"] = build()
        for x in ns["xs"]:
            step(ns["net"], x)

    error, (_, after) = run_cell(session, rebuild_and_train)
    assert error is None  # the cell ran on a model built in it, which no one had hooked yet
    assert after.lines[0] == "numguard: net is a new Sequential: guarding it"
    assert after.lines[1].startswith("numguard: (found at the end of this cell, so guarded from the "
                                     "next one on")
    error, _ = run_cell(session, lambda: [step(ns["net"], x) for x in ns["xs"]])
    assert isinstance(error, NonFiniteError)
    session.stop()


def test_a_replaced_model_is_not_kept_alive_by_the_run(ns):
    import gc
    import weakref

    session = start_session(ns)
    run_cell(session, lambda: step(ns["net"], ns["xs"][0]))
    old = weakref.ref(ns["net"])
    ns["net"] = build()
    session.before_cell("")
    gc.collect()
    assert old() is None
    session.stop()


def test_the_capture_follows_a_rebuilt_model(ns):
    session = start_session(ns, capture=True)
    run_cell(session, lambda: step(ns["net"], ns["xs"][0]))
    assert session.run.guard.capture.module_class == "Sequential"
    ns["net"] = Wrapper(build())
    run_cell(session, lambda: step(ns["net"], ns["xs"][1]))
    call = session.run.guard.capture
    assert call.module_class == "Wrapper" and call.replay().exception is None  # the new weights' snapshot
    session.stop()
