"""Guard(ops=True): a detection names the ATen op and the source line; nothing else changes."""

import pytest
import torch
from torch import nn

import numguard_nb as ng
from models import NaiveSoftmax, SqrtOfZeroPlusInput, line_of


class SafeSqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x.abs() + 1.0)


def _hooks_left(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) + sum(
        len(p._backward_hooks or {}) for p in model.parameters()
    )


@pytest.mark.parametrize("sync", [False, True])
def test_forward_detection_names_the_op_and_line(sync):
    model = nn.Sequential(nn.Linear(4, 4), NaiveSoftmax(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.fill_(100.0)
    x = torch.ones(3, 4)
    with pytest.raises(ng.NonFiniteError) as caught:
        with ng.Guard(model, ops=True, sync=sync):
            model(x)
    frame = caught.value.report.first_nonfinite
    assert frame.module_name == "1"
    assert frame.op == "aten.exp.default"
    assert frame.source.endswith(f"models.py:{line_of('exp')}: e = torch.exp(x)  # OP:exp")
    text = caught.value.report.to_text()
    assert "first non-finite op: aten.exp.default" in text
    assert f"models.py:{line_of('exp')}" in text
    assert _hooks_left(model) == 0


@pytest.mark.parametrize("sync", [False, True])
def test_backward_detection_names_the_node_op_and_forward_line(sync):
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZeroPlusInput(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    with pytest.raises(ng.NonFiniteError) as caught:
        with ng.Guard(model, ops=True, sync=sync):
            model(x).sum().backward()
    frame = caught.value.report.first_nonfinite
    assert (frame.module_name, frame.phase) == ("1", "backward")
    assert frame.op.startswith("SqrtBackward0: aten.")
    assert frame.source.split(": ", 1)[0].endswith(f"models.py:{line_of('sqrt_backward')}")
    assert _hooks_left(model) == 0


def test_ops_guard_leaves_outputs_gradients_and_rng_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), SafeSqrt(), nn.Linear(8, 2))
    x = torch.rand(4, 8)

    def step(guarded):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        if guarded:
            with ng.Guard(model, ops=True):
                out = model(x)
                out.sum().backward()
        else:
            out = model(x)
            out.sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()], torch.rand(1)

    plain, guarded = step(False), step(True)
    assert torch.equal(plain[0], guarded[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], guarded[1]))
    assert torch.equal(plain[2], guarded[2])  # the RNG stream after the step is the same


def test_ops_with_a_loss_module_guarded_alongside_the_model():
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZeroPlusInput(), nn.Linear(4, 2))
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 1])
    with pytest.raises(ng.NonFiniteError) as caught:
        with ng.Guard({"model": model, "loss_fn": loss_fn}, ops=True):
            loss_fn(model(x), y).backward()
    frame = caught.value.report.first_nonfinite
    assert frame.module_name == "model.1"
    assert frame.op is not None and frame.op.startswith("SqrtBackward0")


class HiddenNanPooling(nn.Module):
    """Attention pooling whose fully masked rows make nan, hidden in forward by nan_to_num: the
    nan comes back in backward through the softmax's saved output."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 1)
        self.proj = nn.Linear(4, 4)

    def forward(self, h, mask):
        additive = torch.zeros_like(mask, dtype=h.dtype).masked_fill(~mask, float("-inf"))
        w = torch.softmax(self.score(h).squeeze(-1) + additive, dim=-1)  # OP:softmax
        w = torch.nan_to_num(w)
        return self.proj((w.unsqueeze(-1) * h).sum(1))


def test_a_nan_hidden_in_forward_names_the_backward_node_in_the_modules_own_code():
    torch.manual_seed(0)
    model = HiddenNanPooling()
    h, mask = torch.randn(3, 5, 4), torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False  # a fully masked row
    with pytest.raises(ng.NonFiniteError) as caught, ng.Guard(model, ops=True):
        model(h, mask).sum().backward()
    report = caught.value.report
    frame = report.first_nonfinite
    assert (frame.module_class, frame.phase, report.cause) == ("HiddenNanPooling", "backward", "backward-inline")
    assert frame.op == "SoftmaxBackward0: aten._softmax_backward_data.default"
    assert frame.source.endswith("w = torch.softmax(self.score(h).squeeze(-1) + additive, dim=-1)  # OP:softmax")
    assert "fully masked" in report.hint and "torch.finfo(scores.dtype).min" in report.hint


class _SqrtOfRowNorm(nn.Module):
    def forward(self, x):
        return x + torch.sqrt(x.abs().sum(1, keepdim=True))  # its gradient at a zero row: inf


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_several_forwards_before_one_backward_say_why_the_op_is_not_named(mode):
    # gradient accumulation summed into one backward: only the latest call could be re-run
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _SqrtOfRowNorm(), nn.Linear(4, 1))
    batches = [torch.randn(4, 4) for _ in range(3)]
    batches[1][2] = 0
    with torch.no_grad():
        model[0].bias.zero_()  # a zero row stays zero through it
    with pytest.raises(ng.NonFiniteError) as raised, ng.Guard(model, mode=mode, ops=True):
        sum(model(x).sum() for x in batches).backward()
    culprit = raised.value.report.first_nonfinite
    assert culprit.module_name == "1" and culprit.op is None
    assert culprit.op_note.startswith("op localisation re-runs the model's latest call, and the "
                                      "value was made in an earlier one")


class _ScaledAdapter(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.down, self.up, self.scale = nn.Linear(4, 2, bias=False), nn.Linear(2, 4, bias=False), scale

    def forward(self, x):
        return x + self.scale * self.up(self.down(x))  # OP: the scale, a Python number, is nan


def test_a_python_number_gone_non_finite_names_the_op_that_took_it():
    model = nn.Sequential(nn.Linear(4, 4), _ScaledAdapter(float("nan")))
    with pytest.raises(ng.NonFiniteError) as raised, ng.Guard(model, ops=True):
        model(torch.randn(2, 4))
    culprit = raised.value.report.first_nonfinite
    assert culprit.module_name == "1" and culprit.op == "aten.mul.Tensor"
    assert "# OP: the scale" in culprit.source and "a number that holds nan" in culprit.op_note
