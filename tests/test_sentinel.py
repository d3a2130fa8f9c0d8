"""Sentinel mode: a whole run watched at almost no cost, and full mode's diagnosis when it breaks.

The re-run must name what full mode names (forward, backward, data, weights, a loss outside the
model, two models), through compiled models too (named as the original model); tell a fault
that does not repeat (transient) and one made by compiled code; survive gradient accumulation,
inputs changed in place and interrupts; keep memory flat, change nothing and leave nothing
behind; and be reachable from the magics and both callbacks.
"""

from __future__ import annotations

import copy
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks

from models import EatsInput, Exp, FirstCallOnly, LogNet, SqrtOfZero, SqrtOfZeroPlusInput, SqrtWeight
from numguard_nb import Guard, NonFiniteError
from numguard_nb.guard import GuardOptions
from numguard_nb.guard.sentinel import _top_of
from promises import bit_identical, hooks_left, memory_growth, model_state, same_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from diagnosis_cases import CASES_BY_NAME, run_steps  # noqa: E402


def x4(rows: int = 3, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(1)) * scale


def exp_net() -> nn.Sequential:
    """Overflows to inf in module "1" for inputs around 100."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Exp(), nn.Linear(4, 2))


def culprit(report) -> tuple:
    """Everything a detection says about its culprit."""
    frame = report.first_nonfinite
    return (frame.module_name, frame.module_class, frame.phase, frame.call_index,
            report.batch_number, report.cause, frame.op, frame.source, report.reason, report.hint)


def caught(run) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as error:
        run()
    return error.value


def leads_with_the_culprit(error: BaseException) -> bool:
    """The message starts with the one-line verdict (then the op, the line and the hint)."""
    return str(error).splitlines()[0] == error.report.summary()


# ---- the option --------------------------------------------------------------------------------
def test_mode_is_full_by_default_and_anything_else_is_refused_in_one_line():
    assert Guard(exp_net()).mode == "full" and Guard(exp_net(), mode="sentinel").mode == "sentinel"
    for make in (lambda: Guard(exp_net(), mode="fast"), lambda: GuardOptions(mode="fast")):
        with pytest.raises(ValueError) as error:
            make()
        assert str(error.value) == """mode must be "full" or "sentinel", got 'fast'"""
    assert "mode:" in Guard.__doc__


# ---- the re-run names what full mode names -----------------------------------------------------
def _first_detection(case_name: str, mode: str):
    run = CASES_BY_NAME[case_name].build()
    models = run.models if len(run.models) > 1 else run.models[""]
    try:
        with Guard(models, mode=mode, ops=True):
            run_steps(run)
    except NonFiniteError as error:
        assert leads_with_the_culprit(error)
        return error.report
    return None


@pytest.mark.parametrize("case_name", [
    "masked_mean_empty",  # forward, a module's own division
    "t5_ff_fp16_overflow",  # forward, deep in a model
    "distance_at_zero",  # backward only
    "bce_fp16_backward",  # backward, in a loss module guarded beside the model
    "nan_in_data",  # the data
    "adam_eps_fp16",  # weights an optimizer wrote
])
def test_the_re_run_names_what_full_mode_names(case_name):
    full = _first_detection(case_name, "full")
    sentinel = _first_detection(case_name, "sentinel")
    assert full is not None and sentinel is not None
    assert culprit(sentinel) == culprit(full)
    assert full.found_by == "" and sentinel.found_by == "re-run"
    assert "found by: re-running the failing call" in sentinel.to_text()
    assert '<div class="ng-note">found by: re-running' in sentinel._repr_html_()
    assert "found by" not in full.to_text() and "found by" not in full._repr_html_()
    assert sentinel.first_nonfinite.flagged_rows


def test_nan_data_that_also_broke_the_running_statistics_is_named_as_the_data():
    """BatchNorm's running statistics take the bad batch's nan in the call itself: the re-run,
    which comes after, must still name the data (as full mode does), not statistics "gone bad in
    an earlier batch", and leave the statistics as the call left them."""
    def run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        x = torch.randn(16, 4)
        x[3, 2] = float("nan")
        if mode is None:
            model(x)
            return None, model
        with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
            model(x)
        return caught.value.report, model

    full, _ = run("full")
    sentinel, model = run("sentinel")
    _, unguarded = run(None)
    assert (sentinel.cause, culprit(sentinel)) == (full.cause, culprit(full)) == ("data", culprit(full))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(model[1], name).nan_to_num(7.0),
                           getattr(unguarded[1], name).nan_to_num(7.0)), name


def test_a_loss_made_outside_the_model_is_named_by_the_outside_watch_as_in_full_mode():
    # No re-run can repeat the user's loss code: the watch over it runs in sentinel mode too.
    full = _first_detection("handwritten_bce_log0", "full")
    sentinel = _first_detection("handwritten_bce_log0", "sentinel")
    assert (full.first_nonfinite.module_name, full.cause) == ("<outside>", "outside")
    assert culprit(sentinel) == culprit(full) and sentinel.cause == full.cause
    assert sentinel.first_nonfinite.op == full.first_nonfinite.op == "aten.log.default"
    assert sentinel.first_nonfinite.source == full.first_nonfinite.source
    assert sentinel.batch_number == full.batch_number


def test_a_regularizer_on_the_weights_whose_gradient_is_nan_is_named_as_in_full_mode():
    # sqrt(sum((w - w0)^2)) at w == w0: its gradient is infinite, made in the loop, from no
    # model output.
    def detect(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        anchor = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
            loss = model(x4()).pow(2).mean()
            for p, a in zip(model.parameters(), anchor):
                loss = loss + 1e-3 * (p - a).pow(2).sum().sqrt()
            loss.backward()
        return caught.value.report

    full, sentinel = detect("full"), detect("sentinel")
    assert full.cause == sentinel.cause == "outside" and full.phase == sentinel.phase == "backward"
    assert culprit(sentinel) == culprit(full)
    assert sentinel.first_nonfinite.op == full.first_nonfinite.op
    assert sentinel.first_nonfinite.op == "SqrtBackward0: aten.sqrt.default"


@pytest.mark.parametrize("case_name", ["trap_padding_mask", "trap_causal_mask"])
def test_masks_carrying_inf_are_no_problem_to_the_sentinel_either(case_name):
    assert _first_detection(case_name, "sentinel") is None


class Policy(nn.Module):
    """Returns what holds its tensors as attributes (a torch.distributions object, RL's way)."""

    def __init__(self, backward_fault=False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), SqrtOfZero() if backward_fault else nn.Tanh(),
                                 nn.Linear(8, 3))

    def forward(self, obs):
        return torch.distributions.Categorical(logits=self.net(obs), validate_args=False)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("fault", ["data", "backward"])
def test_a_model_returning_a_distribution_is_checked_as_one_returning_tensors(fault, mode):
    torch.manual_seed(0)
    policy = Policy(backward_fault=fault == "backward")
    observations = [torch.randn(8, 4) for _ in range(3)]
    if fault == "data":
        observations[2][1, 1] = float("nan")
    with pytest.raises(NonFiniteError) as raised, Guard(policy, mode=mode):
        for obs in observations:
            (-policy(obs).log_prob(torch.zeros(8, dtype=torch.long)).mean()).backward()
    report = raised.value.report
    if fault == "data":
        assert (report.cause, report.batch_number) == ("data", 2)
    else:
        assert (report.cause, report.phase, report.first_nonfinite.module_name) == (
            "backward", "backward", "net.1")


