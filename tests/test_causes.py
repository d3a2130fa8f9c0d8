"""Causes in true words: what wrote non-finite weights, which samples of the data hold inf/nan,
and a reason sentence that reads as English for every cause.

- Weights: an optimizer step the guard saw between the model's forward before (which found them
  finite) and the one that found them is named (class, step, batch, optimizer and group where
  there are several); with no step in between, they changed outside the model's forward; in the
  guard's first forward they were already non-finite when it attached. The hint follows the same
  facts. The step hook is global: gone after detach, however the block ends.
- Data: the samples (indices along dim 0) holding inf/nan, in the reason, the hint, the text and
  the HTML.
- Sentences: one detection per cause (real where a tiny model makes it, else built by hand),
  checked for fragments no person would write.
"""

import gc
import math
import re
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from numguard_nb import Guard, NonFiniteError
from numguard_nb._schema import (
    CAUSE_BACKWARD, CAUSE_BACKWARD_INLINE, CAUSE_DATA, CAUSE_FORWARD, CAUSE_FORWARD_INLINE,
    CAUSE_LOSS_GRADIENT, CAUSE_UNATTRIBUTED, CAUSE_WEIGHTS, CAUSES, ORIGIN_BEFORE_ATTACH, ORIGIN_OPTIMIZER_STEP,
    ORIGIN_OUTSIDE_FORWARD, ORIGIN_SINCE_ATTACH, ORIGIN_SINCE_FORWARD, CAUSE_OUTSIDE, OUTSIDE_MODULE,
    WRITTEN_IN_FORWARD,
)
from numguard_nb.guard import frames
from numguard_nb.guard.options import GuardOptions
from numguard_nb.guard.passes import PassRecord
from numguard_nb.guard.steps import MAX_STEPS, Origin, StepWatch
from numguard_nb.report import (
    BACKWARD, BUFFER, FORWARD, GRAD_INPUT, GRAD_OUTPUT, INPUT, OUTPUT, PARAM, Frame, OptimizerStep,
    TensorRow,
)

from models import Exp, SqrtOfZero
from promises import hooks_left

STEP_HOOK = "WeakHook note_step"  # how the guard's optimizer-step hook shows in `hooks_left`


def detection(models, run, **options):
    """The report of the NonFiniteError `run()` raises under a Guard."""
    with pytest.raises(NonFiniteError) as caught, Guard(models, **options):
        run()
    return caught.value.report


def linear(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def batch(rows: int = 6) -> torch.Tensor:
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(1))
    x[:, 0] = 0.0  # the first weight column gets a zero gradient: inf * 0 is nan there
    return x


# ---- 1. weights: what wrote them ---------------------------------------------------------------
def test_an_optimizer_step_with_a_huge_lr_is_named_as_what_wrote_the_weights():
    model = linear()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train():
        for number in range(5):
            F.mse_loss(model(batch()), torch.zeros(6, 2)).backward()
            if number == 2:
                optimizer.param_groups[0]["lr"] = math.inf  # diverged: the update is inf
            optimizer.step()
            optimizer.zero_grad()

    report = detection(model, train)
    assert report.cause == CAUSE_WEIGHTS and report.batch_number == 3
    assert report.weights_origin == ORIGIN_OPTIMIZER_STEP
    step = report.optimizer_step
    assert (step.optimizer, step.number, step.counted, step.after_batch) == ("Adam", 3, False, 2)
    assert "nan" in report.reason
    assert report.reason.endswith(
        "are non-finite in batch 3 (weight holds nan, +inf and -inf; bias holds -inf), "
        "and an optimizer step wrote them: Adam step 3, after batch 2 (lr inf)"), report.reason
    assert "the optimizer step that wrote them, Adam step 3, after batch 2" in report.hint
    assert "Lower the learning rate" in report.hint


def test_the_step_of_the_optimizer_holding_the_weights_is_named_among_several():
    model = linear()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD([{"params": [model[2].bias], "lr": 0.1},
                              {"params": [model[2].weight], "lr": 0.1}])

    def train():
        for number in range(4):
            F.mse_loss(model(batch()), torch.zeros(6, 2)).backward()
            if number == 1:
                second.param_groups[1]["lr"] = math.inf
            second.step()
            first.step()  # steps after the one that wrote them, holding other weights
            first.zero_grad()
            second.zero_grad()

    report = detection(model, train)
    assert report.first_nonfinite.module_name == "2"
    step = report.optimizer_step
    assert (step.optimizer, step.position, step.optimizers, step.param_group) == ("SGD", 1, 2, 1)
    assert report.reason.endswith(
        "an optimizer step wrote them: the 2nd SGD step since the guard attached, after batch 1 "
        "(optimizer 1 of 2, param group 1, lr inf)"), report.reason


