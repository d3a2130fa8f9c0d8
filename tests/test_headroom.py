"""The headroom: a run with limit_dtype goes to its end and collects what would not fit in that
dtype (`guard.headroom`), by module, with the first overflow's op; stop_at_limit stops instead;
float8 limits; the views; bounded memory; the notebook session's view and status (the magics
that show it are driven in test_magics.py, whose shell is the one IPython test shell)."""

import os
import sys

import pytest
import torch
from torch import nn

from numguard_nb import Guard, NonFiniteError
from numguard_nb.guard import GuardOptions
from numguard_nb.guard.headroom import Headroom
from numguard_nb.session import HEADROOM_NAME, GuardedRun, Session

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models as M  # noqa: E402
from promises import memory_growth  # noqa: E402

MODELS_FILE = os.path.abspath(M.__file__)
# Widen multiplies by 1000: 1e5 (beyond float16's 65504, finite in float32) in batch 2 only.
SCALES = [1.0, 10.0, 100.0, 50.0, 1.0, 1.0]


class Tiny(nn.Module):
    def forward(self, x):
        return x * 1e-12  # below float16's smallest subnormal 5.96e-08: would be 0


def widening_model():
    """Scale (weights 1) -> Widen: output 1000 * x, weight gradient 1000 * sum of x; ReLU only
    carries Widen's values on."""
    return nn.Sequential(M.Scale(4), M.Widen(), nn.ReLU())


def run_batches(model, scales=SCALES, **options):
    with Guard(model, **options) as guard:
        for scale in scales:
            model(torch.full((2, 4), scale)).sum().backward()
    return guard


def keys(headroom):
    return {(e.module_name, e.phase, e.role, e.kind) for e in headroom}


# ---- a run goes to its end and collects what would not fit --------------------------------------
def test_an_activation_reaching_1e5_is_collected_at_its_batch_and_the_run_goes_on():
    model = widening_model()
    guard = run_batches(model, limit_dtype=torch.float16)
    assert guard.detection is None and guard.batch_number == len(SCALES) - 1
    headroom = guard.headroom
    # the producers only: not the ReLU's output (carried on), not the Sequential's (the same)
    assert keys(headroom) == {("1", "forward", "output", "overflow"),
                              ("0", "backward", "weight.grad", "overflow")}
    output = next(e for e in headroom if e.phase == "forward")
    assert (output.module_class, output.dtype, output.batch_number, output.worst_batch) == (
        "Widen", "float32", 2, 2)
    assert output.abs_max == pytest.approx(99999.0) and output.count == 1
    assert output.share == pytest.approx(99999.0 / 65504.0) and output.share > 1
    grad = next(e for e in headroom if e.phase == "backward")
    assert grad.abs_max == pytest.approx(2e5) and grad.batch_number == 2
    assert len(headroom) == 2 and headroom.overflows == 2 and headroom.underflows == 0
    assert headroom.passes == 2 * len(SCALES) and headroom.batches == (0, len(SCALES) - 1)
    assert [e.share for e in headroom] == sorted((e.share for e in headroom), reverse=True)


def test_values_that_would_flush_to_zero_are_collected_as_underflow():
    model = nn.Sequential(nn.Linear(4, 4), Tiny(), nn.Linear(4, 1))
    torch.manual_seed(0)
    guard = run_batches(model, scales=[1.0, 2.0], limit_dtype="fp16")
    assert guard.detection is None
    entry = next(e for e in guard.headroom if (e.module_name, e.phase) == ("1", "forward"))
    assert (entry.kind, entry.role, entry.count, entry.batch_number) == ("underflow", "output", 2, 0)
    assert entry.nonzero_abs_min < 2.0 ** -24 and entry.share == pytest.approx(
        entry.nonzero_abs_min / 2.0 ** -24)
    assert entry.share < 1 and guard.headroom.overflows == 0
    assert guard.headroom.first is None  # the first *overflow*: none


def test_a_gradient_carried_on_is_credited_to_its_maker_only():
    model = nn.Sequential(M.Scale(4), nn.ReLU(), Tiny())
    guard = run_batches(model, scales=[1.0], limit_dtype=torch.float16)
    # ReLU passes Tiny's 1e-12 gradient back unchanged; Scale's weight gradient sums two of them
    assert keys(guard.headroom) == {("2", "forward", "output", "underflow"),
                                    ("2", "backward", "grad_input[0]", "underflow")}