class NanLogits(nn.Module):
    """Makes nan in its own code, into what it returns: a distribution holds it as an attribute."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 3)

    def forward(self, obs):
        logits = self.net(obs)
        return torch.distributions.Categorical(logits=logits / (logits - logits), validate_args=False)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_made_into_a_returned_distribution_names_the_model(mode):
    model = NanLogits()
    with pytest.raises(NonFiniteError) as raised, Guard(model, mode=mode), torch.no_grad():
        model(x4())
    report = raised.value.report
    assert (report.cause, report.first_nonfinite.module_name) == ("forward", "")
    assert [row.role for row in report.first_nonfinite.flagged_rows] == ["output.logits"]


class Out:
    def __init__(self, mean, log_std):
        self.mean, self.log_std = mean, log_std


class GaussianPolicy(nn.Module):
    """Returns its own parameter (log_std) beside what it computes, in a tuple or an object."""

    def __init__(self, as_tuple):
        super().__init__()
        self.net, self.log_std, self.as_tuple = nn.Linear(4, 2), nn.Parameter(torch.zeros(2)), as_tuple

    def forward(self, x):
        mean = self.net(x)
        return (mean, self.log_std) if self.as_tuple else Out(mean, self.log_std)


@pytest.mark.parametrize("as_tuple", [True, False])
def test_a_parameter_a_model_returns_gathers_no_hook_from_call_to_call(as_tuple):
    policy = GaussianPolicy(as_tuple)
    with Guard(policy, mode="sentinel"):
        for _ in range(20):
            out = policy(x4(8))
            mean, log_std = out if as_tuple else (out.mean, out.log_std)
            (mean.pow(2).mean() + log_std.sum()).backward()
        assert len(policy.log_std._backward_hooks or {}) <= 1
    with pytest.raises(NonFiniteError) as raised, Guard(policy, mode="sentinel"):  # still checked
        out = policy(x4(8))
        mean, log_std = out if as_tuple else (out.mean, out.log_std)
        (mean.pow(2).mean() + log_std.sqrt().sum() * 0).backward()  # sqrt'(0) * 0: nan
    assert raised.value.report.cause in ("outside", "backward")


def test_a_clean_run_reports_the_outputs_it_checked():
    model = exp_net()
    with Guard(model, mode="sentinel", max_frames=3) as guard:
        for _ in range(5):
            model(x4()).sum().backward()
    report = guard.report
    assert report.ok and guard.detection is None
    assert [(f.module_name, f.phase, f.batch_number) for f in report.frames] == [
        ("", "forward", 2), ("", "forward", 3), ("", "forward", 4)]
    assert 'mode="sentinel": 10 passes checked' in report.summary()


# ---- compiled models -------------------------------------------------------------------------
@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


def log_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), LogNet())


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("what", ["model", "submodule"])
def test_a_compiled_model_is_re_run_eagerly_and_named_as_the_original(dynamo, backend, what):
    expected = caught(lambda: _guarded_steps(log_model(), "full")).report
    model = log_model()
    if what == "model":
        target = torch.compile(model, backend=backend)
    else:
        model[1] = torch.compile(model[1], backend=backend)
        target = model
    target(x4()).sum().backward()  # compiled before the guard attaches
    graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    before = hooks_left(target)
    report = caught(lambda: _guarded_steps(target, "sentinel", graphs, dynamo)).report
    assert hooks_left(target) == before
    assert culprit(report) == culprit(expected)
    assert report.first_nonfinite.op == "aten.log.default" and report.found_by == "re-run"
    names = {frame.module_name for frame in report.frames}
    assert {"1.first", "1"} <= names and not any("_orig_mod" in name for name in names)


def _guarded_steps(model, mode, graphs=None, dynamo=None):
    with Guard(model, mode=mode, ops=True):
        for _ in range(3):
            model(x4()).sum().backward()
        if graphs is not None:
            assert dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
        model(x4(scale=1000))


def test_a_model_compiled_in_place_is_named_as_out_of_reach(dynamo):
    model = exp_net()
    model.compile(backend="eager")
    with pytest.warns(UserWarning, match=r"compiled in place \(module.compile\(\)\)"):
        Guard(model, mode="sentinel").attach().detach()


def test_full_mode_on_a_compiled_model_re_runs_the_call_eagerly_and_names_the_submodule(dynamo):
    expected = caught(lambda: _guarded_steps(log_model(), "full")).report
    compiled = torch.compile(log_model(), backend="eager")
    error = caught(lambda: _guarded_steps(compiled, "full"))
    text = str(error) + error.report.to_text()
    assert culprit(error.report)[:8] == culprit(expected)[:8] and culprit(expected)[:2] == ("1", "LogNet")
    assert error.report.reason.startswith(expected.reason)
    assert error.report.first_nonfinite.op == expected.first_nonfinite.op == "aten.log.default"
    assert "first seen in compiled code (torch.compile)" in str(error)
    assert error.report.found_by == "re-run"
    assert "OptimizedModule" not in text and "_orig_mod." not in text


def test_full_mode_tells_what_only_compiled_code_makes(dynamo):
    torch.manual_seed(0)
    compiled = torch.compile(nn.Sequential(OnlyWhenCompiled()), backend="eager")
    with pytest.raises(NonFiniteError) as raised, Guard(compiled):
        compiled(x4())
    assert raised.value.report.cause == "compiled-code"


class OnlyWhenCompiled(nn.Module):
    """Divides by zero only in the graph Dynamo captures: eager runs stay finite."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        if torch.compiler.is_compiling():
            h = h / 0
        return h


def nan_kernels(graph_module, example_inputs):
    """A backend whose 'generated kernels' turn every floating output into nan."""
    def run(*args):
        return type(outputs := graph_module(*args))(
            o * float("nan") if isinstance(o, torch.Tensor) and o.is_floating_point() else o
            for o in outputs)
    return run


@pytest.mark.parametrize("block, backend, where", [
    (OnlyWhenCompiled, "eager", "graph capture"), (Exp, nan_kernels, "generated kernels")])
def test_what_only_compiled_code_makes_is_told_apart(dynamo, block, backend, where):
    torch.manual_seed(0)
    model = torch.compile(nn.Sequential(nn.Linear(4, 4), block()), backend=backend)
    with Guard(model, mode="sentinel"):
        report = caught(lambda: model(x4())).report
    assert report.cause == "compiled-code" and report.found_by == "re-run"
    assert "not when re-run eagerly" in report.reason and where in report.reason
    assert report.first_nonfinite.flagged_rows[0].role == "output"


# ---- faults that do not repeat -------------------------------------------------------------------
class NanGradientOnce(torch.autograd.Function):
    """Identity forward; its first backward ever returns nan."""

    backwards = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        NanGradientOnce.backwards += 1
        return grad * float("nan") if NanGradientOnce.backwards == 1 else grad