def test_weights_written_under_no_grad_between_batches_changed_outside_the_forward():
    model = linear()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.01)  # steps, but not model[2]'s

    def train():
        for number in range(4):
            model(batch()).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if number == 1:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan  # a hand-written update gone wrong

    report = detection(model, train)
    assert report.cause == CAUSE_WEIGHTS and report.batch_number == 2
    assert report.weights_origin == ORIGIN_OUTSIDE_FORWARD and report.optimizer_step is None
    assert report.reason == (
        "the weights of 2 (Linear) are non-finite in batch 2 (weight holds nan), and they changed "
        "outside the model's forward: the guard saw no optimizer step since the model's previous "
        "forward (batch 1), which found no non-finite weight")
    assert "`torch.no_grad()`" in report.hint and "`load_state_dict`" in report.hint
    assert "learning rate" not in report.hint and "eps" not in report.hint


def test_with_more_steps_between_two_forwards_than_it_keeps_it_does_not_claim_either():
    model = linear()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.0)

    def train():
        for number in range(3):
            model(batch()).sum().backward()
            if number == 1:
                for _ in range(MAX_STEPS + 1):  # an inner loop of steps on other weights
                    optimizer.step()
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan

    report = detection(model, train)
    assert report.weights_origin == "" and report.optimizer_step is None
    assert report.reason.endswith("an optimizer step or code outside the model's forward wrote them")
    assert "Attach the guard before the first step" in report.hint


def test_weights_non_finite_from_the_start_were_so_when_the_guard_attached():
    model = linear()
    with torch.no_grad():
        model[0].bias[1] = math.nan  # a broken checkpoint
    report = detection(model, lambda: model(batch()))
    assert report.weights_origin == ORIGIN_BEFORE_ATTACH and report.optimizer_step is None
    assert report.reason.endswith(
        "are non-finite in batch 0 (bias holds nan): they were already non-finite when the guard "
        "attached"), report.reason
    assert "checkpoint" in report.hint and "initialisation" in report.hint
    assert "learning rate" not in report.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_weights_finite_at_attach_and_written_before_the_first_forward_were_written_since(mode):
    # The guard looks at the weights as it attaches: finite then, so not "already non-finite
    # when it attached" (nor a checkpoint to check), but written since, outside the forward
    # (full mode said "already non-finite when it attached": it did not look).
    model = linear()

    def write_then_forward():
        with torch.no_grad():
            model[0].weight[0, 0] = math.nan
        model(batch()).sum().backward()

    report = detection(model, write_then_forward, mode=mode)
    assert report.weights_origin == ORIGIN_SINCE_ATTACH and report.optimizer_step is None
    assert report.reason.endswith(
        "they changed outside the model's forward since the guard attached, which found them "
        "finite: the guard saw no optimizer step since"), report.reason
    assert "since the guard attached, which found them finite" in report.hint
    assert "checkpoint (`all(" not in report.hint


def test_a_step_before_the_guards_first_forward_may_have_written_them():
    model = linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=math.inf)
    model(batch()).sum().backward()  # unguarded: gradients for the step below

    def step_then_forward():
        optimizer.step()
        model(batch())

    report = detection(model, step_then_forward)
    assert report.weights_origin == ORIGIN_OPTIMIZER_STEP  # (finite when the guard attached)
    assert report.reason.endswith(
        "an optimizer step wrote them: the 1st SGD step since the guard attached, before the "
        "first batch the guard saw (lr inf)"), report.reason


