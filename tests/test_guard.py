"""The Guard's promises: it names the module that *produces* the first inf/nan (forward or
backward), tells bad data / bad weights / a bad loss apart, lets masks through, never changes the
numbers, never keeps activations alive, always removes its hooks, and bounds its memory.

Every model here is tiny and built in the test (no download); each test is well under a second
except the distributed one (two spawned gloo ranks, a few seconds).
"""

from __future__ import annotations

import copy
import datetime
import gc
import os
import socket
import tracemalloc
import warnings
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from models import Exp, SqrtOfZero

import numguard_nb as ng
from numguard_nb import BatchLimitReached, Guard, NonFiniteError

INF = float("inf")
NAN = float("nan")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---- small modules --------------------------------------------------------------------------
class Counter(nn.Module):
    """Identity that counts its calls (to see whether the forward went on after a module)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


class MaskedSoftmax(nn.Module):
    def forward(self, x, mask):
        return torch.softmax(x + mask, dim=-1)


class Attention(nn.Module):
    """A linear projection followed by softmax(scores + mask): the mask's -inf passes through."""

    def __init__(self, d=4):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.softmax = MaskedSoftmax()

    def forward(self, x, mask):
        return self.softmax(self.proj(x), mask)


class KeepRef(nn.Module):
    """Identity-like module that keeps only a weak reference to the activation it returns."""

    def __init__(self):
        super().__init__()
        self.ref = None

    def forward(self, x):
        y = x * 2
        self.ref = weakref.ref(y)
        return y