class FirstBackwardOnly(nn.Module):
    def forward(self, x):
        return NanGradientOnce.apply(x)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_fault_that_does_not_repeat_is_called_transient(phase):
    torch.manual_seed(0)
    odd = FirstCallOnly() if phase == "forward" else FirstBackwardOnly()
    model = nn.Sequential(nn.Linear(4, 4), odd, nn.Linear(4, 2))
    odd.calls = NanGradientOnce.backwards = 1  # past their first: batch 0 runs clean
    with Guard(model, mode="sentinel"):
        model(x4()).sum().backward()
        odd.calls = NanGradientOnce.backwards = 0  # the fault, once, in batch 1
        error = caught(lambda: model(x4()).sum().backward())
    report = error.report
    assert report.cause == "transient" and report.found_by == "re-run" and leads_with_the_culprit(error)
    assert report.batch_number == 1 and report.phase == phase and report.rank is None
    assert "did not repeat" in report.reason and report.hint
    rows = report.first_nonfinite.flagged_rows
    assert rows and all(row.nonfinite for row in rows)
    assert rows[0].role == ("output" if phase == "forward" else "0.weight.grad")


def test_a_transient_fault_in_many_gradients_names_a_few_in_the_error_and_keeps_them_all():
    # a 12-layer model's backward: its error's first line was 7,000 characters of names
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)], FirstBackwardOnly())
    NanGradientOnce.backwards = 0
    with Guard(model, mode="sentinel"):
        error = caught(lambda: model(x4()).sum().backward())
    report = error.report
    first_line = str(error).splitlines()[0]
    assert report.cause == "transient" and len(first_line) < 600, first_line
    assert "; and 21 more (the report's rows)" in first_line
    assert len(report.first_nonfinite.flagged_rows) == 24


# ---- the gradients a backward re-run starts from -------------------------------------------------
def test_only_outputs_nothing_else_was_computed_from_keep_the_gradient_they_get():
    weight = torch.ones(3, requires_grad=True)
    logits = weight * 2
    loss = logits.sum()  # a model's loss, computed from its logits
    hidden = weight.exp()  # independent of both
    pieces = logits.split(1)  # outputs of one node
    # The logits' gradient comes from the loss, inside the model: a re-run must not add it again.
    assert _top_of([loss, logits, hidden, weight]) == (True, False, True, True)
    assert _top_of([pieces[0], pieces[1], pieces[0].sum()]) == (False, True, True)


# ---- training loops ----------------------------------------------------------------------------
class Norm(nn.Module):
    """Row norms written out: the gradient of a zero row is inf * 0."""

    def forward(self, x):
        return torch.sqrt((x * x).sum(-1, keepdim=True))


def test_gradient_accumulation_finds_the_micro_batch_and_leaves_grad_as_backward_made_it():
    def micro_batches():
        batches = [x4(4) for _ in range(6)]
        batches[3][2] = 0.0  # step 1, second micro-batch: a zero row
        return batches

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4, bias=False), Norm(), nn.Linear(1, 1))

    def train(model, stop_at=None):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        with torch.no_grad():
            model[0].weight.copy_(torch.eye(4))  # a zero row of x stays zero
        for index, x in enumerate(micro_batches()):
            model(x).sum().backward()
            if index == stop_at:
                return
            if index % 2:
                optimizer.step()
                optimizer.zero_grad()

    full = caught(lambda: _run_with(Guard(build(), ops=True), train)).report
    model = build()
    with Guard(model, mode="sentinel"):
        report = caught(lambda: train(model)).report
    assert culprit(report) == culprit(full) and report.batch_number == 3
    twin = build()
    train(twin, stop_at=3)
    grads = [[p.grad for p in m.parameters()] for m in (model, twin)]
    assert grads[0][2].isfinite().all() and bit_identical(*grads)  # none accumulated twice


def _run_with(guard, train):
    with guard:
        train(guard.models[""])


def test_inputs_a_model_changes_in_place_are_copied_for_the_re_run():
    def run(mode):
        torch.manual_seed(0)
        model = nn.Sequential(EatsInput(), nn.Linear(4, 2))
        with Guard(model, mode=mode, ops=True):
            for scale in (1.0, 1.0, -1.0):  # log of negative values: nan in batch 2
                model(x4().abs() * scale)
    full, sentinel = caught(lambda: run("full")).report, caught(lambda: run("sentinel")).report
    assert culprit(sentinel) == culprit(full) and "holds nan" in sentinel.reason


class StandardisesInPlace(nn.Module):
    def forward(self, x):
        return x.sub_(x.mean(0, keepdim=True)).div_(x.std(0, keepdim=True))  # one sample: 0/nan


def test_a_first_call_that_rewrote_its_input_does_not_have_the_data_blamed_alone():
    # not copied before the first call, which it changed: the re-run reads what the call left
    torch.manual_seed(0)
    model = nn.Sequential(StandardisesInPlace(), nn.Linear(4, 2))
    with pytest.raises(NonFiniteError) as raised, Guard(model, mode="sentinel"):
        model(torch.randn(1, 4))
    assert raised.value.report.cause == "data"
    assert "but the call changed its inputs in place" in raised.value.report.reason


def test_an_interrupted_call_does_not_blind_the_sentinel():
    class Interrupt(nn.Module):
        armed = False

        def forward(self, x):
            if self.armed:
                raise KeyboardInterrupt
            return x

    torch.manual_seed(0)
    stop = Interrupt()
    model = nn.Sequential(nn.Linear(4, 4), stop, Exp())
    with Guard(model, mode="sentinel"):
        stop.armed = True
        with pytest.raises(KeyboardInterrupt):
            model(x4())
        stop.armed = False
        report = caught(lambda: model(x4(scale=1000))).report
    assert culprit(report)[:2] == ("2", "Exp")


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 2))
        self.norm = nn.BatchNorm1d(2)

    def forward(self, x):
        return self.norm(self.body(x))