def test_buffers_from_an_earlier_batch_keep_their_own_words():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bad = batch()
    bad[0, 1] = math.nan
    model(bad)  # unguarded, in training mode: the running statistics keep the nan
    model.eval()

    def two_batches():
        model[1].reset_running_stats()  # the buffers are fine for the first batch ...
        model(batch())
        model[1].running_mean[2] = math.nan  # ... and not for the second
        model(batch())

    report = detection(model, two_batches)
    assert report.weights_origin == ORIGIN_SINCE_FORWARD
    assert report.reason.endswith("they held none when the forward of batch 0 began, so that "
                                  "forward (an update inside 1 (BatchNorm1d)) or code run after it "
                                  "wrote them"), report.reason
    assert ("it held none when the model's previous forward began: that forward updated it in "
            "training mode from a batch holding inf/nan") in report.hint, report.hint
    report = detection(model, lambda: model(batch()))
    assert report.weights_origin == ORIGIN_BEFORE_ATTACH
    assert "running statistics kept it" in report.hint and "attached" in report.hint


class EMACodebook(nn.Module):
    """A VQ-VAE codebook updated by an EMA in its forward, its cluster sizes from 0 (as in
    rosinality/vq-vae-2-pytorch#72 and nadavbh12/VQ-VAE#11): a code no input chose gets 0/0.
    `style`: how the forward writes its buffers, in place, assigned anew (as
    zalandoresearch/pytorch-vq-vae) or through `.data` (as rosinality/vq-vae-2-pytorch)."""

    def __init__(self, style: str = "in place", codes: int = 8, dim: int = 4):
        super().__init__()
        self.style = style
        embed = torch.randn(codes, dim, generator=torch.Generator().manual_seed(2))
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(codes))
        self.register_buffer("embed_sum", embed.clone())

    def forward(self, x):
        code = torch.cdist(x, self.embed).argmin(1)
        onehot = F.one_hot(code, len(self.embed)).type(x.dtype)
        quantized = F.embedding(code, self.embed)
        if self.training:
            with torch.no_grad():
                if self.style == "assigned":
                    self.cluster_size = onehot.sum(0)
                    self.embed_sum = onehot.t() @ x
                    self.embed = self.embed_sum / self.cluster_size.unsqueeze(1)
                    return x + (quantized - x).detach()
                sizes, sums, embed = ((self.cluster_size.data, self.embed_sum.data, self.embed.data)
                                      if self.style == ".data" else
                                      (self.cluster_size, self.embed_sum, self.embed))
                sizes.copy_(onehot.sum(0))
                sums.copy_(onehot.t() @ x)
                embed.copy_(sums / sizes.unsqueeze(1))
        return x + (quantized - x).detach()


def vq_model(style: str = "in place") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), EMACodebook(style), nn.Linear(4, 4))


def train_steps(model, steps: int = 3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def run():
        for _ in range(steps):
            model(batch(3)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return run


@pytest.mark.parametrize("style", ["in place", "assigned"])
@pytest.mark.parametrize("read_at_once", [True, False], ids=["cpu-path", "gpu-path"])
def test_nan_a_forward_writes_into_its_own_buffer_is_named_in_that_call(monkeypatch, read_at_once,
                                                                         style):
    """The codebook's outputs stay finite (no input picks the nan codes), but its forward wrote
    nan into its buffer: that call is named, in that batch, with the buffer as it left it."""
    from numguard_nb import stats

    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", read_at_once)
    model = vq_model(style)
    report = detection(model, train_steps(model))
    assert (report.first_nonfinite.module_name, report.cause, report.batch_number) == ("1", CAUSE_FORWARD, 0)
    assert [row.role for row in report.first_nonfinite.flagged_rows] == ["embed" + WRITTEN_IN_FORWARD]
    assert "wrote it into embed, a buffer its forward updates in place" in report.hint
    assert "a code no input chose" in report.hint


@pytest.mark.parametrize("style", ["in place", "assigned"])
def test_ops_names_the_division_that_wrote_nan_into_a_buffer_the_forward_reads_too(style):
    """ops=True re-runs the call from the buffers it started with (its forward read and updated
    them), names the op and line that made the nan it wrote, and leaves the buffers as the
    failing call left them."""
    model = vq_model(style)
    left = {}

    def run():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model[1].register_forward_hook(  # (the failing call's: the re-run calls it again)
            lambda module, args, output: left.setdefault("call", (module.embed.clone(), module.embed)) and None)
        model(batch(3)).square().mean().backward()
        optimizer.step()

    report = detection(model, run, ops=True)
    frame = report.first_nonfinite
    assert (frame.module_name, frame.op) == ("1", "aten.div.Tensor"), frame.op_note
    assert ("sums / sizes" in frame.source or "self.embed_sum / self.cluster_size" in frame.source)
    assert "divided 0 by 0" in report.hint
    values, held = left["call"]
    assert model[1].embed is held  # the very tensor, not the re-run's
    assert torch.equal(model[1].embed.isnan(), values.isnan())
    assert torch.equal(model[1].embed.nan_to_num(), values.nan_to_num())


def test_nan_written_into_a_buffer_through_data_is_named_at_the_next_forward_with_its_batch():
    """An update through `.data` moves no version counter, so the write itself is not seen: the
    next forward finds the buffer non-finite, and says the forward before found it finite."""
    model = vq_model(".data")
    report = detection(model, train_steps(model))
    assert (report.first_nonfinite.module_name, report.cause, report.batch_number) == ("1", CAUSE_WEIGHTS, 1)
    assert report.weights_origin == ORIGIN_SINCE_FORWARD
    assert "held none when the forward of batch 0 began" in report.reason
    assert "through `.data`" in report.hint and "a code no input chose" in report.hint


def test_buffers_written_finite_in_forward_raise_nothing():
    """Healthy buffers updated in forward (an EMA of activations, BatchNorm's running statistics)
    are no alarm; the EMA's shows as each call left it."""

    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(4))

        def forward(self, x):
            with torch.no_grad():
                self.mean.lerp_(x.mean(0), 0.1)
            return x - self.mean

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Ema(), nn.BatchNorm1d(4), nn.Linear(4, 1))
    with Guard(model) as guard:
        train_steps(model, steps=5)()
        frames_ = [frame for frame in guard.report.frames if frame.phase == FORWARD]
    roles = {(frame.module_name, row.role) for frame in frames_ for row in frame.rows}
    assert ("1", "mean" + WRITTEN_IN_FORWARD) in roles