def test_a_value_grown_from_one_already_beyond_the_limit_is_carried_not_made():
    # A Dropout (1/(1-p)) after a Linear that overflows float16: in float16 the Dropout is
    # handed inf; the Linear alone would overflow
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    with torch.no_grad():
        model[0].weight.fill_(2e4)
    model.train()
    with Guard(model, limit_dtype=torch.float16, backward=False) as guard:
        model(torch.ones(8, 4))
    assert [(e.module_name, e.kind) for e in guard.headroom] == [("0", "overflow")]


def test_to_frame_has_one_row_per_entry_the_worst_first():
    guard = run_batches(widening_model(), limit_dtype=torch.float16)
    frame = guard.headroom.to_frame()
    for column in ("module_name", "phase", "role", "dtype", "abs_max", "share", "kind",
                   "batch_number"):
        assert column in frame.columns
    assert frame[["module_name", "phase", "role", "kind", "batch_number"]].values.tolist() == [
        ["0", "backward", "weight.grad", "overflow", 2], ["1", "forward", "output", "overflow", 2]]
    assert (frame["share"] > 1).all() and set(frame["limit_dtype"]) == {"float16"}
    assert Headroom().to_frame().columns.tolist() == frame.columns.tolist()  # empty, same columns


def test_first_overflow_names_its_op_and_line_with_ops():
    guard = run_batches(widening_model(), limit_dtype=torch.float16, ops=True)
    first = guard.headroom.first
    assert (first.module_name, first.phase, first.batch_number) == ("1", "forward", 2)
    assert [row.role for row in first.flagged_rows] == ["output"]
    assert first.flagged_rows[0].predicted_overflow
    assert first.op == "aten.mul.Tensor"
    assert first.source.startswith(f"{MODELS_FILE}:{M.line_of('limit_mul')}: ")
    assert first.source.endswith("# OP:limit_mul")
    without_ops = run_batches(widening_model(), limit_dtype=torch.float16).headroom.first
    assert without_ops.op is None and without_ops.module_name == "1"


def test_stop_at_limit_stops_at_the_first_predicted_overflow_in_plain_words():
    with pytest.raises(NonFiniteError) as caught:
        run_batches(widening_model(), limit_dtype=torch.float16, stop_at_limit=True)
    report = caught.value.report
    assert (report.first_nonfinite.module_name, report.batch_number) == ("1", 2)
    assert report.reason == (
        "1 (Widen) produced a value beyond float16's largest value 65504 in forward (call 0 of "
        "batch 2): output reaches 1e+05, while its inputs and weights stayed below it "
        "(predicted overflow)")
    # nothing is non-finite: the views say "beyond the range", not "inf/nan"
    assert report.to_text().startswith("Detected a value beyond float16's range during batch_number=2")
    with pytest.raises(NonFiniteError) as caught:
        run_batches(widening_model(), limit_dtype=torch.float16, stop_at_limit=True, ops=True)
    assert "first op past limit_dtype's range: aten.mul.Tensor" in str(caught.value)
    assert "first non-finite op" not in caught.value.report._repr_html_()
    assert Guard(widening_model(), limit_dtype="fp16", stop_at_limit=True).stop_at_limit is True


def test_real_inf_still_stops_the_run_and_the_overflow_before_it_is_collected():
    model = nn.Sequential(M.Widen(), M.Exp())  # 1e5, then exp(1e5) = inf in float32
    with pytest.raises(NonFiniteError) as caught, Guard(model, limit_dtype=torch.float16) as guard:
        model(torch.full((2, 4), 100.0))
    report = caught.value.report
    assert (report.first_nonfinite.module_class, report.cause) == ("Exp", "forward")
    assert "+inf" in report.reason
    assert keys(guard.headroom) == {("0", "forward", "output", "overflow")}


def test_sync_mode_runs_to_the_end_too():
    guard = run_batches(widening_model(), limit_dtype=torch.float16, sync=True)
    assert guard.detection is None and ("1", "forward", "output", "overflow") in keys(guard.headroom)


def test_traced_batches_keep_marking_the_limit_and_are_collected():
    guard = run_batches(widening_model(), limit_dtype=torch.float16, trace_batches=[2])
    trace = guard.traces[2]
    assert trace.first_nonfinite.module_name == "1" and "predicted overflow" in trace.reason
    assert any(row.predicted_overflow for row in trace.first_nonfinite.flagged_rows)
    assert ("1", "forward", "output", "overflow") in keys(guard.headroom)


# ---- float8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [torch.float8_e4m3fn, "float8_e4m3fn", "fp8_e4m3", "e4m3"])
def test_float8_e4m3_flags_a_value_of_1000(limit):
    guard = run_batches(widening_model(), scales=[1.0], limit_dtype=limit)  # 999 > 448
    assert guard.limit_dtype is torch.float8_e4m3fn and guard.options.limit_max == 448.0
    entry = next(e for e in guard.headroom if e.phase == "forward")
    assert (entry.module_name, entry.kind) == ("1", "overflow")
    assert entry.share == pytest.approx(999.0 / 448.0)
    assert "in float8_e4m3fn, " in guard.headroom.summary()