def _train(model, steps=5):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    results = []
    for step in range(steps):
        out = model(x4(8))
        loss = F.mse_loss(out, torch.ones_like(out))
        loss.backward()
        results.append((out, loss, [p.grad.clone() for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
    return results, model.state_dict()


def test_outputs_gradients_and_random_state_are_bit_identical():
    def build():
        torch.manual_seed(0)
        return Dropped()

    plain, model = build(), build()
    expected = same_run(lambda: _train(plain))
    with Guard(model, mode="sentinel") as guard:
        got = same_run(lambda: _train(model))
    assert bit_identical(got, expected) and guard.detection is None


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_re_run_leaves_weights_buffers_gradients_and_random_state_as_the_step_left_them(phase):
    def build():
        torch.manual_seed(0)
        odd = Exp() if phase == "forward" else SqrtOfZeroPlusInput()
        return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), odd, nn.BatchNorm1d(8))

    def step(model, backward=True):
        torch.manual_seed(1)
        out = model(x4(8, scale=1000 if phase == "forward" else 1))
        if backward:  # random numbers drawn after the forward too: a re-run must not rewind them
            (out.sum() + torch.rand(()) * 0).backward()

    twin, model = build(), build()
    step(twin, backward=phase == "backward")  # unguarded, up to where the guard stops
    expected = (model_state(twin), torch.get_rng_state())
    with Guard(model, mode="sentinel"):
        assert caught(lambda: step(model)).report.phase == phase
    assert bit_identical((model_state(model), torch.get_rng_state()), expected)


def test_memory_stays_flat_over_2000_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = x4()

    def step():
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        model(x)  # evaluation with grad on: an output whose backward never comes

    with Guard(model, mode="sentinel") as guard:
        grown = memory_growth(step, 2000)
        assert not guard._sentinel.tasks and len(guard._sentinel._grad_handles) < 200
    assert grown < 64 * 1024, f"{grown} bytes more after 2000 steps"


def test_a_parameter_set_while_guarded_has_its_gradient_checked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtWeight(), nn.Linear(4, 2))
    with Guard(model, mode="sentinel"):
        model(x4()).sum().backward()
        model[1].w = nn.Parameter(torch.zeros(4))  # a new parameter, unknown at attach
        report = caught(lambda: model(x4()).sum().backward()).report
    assert report.first_nonfinite.module_name == "1" and report.phase == "backward"
    assert [row.role for row in report.frames[-1].rows if row.flagged] == ["w.grad"]


class SlicesItsLayers(nn.Module):
    """Hugging Face's Llama slices its layers in forward: a new ModuleList (and a registration
    per layer in it) each call."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_a_forward_building_a_container_each_call_looks_the_parameters_up_once():
    torch.manual_seed(0)
    model = SlicesItsLayers()
    with Guard(model, mode="sentinel") as guard:
        model(x4()).sum().backward()
        known = guard._sentinel.parts.parameters()
        for _ in range(3):
            model(x4()).sum().backward()
        assert guard._sentinel.parts.parameters() is known  # (not once per step)
        bad = SqrtWeight()
        with torch.no_grad():
            bad.w.zero_()  # sqrt(0): its gradient is inf
        model.layers[1] = bad  # joins the model: looked up again, its gradient checked
        report = caught(lambda: model(x4()).sum().backward()).report
    assert report.first_nonfinite.module_name == "layers.1" and report.phase == "backward"


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_distributed_model_is_re_run_inside_its_wrapper_on_this_rank_alone(tmp_path, phase):
    import torch.distributed as dist

    class CountingDDP(nn.parallel.DistributedDataParallel):
        calls = 0  # forwards of the wrapper: each one starts collectives on every rank

        def forward(self, *args, **kwargs):
            CountingDDP.calls += 1
            return super().forward(*args, **kwargs)

    def run(mode):
        torch.manual_seed(0)
        odd = Exp() if phase == "forward" else SqrtOfZeroPlusInput()
        model = CountingDDP(nn.Sequential(nn.Linear(4, 4), odd))
        CountingDDP.calls = 0
        with Guard(model, mode=mode, ops=True):
            model(x4()).sum().backward()
            model(x4(scale=1000 if phase == "forward" else 1)).sum().backward()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        full, sentinel = caught(lambda: run("full")).report, caught(lambda: run("sentinel")).report
        # the user's calls up to the detection: the re-runs went inside the wrapper
        assert CountingDDP.calls == (2 if phase == "forward" else 1)
    finally:
        dist.destroy_process_group()
    # Full mode's op localisation re-runs the DDP wrapper itself, which DDP refuses in backward.
    assert culprit(sentinel)[:6] == culprit(full)[:6] and sentinel.reason == full.reason
    assert sentinel.first_nonfinite.module_name == "module.1" and sentinel.phase == phase
    assert sentinel.first_nonfinite.op.endswith("aten.exp.default" if phase == "forward"
                                                else "aten.div.Tensor")
    assert sentinel.rank == 0


# ---- nothing left behind -------------------------------------------------------------------
def test_nothing_is_left_behind_on_any_exit_path():
    model = exp_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = []

    def forward_nan():
        model(x4(scale=1000))

    def backward_nan():
        with torch.no_grad():
            model[2].weight[0, 0] = 0.0
        out = model(x4())
        (out * torch.tensor([float("nan"), 1.0])).sum().backward()

    def raises():
        model(torch.randn(3, 5))

    def unused_output():
        kept.append(model(x4()))  # a backward that never comes: its hooks go on detach

    before = hooks_left(model, optimizers=[optimizer])
    for exit_path in (forward_nan, backward_nan, raises, unused_output):
        try:
            with Guard(model, mode="sentinel"):
                assert hooks_left(copy.deepcopy(model)) == hooks_left()  # copies: unwatched
                exit_path()
        except (NonFiniteError, RuntimeError):
            pass
        assert hooks_left(model, optimizers=[optimizer], tensors=kept) == before, exit_path
    assert kept[0].grad_fn is not None


# ---- running chosen batches with the full hooks ------------------------------------------------
def test_sampled_batches_keep_the_history_with_the_full_hooks():
    model = exp_net()
    with Guard(model, mode="sentinel", history_every=2) as guard:
        for _ in range(5):
            model(x4()).sum().backward()
    history = guard.history
    assert history.samples_taken == 3 and history.every == 2  # batches 0, 2 and 4
    assert hooks_left(model) == [] and guard.detection is None


def test_traced_batches_run_with_the_full_hooks():
    model = exp_net()
    traced = []
    with Guard(model, mode="sentinel", trace_batches=[1, 2], on_trace=traced.append) as guard:
        for _ in range(4):
            model(x4()).sum().backward()
        error = caught(lambda: model(x4(scale=1000)))
    assert sorted(guard.traces) == [1, 2] and {r.batch_number for r in traced} == {1, 2}
    names = {(f.module_name, f.phase) for f in guard.traces[1].frames}
    assert {("1", "forward"), ("2", "backward"), ("", "forward")} <= names
    assert error.report.batch_number == 4 and error.report.found_by == "re-run"
    assert hooks_left(model) == []


# ---- loss scaling ------------------------------------------------------------------------
def _scaled_run(mode: str, case_name: str = "trap_grad_scaler_warmup", **options):
    run = CASES_BY_NAME[case_name].build()
    guard = Guard(run.models[""], mode=mode, scaler=run.scaler, **options)
    try:
        with guard:
            run_steps(run)
    except NonFiniteError:
        pass
    return guard


def test_the_overflows_a_grad_scaler_skips_are_let_through_and_recorded_as_in_full_mode():
    full, sentinel = _scaled_run("full"), _scaled_run("sentinel")
    assert full.detection is None and sentinel.detection is None
    assert [step.batch for step in sentinel.skipped_steps] == [s.batch for s in full.skipped_steps]
    assert [step.scale for step in sentinel.skipped_steps] == [s.scale for s in full.skipped_steps]
    assert sentinel.skipped_steps and "GradScaler skipped" in sentinel.report.summary()


class ScaledSqrt(nn.Module):
    """A nan gradient at every loss scale: sqrt at 0 in backward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.sqrt = SqrtOfZeroPlusInput()

    def forward(self, x):
        return self.sqrt(self.linear(x)).sum()