# ---- the hook: global while attached, gone after ----------------------------------------------
def test_the_global_step_hook_is_gone_after_detach_and_after_an_exception():
    model = linear()
    before = hooks_left(model)
    assert not any(STEP_HOOK in hook for hook in before)
    with Guard(model):
        assert sum(STEP_HOOK in hook for hook in hooks_left(model)) == 1
    assert hooks_left(model) == before
    with pytest.raises(NonFiniteError), Guard(model):
        model(batch() * math.nan)
    assert hooks_left(model) == before
    with pytest.raises(KeyError), Guard(model):
        raise KeyError("the user's own error")
    assert hooks_left(model) == before
    watch = StepWatch()
    watch.start({})
    assert sum(STEP_HOOK in hook for hook in hooks_left()) == 1
    del watch  # the hook holds it weakly, and goes with it
    gc.collect()
    assert hooks_left(model) == before


def test_the_step_record_stays_small_and_holds_no_tensor():
    model = linear()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Guard(model) as guard:
        for _ in range(200):  # many more steps than the guard keeps
            model(batch()).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        kept = list(guard.steps._steps)
    assert len(kept) <= MAX_STEPS
    for record in kept:
        assert type(record) is tuple
        assert not any(isinstance(field, torch.Tensor) for field in record)
        assert isinstance(record[0], weakref.ref)


# ---- 2. data: which samples --------------------------------------------------------------------
def test_nan_in_the_data_names_the_samples_that_hold_it():
    model = linear()
    x = batch()
    x[1, 2] = x[3, 1] = math.nan
    report = detection(model, lambda: model(x))
    assert report.cause == CAUSE_DATA
    row = report.first_nonfinite.flagged_rows[0]
    assert (row.nonfinite_samples, row.nonfinite_sample_count) == ((1, 3), 2)
    assert report.reason == ("the data fed to Sequential in batch 0 holds nan "
                             "(input[0] holds nan in samples 1 and 3 of 6)")
    assert "In input[0], samples 1 and 3 of 6 hold it" in report.hint
    assert "samples holding inf/nan in input[0]: 1, 3 (2 of 6)" in report.to_text().splitlines()
    assert '<span class="ng-samples">in samples 1, 3 (2 of 6)</span>' in report._repr_html_()


