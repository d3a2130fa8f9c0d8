"""The hint of a detection (`explain.hint_for`, `Report.hint`) and where the views show it.

One test per family of causes, each on a real detection of a tiny model written here (float16
runs on CPU), asserting that the hint names the number that matters and the fix to try; then
reports built by hand for what no small model reaches, the views, and the demo.
Set NUMGUARD_UPDATE_GOLDEN=1 to rewrite tests/golden/hint_* after an intended change.
"""

import math
import os
import pickle
import re
from pathlib import Path

import pytest

import torch
import torch.nn.functional as F
from torch import nn

from numguard_nb import Guard, NonFiniteError
from numguard_nb.explain import format_number, hint_for, limit_text
from numguard_nb.render.html import report_html
from numguard_nb.render.widget import ReportView
from numguard_nb.report import (
    BACKWARD, DETECTION, FORWARD, GRAD_INPUT, GRAD_OUTPUT, INPUT, OUTPUT, PARAM, Frame, Report,
    TensorRow,
)

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("NUMGUARD_UPDATE_GOLDEN") == "1"
SPECIFIC_WORDS = ("65504", "bfloat16", "autocast", "softmax", "learning rate", "-100", "eps=")


def detect(models, step, **options) -> Report:
    """The report of the detection `step()` makes under a Guard (ops=True unless told)."""
    options.setdefault("ops", True)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(models, **options):
            step()
    return caught.value.report


# ---- tiny models, after the code of the bug reports ---------------------------------------------
class FeedForward(nn.Module):
    """T5's wi -> relu -> wo, with weights an fp16 run grew until wo overflows."""

    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(4, 8, bias=False)
        self.wo = nn.Linear(8, 4, bias=False)
        with torch.no_grad():
            self.wi.weight.fill_(10.0)
            self.wo.weight.fill_(100.0)

    def forward(self, h):
        h = torch.relu(self.wi(h))
        h = self.wo(h)
        return h


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-2, -1)
        scores = scores.masked_fill(mask[:, None, :] == 0, float("-inf"))
        return torch.softmax(scores, dim=-1)


class Distance(nn.Module):
    def forward(self, a, b):
        return torch.sqrt(((a - b) ** 2).sum(-1))


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.distance = Distance()

    def forward(self, a, b):
        return self.distance(self.encoder(a), self.encoder(b))


class HandBCE(nn.Module):
    def forward(self, logits, target):
        p = torch.sigmoid(logits)
        return -(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()


class MaskedMean(nn.Module):
    def forward(self, hidden, mask):
        mask = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)