def test_an_overflow_lowering_the_scale_does_not_cure_is_raised_as_in_full_mode():
    def run(mode):
        torch.manual_seed(0)
        model = ScaledSqrt()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        with Guard(model, mode=mode, scaler=scaler, max_skipped_steps=2, ops=True) as guard:
            for _ in range(5):
                scaler.scale(model(x4())).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        return guard

    full = caught(lambda: run("full")).report
    sentinel = caught(lambda: run("sentinel")).report
    assert culprit(sentinel)[:8] == culprit(full)[:8] and sentinel.batch_number == 2
    assert "does not cure this" in sentinel.reason and sentinel.found_by == "re-run"


# ---- the magics ----------------------------------------------------------------------------
@pytest.fixture
def shell(ipython):
    ipython.run_cell("%load_ext numguard_nb")
    ipython.reset(new_session=False)
    assert ipython.run_cell(
        "import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))\n"
        "xs = [torch.randn(3, 4) for _ in range(4)]\nxs[3] = xs[3] * float('inf')\n").success
    yield ipython
    ipython.run_cell("%numguard off")
    ipython.run_cell("%unload_ext numguard_nb")


def test_the_magics_take_sentinel(shell):
    from IPython.utils.capture import capture_output

    loop = "for x in xs:\n    net(x).sum().backward()"
    with capture_output():
        result = shell.run_cell("%%numguard --sentinel\n" + loop)
    report = shell.user_ns["_numguard"]
    assert isinstance(result.error_in_exec, NonFiniteError)
    assert report.found_by == "re-run" and report.cause == "data" and report.batch_number == 3
    with capture_output():
        assert shell.run_cell("%numguard on --sentinel net").success
        shell.run_cell(loop)
    assert shell.user_ns["_numguard"].found_by == "re-run"
    net = shell.user_ns["net"]  # hooked: net and the modules it calls, not their parameters
    assert [len(m._forward_hooks) for m in net.modules()] == [1, 1, 1, 1]
    assert not any(p._backward_hooks for p in net.parameters())
    with capture_output():
        shell.run_cell("%numguard off")
    assert hooks_left(net) == []


# ---- the callbacks -------------------------------------------------------------------------
LATE_STEP = 6  # 0-indexed: the step whose forward meets the nan


def test_trainer_callback_is_a_sentinel_that_finds_a_late_nan(tmp_path):
    import transformers

    from numguard_nb.integrations import NumguardCallback

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 64, (8,), generator=generator), "labels": i % 2}
            for i in range(64)]

    class BreakWeights(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == LATE_STEP:
                with torch.no_grad():
                    model.bert.encoder.layer[1].intermediate.dense.weight[0, 0] = float("nan")

    callback = NumguardCallback()
    assert callback.options.mode == "sentinel"
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=4,
        max_steps=12, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[BreakWeights(), callback])
    report = caught(trainer.train).report
    assert report.found_by == "re-run" and report.cause == "weights"
    assert report.first_nonfinite.module_name == "bert.encoder.layer.1.intermediate.dense"
    assert report.batch_number == LATE_STEP and trainer.state.global_step == LATE_STEP
    assert callback.report is report and hooks_left(model) == []


def test_lightning_callback_is_a_sentinel_that_finds_a_late_nan():
    import lightning

    from numguard_nb.integrations import NumguardLightningCallback

    class LitClassifier(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

        def training_step(self, batch, batch_index):
            features, labels = batch
            return F.cross_entropy(self.net(features), labels)  # the module is never called

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    features = torch.randn(40, 4)
    features[4 * LATE_STEP + 1, 2] = float("nan")  # one sample of a late batch
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(features, torch.arange(40) % 2), batch_size=4)
    module = LitClassifier()
    callback = NumguardLightningCallback()
    trainer = lightning.Trainer(max_steps=10, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[callback])
    report = caught(lambda: trainer.fit(module, loader)).report
    assert callback.options.mode == "sentinel" and report.found_by == "re-run"
    assert report.cause == "data" and report.first_nonfinite.module_name == "net"
    assert report.batch_number == LATE_STEP and callback.report is report
    assert hooks_left(module) == []


class _CheckpointedSqrt(nn.Module):
    """A block run under torch.utils.checkpoint whose backward makes nan (d sqrt(u)/du at 0)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4))
        self.reentrant = reentrant
        self.scale = torch.ones(4, requires_grad=True)  # a leaf the user trains, no parameter

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda h: torch.sqrt(self.block(h) * 0), self.inp(x),
                          use_reentrant=self.reentrant) + x * self.scale  # a finite gradient


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_nan_in_backward_under_checkpointing_is_named_and_the_grads_are_left_as_they_were(reentrant):
    # HF's gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    # is what PEFT/QLoRA recipes use; reentrant checkpointing refuses torch.autograd.grad.
    def step(guarded: bool):
        torch.manual_seed(0)
        model = _CheckpointedSqrt(reentrant)
        x = torch.randn(2, 4)
        if not guarded:
            model(x).sum().backward()
            return model, None
        with pytest.raises(NonFiniteError) as caught, Guard(model, mode="sentinel"):
            model(x).sum().backward()
        return model, caught.value

    plain, _ = step(False)
    guarded, error = step(True)
    assert error.report.found_by == "re-run" and error.report.phase == "backward"
    pairs = list(zip(plain.named_parameters(), guarded.parameters()))
    pairs.append((("scale", plain.scale), guarded.scale))
    for (name, a), b in pairs:
        assert torch.equal(a.grad.isnan(), b.grad.isnan()), name
        assert torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num()), name


class ClampedOverflow(nn.Module):
    """A float16 Linear that overflows, its inf clamped away by the model's own code (as T5
    clamps its float16 hidden states): outputs and gradients stay finite."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).half()
        with torch.no_grad():
            self.lin.weight.fill_(1e4)

    def forward(self, x):
        return torch.clamp(self.lin(x), -6e4, 6e4)


def test_a_sampled_full_pass_names_what_the_sentinels_checks_cannot_see():
    x = torch.full((2, 4), 10.0).half()
    model = ClampedOverflow()
    with Guard(model, mode="sentinel") as guard:
        for _ in range(4):
            model(x).float().sum().backward()
    assert guard.detection is None  # the clamp hides it from the outputs and the gradients
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode="sentinel", full_every=3):
        for _ in range(4):
            model(x).float().sum().backward()
    report = caught.value.report
    assert (report.batch_number, report.first_nonfinite.module_name) == (2, "lin")  # batch N-1


def test_the_training_callbacks_sentinel_samples_a_full_pass_every_100_batches():
    from numguard_nb.integrations import FULL_EVERY, _GuardedRun

    assert FULL_EVERY == 100
    assert _GuardedRun().options.full_every == FULL_EVERY
    assert _GuardedRun(full_every=None).options.full_every is None
    assert _GuardedRun(mode="full").options.full_every is None
    with pytest.raises(ValueError, match="full_every samples full passes in mode=\"sentinel\""):
        Guard(nn.Linear(2, 2), full_every=5)