@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_nan_in_a_packed_sequence_names_the_samples_not_the_packed_rows(enforce_sorted):
    # A PackedSequence's data lies time step after time step, each step's samples in order of
    # length: packed row 4 is sample 2 at time step 1 here, not "sample 4 of 10".
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(0)
    rnn = nn.LSTM(3, 4)
    x = torch.randn(5, 3, 3)  # time, batch, features
    lengths = torch.tensor([5, 3, 2]) if enforce_sorted else torch.tensor([2, 5, 3])
    x[1, 2, 0] = x[0, 2, 1] = math.nan  # sample 2, twice
    packed = pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
    report = detection(rnn, lambda: rnn(packed))
    assert report.cause == CAUSE_DATA
    row = report.first_nonfinite.flagged_rows[0]
    assert (row.nonfinite_samples, row.nonfinite_sample_count) == ((2,), 1)
    assert "holds nan in sample 2 of 3)" in report.reason, report.reason


def test_many_samples_are_counted_and_the_first_ones_named():
    model = linear()
    x = torch.randn(40, 4)
    x[::2, 3] = -math.inf  # log(0) of every other sample
    report = detection(model, lambda: model(x))
    row = report.first_nonfinite.flagged_rows[0]
    assert (row.nonfinite_samples, row.nonfinite_sample_count) == (tuple(range(0, 16, 2)), 20)
    assert "holds -inf in 20 of 40 samples, starting with 0, 2, 4, 6, 8, 10, 12 and 14" in report.reason


def test_samples_of_data_that_is_gone_or_changed_stay_unknown():
    pass_ = PassRecord()
    kept, gone, changed = torch.ones(3, 2), torch.ones(3, 2), torch.ones(3, 2)
    slots = [(f"input[{i}]", INPUT, "tensor", t.dtype, (3, 2), pass_.summarise(t, None, False, {})[2], 0)
             for i, t in enumerate((kept, gone, changed))]
    del gone
    changed.add_(1)
    assert frames.value_of(pass_, slots[0]) is kept
    assert frames.value_of(pass_, slots[1]) is None and frames.value_of(pass_, slots[2]) is None


# ---- 3. the reason reads as English, for every cause --------------------------------------------
# What no person writes: a vocabulary word where a sentence belongs, a value's repr, empty or
# doubled punctuation.
_FRAGMENTS = re.compile(
    r"None|overflow predicted|holds overflow|backward-inline|forward-inline|loss-gradient|unattributed|"
    r"ORIGIN|CAUSE|\(\)|\( | \)|  | ,|,,|\.\.|::|: :|;;|\bnan nan\b|\bthe the\b")


def assert_english(sentence: str) -> None:
    assert sentence and not _FRAGMENTS.search(sentence), sentence
    assert sentence.count("(") == sentence.count(")"), sentence
    assert sentence[0].islower() or sentence[0].isdigit() or sentence.split()[0].isidentifier(), sentence
    assert not sentence.endswith((" ", ",", ":", ";", ".")), sentence


class SqrtBetween(nn.Module):
    """A nan gradient made in its own code, between its submodules."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.sqrt(self.emb(x) * 0))


class ExpBetween(nn.Module):
    """An overflow made in its own code, between its submodules, that the next one turns into nan."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(4, 4), nn.Linear(4, 1)
        with torch.no_grad():
            self.head.weight.copy_(torch.tensor([[1.0, -1.0, 1.0, -1.0]]))

    def forward(self, x):
        return self.head(torch.exp(self.emb(x) * 0 + 1000))  # +inf - +inf: nan


def _forward_inline():
    model = ExpBetween()
    return detection(model, lambda: model(batch()))


def _forward_nan():
    model = nn.Sequential(nn.Linear(4, 4), Exp())
    return detection(model, lambda: model(batch() * 1000))


def _backward_nan():
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1))
    return detection(model, lambda: model(batch()).sum().backward())


def _backward_inline():
    model = SqrtBetween()
    return detection(model, lambda: model(batch()).sum().backward())


def _weights():
    model = linear()
    with torch.no_grad():
        model[2].weight.fill_(math.inf)
    return detection(model, lambda: model(batch()))


def _data():
    model = linear()
    return detection(model, lambda: model(batch().index_fill(0, torch.tensor([2]), math.nan)))


def _loss_gradient():
    model = linear()

    def step():
        out = model(batch())
        out.backward(torch.full_like(out, math.nan))  # a gradient handed in, made by no torch op

    return detection(model, step)


