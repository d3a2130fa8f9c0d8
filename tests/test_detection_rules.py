"""The data and mask rules on real tiny models: an inf in the data is bad data like a nan, a -inf
mask that only masks stops nothing, a mask that leads to nan names the module that made the nan
and says where the -inf came from, and a -inf reaching the model's output is a detection."""

import math

import pytest
import torch
from torch import nn

from numguard_nb import Guard, NonFiniteError


class MaskBuilder(nn.Module):
    """Turns a 0/1 key-padding mask into an additive one: 0 where kept, -inf where masked."""

    def forward(self, keep):
        return torch.zeros(keep.shape).masked_fill(keep == 0, -math.inf).unsqueeze(1)


class Scores(nn.Module):
    """Softmax over masked attention scores."""

    def forward(self, x, additive):
        return (x @ x.transpose(-2, -1) + additive).softmax(-1)


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.build_mask = MaskBuilder()
        self.scores = Scores()
        self.out = nn.Linear(4, 4)

    def forward(self, x, keep):
        weights = self.scores(x, self.build_mask(keep))
        return self.out(weights @ x)


class ReturnsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.build_mask = MaskBuilder()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, keep):
        return self.proj(x), self.build_mask(keep)


def run(model, *inputs, sync=False):
    """The detection of one forward and backward pass under a guard, or None."""
    with Guard(model, sync=sync) as guard:
        try:
            out = model(*inputs)
            out = out[0] if isinstance(out, tuple) else out
            out.sum().backward()
        except NonFiniteError as error:
            return error.report
    assert guard.detection is None
    return None


@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_an_inf_or_nan_in_the_data_is_bad_data(bad, sync):
    torch.manual_seed(0)
    model = nn.Linear(2, 3)
    report = run(model, torch.tensor([[bad, 1.0]]), sync=sync)
    assert report is not None and report.cause == "data"
    assert report.first_nonfinite.module_name == ""
    assert [row.role for row in report.first_nonfinite.flagged_rows] == ["input[0]"]
    word = {math.inf: "+inf", -math.inf: "-inf"}.get(bad, "nan")
    assert f"the data fed to Linear in batch 0 holds {word} " in report.reason


@pytest.mark.parametrize("sync", [False, True])
def test_an_inf_in_the_data_is_bad_data_when_a_submodule_turns_it_into_something_new(sync):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    report = run(model, torch.tensor([[-math.inf, 1.0]]), sync=sync)
    assert report is not None and report.cause == "data"
    assert report.first_nonfinite.module_name == ""
    assert "holds -inf" in report.reason


@pytest.mark.parametrize("sync", [False, True])
def test_a_built_minus_inf_mask_over_partly_masked_rows_is_no_detection(sync):
    torch.manual_seed(0)
    keep = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert run(MaskedAttention(), torch.randn(2, 3, 4), keep, sync=sync) is None


@pytest.mark.parametrize("sync", [False, True])
def test_a_fully_masked_row_names_the_softmax_and_where_the_minus_inf_came_from(sync):
    torch.manual_seed(0)
    keep = torch.tensor([[1, 1, 0], [0, 0, 0]])  # the second sample has no key left
    report = run(MaskedAttention(), torch.randn(2, 3, 4), keep, sync=sync)
    assert report is not None and report.cause == "forward"
    assert report.first_nonfinite.module_name == "scores"
    assert report.reason.endswith("the -inf mask it received came from build_mask (MaskBuilder)")


