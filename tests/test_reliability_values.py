"""Values with no numbers behind them, and calls something else is tracing, on their own: the
statistics (`stats`), the detection rules (`guard.detect`) and the report (`guard.frames`).

Fake tensors (torch.export, FakeTensorMode), meta tensors, functional and functorch-wrapped
tensors (torch.func.functionalize, vmap, grad) and wrapper subclasses get no statistics
("unsupported"), never made-up ones that read as nan; a tensor that holds numbers gets them even
while a dispatch mode, the torch.jit tracer or a torch.func transform is active, and the work is
neither recorded into the trace nor seen by the mode. A report with values that were not watched
says so instead of an all-clear.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from promises import bit_identical, same_run
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import numguard_nb as ng
from numguard_nb import stats
from numguard_nb._schema import (
    CAUSE_WEIGHTS, FORWARD, INPUT, LATEST, OUTPUT, PARAM, VALUE_TENSOR, VALUE_UNSUPPORTED,
)
from numguard_nb.guard import GuardOptions, detect, frames
from numguard_nb.guard.passes import CallRecord, PassRecord

INF, NAN = math.inf, math.nan


def row_of(t: torch.Tensor):
    with torch.no_grad():
        return stats.device_stats(t, sign_hints={}, site="s")


def expected_row(t: torch.Tensor) -> tuple:
    magnitude = t.detach().double().abs()
    return float(magnitude.min()), float(magnitude.max())


class OpLog(TorchDispatchMode):
    """A user's dispatch mode that records every op it sees."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# ---- statistics: tensors with no numbers ----------------------------------------------------
def test_fake_tensors_get_no_statistics_and_no_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FakeTensorMode():
            fake = torch.randn(3, 4)
            assert row_of(fake) is None
            assert row_of(torch.full((2,), NAN)) is None  # made under the mode: fake too
            functional = torch._to_functional_tensor(fake)  # what functionalization wraps it in
            assert row_of(functional) is None
        assert row_of(fake) is None and row_of(functional) is None  # and outside the mode
    # e.g. reading a fake tensor's data pointer: deprecated, and the user's to see
    assert [str(w.message) for w in caught] == []


def test_a_real_tensor_under_fake_mode_gets_its_numbers_and_the_scratch_buffer_stays_real():
    stats.release_workspace()
    real = torch.randn(300, 40)
    with FakeTensorMode():
        row = row_of(real)
    assert row[:2] == expected_row(real)
    # the scratch buffer made under the mode holds numbers: the next plain call reads right
    other = torch.randn(300, 40) * 3
    assert row_of(other)[:2] == expected_row(other)
    assert all(not b.is_meta and type(b) is torch.Tensor for b in stats._workspace.buffers.values())


def test_a_default_device_of_meta_leaves_the_scratch_buffer_on_the_cpu():
    stats.release_workspace()
    real = torch.randn(50, 7)
    with torch.device("meta"):  # what torch.set_default_device("meta") does, for a while
        assert row_of(real)[:2] == expected_row(real)
    assert [b.device.type for b in stats._workspace.buffers.values()] == ["cpu"]


def test_meta_tensors_get_no_statistics():
    assert row_of(torch.randn(3, 4, device="meta")) is None
    assert row_of(nn.Parameter(torch.empty(4, device="meta"))) is None


@pytest.mark.parametrize("transform", ["vmap", "grad", "vmap(grad)", "functionalize"])
def test_tensors_inside_torch_func_transforms_get_no_statistics(transform):
    seen = {}
    weight = torch.randn(4)

    def f(x):
        seen["x"] = row_of(x)
        seen["weight"] = row_of(weight)  # a plain tensor inside the transform: read normally
        return (torch.sqrt(x - 10) * weight).sum()  # nan inside: sqrt of negatives

    x = torch.randn(3, 4)
    if transform == "vmap":
        torch.func.vmap(f)(x)
    elif transform == "grad":
        torch.func.grad(f)(x[0])
    elif transform == "vmap(grad)":
        torch.func.vmap(torch.func.grad(f))(x)
    else:
        torch.func.functionalize(f)(x[0])
    assert seen["x"] is None
    assert seen["weight"][:2] == expected_row(weight)


def test_wrapper_subclasses_get_no_statistics_rather_than_their_empty_storage():
    from torch.testing._internal.two_tensor import TwoTensor

    wrapped = TwoTensor(torch.randn(5), torch.randn(5))
    assert row_of(wrapped) is None

    class Scaled(torch.Tensor):  # a subclass over real storage: read through it
        pass

    plain = torch.tensor([1.0, -INF, 2.0])
    abs_min, abs_max, nan, posinf, neginf, _ = stats.decode(row_of(plain.as_subclass(Scaled)))
    assert (abs_min, abs_max, nan, posinf, neginf) == (1.0, INF, False, False, True)