def _outside():
    model = linear()
    return detection(model, lambda: torch.sqrt(model(batch()) * 0).sum().backward())


def _predicted_overflow():
    model = linear()
    with torch.no_grad():
        model[0].weight.fill_(1e4)
    return detection(model, lambda: model(batch() * 10), limit_dtype=torch.float16,
                     stop_at_limit=True)


REAL = {
    CAUSE_FORWARD: _forward_nan, CAUSE_FORWARD_INLINE: _forward_inline, CAUSE_BACKWARD: _backward_nan,
    CAUSE_BACKWARD_INLINE: _backward_inline, CAUSE_WEIGHTS: _weights, CAUSE_DATA: _data,
    CAUSE_LOSS_GRADIENT: _loss_gradient, CAUSE_OUTSIDE: _outside,
    "predicted overflow": _predicted_overflow,
}


@pytest.mark.parametrize("case", REAL)
def test_a_real_detection_of_each_cause_reads_as_english(case):
    report = REAL[case]()
    assert report.cause == (CAUSE_FORWARD if case == "predicted overflow" else case)
    assert_english(report.reason)
    assert_english(report.summary())
    if case == "predicted overflow":
        assert "beyond float16's largest value 65504" in report.reason
        assert "non-finite" not in report.reason


NAN = dict(nan=True, abs_max=math.nan)
INF = dict(posinf=True, abs_max=math.inf)
OVER = dict(abs_max=7.2e4, predicted_overflow=True)
F16 = GuardOptions(limit_dtype=torch.float16)
PLAIN = GuardOptions()


def _row(role, category, **values):
    fields = dict(dtype="float32", shape=(6, 4), abs_min=0.0, abs_max=1.0, flagged=True)
    fields.update(values)
    return TensorRow(role, category, **fields)


def _frame(rows, phase=FORWARD, name="block.fc", cls="Linear"):
    return Frame(name, cls, phase, 3, 1, rows)


def _outside_frame(rows, phase, node, op):
    frame = _frame(rows, phase, OUTSIDE_MODULE, node)
    frame.op, frame.source = op, "train.py:12: loss = torch.log(p).mean()"
    return frame