def test_limit_dtype_in_sentinel_mode_needs_the_full_passes_it_is_measured_in():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.mul_(1e5)  # outputs beyond float16's 65504
    with pytest.raises(ValueError, match="limit_dtype is measured by the full hooks, which "
                                         "mode=\"sentinel\" runs only in the batches full_every"):
        Guard(model, mode="sentinel", limit_dtype=torch.float16)
    with Guard(model, mode="sentinel", limit_dtype=torch.float16, full_every=2) as guard:
        for _ in range(3):
            model(torch.randn(2, 4) * 100).sum().backward()
    assert guard.headroom.first.module_name == "0" and guard.headroom.batches == (1, 1)
    from numguard_nb.integrations import _GuardedRun
    assert _GuardedRun(limit_dtype="float16").options.limit_dtype is torch.float16


def test_a_backward_re_run_starts_no_thread(monkeypatch):
    # The re-run used to run its forward in a thread of its own: a process that used it then
    # aborted at exit now and then, more often on a loaded machine ("terminate called without
    # an active exception"). It runs in the thread whose backward found the fault.
    import threading

    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real_start(self)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    big = torch.full((3, 4), 1e38)
    model(big).sum().backward()  # gradients summed into .grad: inf in the next backward
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode="sentinel"):
        model(big).sum().backward()
    assert caught.value.report.found_by == "re-run" and started == []


# ---- entries nested in a model -----------------------------------------------------------------
class Blocks(nn.Module):
    """A model over a list of blocks, each of which could be called at top level too."""

    def __init__(self, probe=None):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3))
        self.probe = probe

    def forward(self, x):
        for block in self.blocks:
            if self.probe is not None:
                self.probe(block)
            x = block(x)
        return x.sum()


def _block_alone_is_checked(model: Blocks, index: int) -> None:
    """A block called on its own (top level), 0 * inf made in it: named as the producer."""
    bad = x4()
    bad[0, 0] = float("inf")
    with pytest.raises(NonFiniteError) as caught:
        model.blocks[index](bad * 0)
    assert caught.value.report.first_nonfinite.module_name == f"blocks.{index}"


def test_a_nested_entry_called_at_top_level_after_the_model_is_checked():
    model = Blocks()
    with Guard(model, mode="sentinel"):
        model(x4()).backward()
        _block_alone_is_checked(model, 1)
    assert hooks_left(model) == []


class _Timesnan(nn.Module):
    armed = False

    def forward(self, x):
        return x * float("nan") if self.armed else x