def test_statistics_are_numbers_or_nothing_inside_torch_export():
    rows = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            y = self.linear(x)
            rows.extend([row_of(x), row_of(self.linear.weight), row_of(y)])
            return y

    x = torch.randn(3, 4)
    torch.export.export(Probe(), (x,))
    assert rows and all(row is None for row in rows)  # every value export sees is fake
    rows.clear()
    batch = torch.export.Dim("batch")
    torch.export.export(Probe(), (x,), dynamic_shapes=({0: batch},))  # symbolic shapes
    assert rows and all(row is None for row in rows)


# ---- statistics: nothing recorded, nothing seen --------------------------------------------
def test_statistics_never_enter_a_torch_jit_trace():
    seen = []

    def f(x):
        seen.append(row_of(x))
        return x * 2

    x = torch.tensor([[0.5, -3.0], [INF, 1.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's own warnings about Python values
        traced = torch.jit.trace(f, (x,), check_trace=False)
    assert seen[0][:3] == (0.5, INF, INF)  # the numbers, exactly, while tracing
    ops = {node.kind() for node in traced.graph.nodes()}
    assert ops <= {"aten::mul", "prim::Constant"}, ops


def test_a_users_dispatch_mode_never_sees_the_statistics():
    t = torch.randn(64, 64)
    with torch.no_grad():  # what a GPU gets: 0-d tensors, stacked and read at the pass's end
        device_row = stats._bit_stats(t, torch.int32, False, None, None, read_now=False)
    with OpLog() as log:
        row = row_of(t)
        host = stats.to_host([row, device_row])
    assert log.ops == []
    assert row[:2] == expected_row(t) == tuple(host[1][:2])


def test_a_row_that_cannot_be_read_back_is_none_not_nan():
    class Unreadable:  # what a tensor type that refuses the transfer leaves
        device = torch.device("cpu")

    rows = stats.to_host([(torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.0)),
                          (Unreadable(), Unreadable(), Unreadable())])
    assert rows[0] == (1.0, 2.0, 0.0)
    assert rows[1] is None


def test_the_infinities_beside_a_nan_are_known_on_cpu():
    for values, expected in (([NAN, 1.0], (False, False)), ([NAN, INF], (True, False)),
                             ([NAN, -INF, 2.0], (False, True)), ([INF, NAN, -INF], (True, True))):
        _, _, nan, posinf, neginf, _ = stats.decode(row_of(torch.tensor(values)))
        assert (nan, posinf, neginf) == (True, *expected), values


# ---- detection rules and report: a value without numbers ------------------------------------
def _recorded_pass(rows):
    """A forward pass of one call whose weight and output have the host `rows` given (None: a
    row that could not be read back)."""
    pass_ = PassRecord()
    call = CallRecord(1, "linear", "Linear", FORWARD, 0, 0, True)
    for role, category, row in zip(("weight", "input[0]", "output"), (PARAM, INPUT, OUTPUT), rows):
        pass_.values.append(row)
        call.slots.append((role, category, VALUE_TENSOR, torch.float32, (2,),
                           len(pass_.values) - 1, next(pass_.seq)))
    pass_.close(call)
    return pass_, call


def test_rows_that_could_not_be_read_back_are_no_detection():
    pass_, call = _recorded_pass([None, [0.5, 1.0, 0.0], None])
    assert not detect.has_problem(pass_, None)
    assert detect.find_in_forward(pass_, GuardOptions()) is None
    frame = frames.build_frame(pass_, call, GuardOptions())
    kinds = [row.kind for row in frame.rows]
    assert kinds == [VALUE_UNSUPPORTED, VALUE_TENSOR, VALUE_UNSUPPORTED]
    assert not frame.nonfinite


def test_a_nan_beside_unreadable_rows_is_still_found():
    pass_, call = _recorded_pass([None, [0.5, 1.0, 0.0], [NAN, NAN, NAN]])
    assert detect.has_problem(pass_, None)
    pass_, call = _recorded_pass([[NAN, NAN, NAN], None, [0.5, 1.0, 0.0]])
    assert detect.has_problem(pass_, None)
    assert detect.find_in_forward(pass_, GuardOptions())[2] == CAUSE_WEIGHTS


def test_fake_tensors_recorded_in_a_pass_are_no_detection():
    pass_ = PassRecord()
    call = CallRecord(1, "0", "Linear", FORWARD, 0, 0, True)
    with FakeTensorMode():
        weight, output = torch.randn(4, 4), torch.full((4,), NAN)
        for role, category, value in (("weight", PARAM, weight), ("output", OUTPUT, output)):
            entry = pass_.summarise(value, (1, role), False, {})
            call.slots.append((role, category, entry[5], value.dtype, entry[4], entry[2], 0))
    pass_.calls.append(call)
    pass_.read_back()
    assert not detect.has_problem(pass_, None)
    assert detect.find_in_forward(pass_, GuardOptions()) is None
    rows = frames.build_frame(pass_, call, GuardOptions()).rows
    assert [row.kind for row in rows] == [VALUE_UNSUPPORTED, VALUE_UNSUPPORTED]


def test_a_report_with_unwatched_values_says_so_instead_of_an_all_clear():
    pass_, call = _recorded_pass([[0.5, 1.0, 0.0], None, None])
    report = frames.make_report([frames.build_frame(pass_, call, GuardOptions())], None, LATEST,
                                "", "", 0, GuardOptions())
    assert report.reason.startswith("2 values were not watched")
    assert "torch.func" in report.reason and "vmap" in report.reason
    pass_, call = _recorded_pass([[0.5, 1.0, 0.0]] * 3)
    report = frames.make_report([frames.build_frame(pass_, call, GuardOptions())], None, LATEST,
                                "", "", 0, GuardOptions())
    assert report.reason == ""


# ---- through the Guard ----------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_a_nan_inside_vmap_of_grad_is_reported_as_not_watched():
    model = _mlp()

    def loss(x):
        return torch.sqrt(model(x) - 100).sum()  # nan: the square root of negatives

    with ng.Guard(model) as guard:
        per_sample = torch.func.vmap(torch.func.grad(loss))(torch.randn(3, 4))
    assert per_sample.isnan().all()
    report = guard.report
    assert report.ok and guard.detection is None
    assert "values were not watched" in report.reason and "vmap" in report.reason
    with ng.Guard(model, trace_batches=[0]) as guard:  # a traced batch says so too
        torch.func.vmap(torch.func.grad(loss))(torch.randn(3, 4))
    assert "values were not watched" in guard.traces[0].reason


def test_torch_export_under_the_guard_is_no_detection_and_changes_nothing():
    def run(guarded):
        model = _mlp()
        x = torch.randn(5, 4)
        if guarded:
            with ng.Guard(model) as guard:
                program = torch.export.export(model, (x,))
            assert guard.detection is None, guard.detection.summary()
        else:
            program = torch.export.export(model, (x,))
        return program.module()(x), model(x)

    assert bit_identical(same_run(lambda: run(False)), same_run(lambda: run(True)))


def test_torch_jit_trace_under_the_guard_is_no_detection_and_changes_nothing():
    def run(guarded):
        model = _mlp()
        x = torch.randn(5, 4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if guarded:
                with ng.Guard(model) as guard:
                    traced = torch.jit.trace(model, (x,))
                assert guard.detection is None, guard.detection.summary()
            else:
                traced = torch.jit.trace(model, (x,))
        ops = sorted(node.kind() for node in traced.inlined_graph.nodes())
        return traced(x), model(x), str(ops)

    assert bit_identical(same_run(lambda: run(False)), same_run(lambda: run(True)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_users_dispatch_mode_counts_the_same_ops_under_the_guard(mode):
    """A logging mode around a training step sees the step's ops, none of the guard's (its
    checks run outside it), and the guard still watches the step."""
    def run(guarded):
        model = _mlp()
        x = torch.randn(5, 4)
        with OpLog() as log:
            if guarded:
                with ng.Guard(model, mode=mode):
                    out = model(x)
                    out.sum().backward()
            else:
                out = model(x)
                out.sum().backward()
        return out, str(log.ops)

    assert bit_identical(same_run(lambda: run(False)), same_run(lambda: run(True)))


class SqrtBelow100(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - 100.0)  # nan for every value below 100


def test_a_gradient_found_after_a_vmap_forward_says_the_forward_was_not_read():
    # the forward ran inside vmap (its values unreadable): the nan gradient a layer gives may
    # come from there, and the reason says so rather than only "received finite"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), SqrtBelow100(), nn.Linear(16, 4))
    with pytest.raises(ng.NonFiniteError) as caught, ng.Guard(model):
        torch.func.vmap(model)(torch.randn(4, 5, 8)).sum().backward()
    assert "could not be read (inside a torch.func transform such as vmap" in str(caught.value)
