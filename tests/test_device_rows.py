"""Full mode's rows on a GPU: one reduction a row, abs min measured where a report shows it.

On a GPU every reduction is a kernel launch of ~15 us of host time, and full mode summarises
hundreds of tensors a step. So a pass's rows are its tensors' signed min and max only (one
`aminmax`), from which abs max, nan and the infinities are exact, and abs min is exact for a
tensor of one sign. What a report shows is measured: traced batches, history's samples and a
sentinel's re-run measure every row; a detection measures the values of its pass still alive.
These run the GPU's path on the host (`deferred_on_host`).
"""

from __future__ import annotations

import collections
import math

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import pytest

from numguard_nb import Guard, NonFiniteError
from numguard_nb._schema import VALUE_TENSOR


class Divide(nn.Module):
    def forward(self, x, y):
        return x / y


class Net(nn.Module):
    """Linear (both signs out), ReLU (one sign out), a division by its second input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.act, self.div, self.out = nn.Linear(4, 4), nn.ReLU(), Divide(), nn.Linear(4, 2)

    def forward(self, x, y):
        return self.out(self.div(self.act(self.lin(x)), y))


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
DIVISOR = torch.tensor([[-1.0, 0.5, 2.0, 3.0]] * 3)  # both signs, no zero
ZERO_DIVISOR = torch.tensor([[-1.0, 0.0, 2.0, 3.0]] * 3)  # both signs and a zero


def _reductions(step) -> collections.Counter:
    """The reductions `step()` ran: {'norm': smallest |t| reductions, 'aminmax': ...}, besides
    the multi-tensor ones of the weights and gradients written together (on CPU, `_foreach_norm`
    runs a norm per tensor)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = collections.Counter(event.name for event in prof.events()
                                if not (event.cpu_parent and event.cpu_parent.name.startswith("aten::_foreach")))
    return collections.Counter(norm=names["aten::linalg_vector_norm"], aminmax=names["aten::aminmax"])


def _train_step(net, divisor=DIVISOR):
    net(X, divisor).sum().backward()


def _rows(report):
    return [(frame.module_name, frame.phase, row) for frame in report.frames for row in frame.rows
            if row.kind == VALUE_TENSOR]


def test_a_healthy_step_makes_one_reduction_a_row_and_a_traced_batch_two(deferred_on_host):
    net = Net()
    with Guard(net, trace_batches=[1]) as guard:
        _train_step(net)  # (warm: made once)
        traced = _reductions(lambda: _train_step(net))  # batch 1
        traced_report = guard.traces[1]
        healthy = _reductions(lambda: _train_step(net))  # batch 2
        latest = guard.report
    assert healthy["norm"] == 0 and healthy["aminmax"] >= 10, healthy  # (weights, gradients: together)
    assert traced["norm"] == traced["aminmax"] >= 15, traced
    # the latest report: abs min exact for one sign, unmeasured ("-") for both
    rows = {(name, row.role): row for name, phase, row in _rows(latest) if phase == "forward"}
    assert rows[("act", "output")].abs_min is not None
    assert rows[("div", "input[1]")].abs_min is None
    assert any(line.lstrip().startswith("- ") for line in latest.to_text().splitlines())
    # the traced batch: every row measured
    assert all(row.abs_min is not None for _, _, row in _rows(traced_report))
    assert [row.abs_min for name, phase, row in _rows(traced_report)
            if (name, phase, row.role) == ("div", "forward", "input[1]")] == [0.5]


def test_the_loss_codes_rows_are_one_reduction_and_its_culprit_shows_abs_min(deferred_on_host):
    """The loss code's rows too are one reduction each on a GPU (a region read later, a
    backward's nodes); a loss-code culprit's report measures the abs min of its values still
    alive, as a model's detection does: log's input of both signs shows its smallest |x|."""
    net = Net()
    with Guard(net) as guard:
        _train_step(net)
        healthy = _reductions(lambda: (net(X, DIVISOR) * 2).pow(2).sum().backward())
    assert healthy["norm"] == 0, healthy
    with pytest.raises(NonFiniteError) as caught, Guard(net):
        out = net(X, DIVISOR)
        torch.log(out).sum().backward()  # log of the negative outputs: nan
    culprit = caught.value.report.first_nonfinite
    assert (culprit.module_name, culprit.op) == ("<outside>", "aten.log.default")
    given = next(row for row in culprit.rows if row.category == "input")
    assert given.abs_min == pytest.approx(float(out.detach().abs().min()))