class CausalLM(nn.Module):
    """Computes its loss in forward, as transformers' causal LMs do."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.lm_head = nn.Linear(8, 16)

    def forward(self, ids, labels):
        logits = self.lm_head(self.embed(ids))
        return F.cross_entropy(logits.view(-1, 16), labels.view(-1), ignore_index=-100)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(2, 3)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


class MaskBuilder(nn.Module):
    def forward(self, ids):
        return torch.zeros(ids.shape).masked_fill(ids == 0, float("-inf"))


class Acos(nn.Module):
    def forward(self, x):
        return torch.acos(x * 2)


def mlp(widths=(4, 8, 1)):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


# ---- one test per family ---------------------------------------------------------------------
def test_fp16_matmul_overflow_keeps_the_layer_in_float32_under_autocast():
    model = FeedForward().half()
    report = detect(model, lambda: model(torch.full((2, 4), 3.0).half()))
    assert report.first_nonfinite.module_name == "wo"
    hint = hint_for(report)
    assert "float16's largest value 65504" in hint
    assert "its input reached 120 and its weight 100" in hint
    assert 'with torch.autocast("cuda", enabled=False): h = self.wo(h.float())' in hint
    assert "`model.wo.float()`" in hint  # the weights are float16: autocast alone cannot help
    assert "bfloat16 (largest value 3.39e+38)" in hint


def test_an_overflow_under_cpu_autocast_is_told_to_turn_off_the_cpu_s_autocast():
    model = FeedForward()

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.full((2, 4), 3.0))

    report = detect(model, step)
    assert report.first_nonfinite.module_name == "wo" and report.autocast_device == "cpu"
    assert 'with torch.autocast("cpu", enabled=False): h = self.wo(h.float())' in hint_for(report)


def test_fp16_overflow_in_a_sequential_layer_names_its_path():
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(10.0)
        model[2].weight.fill_(100.0)
    model.half()
    hint = hint_for(detect(model, lambda: model(torch.full((2, 4), 3.0).half())))
    assert "The matmul `aten.mm.default` in 2 (Linear) passed float16's largest value 65504" in hint
    assert "Keep `model[2]` in float32" in hint and "`model[2].float()`" in hint


def test_predicted_overflow_says_what_float16_would_do():
    model = FeedForward()  # float32, run with float16's limits
    report = detect(model, lambda: model(torch.full((2, 4), 3.0)), limit_dtype=torch.float16,
                    stop_at_limit=True)
    hint = hint_for(report)
    assert "reached 96000, beyond float16's largest value 65504" in hint
    assert "would overflow to inf" in hint and "h = self.wo(h.float())" in hint


def test_fully_masked_softmax_row_masks_with_a_finite_value():
    torch.manual_seed(0)
    model = MaskedAttention()
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])  # the second sample has no token
    report = detect(model, lambda: model(torch.randn(2, 3, 4), mask))
    hint = hint_for(report)
    assert "`aten._softmax.default`" in hint and "entries are all -inf" in hint
    assert "torch.finfo(scores.dtype).min" in hint


def test_sqrt_at_zero_in_backward_puts_an_eps_inside_or_uses_vector_norm():
    torch.manual_seed(0)
    model = Siamese()
    a = torch.randn(3, 4)
    report = detect(model, lambda: model(a, a.clone()).sum().backward())
    assert report.first_nonfinite.phase == BACKWARD
    hint = hint_for(report)
    assert "`SqrtBackward0`" in hint and "infinite at 0" in hint
    assert "torch.sqrt(d2 + 1e-12)" in hint and "torch.linalg.vector_norm(a - b, dim=-1)" in hint


def test_log_of_zero_clamps_or_works_from_logits():
    loss_fn = HandBCE()
    logits, target = torch.tensor([40.0, -1.0]), torch.tensor([0.0, 1.0])  # sigmoid(40) is 1.0
    report = detect(loss_fn, lambda: loss_fn(logits, target))
    hint = hint_for(report)
    assert "came from the log `aten.log.default`" in hint and "log(0) = -inf" in hint
    assert "torch.log(p.clamp_min(1e-7))" in hint and "nn.BCEWithLogitsLoss" in hint


def test_a_loss_outside_the_guarded_modules_is_named_with_its_op_and_fix():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(10.0)

    def step():
        p = torch.sigmoid(model(torch.full((2, 4), 1.0)).squeeze(-1))  # rounds to 1.0
        target = torch.tensor([1.0, 0.0])
        (-(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()).backward()

    report = detect(model, step)
    assert report.cause == "outside" and report.first_nonfinite.module_name == "<outside>"
    assert report.first_nonfinite.op == "aten.log.default"
    hint = hint_for(report)
    assert "log(0) = -inf" in hint and "nn.BCEWithLogitsLoss" in hint


def test_division_by_a_zero_sum_clamps_the_denominator():
    model = MaskedMean()
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    report = detect(model, lambda: model(torch.rand(2, 3, 4) + 0.5, mask))
    hint = hint_for(report)
    assert "divided 0 by 0 in `aten.div.Tensor`" in hint and "input[1] holds zeros" in hint
    assert "n.clamp_min(1)" in hint


class TemperedSoftmax(nn.Module):
    """Gumbel-softmax style: logits over a temperature that reached 0, then a softmax."""

    def __init__(self):
        super().__init__()
        self.tau = 0.0

    def forward(self, x):
        return torch.softmax(x / self.tau, dim=-1)  # x/0 = inf; the softmax makes nan of it


def test_a_division_that_made_inf_says_by_0_though_the_module_gave_nan():
    model = TemperedSoftmax()
    hint = hint_for(detect(model, lambda: model(torch.randn(2, 3))))
    assert "divided by 0 in `aten.div.Tensor`" in hint and "0 by 0" not in hint, hint
    assert "a temperature that reached 0" in hint


class Reparameterise(nn.Module):
    """A VAE's sample: exp of a log-variance the encoder made large from a small input."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 2)
        with torch.no_grad():
            self.encoder.weight.fill_(100.0)

    def forward(self, x):
        logvar = self.encoder(x)
        return torch.exp(0.5 * logvar)