class _Backbone(nn.Module):
    """timm's shape: the training step calls `forward_features`, which calls the blocks."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.act = nn.Sequential(nn.Tanh(), _Timesnan())

    def forward_features(self, x):
        return self.act(self.stem(x))

    def forward(self, x):
        return self.forward_features(x).mean(-1)


class _Wrapper(nn.Module):  # a LightningModule's shape: the model one level down
    def __init__(self):
        super().__init__()
        self.net = nn.ModuleDict({"backbone": _Backbone(), "head": nn.Linear(8, 3)})


@pytest.mark.parametrize("step", ["grandchildren", "forward_features"])
def test_a_step_calling_modules_deep_inside_the_model_is_checked_and_named(step):
    """Calls of submodules at any depth are top-level calls when the step makes them: the
    sentinel checks them and names the one that made nan, before the weights are written."""
    model = _Wrapper()
    backbone, head = model.net["backbone"], model.net["head"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for i in range(4):
                backbone.act[1].armed = i == 2
                if step == "grandchildren":
                    features = backbone.act(backbone.stem(x4()))
                else:
                    features = backbone.forward_features(x4())
                head(features).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    report = caught.value.report
    assert report.first_nonfinite.module_name == "net.backbone.act.1" and report.phase == "forward"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert hooks_left(model) == []


def test_a_nested_entry_with_a_hook_of_the_user_s_keeps_its_hooks_in_their_order():
    order = []
    model = Blocks()
    with Guard(model, mode="sentinel"):
        handle = model.blocks[0].register_forward_hook(lambda *a: order.append("user"))
        before = list(model.blocks[0]._forward_hooks)
        model(x4()).backward()
        assert list(model.blocks[0]._forward_hooks) == before and order == ["user"]
        handle.remove()
    assert hooks_left(model) == []


def _raising_at_the_second_block(error: BaseException):
    """A probe for `Blocks` that raises `error` as the second block is about to run."""
    calls = []

    def probe(block):
        calls.append(block)
        if len(calls) == 2:
            raise error

    return probe


def test_after_a_model_call_that_raises_its_blocks_called_alone_are_checked():
    model = Blocks(probe=_raising_at_the_second_block(ValueError("the user's forward fails")))
    with Guard(model, mode="sentinel"):
        with pytest.raises(ValueError):
            model(x4())
        _block_alone_is_checked(model, 0)
        assert all(len(block._forward_hooks) == 1 for block in model.blocks)  # put back
    assert hooks_left(model) == []


def test_while_the_model_runs_its_inner_entries_take_torch_s_fast_path_and_get_their_hooks_back():
    seen = []
    model = Blocks(probe=lambda block: seen.append((len(block._forward_pre_hooks),
                                                     len(block._forward_hooks))))
    with Guard(model, mode="sentinel"):
        before = [(list(b._forward_pre_hooks), list(b._forward_hooks)) for b in model.blocks]
        for _ in range(3):
            model(x4()).backward()
        assert seen == [(0, 0)] * 9  # no hook: torch's fast path for each block
        # kept aside between the model's calls: a block called alone has them put back
        model.blocks[2](x4())
        assert [(list(b._forward_pre_hooks), list(b._forward_hooks)) for b in model.blocks] == before
    assert hooks_left(model) == []


def test_an_inner_entry_called_alone_between_the_model_s_calls_is_checked_each_time():
    model = Blocks()
    with Guard(model, mode="sentinel"):
        for index in (0, 1, 0, 2):  # the model's call between: its blocks' hooks aside again
            model(x4()).backward()
            model.blocks[index](x4()).sum().backward()  # a healthy call alone
            model(x4()).backward()
            _block_alone_is_checked(model, index)
    assert hooks_left(model) == []


def test_the_watch_between_the_model_s_calls_hands_a_block_its_keyword_arguments():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x, *, scale):
            return x * self.weight * scale

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Scaled()

        def forward(self, x):
            return self.inner(x, scale=2.0).sum()

    model = Outer()
    with Guard(model, mode="sentinel"):
        model(x4()).backward()
        with pytest.raises(NonFiniteError) as caught:
            model.inner(x4(), scale=float("inf"))  # its call is re-run with the same scale
    report = caught.value.report
    assert report.found_by == "re-run" and report.first_nonfinite.module_name == "inner"
    assert hooks_left(model) == []


def test_a_loss_module_compiled_whole_between_the_model_s_calls_traces_through_the_watch():
    # (the watch is in torch's global registry there: dynamo traces it, and must not break)
    torch.manual_seed(0)
    model, cross_entropy = Blocks(), nn.CrossEntropyLoss()
    loss_of = torch.compile(lambda out, y: cross_entropy(out, y), fullgraph=True, backend="eager")
    with Guard(model, mode="sentinel") as guard:
        for _ in range(3):
            out = model.blocks[0](x4())  # (a block as the model: the Blocks call keeps it aside)
            model(x4()).backward()
            assert len(module_hooks._global_forward_pre_hooks) == 1 and guard._sentinel.aside.kept
            loss_of(out, torch.tensor([0, 1, 2])).backward()
    assert hooks_left(model) == []


def test_many_calls_of_other_modules_between_the_model_s_calls_end_the_watch():
    # (each of them takes torch's slow path while the watch is in its registry)
    from numguard_nb.guard.set_aside import GAPS_TO_STOP

    model, teacher = Blocks(), nn.Sequential(*(nn.Linear(4, 4) for _ in range(40)))
    with Guard(model, mode="sentinel") as guard:
        model(x4()).backward()
        assert len(module_hooks._global_forward_pre_hooks) == 1  # watching
        with torch.no_grad():
            teacher(x4())  # once: its calls past the limit put the hooks back, the watch goes
        assert not module_hooks._global_forward_pre_hooks and not guard._sentinel.aside.kept
        model(x4()).backward()
        assert len(module_hooks._global_forward_pre_hooks) == 1  # kept aside again
        for _ in range(GAPS_TO_STOP):  # the teacher called each step: not kept aside any more
            with torch.no_grad():
                teacher(x4())
            model(x4()).backward()
        for _ in range(2):
            model(x4()).backward()
            assert not module_hooks._global_forward_pre_hooks and not guard._sentinel.aside.kept
        _block_alone_is_checked(model, 1)
    assert hooks_left(model, teacher) == []


def test_a_hook_registered_on_an_inner_entry_while_the_model_runs_comes_after_the_guard_s():
    added = []

    def probe(block):
        if not added:
            added.append(block.register_forward_hook(lambda *a: None))

    model = Blocks(probe=probe)
    with Guard(model, mode="sentinel"):
        ours = list(model.blocks[0]._forward_hooks)
        model(x4()).backward()
        model.blocks[0](x4())  # (called alone: the guard's are put back)
        assert list(model.blocks[0]._forward_hooks) == ours + [added[0].id]
        added[0].remove()
    assert hooks_left(model) == []


def test_after_an_interrupted_model_call_a_reset_puts_the_inner_hooks_back():
    # (torch runs no closing hook for a KeyboardInterrupt)
    model = Blocks(probe=_raising_at_the_second_block(KeyboardInterrupt()))
    with Guard(model, mode="sentinel") as guard:
        with pytest.raises(KeyboardInterrupt):
            model(x4())
        guard.reset()  # what the session does after a failed cell
        _block_alone_is_checked(model, 2)
    assert hooks_left(model) == []


def test_a_copy_of_an_inner_entry_made_while_the_model_runs_is_unhooked_and_runs():
    snapshots = []
    model = Blocks(probe=lambda block: snapshots.append(copy.copy(block)) if not snapshots else None)
    with Guard(model, mode="sentinel"):
        model(x4()).backward()
        snapshot = snapshots[0]
        assert snapshot._forward_pre_hooks is not model.blocks[0]._forward_pre_hooks
        assert len(snapshot._forward_pre_hooks) == len(snapshot._forward_hooks) == 0
        snapshot(x4())  # (its hooks were the guard's, called with a module they do not know)
    assert hooks_left(model) == []


def test_a_deep_copy_of_a_guarded_model_with_a_parametrized_entry_keeps_its_flags():
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Linear(4, 1))
    with Guard(model, mode="sentinel"):
        model(x4()).sum().backward()
        ema = copy.deepcopy(model)
    assert ema[0].training is True and ema[1].training is True


def test_a_data_parallel_replica_sharing_the_hook_dicts_runs_unguarded():
    model = Blocks()
    with Guard(model, mode="sentinel"):
        replica = model._replicate_for_data_parallel()  # what DataParallel's replicate() makes
        replica(x4())
        assert [len(b._forward_pre_hooks) for b in model.blocks] == [1, 1, 1]
    assert hooks_left(model) == []


class _Race:
    """Thread t1's model call sets the inner entries' hooks aside and pauses; t2 enters an inner
    entry (torch's slow path there: it has a backward hook) and pauses; t1 ends its call, putting
    the hooks back; then t2 goes on: that entry's closing hook runs in t2 without its opening one."""

    def __init__(self):
        self.t1_inside, self.t1_go, self.t2_inside, self.t2_go = (threading.Event() for _ in range(4))

    def pause_t1(self) -> None:
        if threading.current_thread().name == "t1":
            self.t1_inside.set()
            self.t1_go.wait(5)

    def pause_t2(self) -> None:
        if threading.current_thread().name == "t2":
            self.t2_inside.set()
            self.t2_go.wait(5)

    def run(self, target, t1_args: tuple, t2_args: tuple) -> None:
        t1 = threading.Thread(target=target, args=("t1",) + t1_args, name="t1")
        t2 = threading.Thread(target=target, args=("t2",) + t2_args, name="t2")
        t1.start()
        self.t1_inside.wait(5)
        t2.start()
        self.t2_inside.wait(5)
        self.t1_go.set()
        t1.join()
        self.t2_go.set()
        t2.join()


class _PausesT2(nn.Module):
    def __init__(self, race: _Race):
        super().__init__()
        self.race = race
        self.lin = nn.Linear(4, 4)
        self.register_full_backward_hook(lambda *args: None)  # torch's slow path in its calls

    def forward(self, x):
        self.race.pause_t2()
        return self.lin(x)


def _nonfinite_errors_by_thread(model, race: _Race, t1_args: tuple, t2_args: tuple,
                                **kwargs) -> dict:
    found = {}

    def run(name, x):
        try:
            with torch.no_grad():
                model(x, **kwargs)
        except NonFiniteError as error:
            found[name] = error.report.first_nonfinite.module_name

    with Guard(model, mode="sentinel"):
        race.run(run, t1_args, t2_args)
    return found


def test_a_thread_inside_a_block_when_another_puts_the_hooks_back_still_has_its_call_checked():
    class Model(nn.Module):
        def __init__(self, race):
            super().__init__()
            self.race = race
            self.a, self.b = _PausesT2(race), nn.Linear(4, 1)

        def forward(self, x):
            h = self.a(x)
            self.race.pause_t1()
            return self.b(h)

    torch.manual_seed(0)
    race = _Race()
    found = _nonfinite_errors_by_thread(Model(race), race, (x4(),), (x4() * float("nan"),))
    assert found == {"t2": ""}  # the nan fed to the model: its data, named at the model's call


def test_a_recursive_model_s_inner_call_closing_half_seen_does_not_end_its_top_level_call():
    """t2 runs M -> M' -> a: M' must not end t2's call, whose outer output holds nan."""

    class Recursive(nn.Module):
        def __init__(self, race):
            super().__init__()
            self.race = race
            self.a = _PausesT2(race)

        def forward(self, x, n=0):
            if threading.current_thread().name == "t1":
                self.race.pause_t1()
                return self.a(x)
            if n:  # the outer call: nan only here
                h = self(x, n - 1)
                return h + torch.log(-torch.ones_like(h))
            return self.a(x)

    torch.manual_seed(0)
    race = _Race()
    found = _nonfinite_errors_by_thread(Recursive(race), race, (torch.ones(2, 4),),
                                        (torch.ones(2, 4),), n=1)
    assert list(found) == ["t2"]


class SharesItsState(nn.Module):
    """A class whose own __deepcopy__ shares its attributes (hook dicts too) with the copy."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__ = dict(self.__dict__)
        new._modules = copy.deepcopy(self._modules, memo)
        return new


@pytest.mark.parametrize("mode", ["sentinel", "full"])
def test_a_deep_copy_made_by_a_class_s_own_deepcopy_leaves_the_original_guarded(mode):
    model = nn.Sequential(SharesItsState(), nn.Linear(4, 1))
    with Guard(model, mode=mode):
        model(x4()).sum().backward()
        ema = copy.deepcopy(model)
        assert ema[0]._forward_hooks is not model[0]._forward_hooks
        assert "__reduce_ex__" not in ema[0].__dict__
        with pytest.raises(NonFiniteError):
            model[0](torch.full((2, 4), float("nan")))  # called on its own: still checked
    assert hooks_left(model) == []


def test_a_detach_while_another_thread_puts_the_hooks_back_leaves_no_hook_behind():
    from collections import OrderedDict

    writing, go_on = threading.Event(), threading.Event()

    class SlowHooks(OrderedDict):
        """A hook dict whose writes wait, once armed: a put-back caught half done."""

        armed = False

        def __setitem__(self, key, value):
            if SlowHooks.armed:
                SlowHooks.armed = False
                writing.set()
                go_on.wait(5)
            super().__setitem__(key, value)

    model = Blocks()
    block = model.blocks[1]
    block._forward_pre_hooks = SlowHooks(block._forward_pre_hooks)
    guard = Guard(model, mode="sentinel").attach()

    def call():
        model(x4())  # (its blocks' hooks kept aside after it)
        SlowHooks.armed = True  # (the attach's own writes are done)
        model.blocks[0](x4())

    caller = threading.Thread(target=call)
    caller.start()
    assert writing.wait(5)  # the call alone is putting the hooks back
    detacher = threading.Thread(target=guard.detach)
    detacher.start()
    detacher.join(0.2)  # it waits for the put-back (without the lock: done by now)
    go_on.set()
    caller.join(5)
    detacher.join(5)
    assert hooks_left(model) == []


# ---- the latest report of a run with sampled batches ------------------------------------------
@pytest.mark.parametrize("every, batches", [(1, 4), (3, 5)])
def test_the_latest_report_shows_a_sampled_batch_only_when_it_is_the_latest(
        deferred_on_host, every, batches):
    # on a GPU the sentinel keeps no frames of its own: every batch sampled (history_every=1)
    # must show the last one's, and an older sampled batch must not pass for the latest
    deferred_on_host[0] = False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with Guard(model, mode="sentinel", history_every=every) as guard:
        for _ in range(batches):
            model(x4()).sum().backward()
    report = guard.latest_report()
    assert [frame.batch_number for frame in report.frames[-1:]] == (
        [batches - 1] if every == 1 else [])
    assert f"{-(-batches // every)} batches watched with the full hooks" in report.reason


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_grad_left_non_finite_before_the_guard_attached_is_said_to_be_so(mode):
    # The run that went nan stopped before zero_grad; the user trains again under the guard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(x4()) * float("nan")).sum().backward()
    with pytest.raises(NonFiniteError) as raised, Guard(model, mode=mode):
        for _ in range(3):
            model(x4()).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    report = raised.value.report
    if mode == "full":  # found at the next forward, in the weights the step wrote
        assert report.cause == "weights" and report.optimizer_step.stale_gradients
        assert "from gradients whose .grad already held inf/nan when the guard attached" in report.reason
    else:  # found at the backward, whose re-run made finite gradients
        assert report.cause == "stale-gradients" and report.batch_number == 0
    assert "zero_grad()" in report.hint and "learning rate" not in report.hint


def test_a_grad_left_non_finite_but_zeroed_before_the_first_backward_is_not_blamed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=float("inf"))  # the step breaks the weights
    (model(x4()) * float("nan")).sum().backward()
    with pytest.raises(NonFiniteError) as raised, Guard(model):
        for _ in range(3):
            optimizer.zero_grad()  # first: nothing left over is applied
            model(x4()).sum().backward()
            optimizer.step()
    report = raised.value.report
    assert report.cause == "weights" and not report.optimizer_step.stale_gradients
    assert "Lower the learning rate" in report.hint


def test_weights_broken_before_attach_are_said_so_though_earlier_steps_ran():
    """A nan row of an embedding (a bad checkpoint), first looked up in batch 2: the sentinel's
    forwards never look at the weights, so the steps before are no evidence they were finite;
    its one look as it attached is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight[7] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for step in range(4):
                model(torch.tensor([[1, 2], [3, 7 if step == 2 else 4]])).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    report = caught.value.report
    assert report.batch_number == 2 and report.weights_origin == "before attach"
    assert "already non-finite when the guard attached" in report.reason
    assert "learning rate" not in report.hint


@pytest.mark.parametrize("step", ["validation_step", "training_step"])
def test_a_step_lightning_calls_through_the_ddp_wrapper_is_checked_as_in_one_process(step):
    """Under strategy="ddp" Lightning calls the step through the wrapper, whose forward it
    patches to the step: an evaluation step's own calls of submodules are checked (it returns
    no output), the training step as the model's call (its loss)."""
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def validation_step(self, x):
            self.lin(torch.log(x - 2))  # nan, fed to lin; nothing returned

        def training_step(self, x):
            return self.lin(torch.log(x - 2)).sum()

    class Wrapper(nn.Module):  # what DDP does with its module
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args):
            return self.module(*args)

    model = Lit()
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"), torch.set_grad_enabled(step == "training_step"):
            _ForwardRedirection()(Wrapper(model), model, step, torch.rand(3, 4))
    first = caught.value.report.first_nonfinite
    assert first.module_name == ("lin" if step == "validation_step" else "")
    assert hooks_left(model) == []


class LogOfSoftmax(nn.Module):
    """torch.log(F.softmax(...)): classes whose probability underflowed to 0 get -inf, a finite
    loss on the others, and LogBackward0 makes 0/0 = nan of them (allenai/allennlp#2797)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        return torch.log(torch.softmax(self.fc(x), -1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_minus_inf_output_the_loss_kept_finite_is_no_culprit_of_the_backward_it_breaks(mode):
    torch.manual_seed(0)
    model = LogOfSoftmax()
    x = torch.randn(4, 3) * 300
    with torch.no_grad():
        labels = model.fc(x).argmax(-1)  # the top classes: a finite loss
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode, ops=True):
        nn.functional.nll_loss(model(x), labels).backward()
    report = caught.value.report  # the sentinel's re-run names what full mode names
    assert (report.cause, report.first_nonfinite.op) == ("backward-inline",
                                                         "LogBackward0: aten.div.Tensor")