def test_a_detection_measures_the_abs_min_of_its_values_still_alive(deferred_on_host):
    """The division's divisor (both signs) is alive when the report is made: its abs min, 0, is
    measured, and the hint gives it as evidence. A value freed since shows no abs min."""
    net = Net()
    with pytest.raises(NonFiniteError) as caught, Guard(net, ops=True):
        _train_step(net, ZERO_DIVISOR)
    report = caught.value.report
    culprit = {row.role: row for row in report.first_nonfinite.rows}
    assert culprit["input[1]"].abs_min == 0.0
    assert "input[1] holds zeros" in report.hint
    rows = {(name, row.role): row for name, _, row in _rows(report)}
    assert rows[("lin", "output")].abs_min is None  # freed: ReLU keeps its output, not its input
    assert rows[("lin", "weight")].abs_min == pytest.approx(float(net.lin.weight.detach().abs().min()))


def test_history_samples_measure_every_abs_min(deferred_on_host):
    net = Net()
    with Guard(net, history_every=2) as guard:
        for _ in range(4):
            _train_step(net)
    columns = guard.history.columns()
    assert sorted(set(columns["batch_number"].tolist())) == [0, 2]
    assert not any(math.isnan(value) for value in columns["abs_min"].tolist())


def test_a_sentinel_re_run_reports_every_abs_min(deferred_on_host):
    net = Net()
    with pytest.raises(NonFiniteError) as caught, Guard(net, mode="sentinel"):
        for _ in range(3):
            _train_step(net, ZERO_DIVISOR)
            deferred_on_host[0] = False
    report = caught.value.report
    assert report.first_nonfinite.module_name == "div"
    measured = [row.abs_min for _, _, row in _rows(report) if not row.nan]
    assert measured and None not in measured


class Attention(nn.Module):
    def forward(self, x, bias):
        return torch.softmax(x @ x.transpose(-1, -2) + bias, dim=-1) @ x


class WithAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x, bias):
        return self.attn(x, bias)


def test_an_additive_bias_of_both_signs_with_minus_inf_is_judged_a_mask_as_on_the_host(deferred_on_host):
    """A relative-position bias (both signs, zeros on its diagonal) masked with -inf, passed to
    the model: the mask rule judges it by its zeros, so its abs min is measured before the
    culprit is named, and the module that made nan of the fully masked row is named, not the
    data (as on the host)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.tensor([[0., 1., -1., 2.], [1., 0., -1., 2.], [1., -2., 0., 3.], [1., 2., -3., 0.]])
    bias[0, :] = -math.inf  # a fully masked row: softmax makes nan of it
    model = WithAttention()
    with pytest.raises(NonFiniteError) as caught, Guard(model, backward=False), torch.no_grad():
        model(x, bias)
    assert (caught.value.report.cause, caught.value.report.first_nonfinite.module_name) == ("forward", "attn")


class ScaledInForward(nn.Module):
    """Rescales its buffer through `.data` in its forward, which moves no version counter."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.tensor([-1.0, 2.0, 3.0]))

    def forward(self, x):
        y = x * self.s
        self.s.data.mul_(100.0)
        return y / 0.0 * 0.0  # nan


def test_a_value_changed_without_a_version_is_not_measured_after_its_change(deferred_on_host):
    """A buffer written through `.data`, and BatchNorm's running statistics its kernel updates,
    keep their version: the report's abs min is not taken from what they hold afterwards (it
    would pair with the abs max of before). Such rows stay unmeasured."""
    net = nn.Sequential(nn.BatchNorm1d(3), ScaledInForward())
    net[0].running_mean.copy_(torch.tensor([-0.5, 0.2, 0.3]))
    x = torch.tensor([[1.0, 5.0, -2.0], [3.0, -1.0, 4.0], [0.0, 2.0, 1.0]])
    with pytest.raises(NonFiniteError) as caught, Guard(net, backward=False), torch.no_grad():
        net(x)
    rows = {row.role: row for frame in caught.value.report.frames for row in frame.rows}
    assert rows["running_mean"].abs_min is None and rows["s"].abs_min is None
    # (running_var, all ones, summarised with the pass's weights: its abs min unmeasured too)
    assert rows["running_var"].abs_min is None and rows["running_var"].abs_max == 1.0