STEP = OptimizerStep("AdamW", 41, after_batch=40, optimizers=2, position=2, param_group=1, lr=0.1)
BY_HAND = {
    "forward": (CAUSE_FORWARD, _frame([_row("output", OUTPUT, **NAN)]), PLAIN, {}),
    "forward, mask": (CAUSE_FORWARD, _frame([_row("output", OUTPUT, **NAN)]), PLAIN,
                      {"mask_from": "masks (MaskBuilder)"}),
    "forward, -inf out": (CAUSE_FORWARD, _frame([_row("output", OUTPUT, neginf=True, abs_max=math.inf)]),
                          PLAIN, {}),
    "forward, predicted": (CAUSE_FORWARD, _frame([_row("output", OUTPUT, **OVER)]), F16, {}),
    "forward, predicted and nan": (CAUSE_FORWARD, _frame([
        _row("output[0]", OUTPUT, **OVER), _row("output[1]", OUTPUT, **NAN)]), F16, {}),
    "backward": (CAUSE_BACKWARD, _frame([_row("grad_input[0]", GRAD_INPUT, **INF)], BACKWARD), PLAIN, {}),
    "backward, predicted": (CAUSE_BACKWARD, _frame([_row("grad_input[0]", GRAD_INPUT, **OVER)], BACKWARD),
                            F16, {}),
    "forward-inline": (CAUSE_FORWARD_INLINE, _frame([_row("input[0]", INPUT, **INF)], FORWARD, "block", "Block"),
                       PLAIN, {"evidence": _frame([_row("input[0]", INPUT, **INF),
                                                   _row("output", OUTPUT, **NAN, flagged=False)], FORWARD,
                                                  "block.fc")}),
    "backward-inline": (CAUSE_BACKWARD_INLINE, _frame([], BACKWARD, "block", "Block"), PLAIN, {
        "evidence": _frame([_row("grad_output", GRAD_OUTPUT, **NAN)], BACKWARD, "block.fc")}),
    "weights, step": (CAUSE_WEIGHTS, _frame([_row("weight", PARAM, **NAN)]), PLAIN, {
        "origin": Origin(ORIGIN_OPTIMIZER_STEP, STEP, 40)}),
    "weights, outside": (CAUSE_WEIGHTS, _frame([_row("weight", PARAM, **NAN)]), PLAIN, {
        "origin": Origin(ORIGIN_OUTSIDE_FORWARD, None, 2)}),
    "weights, attached": (CAUSE_WEIGHTS, _frame([_row("weight", PARAM, **NAN)]), PLAIN, {
        "origin": Origin(ORIGIN_BEFORE_ATTACH, None, None)}),
    "weights, attached after a step": (CAUSE_WEIGHTS, _frame([_row("weight", PARAM, **NAN)]), PLAIN, {
        "origin": Origin(ORIGIN_BEFORE_ATTACH, OptimizerStep("SGD", 2, counted=True), None)}),
    "weights, unknown": (CAUSE_WEIGHTS, _frame([_row("weight", PARAM, **NAN)]), PLAIN, {}),
    "weights, predicted": (CAUSE_WEIGHTS, _frame([_row("weight", PARAM, **OVER)]), F16, {}),
    "buffers": (CAUSE_WEIGHTS, _frame([_row("running_var", BUFFER, **INF)], name="bn", cls="BatchNorm1d"),
                PLAIN, {}),
    "data": (CAUSE_DATA, _frame([_row("input[0]", INPUT, **NAN, nonfinite_samples=(3, 17),
                                      nonfinite_sample_count=2, shape=(32, 4))], name="", cls="Net"),
             PLAIN, {}),
    "data, samples unknown": (CAUSE_DATA, _frame([_row("input[x]", INPUT, **INF)], name="", cls="Net"),
                              PLAIN, {}),
    "loss-gradient": (CAUSE_LOSS_GRADIENT, _frame([_row("grad_output", GRAD_OUTPUT, **NAN)], BACKWARD,
                                                  "", "Net"), PLAIN, {}),
    "loss-gradient, predicted": (CAUSE_LOSS_GRADIENT, _frame([_row("grad_output", GRAD_OUTPUT, **OVER)],
                                                             BACKWARD, "", "Net"), F16, {}),
    "outside": (CAUSE_OUTSIDE, _outside_frame([_row("output", OUTPUT, neginf=True, abs_max=math.inf)],
                                              FORWARD, "torch.log", "aten.log.default"), PLAIN, {}),
    "outside, backward": (CAUSE_OUTSIDE, _outside_frame([_row("grad_input", GRAD_INPUT, **INF)],
                                                        BACKWARD, "SqrtBackward0",
                                                        "SqrtBackward0: aten.div.Tensor"), PLAIN, {}),
    "unattributed": (CAUSE_UNATTRIBUTED, _frame([_row("input[0]", INPUT, **NAN)]), PLAIN, {}),
}


@pytest.mark.parametrize("case", BY_HAND)
def test_the_reason_of_each_cause_reads_as_english(case):
    cause, frame, options, extra = BY_HAND[case]
    assert_english(frames.reason_sentence(cause, frame, options, **extra))


def test_every_cause_has_a_sentence_checked():
    assert {cause for cause, *_ in BY_HAND.values()} == set(CAUSES) - {""}


def test_the_sentences_say_what_the_facts_are():
    said = {case: frames.reason_sentence(cause, frame, options, **extra)
            for case, (cause, frame, options, extra) in BY_HAND.items()}
    assert said["weights, step"].endswith(
        "an optimizer step wrote them: AdamW step 41, after batch 40 (optimizer 2 of 2, "
        "param group 1, lr 0.1)")
    assert "no optimizer step since the model's previous forward (batch 2)" in said["weights, outside"]
    assert said["weights, attached"].endswith("they were already non-finite when it attached")
    assert "the 2nd SGD step since the guard attached" in said["weights, attached after a step"]
    assert "optimizer step or code outside the model's forward wrote them" in said["weights, unknown"]
    assert said["data"].endswith("holds nan (input[0] holds nan in samples 3 and 17 of 32)")
    assert said["forward-inline"] == (
        "block (Block) produced a non-finite value in forward (call 1 of batch 3), in its own code "
        "between its submodules: input[0] of block.fc holds +inf, which its inputs and weights did "
        "not hold (an overflow, which block.fc turned into nan)")
    assert said["forward, predicted and nan"].startswith(
        "block.fc (Linear) produced a non-finite value in forward (call 1 of batch 3): output[0] "
        "reaches 7.2e+04, beyond float16's largest value 65504; output[1] holds nan")