def exp_overflow_model(dtype=torch.float32):
    """Linear -> Exp -> Counter -> Linear: the Linear's output is 100, exp(100) overflows any dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Exp(), Counter(), nn.Linear(4, 2)).to(dtype)
    with torch.no_grad():
        model[0].weight.fill_(25.0)
        model[0].bias.zero_()
    return model, torch.ones(3, 4, dtype=dtype)


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(dtype)


def assert_no_hooks(model: nn.Module):
    for name, module in model.named_modules():
        assert not module._forward_hooks, f"forward hook left on {name!r}"
        assert not module._forward_pre_hooks, f"forward pre-hook left on {name!r}"
    for name, param in model.named_parameters():
        assert not param._backward_hooks, f"gradient hook left on parameter {name!r}"


def assert_hooked(model: nn.Module):
    """The guard really hooked every module and trainable parameter (so the checks can fail)."""
    assert all(module._forward_hooks and module._forward_pre_hooks for module in model.modules())
    assert all(p._backward_hooks for p in model.parameters() if p.requires_grad)


# ---- detection: forward -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_forward_overflow_names_the_producing_module_at_the_end_of_the_forward(dtype):
    model, x = exp_overflow_model(dtype)
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x)
    error = caught.value
    assert isinstance(error, FloatingPointError)
    # deferred mode: the forward ran to its end before the error was raised
    assert model[2].calls == 1
    report = error.report
    culprit = report.first_nonfinite
    assert culprit.module_name == "1" and culprit.module_class == "Exp"
    assert report.phase == "forward" and report.cause == "forward"
    assert report.batch_number == 0 and culprit.batch_number == 0 and culprit.call_index == 0
    assert [row.role for row in culprit.flagged_rows] == ["output"]
    output = culprit.flagged_rows[0]
    assert output.posinf and not output.nan and not output.neginf
    assert output.dtype == str(dtype).replace("torch.", "")
    assert output.shape == (3, 4)
    # the input it received was finite, and it is not flagged
    (received,) = [row for row in culprit.rows if row.role == "input[0]"]
    assert received.abs_max == pytest.approx(100.0) and not received.flagged
    # the modules that carry the inf on are not blamed; the report's last frame is the culprit
    assert report.frames[-1] is culprit
    assert "1 (Exp)" in str(error) and "forward" in str(error)


def test_fp16_linear_whose_output_exceeds_65504_is_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 1)).half()
    with torch.no_grad():
        model[2].weight.fill_(100.0)  # finite weights, 8 inputs of ~100 each -> ~80000 > 65504
        model[0].weight.fill_(25.0)
    x = torch.ones(2, 4, dtype=torch.float16)
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x).float().sum().backward()
    culprit = caught.value.report.first_nonfinite
    assert (culprit.module_name, culprit.module_class, culprit.phase) == ("2", "Linear", "forward")
    flagged = culprit.flagged_rows
    assert [row.role for row in flagged] == ["output"] and flagged[0].posinf
    weight = next(row for row in culprit.rows if row.role == "weight")
    assert weight.abs_max == 100.0 and not weight.flagged


def test_backward_only_nan_names_the_module_in_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(x)
        assert torch.isfinite(out).all()  # the forward is finite
        out.sum().backward()
    report = caught.value.report
    culprit = report.first_nonfinite
    assert report.phase == "backward" and culprit.phase == "backward"
    assert report.cause == "backward"
    assert (culprit.module_name, culprit.module_class) == ("1", "SqrtOfZero")
    flagged = culprit.flagged_rows
    assert [row.role for row in flagged] == ["grad_input[0]"] and flagged[0].nan
    # the gradient it received was finite
    grad_output = next(row for row in culprit.rows if row.role == "grad_output")
    assert not grad_output.nonfinite
    assert "backward" in report.summary()


@pytest.mark.parametrize("sync", [False, True], ids=["deferred", "sync"])
def test_backward_report_lists_no_frame_that_only_received_the_bad_gradient(sync):
    # The frames of a report lead up to the culprit: none of them may hold the non-finite
    # gradient the culprit produced. Here layer 0's grad_output *is* SqrtOfZero's nan
    # grad_input[0], so layer 0's backward frame comes after the culprit, not before it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError) as caught, Guard(model, sync=sync):
        model(torch.randn(3, 4)).sum().backward()
    report = caught.value.report
    assert report.first_nonfinite.module_name == "1"
    before = report.frames[:-1]
    assert report.frames[-1] is report.first_nonfinite
    assert [(f.module_name, f.phase) for f in before if f.nonfinite] == []
    assert ("0", "backward") not in [(f.module_name, f.phase) for f in before]


def test_nan_in_the_input_data_is_reported_as_bad_data():
    model = mlp()
    x = torch.randn(3, 4)
    x[1, 2] = NAN
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x)
    report = caught.value.report
    assert report.cause == "data"
    assert report.first_nonfinite.module_name == ""  # the model itself received it
    assert [row.role for row in report.first_nonfinite.flagged_rows] == ["input[0]"]
    assert "data" in report.summary()


def test_nan_weights_are_reported_as_broken_weights():
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 3] = NAN
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(torch.randn(3, 4))
    report = caught.value.report
    assert report.cause == "weights"
    assert report.first_nonfinite.module_name == "2"
    assert [row.role for row in report.first_nonfinite.flagged_rows] == ["weight"]
    assert "weights" in report.summary()


def test_nan_gradient_from_a_loss_outside_the_model_is_blamed_on_the_loss():
    model = mlp()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(torch.randn(3, 4))
        loss = torch.sqrt(out * 0).sum()  # finite loss, nan gradient
        assert torch.isfinite(loss)
        loss.backward()
    report = caught.value.report
    assert report.cause == "outside" and report.phase == "backward"
    culprit = report.first_nonfinite
    assert (culprit.module_name, culprit.module_class) == ("<outside>", "SqrtBackward0")
    assert [row.role for row in culprit.flagged_rows] == ["grad_input"]


def test_a_gradient_handed_in_non_finite_is_blamed_on_the_loss():
    model = mlp()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(torch.randn(3, 4))
        out.backward(torch.full_like(out, float("nan")))  # made by no torch op the guard saw
    report = caught.value.report
    assert report.cause == "loss-gradient" and report.phase == "backward"
    assert report.first_nonfinite.module_name == ""
    assert [row.role for row in report.first_nonfinite.flagged_rows] == ["grad_output"]


# ---- masks and allow_inf ------------------------------------------------------------------
def test_causal_minus_inf_mask_through_a_transformer_encoder_does_not_raise():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    assert torch.isneginf(mask).any()
    with Guard(encoder) as guard:
        out = encoder(torch.randn(2, 5, 8), mask=mask, is_causal=True)
        out.sum().backward()
    assert guard.detection is None and guard.report.ok


def test_minus_inf_mask_in_softmax_passes_but_a_fully_masked_row_raises():
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(4, 4, requires_grad=True)
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    with Guard(model, max_frames=50) as guard:
        model(x, causal).sum().backward()
    assert guard.detection is None
    mask_rows = [row for frame in guard.report.frames for row in frame.rows
                 if row.role == "input[1]" and frame.module_name == "softmax"]
    assert mask_rows and mask_rows[0].neginf  # it saw the -inf, and let it through

    fully_masked = causal.clone()
    fully_masked[2, :] = -INF
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x, fully_masked)
    culprit = caught.value.report.first_nonfinite
    assert (culprit.module_name, culprit.module_class) == ("softmax", "MaskedSoftmax")
    assert [row.role for row in culprit.flagged_rows] == ["output"]
    assert culprit.flagged_rows[0].nan


class Scores(nn.Module):
    def forward(self, x, mask):
        return x @ x.transpose(-1, -2) + mask


class SoftmaxF32(nn.Module):
    def forward(self, scores):
        return torch.softmax(scores.float(), dim=-1)


class ScoresThenSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.scores = Scores()
        self.softmax = SoftmaxF32()

    def forward(self, x, mask):
        return self.softmax(self.scores(x, mask))


def test_fp16_overflow_to_plus_inf_in_a_module_that_receives_a_minus_inf_mask_is_named():
    # fp16 attention scores overflow to +inf where the mask is 0; elsewhere the mask adds -inf.
    # The module received -inf (the mask) but produced +inf: it is the producer, not the
    # softmax that turns the +inf into nan afterwards.
    model = ScoresThenSoftmax()
    mask = nn.Transformer.generate_square_subsequent_mask(3).half()
    x = torch.tensor([[0.1] * 4, [0.1] * 4, [200.0] * 4], dtype=torch.float16)  # 4*200*200 > 65504
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x, mask)
    culprit = caught.value.report.first_nonfinite
    assert (culprit.module_name, culprit.module_class) == ("scores", "Scores")
    flagged = culprit.flagged_rows
    assert [row.role for row in flagged] == ["output"] and flagged[0].posinf


class MakesInf(nn.Module):
    def forward(self, x):
        return x.masked_fill(x > 0, INF)


class NegExp(nn.Module):
    def forward(self, x):
        return torch.exp(-x)  # +inf -> 0: the inf is consumed inside the model


def _inf_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), MakesInf(), NegExp()), torch.randn(3, 4)


def test_a_module_producing_inf_raises_by_default():
    model, x = _inf_model()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x)
    assert caught.value.report.first_nonfinite.module_name == "1"


@pytest.mark.parametrize("allow", [True, "1", ["1"], ("*",), ["2", "[01]"]])
def test_allow_inf_lets_a_named_module_produce_inf(allow):
    model, x = _inf_model()
    with Guard(model, allow_inf=allow, max_frames=50) as guard:
        out = model(x)
    assert torch.isfinite(out).all()
    assert guard.detection is None
    produced = next(f for f in guard.report.frames if f.module_name == "1")
    assert produced.rows[-1].posinf  # the inf was there, and seen


def test_allow_inf_glob_that_does_not_match_still_raises():
    model, x = _inf_model()
    with pytest.raises(NonFiniteError) as caught, Guard(model, allow_inf=["2", "*.attn"]):
        model(x)
    assert caught.value.report.first_nonfinite.module_name == "1"


class BannedTokens(nn.Module):
    """A logits processor: -inf on banned vocabulary entries, on purpose."""

    def forward(self, logits):
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool)
        banned[::2] = True
        return logits.masked_fill(banned, -INF)


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 6)
        self.ban = BannedTokens()

    def forward(self, x):
        return self.ban(self.head(x))


def test_allow_inf_glob_is_not_undone_by_the_enclosing_module():
    # The allowed module's -inf reaches the model's output; the model did not produce it, so
    # allowing "ban" must be enough (the enclosing module must not be named as the producer).
    torch.manual_seed(0)
    model = LM()
    with Guard(model, allow_inf="ban") as guard:
        out = model(torch.randn(2, 4))
    assert torch.isneginf(out).any()
    assert guard.detection is None


# ---- rows: keyword inputs, nested outputs, odd values -------------------------------------
def test_keyword_inputs_and_model_output_fields_of_a_transformers_model_are_rows():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(1, 50, (2, 6))
    with Guard(model, max_frames=100) as guard:
        out = model(input_ids=ids, attention_mask=torch.ones(2, 6, dtype=torch.long), labels=ids)
        out.loss.backward()
    frames = guard.report.frames
    root = next(f for f in frames if f.module_name == "" and f.phase == "forward")
    rows = {row.role: row for row in root.rows}
    assert {"input[input_ids]", "input[attention_mask]", "input[labels]"} <= set(rows)
    assert {"output[loss]", "output[logits]"} <= set(rows)
    assert rows["input[input_ids]"].dtype == "int64" and rows["input[input_ids]"].shape == (2, 6)
    assert rows["input[attention_mask]"].abs_min == rows["input[attention_mask]"].abs_max == 1.0
    assert rows["output[logits]"].shape == (2, 6, 50)
    assert rows["output[loss]"].abs_max == pytest.approx(out.loss.item(), rel=1e-6)
    # gradients arrive for the loss field in backward
    root_bwd = next(f for f in frames if f.module_name == "" and f.phase == "backward")
    assert "grad_output[loss]" in {row.role for row in root_bwd.rows}


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, ints, flags, empty, nothing, text, scale=2.0, pair=None):
        y = self.lin(x) * scale
        return (y, {"ints": ints + 1, "flags": ~flags, "empty": empty * 2, "none": None,
                    "label": text, "pair": [y.sum(), (y.mean(), None)]})


def test_int_bool_empty_none_and_non_tensors_never_crash_and_are_reported_by_kind():
    torch.manual_seed(0)
    model = Odd()
    x = torch.randn(2, 3, requires_grad=True)
    with Guard(model) as guard:
        y, _extra = model(x, torch.arange(4), torch.tensor([True, False]), torch.empty(0, 3),
                         None, "hello", scale=3.0, pair=(torch.ones(1), 7))
        y.sum().backward()
    frame = next(f for f in guard.report.frames if f.module_name == "" and f.phase == "forward")
    rows = {row.role: row for row in frame.rows}
    kinds = {role: row.kind for role, row in rows.items()}
    assert kinds["input[0]"] == "tensor"
    assert kinds["input[1]"] == "tensor" and rows["input[1]"].dtype == "int64"
    assert (rows["input[1]"].abs_min, rows["input[1]"].abs_max) == (0.0, 3.0)
    assert kinds["input[2]"] == "tensor" and rows["input[2]"].dtype == "bool"
    assert kinds["input[3]"] == "empty" and rows["input[3]"].shape == (0, 3)
    assert kinds["input[4]"] == "none"
    assert kinds["input[5]"] == "not a tensor"
    assert kinds["input[scale]"] == "not a tensor"
    assert kinds["input[pair][0]"] == "tensor" and kinds["input[pair][1]"] == "not a tensor"
    assert kinds["output[0]"] == "tensor"
    assert kinds["output[1][ints]"] == "tensor" and rows["output[1][ints]"].abs_max == 4.0
    assert kinds["output[1][flags]"] == "tensor"
    assert kinds["output[1][empty]"] == "empty"
    assert kinds["output[1][none]"] == "none"
    assert kinds["output[1][label]"] == "not a tensor"
    assert kinds["output[1][pair][0]"] == "tensor"
    assert kinds["output[1][pair][1][0]"] == "tensor"
    assert kinds["output[1][pair][1][1]"] == "none"
    assert not any(row.nonfinite for row in frame.rows)
    # the text view writes each kind in HF's style
    lines = frame.hf_lines()
    assert "             None input[4]" in lines
    assert "     not a tensor input[5]" in lines
    assert "     empty tensor input[3]" in lines


# ---- sync mode ----------------------------------------------------------------------------
def test_sync_raises_inside_the_culprits_forward_hook_with_the_same_culprit():
    model, x = exp_overflow_model()
    with pytest.raises(NonFiniteError) as deferred, Guard(model):
        model(x)
    assert model[2].calls == 1  # deferred: the forward went on to its end

    model, x = exp_overflow_model()
    with pytest.raises(NonFiniteError) as synced, Guard(model, sync=True):
        model(x)
    assert model[2].calls == 0  # sync: stopped right after the culprit, before the next module
    a, b = deferred.value.report, synced.value.report
    assert (b.first_nonfinite.module_name, b.phase, b.cause) == (
        a.first_nonfinite.module_name, a.phase, a.cause)
    assert [r.role for r in b.first_nonfinite.flagged_rows] == [
        r.role for r in a.first_nonfinite.flagged_rows]


def test_sync_raises_inside_the_culprits_gradient_hook_in_backward():
    def run(sync):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1))
        with pytest.raises(NonFiniteError) as caught, Guard(model, sync=sync):
            model(torch.randn(3, 4)).sum().backward()
        return model, caught.value.report

    deferred_model, deferred = run(False)
    synced_model, synced = run(True)
    # deferred: the backward finished (first layer's gradient written) before the error;
    # sync: it stopped at the culprit, so the first layer never got its gradient.
    assert deferred_model[0].weight.grad is not None
    assert synced_model[0].weight.grad is None
    for report in (deferred, synced):
        assert report.phase == "backward" and report.cause == "backward"
        assert report.first_nonfinite.module_name == "1"
        assert [r.role for r in report.first_nonfinite.flagged_rows] == ["grad_input[0]"]


# ---- batches ------------------------------------------------------------------------------
def test_trace_batches_records_every_frame_of_the_batch_without_raising():
    model = mlp()
    x = torch.randn(3, 4)
    bad = x.clone()
    bad[0, 0] = NAN
    with Guard(model, trace_batches=[1]) as guard:
        for batch in range(2):
            model(bad if batch == 1 else x).sum().backward()
        # batch 2 is not traced: the same nan stops it
        with pytest.raises(NonFiniteError) as caught:
            model(bad)
    assert caught.value.report.batch_number == 2
    assert caught.value.report.cause == "data"
    assert set(guard.traces) == {1}
    trace = guard.traces[1]
    assert trace.kind == "trace" and trace.batch_number == 1
    forward = [(f.module_name, f.call_index) for f in trace.frames if f.phase == "forward"]
    assert forward == [("0", 0), ("1", 0), ("2", 0), ("", 0)]  # every call, in completion order
    backward = {f.module_name for f in trace.frames if f.phase == "backward"}
    assert {"0", "1", "2", ""} <= backward
    assert all(f.batch_number == 1 for f in trace.frames)
    # the trace still notes where it would have stopped
    assert trace.first_nonfinite is not None and trace.cause == "data"


def test_abort_after_batch_raises_when_the_next_batch_starts():
    model = mlp()
    x = torch.randn(3, 4)
    done = []
    with pytest.raises(BatchLimitReached) as caught, Guard(model, abort_after_batch=1) as guard:
        for _ in range(5):
            model(x).sum().backward()
            done.append(guard.batch_number)
    assert done == [0, 1]
    assert "abort_after_batch=1" in str(caught.value)
    assert_no_hooks(model)


def test_max_frames_bounds_the_report():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)], Exp())
    with torch.no_grad():
        model[5].weight.zero_()
        model[5].bias.fill_(100.0)  # exp(100) overflows float32
    with pytest.raises(NonFiniteError) as caught, Guard(model, max_frames=3):
        model(torch.ones(1, 4))
    report = caught.value.report
    assert len(report.frames) == 3
    assert [f.module_name for f in report.frames] == ["4", "5", "6"]
    assert report.frames[-1] is report.first_nonfinite

    clean = mlp()
    with Guard(clean, max_frames=2) as guard:
        for _ in range(3):
            clean(torch.randn(3, 4)).sum().backward()
    assert len(guard.report.frames) == 2


def test_the_report_reaches_back_across_earlier_batches_up_to_max_frames():
    # 5 calls per forward: a detection in batch 5 shows the 20 frames before the culprit,
    # from batches 1 to 5, like transformers' detector (its 21 frames span batches).
    model, x = exp_overflow_model()
    with torch.no_grad():
        model[0].weight.fill_(0.01)
    with pytest.raises(NonFiniteError) as caught, Guard(model), torch.no_grad():
        for batch in range(6):
            model(x * (10_000.0 if batch == 5 else 1.0))
    report = caught.value.report
    assert report.batch_number == 5
    assert len(report.frames) == 21
    expected = [1] * 4 + [2] * 5 + [3] * 5 + [4] * 5 + [5] * 2
    assert [f.batch_number for f in report.frames] == expected
    assert [f.module_name for f in report.frames[-7:]] == ["0", "1", "2", "3", "", "0", "1"]
    assert report.frames[-1] is report.first_nonfinite



@pytest.mark.parametrize("path", ["host", "device"])
def test_a_report_shows_the_backward_before_it_with_each_gradient_where_it_came(path, request):
    # A healthy backward's calls and slots are made only when a report reads them as context:
    # they must come out as the gradients came (parameters' gradients, and the rows a GPU
    # writes together at the backward's end, included).
    if path == "device":
        request.getfixturevalue("deferred_on_host")
    model = mlp()
    with pytest.raises(NonFiniteError) as caught, Guard(model, max_frames=30):
        model(torch.randn(3, 4)).sum().backward()
        model(torch.full((3, 4), float("nan")))
    frames = caught.value.report.frames
    backward = [(f.batch_number, f.module_name, [row.role for row in f.rows])
                for f in frames if f.phase == "backward"]
    assert backward == [
        (0, "", ["grad_output"]),
        (0, "2", ["grad_output", "bias.grad", "weight.grad", "grad_input[0]"]),
        (0, "1", ["grad_output", "grad_input[0]"]),
        (0, "0", ["grad_output", "bias.grad", "weight.grad"]),
    ]
    weight_grad = next(row for f in frames if f.phase == "backward" and f.module_name == "0"
                       for row in f.rows if row.role == "weight.grad")
    assert 0 < weight_grad.abs_max < float("inf")
    assert [f.phase for f in frames].index("backward") == 4  # after batch 0's forward


def test_two_threads_reading_the_report_at_once_see_the_same_frames():
    # A healthy backward's slots are made when a report first reads them: two threads asking
    # at once (a notebook's display beside a training thread) must not each make half of them.
    import sys
    import threading

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(40)])
    x = torch.randn(2, 8)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: a race shows within a few steps
    try:
        with Guard(model, max_frames=21) as guard:
            for _ in range(40):
                model(x).sum().backward()
                start, seen = threading.Barrier(2), []

                def read():
                    start.wait()
                    seen.append([(f.phase, f.module_name, [r.role for r in f.rows])
                                 for f in guard.report.frames])

                threads = [threading.Thread(target=read) for _ in range(2)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                assert seen[0] == seen[1]
                assert [phase for phase, _, _ in seen[0]] == ["backward"] * 21
    finally:
        sys.setswitchinterval(interval)

# ---- in-place, shared and frozen modules in backward --------------------------------------
def test_inplace_relu_works_forward_and_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    with Guard(model, max_frames=50) as guard:
        out = model(x)
        out.sum().backward()
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    frames = {(f.module_name, f.phase): f for f in guard.report.frames}
    assert ("1", "backward") in frames
    relu_fwd = {row.role: row for row in frames[("1", "forward")].rows}
    linear_out = {row.role: row for row in frames[("0", "forward")].rows}["output"]
    # the in-place module's input is summarised before it ran (the Linear's output, negatives too)
    assert relu_fwd["input[0]"].abs_max == linear_out.abs_max
    relu_bwd = {row.role: row for row in frames[("1", "backward")].rows}
    assert {"grad_output", "grad_input[0]"} <= set(relu_bwd)


def test_in_place_nan_producing_module_is_named():
    class LogInPlace(nn.Module):
        def forward(self, x):
            return x.log_()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogInPlace(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(-1.0)
        model[0].bias.zero_()
    with pytest.raises(NonFiniteError) as caught, Guard(model), torch.no_grad():
        model(torch.ones(2, 4))
    culprit = caught.value.report.first_nonfinite
    assert culprit.module_name == "1"
    assert [row.role for row in culprit.flagged_rows] == ["output"]


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.lin(torch.tanh(self.lin(x))))


def test_shared_module_called_twice_has_call_index_0_and_1_in_forward_and_backward():
    torch.manual_seed(0)
    model = Shared()
    x = torch.randn(3, 4, requires_grad=True)
    with Guard(model, max_frames=50) as guard:
        model(x).sum().backward()
    calls = [(f.phase, f.call_index) for f in guard.report.frames if f.module_name == "lin"]
    assert sorted(calls) == [("backward", 0), ("backward", 1), ("forward", 0), ("forward", 1)]
    backward = {f.call_index: {r.role for r in f.rows} for f in guard.report.frames
                if f.module_name == "lin" and f.phase == "backward"}
    assert {"grad_output", "grad_input[0]"} <= backward[0] and {"grad_output", "grad_input[0]"} <= backward[1]
    assert any("weight.grad" in roles for roles in backward.values())


def test_shared_module_producing_nan_on_its_second_call_is_named_with_call_index_1():
    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.log = Log()

        def forward(self, x):
            return self.log(self.log(x) - 5)  # second call takes log of a negative number

    model = Twice()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(torch.full((2,), 2.0))
    culprit = caught.value.report.first_nonfinite
    assert (culprit.module_name, culprit.call_index) == ("log", 1)


def test_frozen_parameters_have_no_gradient_row_and_raise_nothing():
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    with Guard(model, max_frames=50) as guard:
        model(torch.randn(3, 4)).sum().backward()
    assert guard.detection is None
    rows = [(f.module_name, r.role) for f in guard.report.frames if f.phase == "backward"
            for r in f.rows]
    assert ("2", "weight.grad") in rows
    assert not any(name == "0" and role.endswith(".grad") for name, role in rows)
    assert model[0].weight.grad is None


# ---- promises: hooks, numbers, memory -------------------------------------------------------
def test_hooks_are_removed_after_normal_exit():
    model = mlp()
    with Guard(model):
        assert_hooked(model)
        model(torch.randn(3, 4)).sum().backward()
    assert_no_hooks(model)


def test_hooks_are_removed_after_nonfinite_error():
    model, x = exp_overflow_model()
    with pytest.raises(NonFiniteError), Guard(model):
        assert_hooked(model)
        model(x)
    assert_no_hooks(model)


def test_hooks_are_removed_after_a_backward_nonfinite_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError), Guard(model, sync=True):
        model(torch.randn(3, 4)).sum().backward()
    assert_no_hooks(model)


class Raises(nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def forward(self, x):
        raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("shape mismatch"), KeyboardInterrupt()],
                         ids=["RuntimeError", "KeyboardInterrupt"])
def test_hooks_are_removed_after_an_exception_inside_a_modules_forward(exc):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Raises(exc)), nn.Linear(4, 1))
    with pytest.raises(type(exc)), Guard(model):
        assert_hooked(model)
        model(torch.randn(3, 4))
    assert_no_hooks(model)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()],
                         ids=["RuntimeError", "KeyboardInterrupt"])
def test_an_attached_guard_keeps_working_after_an_exception_inside_forward(exc):
    # Notebook use: the guard stays attached (guard.attach(), %%numguard, the HF drop-in) and
    # the user interrupts a forward (Ctrl-C) or hits an error, fixes it and runs the next batch.
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.exc = exc

        def forward(self, x):
            if self.exc is not None:
                raise self.exc
            return torch.exp(x)

    model, x = exp_overflow_model()
    model[1] = Flaky()
    guard = Guard(model).attach()
    try:
        with pytest.raises(type(exc)):
            model(x)
        model[1].exc = None
        with pytest.raises(NonFiniteError) as caught:
            model(x)
        assert caught.value.report.first_nonfinite.module_name == "1"
        assert caught.value.report.batch_number == 1
    finally:
        guard.detach()
    assert_no_hooks(model)


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.5), nn.Linear(16, 16),
                                 nn.ReLU(inplace=True), nn.LayerNorm(16), nn.Linear(16, 3))

    def forward(self, x, scale=1.0):
        return {"logits": self.net(x) * scale, "aux": (x.sum(), None)}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_outputs_loss_and_gradients_are_bit_identical_with_and_without_the_guard(dtype):
    torch.manual_seed(0)
    plain = DropoutNet().to(dtype)
    guarded = copy.deepcopy(plain)
    x = torch.randn(5, 8, dtype=dtype)

    def step(model):
        torch.manual_seed(1234)  # same dropout masks, unless the guard consumed randomness
        outs = []
        for _ in range(2):
            out = model(x, scale=0.5)
            loss = out["logits"].float().pow(2).mean()
            loss.backward()
            outs.append((out["logits"].detach(), loss.detach()))
        return outs, [p.grad.clone() for p in model.parameters()], torch.get_rng_state()

    expected, expected_grads, expected_rng = step(plain)
    with Guard(guarded, limit_dtype=torch.float16):
        got, got_grads, got_rng = step(guarded)
    for (a_out, a_loss), (b_out, b_loss) in zip(expected, got):
        assert torch.equal(a_out, b_out)
        assert torch.equal(a_loss, b_loss)
    assert len(expected_grads) == len(got_grads) == 8
    for a, b in zip(expected_grads, got_grads):
        assert torch.equal(a, b)
    # the guard drew no random numbers, and changed no weight
    assert torch.equal(expected_rng, got_rng)
    for p, q in zip(plain.parameters(), guarded.parameters()):
        assert torch.equal(p, q)


def test_no_activation_is_kept_alive_after_a_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), KeepRef(), nn.Linear(8, 1))
    keep = model[2]
    x = torch.randn(3, 4)
    with Guard(model):
        out = model(x)
        loss = out.sum()
        assert keep.ref() is not None  # alive while the graph (saved for backward) is alive
        del out, loss
        assert keep.ref() is None  # forward only, then dropped

        out = model(x)
        loss = out.sum()
        loss.backward()
        del out, loss
        assert keep.ref() is None  # after a backward

        with torch.no_grad():
            out = model(x)
        del out
        assert keep.ref() is None  # under no_grad


def _live_tensors():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def test_memory_stays_bounded_over_thousands_of_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    tensors, handles, traced = {}, {}, {}
    tracemalloc.start()
    try:
        with Guard(model) as guard:
            for step in range(1, 2001):
                optimizer.zero_grad()
                model(x).pow(2).mean().backward()
                optimizer.step()
                if step in (10, 1000, 2000):
                    gc.collect()
                    tensors[step] = _live_tensors()
                    handles[step] = len(guard._grad_hooks.handles)
                    traced[step] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert tensors[1000] <= tensors[10] + 2 and tensors[2000] <= tensors[10] + 2, tensors
    assert max(handles.values()) <= 64, handles
    assert traced[2000] - traced[1000] < 64 * 1024, traced


# ---- a second backward over the same forward ------------------------------------------------
def test_second_backward_over_the_same_graph_is_checked_too():
    # retain_graph=True (or torch.autograd.grad for a gradient penalty, then loss.backward()):
    # the second backward pass must be watched like the first.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e30)
    x = torch.randn(3, 4)
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(x)
        out.backward(torch.ones_like(out), retain_graph=True)  # finite
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        model.zero_grad()
        out.backward(torch.full_like(out, 1e30))  # layer 1's weight.grad overflows
    report = caught.value.report
    assert report.phase == "backward" and report.cause == "backward"
    assert report.first_nonfinite.module_name == "1"


# ---- limit_dtype ----------------------------------------------------------------------------
def test_limit_dtype_fp16_predicts_the_overflow_of_an_fp32_activation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(25.0)
        model[0].bias.zero_()
        model[2].weight.fill_(100.0)  # 8 * 100 * 100 = 80000 > 65504, finite in fp32
    x = torch.ones(2, 4)
    with Guard(model):  # fine in fp32
        model(x).sum().backward()
    with pytest.raises(NonFiniteError) as caught, \
            Guard(model, limit_dtype=torch.float16, stop_at_limit=True):
        model(x)
    report = caught.value.report
    culprit = report.first_nonfinite
    assert (culprit.module_name, culprit.module_class, report.cause) == ("2", "Linear", "forward")
    flagged = culprit.flagged_rows
    assert [row.role for row in flagged] == ["output"]
    assert flagged[0].predicted_overflow and not flagged[0].nonfinite
    assert flagged[0].abs_max == pytest.approx(80000.0, rel=1e-3)
    assert report.limit_dtype == "float16"
    assert "predicted overflow" in report.summary()
    # the rows before the culprit are not marked
    assert not any(r.predicted_overflow for f in report.frames[:-1] for r in f.rows)


def test_limit_dtype_ignores_integer_tensors_beyond_its_range():
    # token ids above 65504 are not an fp16 overflow
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(70_000, 4), nn.Linear(4, 1))
    ids = torch.tensor([[3, 69_999, 65_600]])
    with Guard(model, limit_dtype=torch.float16, max_frames=50) as guard:
        model(ids).sum().backward()
    assert guard.detection is None
    embedding_input = next(r for f in guard.report.frames for r in f.rows
                           if f.module_name == "0" and r.role == "input[0]")
    assert embedding_input.abs_max == 69_999 and not embedding_input.predicted_overflow


@pytest.mark.parametrize("limit", [torch.float16, "float16", "fp16"])
def test_limit_dtype_flags_values_and_gradients_that_would_underflow_without_raising(limit):
    class Tiny(nn.Module):
        def forward(self, x):
            return x * 1e-12

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Tiny(), nn.Linear(4, 1))
    with Guard(model, limit_dtype=limit, max_frames=50) as guard:
        model(torch.randn(3, 4)).sum().backward()
    assert guard.detection is None
    rows = {(f.module_name, f.phase, r.role): r for f in guard.report.frames for r in f.rows}
    assert rows[("1", "forward", "output")].predicted_underflow
    assert rows[("1", "forward", "input[0]")].predicted_underflow is False
    assert rows[("2", "backward", "weight.grad")].predicted_underflow  # gradient ~1e-12
    assert rows[("0", "backward", "weight.grad")].predicted_underflow
    assert not rows[("2", "backward", "bias.grad")].predicted_underflow
    assert "underflow predicted" in rows[("1", "forward", "output")].problems


# ---- bad arguments --------------------------------------------------------------------------
@pytest.mark.parametrize("args, kwargs, words", [
    (("not a module",), {}, ["Module", "str"]),
    ((None,), {}, ["Module"]),
    ((mlp(),), {"max_frames": 0}, ["max_frames", "0"]),
    ((mlp(),), {"max_frames": 2.5}, ["max_frames"]),
    ((mlp(),), {"trace_batches": ["x"]}, ["trace_batches"]),
    ((mlp(),), {"trace_batches": [-1]}, ["trace_batches"]),
    ((mlp(),), {"abort_after_batch": -1}, ["abort_after_batch", "-1"]),
    ((mlp(),), {"abort_after_batch": "3"}, ["abort_after_batch"]),
    ((mlp(),), {"allow_inf": [1]}, ["allow_inf"]),
    ((mlp(),), {"allow_inf": 3}, ["allow_inf"]),
    ((mlp(),), {"limit_dtype": "int8"}, ["limit_dtype", "int8", "float16"]),
    ((mlp(),), {"limit_dtype": torch.int8}, ["limit_dtype"]),
], ids=["str-model", "None-model", "max_frames=0", "max_frames=2.5", "trace_batches=x",
        "trace_batches=-1", "abort=-1", "abort=str", "allow_inf=[1]", "allow_inf=3",
        "limit=int8-str", "limit=int8"])
def test_bad_arguments_raise_a_one_line_error_that_says_what_to_pass(args, kwargs, words):
    with pytest.raises((TypeError, ValueError)) as caught:
        Guard(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and message.strip()
    for word in words:
        assert word in message, message


def test_a_bad_argument_leaves_no_hook_behind():
    model = mlp()
    with pytest.raises(ValueError):
        Guard(model, limit_dtype="int8")
    assert_no_hooks(model)


# ---- CUDA ----------------------------------------------------------------------------------
@pytest.mark.cuda
def test_detection_on_cuda_names_the_producer_forward_and_backward():
    model, x = exp_overflow_model()
    model, x = model.cuda(), x.cuda()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x)
    culprit = caught.value.report.first_nonfinite
    assert (culprit.module_name, culprit.phase) == ("1", "forward")
    assert culprit.flagged_rows[0].posinf

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 1)).cuda()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(torch.randn(3, 4, device="cuda")).sum().backward()
    assert caught.value.report.first_nonfinite.module_name == "1"
    assert caught.value.report.phase == "backward"
    assert_no_hooks(model)


# ---- torch.distributed ---------------------------------------------------------------------
def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _distributed_worker(rank, world_size, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=15))
    try:
        model, x = exp_overflow_model()
        try:
            with Guard(model):
                model(x)
            queue.put((rank, None))
        except NonFiniteError as error:
            report = error.report
            queue.put((rank, (report.rank, report.world_size, report.to_text().splitlines()[0],
                              report.summary(), report.first_nonfinite.module_name)))
    finally:
        torch.distributed.destroy_process_group()


def test_each_rank_reports_its_rank_under_torch_distributed():
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    processes = mp.spawn(_distributed_worker, args=(2, _free_port(), queue), nprocs=2,
                         join=False)
    try:
        for _ in range(60):  # a hang-safety net, not a timing assertion
            if processes.join(timeout=1):
                break
        else:
            pytest.fail("distributed workers did not finish")
    finally:
        for process in processes.processes:
            if process.is_alive():
                process.kill()
    results = dict(queue.get() for _ in range(2))
    assert set(results) == {0, 1}
    for rank, result in results.items():
        assert result is not None, f"rank {rank} saw no inf"
        report_rank, world, header, summary, culprit = result
        assert (report_rank, world, culprit) == (rank, 2, "1")
        assert f"rank {rank}/2" in header and header.startswith("Detected inf/nan")
        assert summary.endswith(f"[rank {rank}/2]")


def test_without_distributed_the_report_has_no_rank():
    model, x = exp_overflow_model()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x)
    report = caught.value.report
    assert report.rank is None and report.world_size is None
    assert "rank" not in report.to_text().splitlines()[0]


def test_public_names():
    assert ng.Guard is Guard and ng.NonFiniteError is NonFiniteError
    assert issubclass(NonFiniteError, FloatingPointError)
    assert issubclass(BatchLimitReached, RuntimeError)


def test_retarget_points_a_detached_guard_at_a_rebuilt_model_and_keeps_its_count():
    old, new = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2), Exp())
    guard = Guard(old)
    with guard:
        old(torch.ones(1, 2))
        with pytest.raises(RuntimeError, match="detach the guard"):
            guard.retarget(new)
    guard.retarget(new)
    with pytest.raises(NonFiniteError) as caught:
        with guard:
            new(torch.full((1, 2), 1e4))
    assert caught.value.report.first_nonfinite.module_name == "1"
    assert caught.value.report.batch_number == 1
    with pytest.raises(TypeError, match="torch.nn.Module"):
        guard.retarget("model")


def test_an_uncaught_error_in_a_script_says_the_op_the_line_and_the_hint(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\nimport numguard_nb as ng\n"
        "model = torch.nn.Linear(4, 1)\n"
        "with ng.Guard(model, ops=True):\n"
        "    loss = torch.log(model(torch.ones(2, 4)) - 100).mean()\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1
    said = run.stderr[run.stderr.index("NonFiniteError: "):]
    assert said.startswith("NonFiniteError: code outside the guarded modules produced a non-finite value")
    assert "hint: " in said and "Clamp the argument" in said
    assert "first non-finite op: aten.log.default" in said
    assert f"called from: {script}:5: loss = torch.log(model(torch.ones(2, 4)) - 100).mean()" in said
    assert "err.report after `except numguard_nb.NonFiniteError as err`" in said


def test_a_guard_never_attached_says_so_when_its_report_is_read():
    """Guard(model) alone watches nothing (Hugging Face's detector hooks at construction): its
    report is no all-clear, and reading it warns how to attach."""
    model = nn.Linear(2, 2)
    guard = Guard(model)
    model(torch.full((1, 2), float("nan")))
    with pytest.warns(UserWarning, match="never attached, so it watched nothing: run the training "
                                         r"code inside `with guard:`"):
        report = guard.report
    assert "never attached" in report.summary()
    with guard:
        model(torch.ones(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "never attached" not in guard.report.summary()


class _SqrtActivation(nn.Module):
    def forward(self, x):
        return torch.sqrt(x - x) + x  # finite forward, nan backward


def test_a_submodule_swapped_in_while_attached_is_hooked_and_named():
    from promises import hooks_left

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    old = model[1]
    with pytest.raises(NonFiniteError) as raised, Guard(model, ops=True):
        model(torch.randn(3, 8)).sum().backward()
        model[1] = _SqrtActivation()  # swapped while the guard is attached
        model(torch.randn(3, 8)).sum().backward()
    culprit = raised.value.report.first_nonfinite
    assert (culprit.module_name, culprit.module_class, culprit.phase) == ("1", "_SqrtActivation", "backward")
    assert hooks_left(model, old) == []