def test_the_sentinel_s_sampled_full_passes_make_one_reduction_a_row(deferred_on_host):
    """`full_every` runs a full pass now and then as a history sample would, not as a re-run:
    lean, like full mode's passes."""
    net = Net()
    with Guard(net, mode="sentinel", full_every=2):
        counts = [_reductions(lambda: _train_step(net)) for _ in range(4)]
    assert [c["norm"] for c in counts] == [0, 0, 0, 0] and counts[1]["aminmax"] >= 10, counts



class WritesAWeight(nn.Module):
    """Writes nan into another module's weight in its forward, before that module runs."""

    def __init__(self, target: nn.Linear):
        super().__init__()
        self.target = [target]  # (not a submodule)

    def forward(self, x):
        with torch.no_grad():
            self.target[0].weight[0, 0] = math.nan
        return x


def test_a_pass_summarises_its_weights_together_and_again_where_one_changes(deferred_on_host):
    """A forward's weights are summarised at its start with a few multi-tensor reductions
    (on a GPU each reduction is a launch of ~15 us of host time; 24 Linear layers have 48
    weights), not one `aminmax` each at each layer's call; a weight written during the forward
    before its layer runs is summarised again at the layer's call, which is then named."""
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(24)])
    x = torch.randn(2, 4)
    with Guard(net, backward=False), torch.no_grad():
        net(x)  # (warm: blocks made once)
        counts = _reductions(lambda: net(x))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            net(x)
    names = collections.Counter(event.name for event in prof.events())
    # (on the host a batch takes two: the max, and the max of |t|; on a GPU `_foreach_norm` the latter)
    assert names["aten::_foreach_max"] == 2, names
    assert counts["aminmax"] == 25, counts  # the input and the 24 outputs

    writer_net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    writer_net.insert(1, WritesAWeight(writer_net[1]))
    with pytest.raises(NonFiniteError) as caught, Guard(writer_net, backward=False), torch.no_grad():
        writer_net(x)
    report = caught.value.report
    rows = {row.role: row for row in report.first_nonfinite.rows}
    assert report.first_nonfinite.module_name == "2" and rows["weight"].nan, report.to_text()


class _NanGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight):
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


class NanWeightGradient(nn.Linear):
    """A Linear whose weight's gradient is nan though its output's gradient is finite."""

    def forward(self, x):
        return nn.functional.linear(x, _NanGradient.apply(self.weight), self.bias)


@pytest.mark.parametrize("how", ["backward", "accumulated", "autograd.grad"])
def test_parameters_gradients_are_summarised_together_from_grad_where_it_is_theirs(deferred_on_host, how):
    """A backward's parameter gradients are summarised together at its end from `.grad` (a
    few multi-tensor reductions, not an `aminmax` each), where `.grad` is the very gradient:
    none before (a second micro-step adds to it: summarised as it comes), and a `backward()`
    (`autograd.grad` leaves `.grad` alone: summarised as it comes). Either way a parameter's
    nan gradient is named."""
    torch.manual_seed(0)
    deep = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    x = torch.randn(2, 4)
    with Guard(deep) as guard:
        for _ in range(2):  # (warm; the first backwards after attaching learn, deferring nothing)
            deep(x).sum().backward()
            deep.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            deep(x).sum().backward()
        names = collections.Counter(event.name for event in prof.events())
        assert names["aten::_foreach_max"] == 4, names  # the weights, then the gradients (two each)
        for param in deep.parameters():  # an earlier micro-step's: not this backward's gradient
            param.grad = torch.full_like(param, 1e3)
        deep(x).sum().backward()
        rows = [row for frame in guard.report.frames if frame.phase == "backward"
                for row in frame.rows if row.role == "weight.grad"]
    assert rows and all(row.abs_max < 1e3 for row in rows), rows

    net = nn.Sequential(nn.Linear(4, 4), NanWeightGradient(4, 4), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError) as caught, Guard(net):
        if how == "accumulated":
            net[0](x).sum().backward()  # an earlier micro-step's gradient
            net[1].weight.grad = torch.zeros_like(net[1].weight)
        loss = net(x).sum()
        if how == "autograd.grad":
            torch.autograd.grad(loss, list(net.parameters()))
        else:
            loss.backward()
    report = caught.value.report
    culprit = report.first_nonfinite
    assert (report.cause, culprit.module_name, culprit.phase) == ("backward", "1", "backward")
    assert [row.role for row in culprit.rows if row.nan] == ["weight.grad"]