def test_float8_e5m2_has_room_for_1000():
    guard = run_batches(widening_model(), scales=[1.0], limit_dtype="fp8_e5m2")  # max 57344
    assert guard.options.limit_max == 57344.0 and guard.headroom.overflows == 0


@pytest.mark.parametrize("limit", ["fp8", "int8", "float8"])
def test_a_bad_limit_name_is_a_one_line_error_listing_the_names(limit):
    with pytest.raises(ValueError) as caught:
        Guard(widening_model(), limit_dtype=limit)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"limit_dtype {limit!r} is not a float dtype")
    for name in ("float16 (fp16, half)", "bfloat16 (bf16)", "float8_e4m3fn (fp8_e4m3fn, fp8_e4m3, e4m3)",
                 "float8_e5m2 (fp8_e5m2, e5m2)"):
        assert name in message


def test_stop_at_limit_must_be_a_bool():
    with pytest.raises(ValueError, match="stop_at_limit must be True or False, got 'yes'"):
        Guard(widening_model(), limit_dtype="fp16", stop_at_limit="yes")


# ---- no false entries ---------------------------------------------------------------------------
def test_a_healthy_run_has_an_empty_headroom():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(70_000, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    ids = torch.tensor([[0, 3, 69_999, 65_600]])  # integers beyond 65504 are no overflow
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, limit_dtype=torch.float16) as guard:
        for _ in range(5):
            optimizer.zero_grad()
            model(ids).pow(2).mean().backward()  # ReLU's zeros are no underflow
            optimizer.step()
    assert len(guard.headroom) == 0 and list(guard.headroom) == [] and guard.headroom.first is None
    assert guard.headroom.summary() == (
        "in float16, every value fits (none beyond its largest value 65504, none below its "
        "smallest subnormal 5.96e-08); batches 0-4, 10 passes")
    assert len(run_batches(widening_model()).headroom) == 0  # no limit_dtype: nothing collected


# ---- the views ----------------------------------------------------------------------------------
def test_the_text_and_html_views(golden):
    torch.manual_seed(0)
    model = nn.Sequential(M.Scale(4), M.Widen(), Tiny())
    guard = run_batches(model, scales=[1.0, 100.0, 30.0, 100.0], limit_dtype=torch.float16)
    golden("headroom.txt", guard.headroom.to_text() + "\n")
    golden("headroom.html", guard.headroom._repr_html_() + "\n")
    assert repr(guard.headroom) == guard.headroom.to_text()
    lines = guard.headroom.to_text().splitlines()
    assert lines[1].startswith("first overflow: 1 (Widen) forward output in batch 1")
    assert lines[2].startswith("  overflow ") and lines[-1].startswith("  underflow ")