def test_an_exp_overflow_quotes_no_input_that_stayed_below_exp_s_threshold():
    model = Reparameterise()
    hint = hint_for(detect(model, lambda: model(torch.ones(1, 4))))
    assert "exp overflows float32 above 88.72" in hint and "reached" not in hint, hint
    from models import Exp

    model = nn.Sequential(Exp())
    hint = hint_for(detect(model, lambda: model(torch.full((2,), 200.0))))
    assert "its input reached 200" in hint, hint  # exp's argument itself: quoted


def test_a_loss_over_zero_labels_says_every_label_was_ignored():
    torch.manual_seed(0)
    model = CausalLM()
    ids = torch.randint(0, 16, (2, 5))
    report = detect(model, lambda: model(ids, torch.full((2, 5), -100)))
    hint = hint_for(report)
    assert "ignore_index (-100)" in hint and "every value of input[1] is -100)" in hint
    assert "max(count, 1)" in hint


class Speech(nn.Module):
    """Frames -> per-frame log-probabilities over 5 labels (0: the blank)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.rnn(x)[0]).log_softmax(-1).transpose(0, 1)


@pytest.mark.parametrize("allow_inf", [False, True])
def test_a_ctc_target_longer_than_its_input_names_zero_infinity(allow_inf):
    # 4 frames cannot hold 6 labels: the loss is inf (forward) and, with the inf allowed, its
    # gradient nan (backward). Both point at the lengths and at zero_infinity.
    torch.manual_seed(0)
    model = Speech()
    frames, targets = torch.randn(2, 4, 8), torch.randint(1, 5, (2, 6))

    def step():
        log_probs = model(frames)
        loss = F.ctc_loss(log_probs, targets, torch.tensor([4, 4]), torch.tensor([6, 6]))
        loss.backward()

    with Guard(model, allow_inf=allow_inf) as guard:
        with pytest.raises(NonFiniteError) as caught:
            step()
    report = caught.value.report
    assert report.first_nonfinite.phase == ("backward" if allow_inf else "forward")
    hint = hint_for(report)
    assert "CTC loss" in hint and "zero_infinity=True" in hint, hint
    assert "input_lengths >= target_lengths" in hint and "allow_inf" not in hint


def test_an_exploding_learning_rate_lowers_it_and_clips():
    torch.manual_seed(10)
    model = mlp((8, 32, 32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    x, y = torch.randn(16, 8), torch.randn(16)

    def train():
        for _ in range(20):
            F.mse_loss(model(x).squeeze(-1), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    report = detect(model, train)
    assert report.batch_number > 0
    hint = hint_for(report)
    assert "float32's largest value 3.4e+38" in hint and "training diverged" in hint
    assert "Lower the learning rate" in hint and "clip_grad_norm_" in hint


def test_nan_in_the_data_says_how_to_find_the_samples():
    torch.manual_seed(0)
    model = ConvNet()
    images = torch.rand(2, 1, 4, 4)
    images[1] = float("nan")  # a blank image after a min-max normalisation: 0/0
    report = detect(model, lambda: model(images))
    assert report.cause == "data"
    hint = hint_for(report)
    assert "torch.isnan(x).flatten(1).any(1).nonzero()" in hint and "shape 2×1×4×4" in hint
    report = detect(model, lambda: model(images[1:]))
    assert "the batch's only sample" in hint_for(report)


def test_weights_broken_by_adam_in_float16_name_its_eps():
    torch.manual_seed(13)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Flatten(), nn.Linear(8, 3)).half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)

    def train():
        for low in (0, 0, 4):  # rows 4-7 get zero gradients until the last batch
            ids = torch.randint(low, low + 4, (2, 2))
            F.cross_entropy(model(ids).float(), torch.tensor([0, 1])).backward()
            optimizer.step()
            optimizer.zero_grad()

    report = detect(model, train)
    assert report.cause == "weights"
    hint = hint_for(report)
    assert "eps=1e-8 rounds to 0" in hint and "5.96e-08" in hint and "`eps=1e-4`" in hint


def test_weights_broken_by_an_optimizer_with_eps_0_name_it_not_the_learning_rate():
    # AdamW(eps=0) (`adam_epsilon=0.0` of a Trainer): 0/0 where a row's gradients were all 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 4), nn.Flatten(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, eps=0.0)

    def train():
        for _ in range(2):  # rows 4-7 are never used: their gradients stay exactly 0
            F.cross_entropy(model(torch.randint(0, 4, (2, 2))), torch.tensor([0, 1])).backward()
            optimizer.step()
            optimizer.zero_grad()

    report = detect(model, train)
    assert report.cause == "weights" and report.optimizer_step.eps == 0.0
    hint = hint_for(report)
    assert "has eps=0" in hint and "0/0" in hint and "Lower the learning rate" not in hint


def test_float32_weights_broken_by_a_step_lower_the_learning_rate():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e37)

    def train():
        for _ in range(2):  # backward is not watched: the step writes inf weights
            model(torch.full((2, 4), 100.0)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    report = detect(model, train, backward=False)
    assert report.cause == "weights"
    hint = hint_for(report)
    assert "optimizer step" in hint and "Lower the learning rate" in hint and "clip_grad_norm_" in hint


def test_broken_running_statistics_reset_them():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bad = torch.randn(3, 4)
    bad[0, 0] = float("nan")
    model(bad)  # unguarded, in training mode: running_mean keeps the nan
    model.eval()
    report = detect(model, lambda: model(torch.randn(3, 4)))
    hint = hint_for(report)
    assert "running statistics kept it" in hint and "`model[1].reset_running_stats()`" in hint


def test_bce_in_float16_backward_uses_bce_with_logits():
    torch.manual_seed(7)
    model, loss_fn = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid()).half(), nn.BCELoss()
    x = (20.0 * model[0].weight[0].float().sign()).half().expand(2, 4)  # confidently right
    target = torch.ones(2).half()
    report = detect({"model": model, "loss_fn": loss_fn},
                    lambda: loss_fn(model(x).squeeze(-1), target).backward())
    hint = hint_for(report)
    assert "clamped at 1e-12, which is 0 in float16" in hint and "5.96e-08" in hint
    assert "`nn.BCEWithLogitsLoss`" in hint


def test_float16_gradient_overflow_mentions_the_grad_scaler():
    model = nn.Linear(8, 4).half()
    with torch.no_grad():
        model.weight.fill_(100.0)
    x = torch.ones(2, 8).half().requires_grad_()
    # forward stays finite (800); the gradient handed in, 1000, overflows inside the Linear
    report = detect(model, lambda: model(x).sum().backward(torch.tensor(1000.0).half()))
    assert report.first_nonfinite.phase == BACKWARD
    hint = hint_for(report)
    assert "float16's largest value 65504" in hint and "torch.amp.GradScaler" in hint


def test_an_inf_mask_that_reaches_the_loss_is_told_to_be_finite_not_allowed():
    model = nn.ModuleDict({"masks": MaskBuilder()})
    bias = torch.zeros(1, 2, requires_grad=True)
    # the mask reaches the loss (a mask alone, with no loss, only gets a note): allowing its
    # -inf would leave the loss infinite
    report = detect(model, lambda: (model["masks"](torch.tensor([[1, 0]])) + bias).sum().backward())
    hint = hint_for(report)
    assert "masks (MaskBuilder) made -inf from finite inputs" in hint
    assert "the -inf reached the loss and made it non-finite" in hint
    assert "large negative finite value" in hint and "allow_inf" not in hint
    assert report.first_nonfinite.op_note and "Rerun" not in hint  # op localisation did run


class PlusInfFill(nn.Module):
    def forward(self, ids):
        return torch.zeros(ids.shape).masked_fill(ids == 0, float("inf"))  # a "no limit" marker


def test_an_inf_a_module_writes_on_purpose_is_allowed_by_name():
    model = nn.ModuleDict({"limits": PlusInfFill()})
    report = detect(model, lambda: model["limits"](torch.tensor([[1, 0]])))
    assert 'allow it: `Guard(model, allow_inf=["limits"])`' in hint_for(report)


def test_an_inf_given_with_the_data_is_traced_back_to_it():
    torch.manual_seed(0)
    model = mlp((4, 8, 2))
    x = torch.rand(3, 4)
    x[1, 2] = float("-inf")  # log(0) of a zero-width box in the preprocessing
    report = detect(model, lambda: model(x))
    hint = hint_for(report)
    assert report.cause == "data"
    assert "already holds -inf in input[0]" in hint and "~torch.isfinite(x)" in hint
    assert "log(0)" in hint and "65504" not in hint and "overflow" not in hint
    # the search it suggests, run as written, finds the sample
    search = re.search(r"`([^`]*nonzero\(\))`", hint).group(1)
    assert eval(search, {"torch": torch, "x": x}).flatten().tolist() == [1]


def test_an_unknown_cause_gets_a_general_hint_that_names_no_wrong_fix():
    model = nn.Sequential(nn.Linear(2, 2), Acos())
    report = detect(model, lambda: model(torch.ones(1, 2)), ops=False)
    hint = hint_for(report)
    assert "1 (Acos) made nan from finite inputs" in hint
    assert "0/0, inf - inf, 0 * inf or sqrt/log of a negative value" in hint
    assert "Rerun with `Guard(model, ops=True)`" in hint
    assert not any(word in hint for word in SPECIFIC_WORDS)


# ---- reports built by hand ---------------------------------------------------------------------
def row(role, category, dtype="float32", shape=(2, 4), lo=0.1, hi=1.0, **kw):
    return TensorRow(role=role, category=category, dtype=dtype, shape=shape, abs_min=lo, abs_max=hi, **kw)


def hand_report(frame, cause="forward", **fields):
    return Report(frames=[frame], first_nonfinite=frame, batch_number=3, kind=DETECTION,
                  reason="the reason", cause=cause, **fields)


def test_what_an_op_was_given_counts_neither_integer_ids_nor_a_masks_fill():
    # ids up to 30000 and an additive mask of finfo(float32).min are no values that overflow:
    # the input that matters reached 2.
    frame = Frame("head", "Custom", FORWARD, 3, 0, [
        row("input[0]", INPUT, hi=2.0),
        row("input[1]", INPUT, dtype="int64", lo=0.0, hi=30000.0),
        row("input[2]", INPUT, lo=0.0, hi=3.4028234663852886e38),
        row("output", OUTPUT, lo=math.nan, hi=math.nan, nan=True, flagged=True),
    ], op="aten.special_frobnicate.default", source="model.py:9: y = frobnicate(x, ids, mask)")
    hint = hint_for(hand_report(frame))
    assert "its input reached 2)" in hint, hint


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_an_exp_overflow_says_float32_only_where_it_is_wider(dtype):
    frame = Frame("head", "Custom", FORWARD, 3, 0, [
        row("input[0]", INPUT, dtype=dtype, hi=120.0),
        row("output", OUTPUT, dtype=dtype, lo=1.0, hi=math.inf, posinf=True, flagged=True),
    ], op="aten.exp.default", source="model.py:9: y = torch.exp(x)")
    hint = hint_for(hand_report(frame))
    assert "Subtract the max first" in hint, hint
    assert ("compute it in float32" in hint) == (dtype == "float16"), hint


def test_an_op_no_rule_knows_gets_the_general_hint_with_the_op_and_line():
    frame = Frame("head", "Custom", FORWARD, 3, 0, [
        row("input[0]", INPUT, hi=2.0),
        row("output", OUTPUT, lo=math.nan, hi=math.nan, nan=True, flagged=True),
    ], op="aten.special_frobnicate.default", source="model.py:9: y = frobnicate(x)")
    hint = hint_for(hand_report(frame))
    assert "in `aten.special_frobnicate.default` at `y = frobnicate(x)`" in hint
    assert "its input reached 2" in hint and "Rerun" not in hint
    assert not any(word in hint for word in SPECIFIC_WORDS)


def test_an_unattributed_nan_says_no_module_can_be_named():
    frame = Frame("block", "Block", BACKWARD, 3, 0, [
        row("grad_output", GRAD_OUTPUT),
        row("grad_input[0]", GRAD_INPUT, lo=math.nan, hi=math.nan, nan=True, flagged=True),
    ])
    hint = hint_for(hand_report(frame, cause="unattributed"))
    assert "nan first shows in block (Block) (backward, grad_input[0])" in hint
    assert "no module can be named" in hint


def test_weights_beyond_the_limit_dtype_would_be_inf():
    frame = Frame("fc", "Linear", FORWARD, 3, 0, [
        row("weight", PARAM, hi=7.0e4, predicted_overflow=True, limit_share=7e4 / 65504, flagged=True),
    ])
    hint = hint_for(hand_report(frame, cause="weights", limit_dtype="float16"))
    assert "weight of fc (Linear) reached 70000, beyond float16's largest value 65504" in hint
    assert "it would be inf" in hint


def test_no_culprit_no_hint_and_the_numbers_read_as_written():
    assert hint_for(Report(frames=[])) == ""
    assert [format_number(v) for v in (65504.0, 240.0, 4.394e27, 0.3654, math.inf)] == [
        "65504", "240", "4.39e+27", "0.365", "inf"]
    assert limit_text("float16") == "float16's largest value 65504"
    assert limit_text("int64") == ""


# ---- Report.hint and the views ---------------------------------------------------------------
HINT = ("The matmul `aten.mm.default` in ff.wo (Linear) passed float16's largest value 65504. "
        "Keep it in float32: `h = self.wo(h.float())` & <b>, or train in bfloat16.")


def report_with_hint(hint=HINT):
    frames = [
        Frame("ff.wi", "Linear", FORWARD, 7, 0, [
            row("weight", PARAM, "float16", hi=40.0), row("input[0]", INPUT, "float16", hi=2.5),
            row("output", OUTPUT, "float16", hi=700.0),
        ]),
        Frame("ff.wo", "Linear", FORWARD, 7, 0, [
            row("weight", PARAM, "float16", hi=30.0), row("input[0]", INPUT, "float16", hi=700.0),
            row("output", OUTPUT, "float16", lo=8.0, hi=math.inf, posinf=True, flagged=True),
        ], op="aten.mm.default", source="model.py:12: h = self.wo(h)"),
    ]
    return Report(frames=frames, first_nonfinite=frames[-1], batch_number=7, kind=DETECTION,
                  reason="ff.wo (Linear) produced a non-finite value in forward (call 0 of batch "
                         "7): output holds +inf, which its inputs and weights did not hold",
                  cause="forward", hint=hint)


def check_golden(name, text):
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing: run with NUMGUARD_UPDATE_GOLDEN=1 once"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file"


def test_the_hint_is_a_field_of_the_report_kept_by_pickling_and_equality():
    report = report_with_hint()
    assert Report(frames=[]).hint == ""
    assert pickle.loads(pickle.dumps(report)).hint == HINT
    assert pickle.loads(pickle.dumps(report)) == report
    assert report_with_hint("another hint") != report


def test_nonfinite_words_leave_the_predictions_out_of_problems():
    row = TensorRow("output", OUTPUT, abs_max=math.inf, posinf=True, neginf=True,
                    predicted_underflow=True)
    assert row.nonfinite_words == "+inf and -inf"
    assert row.problems == "+inf and -inf, underflow predicted"
    row = TensorRow("output", OUTPUT, abs_max=7e4, nan=True, predicted_overflow=True)
    assert (row.nonfinite_words, row.problems) == ("nan", "nan, overflow predicted")
    assert TensorRow("output", OUTPUT, abs_max=7e4, predicted_overflow=True).nonfinite_words == ""


def test_text_prints_the_hint_after_the_reason():
    report = report_with_hint()
    text = report.to_text()
    check_golden("hint_detection.txt", text + "\n")
    lines = text.splitlines()
    assert lines[lines.index(report.reason) + 1] == f"hint: {HINT}"
    report.hint = ""
    assert report.to_text() == "\n".join(line for line in lines if not line.startswith("hint: "))


def test_html_header_shows_the_hint_with_its_code():
    report = report_with_hint()
    markup = report_html(report)
    header = markup[markup.index('<div class="ng-header">'):markup.index('<div class="ng-tree">')]
    summary_end = header.index("</div>")
    hint_at = header.index('<div class="ng-hint"')
    assert summary_end < hint_at < header.index('<div class="ng-meta">')
    assert "<code>aten.mm.default</code>" in header
    assert "<code>h = self.wo(h.float())</code> &amp; &lt;b&gt;" in header
    report.hint = ""
    assert "ng-hint" not in report_html(report)


def test_widget_header_shows_the_hint():
    view = ReportView(report_with_hint())
    header = view.widget.children[0]
    assert "ng-header-widget" in header._dom_classes
    assert 'class="ng-hint"' in header.value and "<code>aten.mm.default</code>" in header.value


def test_demo_leads_with_the_verdict_and_the_hint(capsys):
    from numguard_nb import demo

    assert demo.main() == 0
    lines = capsys.readouterr().out.splitlines()
    verdict = lines.index("Caught NonFiniteError in batch 0:") + 1
    assert "DenseReluDense.wo (Linear) produced a non-finite value" in lines[verdict]
    assert lines[verdict + 1].startswith("hint: The matmul `aten.mm.default`")
    assert "65504" in lines[verdict + 1] and "enabled=False" in lines[verdict + 1]
    assert verdict + 1 < lines.index("Detected inf/nan during batch_number=0")


@pytest.mark.parametrize("cause", ["forward", "backward", "weights", "data", "loss-gradient",
                                   "unattributed", ""])
def test_reports_without_rows_or_numbers_still_get_a_hint(cause):
    """The engine fills the hint while raising a detection: a report it cannot read must not
    turn into another error."""
    bare = Frame("", "Model", FORWARD, 0, 0, [])
    blank = Frame("fc", "Linear", BACKWARD, 0, 0, [
        TensorRow("weight", PARAM, kind="none", flagged=True),
        TensorRow("output", OUTPUT, dtype="float16", abs_min=None, abs_max=None, nan=True),
    ], op="aten.mm.default", op_note="note")
    for frame in (bare, blank):
        report = Report(frames=[], first_nonfinite=frame, cause=cause, limit_dtype="bogus")
        hint = hint_for(report)
        assert hint and hint.count("`") % 2 == 0


def test_exploding_recurrent_gradients_get_clipping_init_and_shorter_bptt_not_an_eps():
    import torch.nn.functional as F
    from torch import nn

    from numguard_nb import Guard, NonFiniteError

    class LanguageModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.rnn = nn.LSTM(16, 256, batch_first=True)
            self.head = nn.Linear(256, 50)
            with torch.no_grad():
                self.rnn.weight_hh_l0.normal_(0, 1)  # recurrent weights far above orthogonal

        def forward(self, ids):
            return self.head(self.rnn(self.embed(ids))[0])

    torch.manual_seed(0)
    model = LanguageModel()
    ids = torch.randint(0, 50, (2, 512))  # backpropagation through 512 steps
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        F.cross_entropy(model(ids).reshape(-1, 50), ids.reshape(-1)).backward()
    report = caught.value.report
    assert (report.first_nonfinite.module_class, report.phase) == ("LSTM", "backward")
    hint = report.hint
    assert "exploding gradients" in hint and "clip_grad_norm_" in hint and "orthogonal" in hint
    assert "truncated BPTT" in hint and "Add an eps" not in hint


def test_a_feature_normalised_by_a_zero_std_is_named_by_its_column_not_as_bad_samples():
    from torch import nn

    from numguard_nb import Guard, NonFiniteError

    torch.manual_seed(0)
    x = torch.randn(100, 12)
    x[:, 7] = 3.0  # a constant feature
    x = (x - x.mean(0)) / x.std(0)  # column 7: 0 / 0
    model = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 1))
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x)
    report = caught.value.report
    assert report.cause == "data"
    assert report.first_nonfinite.flagged_rows[0].nonfinite_features == (7,)
    assert "column 7 of input[0]" in report.hint and "every one of its 100 samples" in report.hint
    assert "std.clamp_min(1e-8)" in report.hint and "fix or drop them" not in report.hint


def test_a_mask_fill_summed_by_a_label_smoothed_loss_is_named_as_the_fill():
    class FinfoMinMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(6, 5)

        def forward(self, x, legal):
            return self.net(x).masked_fill(~legal, torch.finfo(torch.float32).min)

    torch.manual_seed(0)
    model, legal = FinfoMinMask(), torch.ones(4, 5, dtype=torch.bool)
    legal[:, 3:] = False
    report = detect(model, lambda: nn.functional.cross_entropy(
        model(torch.randn(4, 6), legal), torch.tensor([0, 1, 2, 1]), label_smoothing=0.1).backward())
    hint = hint_for(report)
    assert "which holds a mask's fill, 3.4e+38 (`torch.finfo(dtype).min`)" in hint, hint
    assert "allow_inf" not in hint and "initial weights" not in hint


class LogSpaceRecursion(nn.Module):
    """An HMM/CTC-style log-space step: a row whose states are all impossible (-inf)
    (pytorch/pytorch#31829): logsumexp gives -inf, its backward exp(-inf - -inf) = nan."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        mask = torch.tensor([[0.0] * 3, [float("-inf")] * 3])
        return torch.logsumexp(self.fc(x) + mask, -1).clamp_min(-100.0)


class Whitening(nn.Module):
    """ZCA whitening's eigh of a covariance with two dead features: repeated eigenvalues."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.cat([self.fc(x), torch.zeros(x.shape[0], 2)], 1)
        return torch.linalg.eigh(h.T @ h)[1].sum(0)


@pytest.mark.parametrize("model, words", [
    (LogSpaceRecursion, "over a row that is all -inf"),
    (Whitening, "repeated (degenerate) ones"),
])
def test_a_backward_nan_no_eps_can_fix_gets_its_own_hint(model, words):
    torch.manual_seed(0)
    module = model()
    x = torch.randn(2, 3) if model is LogSpaceRecursion else torch.randn(6, 3)
    hint = hint_for(detect(module, lambda: module(x).sum().backward()))
    assert words in hint and "Add an eps" not in hint, hint