class InfBiasGradient(nn.Module):
    """Given output gradients of 1e37, b's bias gradient overflows to +inf (100 rows summed); b's
    weight is frozen, its input gradient finite."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            self.b.weight.fill_(1e-30)
        self.b.weight.requires_grad_(False)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("first_step", [1, 3], ids=["from the first step", "from a later step"])
@pytest.mark.parametrize("how", ["grad set to None", "clamped in place", "clamped by a pre-hook"])
def test_a_gradient_a_hook_on_its_accumulator_changes_is_never_read_from_grad(deferred_on_host, how, first_step):
    """Hooks on a parameter's AccumulateGrad node (Horovod's, Apex's, DeepSpeed's) may move or
    change `.grad` during the backward: a gradient whose `.grad` is not the one its hook saw by
    the backward's end (data pointer, version) gets no row from it, never the changed values,
    and is summarised as it comes from then on; the first backwards after attaching learn that
    at once. Its +inf is named as on the host: a backward later where the hook started after
    those."""
    torch.manual_seed(0)
    net = InfBiasGradient()
    x = torch.ones(100, 4)
    active = [False]
    for param in (net.a.weight, net.a.bias, net.b.bias):
        accumulator = torch.autograd.graph.get_gradient_edge(param).node
        if how == "grad set to None":
            accumulator.register_hook(lambda *_, p=param: setattr(p, "grad", None) if active[0] else None)
        elif how == "clamped in place":
            accumulator.register_hook(lambda *_, p=param: (p.grad.clamp_(-1e30, 1e30), None)[1] if active[0] else None)
        else:
            accumulator.register_prehook(lambda grads: (grads[0].clamp(-1e30, 1e30),) if active[0] else None)
    steps = 0
    with pytest.raises(NonFiniteError) as caught, Guard(net):
        for steps in range(1, 6):
            active[0] = steps >= first_step
            out = net(x)
            out.backward(torch.full_like(out, 1e37 if steps >= first_step else 1.0))
            net.zero_grad(set_to_none=True)
    report = caught.value.report
    assert steps == (1 if first_step == 1 else 4), steps
    assert (report.cause, report.first_nonfinite.module_name) == ("backward", "b")
    assert [row.role for row in report.first_nonfinite.rows if row.posinf] == ["bias.grad"]


class MomentumInForward(nn.Module):
    """MoCo: the key encoder's weights set through `.data` in the forward, before its call."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            self.k.weight.zero_()
            self.q.weight.fill_(8.0)

    def forward(self, x):
        out = self.q(x)
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                pk.data = pk.data * 0.5 + pq.data * 0.5  # (a new tensor: no version moves)
            out_k = self.k(x)
        return out, out_k


def test_weights_set_through_data_during_the_forward_are_summarised_again_at_their_call(deferred_on_host):
    """Weights summarised at the forward's start and then set through `.data` before their
    module's call (which moves no version) are summarised again at the call, by their data
    pointer: the report shows what the call used."""
    net = MomentumInForward()
    x = torch.randn(8, 4)
    with Guard(net) as guard:
        for _ in range(4):
            net(x)[0].sum().backward()
        rows = {row.role: row for frame in guard.report.frames if frame.module_name == "k"
                and frame.phase == "forward" for row in frame.rows}
    assert rows["weight"].abs_max == pytest.approx(float(net.k.weight.abs().max()))