class Branches(nn.Module):
    """24 heads on one input, each overflowing float8_e4m3fn's 448 by itself."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(4, 4) for _ in range(24))
        with torch.no_grad():
            for index, head in enumerate(self.heads):
                head.weight.fill_(120.0 + index)

    def forward(self, x):
        return torch.stack([head(x) for head in self.heads]).sum(0)


def test_the_views_show_the_worst_first_and_say_how_many_more():
    guard = run_batches(Branches(), scales=[1.0], limit_dtype="float8_e4m3fn")
    lines = guard.headroom.to_text().splitlines()
    assert len(guard.headroom) > 20 and len(lines) == 2 + 20 + 1  # summary, first, 20, more
    assert lines[-1] == f"  ... and {len(guard.headroom) - 20} more (.to_frame() has them all)"
    assert "more (.to_frame() has them all)" in guard.headroom._repr_html_()


def test_without_a_limit_the_views_say_how_to_set_one():
    assert Headroom().to_text().startswith("headroom: no limit_dtype set")
    assert "no limit_dtype set" in Headroom()._repr_html_()


# ---- memory -------------------------------------------------------------------------------------
def test_memory_stays_bounded_over_many_batches_with_overflows_in_each():
    model = nn.Sequential(M.Scale(4), M.Widen(), Tiny())
    x = torch.full((2, 4), 100.0)
    with Guard(model, limit_dtype=torch.float16) as guard:
        def step():
            model(x).sum().backward()

        grown = memory_growth(step, steps=3000)
    assert keys(guard.headroom) == {("1", "forward", "output", "overflow"),
                                    ("2", "backward", "grad_input[0]", "underflow")}
    assert all(e.count == 3050 for e in guard.headroom)  # warm-up 50 + 3000
    assert grown < 48 * 1024, grown  # what a run of any length holds anyway (the guard's caches)


# ---- the notebook session (the magics' engine; the magics themselves: test_magics.py) -----------
def test_each_cell_that_ran_shows_the_headroom_kept_in_the_namespace_and_status_counts():
    model = widening_model()
    namespace = {"model": model}
    session = Session()
    run = GuardedRun(namespace, {"model": model}, GuardOptions(limit_dtype=torch.float16))
    session.start(run)
    session.before_cell("for scale in SCALES: ...")
    for scale in SCALES:
        model(torch.full((2, 4), scale)).sum().backward()
    shown = session.after_cell(True, None)
    assert shown.views == [run.guard.headroom] and namespace[HEADROOM_NAME] is run.guard.headroom
    session.before_cell("y = 1")
    assert session.after_cell(True, None).views == []  # nothing ran: nothing new to show
    assert session.status().endswith(
        "; in float16, 2 predicted overflow(s) and 0 underflow(s) in _numguard_headroom")
    session.stop()


def test_a_quiet_run_keeps_the_headroom_without_showing_it_and_no_limit_shows_none():
    model = widening_model()
    namespace = {"model": model}
    quiet = GuardedRun(namespace, {"model": model}, GuardOptions(limit_dtype="bf16"), quiet=True)
    with quiet.guard:
        model(torch.ones(2, 4)).sum().backward()
    assert quiet.show_headroom().views == [] and namespace[HEADROOM_NAME] is quiet.guard.headroom
    plain = GuardedRun({}, {"model": model}, GuardOptions())
    with plain.guard:
        model(torch.ones(2, 4)).sum().backward()
    assert plain.show_headroom().views == [] and "; in " not in Session().status()


def test_stop_at_limit_names_data_already_beyond_the_limit_in_forward():
    # every forward overflow is inherited from the input: the data is where it starts
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(NonFiniteError) as raised, \
            Guard(model, limit_dtype=torch.float16, stop_at_limit=True):
        model(torch.randn(3, 4) * 1e5).sum().backward()
    report = raised.value.report
    assert (report.cause, report.phase, report.first_nonfinite.module_name) == ("data", "forward", "")
    assert report.reason.startswith("the data fed to Sequential in batch 0 is beyond float16's "
                                    "largest value 65504 (input[0] reaches")
    assert "standardise" in report.hint and "samples holding" not in str(raised.value)


class _GatedMLP(nn.Module):
    """Llama's MLP in float32: `down(act(gate(x)) * up(x))`, its product past 65504 made by its
    own code, then brought back within by `down`. Its causal-mask-like helper hands `scores` an
    additive mask filled with torch.finfo(float32).min, which is no overflow."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.scores = _AddMask()
        with torch.no_grad():
            for layer, scale in ((self.gate, 300.0), (self.up, 300.0), (self.down, 1e-3)):
                layer.weight.copy_(torch.eye(4) * scale)
                layer.bias.zero_()

    def forward(self, x):
        mask = torch.full((4, 4), torch.finfo(torch.float32).min).triu(1)
        return self.scores(self.down(nn.functional.silu(self.gate(x)) * self.up(x)), mask)


class _AddMask(nn.Module):
    def forward(self, h, mask):
        return torch.softmax(h[:, None, :] + mask, -1)


def test_an_overflow_a_module_s_own_code_hands_a_submodule_is_credited_to_it():
    model = _GatedMLP()
    with Guard(model, limit_dtype=torch.float16, ops=True) as guard:
        model(torch.ones(2, 4))
    overflows = [(e.module_name, e.role) for e in guard.headroom.entries() if e.kind == "overflow"]
    assert overflows == [("", "input[0] of down")]  # not the mask (finfo(float32).min)
    first = guard.headroom.first
    assert (first.module_name, first.op) == ("", "aten.mul.Tensor")
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, limit_dtype=torch.float16, stop_at_limit=True):
            model(torch.ones(2, 4))
    report = caught.value.report
    assert (report.cause, report.first_nonfinite.module_name) == ("forward-inline", "")
    assert report.reason.startswith(
        "_GatedMLP produced a value beyond float16's largest value 65504 in forward (call 0 of "
        "batch 0), in its own code between its submodules: input[0] of down reaches 9e+04")


def test_a_run_s_headroom_can_be_copied_and_pickled_to_keep_it():
    import copy
    import pickle

    guard = run_batches(widening_model(), limit_dtype=torch.float16)
    for kept in (copy.deepcopy(guard.headroom), pickle.loads(pickle.dumps(guard.headroom))):
        assert kept.to_text() == guard.headroom.to_text() and len(kept) == len(guard.headroom)