def test_a_minus_inf_mask_passed_in_that_only_masks_is_no_detection():
    torch.manual_seed(0)
    additive = MaskBuilder()(torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert run(Scores(), torch.randn(2, 3, 4, requires_grad=True), additive) is None


class PassesMaskOn(nn.Module):
    def __init__(self):
        super().__init__()
        self.scores = Scores()

    def forward(self, x, additive):
        return self.scores(x, additive)


@pytest.mark.parametrize("sync", [False, True])
def test_a_mask_passed_in_with_a_fully_masked_row_names_the_softmax_and_the_data(sync):
    torch.manual_seed(0)
    additive = MaskBuilder()(torch.tensor([[1, 1, 0], [0, 0, 0]]))
    report = run(PassesMaskOn(), torch.randn(2, 3, 4, requires_grad=True), additive, sync=sync)
    assert report is not None and report.cause == "forward"
    assert report.first_nonfinite.module_name == "scores"
    assert report.reason.endswith(
        "the -inf mask it received came from the data fed to PassesMaskOn")


@pytest.mark.parametrize("sync", [False, True])
def test_a_minus_inf_reaching_the_models_output_names_its_maker_once_the_loss_takes_it(sync):
    torch.manual_seed(0)
    keep = torch.tensor([[1, 1, 0], [1, 0, 0]])
    model, x = ReturnsMask(), torch.randn(2, 3, 4)
    assert run(model, x, keep, sync=sync) is None  # the loss leaves the mask out: a note
    with pytest.raises(NonFiniteError) as caught, Guard(model, sync=sync):
        out, mask = model(x, keep)
        (out.sum() + mask.sum()).backward()  # the mask's -inf in the loss
    report = caught.value.report
    assert report.cause == "forward" and report.first_nonfinite.module_name == "build_mask"
    assert report.reason.endswith("and the -inf reaches the model's output")


@pytest.mark.parametrize("sync", [False, True])
def test_a_running_variance_that_overflowed_is_named_at_the_next_call(sync):
    # One finite outlier (1e21) overflows the batch variance: the output stays finite
    # (x / sqrt(inf) = 0) but running_var turns +inf, and every evaluation after is constant
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    batches = [torch.randn(16, 4) for _ in range(3)]
    batches[1][0] = 1e21
    with pytest.raises(NonFiniteError) as raised, Guard(model, sync=sync):
        for x in batches:
            model(x).sum().backward()
    report = raised.value.report
    assert (report.cause, report.first_nonfinite.module_name, report.batch_number) == ("weights", "1", 2)
    assert [row.role for row in report.first_nonfinite.flagged_rows] == ["running_var"]
    assert "reset_running_stats()" in report.hint


class DistanceLogits(nn.Module):
    """Masks distances with +inf (a min-pooling's way), then its head turns them into logits."""

    def __init__(self, head=None):
        super().__init__()
        self.head = head or _Negate()

    def forward(self, d, keep):
        return torch.softmax(self.head(d.masked_fill(~keep, float("inf"))), -1)


class _Negate(nn.Module):
    def forward(self, d):
        return -d * 0.5  # +inf -> -inf: a mask, which the softmax uses up


class _Times0(nn.Module):
    def forward(self, d):
        return d * 0  # inf * 0: nan


def test_a_plus_inf_mask_made_between_submodules_and_used_up_is_no_detection():
    keep = torch.tensor([[True, False, True]]).expand(4, 3)
    assert run(DistanceLogits(), torch.rand(4, 3, requires_grad=True), keep) is None


def test_where_a_parent_may_make_inf_its_submodule_that_makes_nan_of_it_is_named():
    keep = torch.tensor([[True, False, True]]).expand(4, 3)
    model = DistanceLogits(_Times0())
    with pytest.raises(NonFiniteError) as raised, Guard(model, allow_inf=[""]):
        model(torch.rand(4, 3), keep)
    assert raised.value.report.cause == "forward" and raised.value.report.first_nonfinite.module_name == "head"
    with pytest.raises(NonFiniteError) as raised, Guard(model):  # not allowed: the parent's code
        model(torch.rand(4, 3), keep)
    assert raised.value.report.cause == "forward-inline" and raised.value.report.first_nonfinite.module_name == ""


class GatedMLP(nn.Module):
    """Llama's MLP: `down(act(gate(x)) * up(x))`, its product made in its own code."""

    def __init__(self, sign: float):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            for layer, scale in ((self.gate, 300.0), (self.up, 300.0 * sign)):
                layer.weight.copy_(torch.eye(4) * scale)
                layer.bias.zero_()

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["+inf", "-inf"])
def test_a_float16_product_that_overflows_to_minus_inf_alone_is_named_where_it_is_made(mode, sign):
    """A product past 65504 is an overflow whatever its sign: -inf alone, handed to a Linear,
    is no mask (no mask goes into a matmul), so the MLP's own code is named, not the Linear."""
    model = GatedMLP(sign).half()
    with pytest.raises(NonFiniteError) as raised, Guard(model, mode=mode, ops=mode == "full"):
        model(torch.ones(2, 4, dtype=torch.float16))
    report = raised.value.report
    assert (report.cause, report.first_nonfinite.module_name) == ("forward-inline", "")
    assert report.first_nonfinite.op == "aten.mul.Tensor"
    assert "mask" not in report.reason
    # a model made with .half() has no autocast to turn off: the fix casts back and forth
    assert ("in float32 (its operands `.float()`, and what it gives `.half()` again for the float16 "
            "layers after it)") in report.hint and "autocast" not in report.hint