# ---- steps after calls the guard could not see ---------------------------------------------------
UNWATCHED = "saw no call of the model"


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_model_compiled_after_the_guard_attached_is_said_to_run_unwatched(mode):
    torch._dynamo.reset()
    model = linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, mode=mode):
        compiled = torch.compile(model, backend="eager")
        with pytest.warns(UserWarning, match=UNWATCHED) as caught:
            for _ in range(3):
                compiled(batch()).sum().backward()
                optimizer.step()
    assert len([w for w in caught if UNWATCHED in str(w.message)]) == 1  # once per attach
    assert caught[0].filename == __file__  # points at the user's optimizer.step()
    assert "Guard(torch.compile(model))" in str(caught[0].message)
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_steps_after_watched_calls_give_no_such_warning(mode, recwarn):
    model, other = linear(), linear(1)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.01),
                  torch.optim.Adam(model.parameters(), lr=1e-3),  # two optimizers, one model
                  torch.optim.SGD(other.parameters(), lr=0.1)]  # an unguarded model's
    with Guard(model, mode=mode):
        for step in range(4):
            for _ in range(2):  # gradient accumulation
                (model(batch()).sum() + other(batch()).sum()).backward()
            for optimizer in optimizers:
                optimizer.step()
            optimizers[2].step()  # stepped again, without any model call: not guarded weights
    with Guard(model, mode=mode):  # the first step after attach applies earlier gradients
        optimizers[0].step()
        model(batch()).sum().backward()
        optimizers[0].step()
    assert not [w for w in recwarn if UNWATCHED in str(w.message)]


def test_ops_copies_small_buffers_and_large_ones_only_once_a_forward_wrote_them():
    """ops=True copies, at each step, the buffers a forward may write and read again: the small
    ones, and a large one once a forward was seen writing it; a large table the forward only
    reads is never copied (a copy per step of a 48 MiB table tripled a step's time)."""
    from numguard_nb.rerun import SMALL_BUFFER_BYTES

    class Tables(nn.Module):
        def __init__(self):
            super().__init__()
            rows = SMALL_BUFFER_BYTES // 16 + 1  # 4 float32 columns: just over the size
            self.register_buffer("table", torch.randn(rows, 4))  # read only
            self.register_buffer("ema", torch.zeros(rows, 4))  # written each step
            self.register_buffer("small", torch.zeros(4))  # read only, small

        def forward(self, x):
            with torch.no_grad():
                self.ema[:2].lerp_(x[:2], 0.5)
            return x @ self.table[:4] + self.small

    model = Tables()
    with Guard(model, ops=True) as guard:
        copied_by_step = []
        for _ in range(2):
            model(torch.randn(4, 4))
            copied = guard._op_recorder.calls[id(model)][5]
            copied_by_step.append(sorted(name for _, name, _, _ in copied))
    assert copied_by_step == [["small"], ["ema", "small"]]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_weights_written_after_an_adam_step_are_not_blamed_on_it(mode):
    # A callback wrote nan into a weight after AdamW's step: the report said the step wrote them
    # and advised a lower learning rate. An Adam step moves a weight by about its learning rate
    # at most from the finite gradients the guard checked: code after it did.
    model = linear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train():
        for step in range(3):
            model(batch()).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan  # (an on_step_end of the user's)

    report = detection(model, train, mode=mode)
    assert report.weights_origin == ORIGIN_OPTIMIZER_STEP
    assert "cannot have made them from the backward's finite gradients: AdamW step 2" in report.reason
    assert report.reason.endswith("code around it changed the gradients or the weights"), report.reason
    assert "code run after the step wrote the weights" in report.hint
    assert "learning rate that makes training diverge" not in report.hint


@pytest.mark.parametrize("options", [{"backward": False}, {"allow_inf": True}])
def test_with_gradients_unchecked_an_adam_step_may_still_have_written_them(options):
    model = linear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train():
        for step in range(3):
            model(batch()).sum().backward()
            if step == 1:
                model[2].weight.grad[0, 0] = math.inf  # unseen, or allowed
            optimizer.step()
            optimizer.zero_grad()

    report = detection(model, train, **options)
    assert "an optimizer step wrote them: AdamW step 2" in report.reason, report.reason
