"""Bad input gets a clear one-line error, never silence (issue 22).

- `stop_at_limit` without `limit_dtype` is refused, in the Guard, the callbacks and the magic;
- a `limit_dtype` that is not narrower than float32 (it could predict nothing) is refused;
- values whose numbers cannot be read (meta and fake tensors) are noted as not watched in both
  modes, never a crash;
- two guards at once (on one model or on two) raise the first detection and nothing else: no
  detection of the second guard is silenced by torch with a UserWarning.
"""

from __future__ import annotations

import itertools
import re
import warnings

import pytest
import torch
from torch import nn

from models import Exp
from numguard_nb import Guard, NonFiniteError
from numguard_nb.guard import GuardOptions

MODES = ("full", "sentinel")


def one_line(error: BaseException) -> str:
    message = str(error)
    assert message.strip() and "\n" not in message, message
    return message


def exp_net() -> nn.Sequential:
    """Overflows to inf in module "1" for inputs of 1000."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Exp(), nn.Linear(4, 2))


def small_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


# ---- 1. stop_at_limit needs limit_dtype -----------------------------------------------------------
def test_stop_at_limit_without_limit_dtype_is_a_one_line_value_error_saying_what_to_set():
    with pytest.raises(ValueError) as caught:
        GuardOptions(stop_at_limit=True)
    message = one_line(caught.value)
    assert message.startswith("stop_at_limit needs limit_dtype")
    assert "limit_dtype=torch.float16" in message  # what to set
    assert GuardOptions(stop_at_limit=True, limit_dtype="fp16").stop_at_limit is True


@pytest.mark.parametrize("mode", MODES)
def test_the_guard_refuses_stop_at_limit_without_limit_dtype_before_hooking(mode):
    model = small_net()
    with pytest.raises(ValueError, match="^stop_at_limit needs limit_dtype"):
        Guard(model, mode=mode, stop_at_limit=True)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    guard = Guard(model, mode=mode)
    with pytest.raises(ValueError, match="^stop_at_limit needs limit_dtype"):
        guard.stop_at_limit = True
    assert guard.stop_at_limit is False


def test_the_trainer_callback_refuses_stop_at_limit_without_limit_dtype():
    pytest.importorskip("transformers")
    from numguard_nb.integrations import NumguardCallback

    with pytest.raises(ValueError, match="^stop_at_limit needs limit_dtype"):
        NumguardCallback(stop_at_limit=True)


def test_the_magic_refuses_stop_at_limit_without_limit_dtype(shell):
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    shell.user_ns["net"] = small_net()
    with capture_output():
        result = shell.run_cell("%%numguard net --stop-at-limit\n1")
    assert isinstance(result.error_in_exec, UsageError)
    assert re.search(r"stop.at.limit needs .*limit.dtype", one_line(result.error_in_exec))
    assert not shell.user_ns["net"][0]._forward_hooks


# ---- 2. limit_dtype is a narrower format -----------------------------------------------------------
@pytest.mark.parametrize("limit", [torch.float32, torch.float64, "float32", "fp32", "float",
                                   "float64", "fp64", "double", "torch.float64"])
def test_a_limit_dtype_as_wide_as_float32_is_refused_saying_what_it_is_for(limit):
    with pytest.raises(ValueError) as caught:
        Guard(small_net(), limit_dtype=limit)
    message = one_line(caught.value)
    assert message.startswith("limit_dtype is the narrower format")
    for name in ("float16 (fp16, half)", "bfloat16 (bf16)", "float8_e4m3fn", "float8_e5m2"):
        assert name in message
    assert "float64 (" not in message and "float32 (" not in message


@pytest.mark.parametrize("limit", [torch.float16, "bf16", "fp8_e4m3", torch.float8_e5m2])
def test_narrower_limit_dtypes_are_still_accepted(limit):
    assert GuardOptions(limit_dtype=limit).limit_dtype.itemsize < 4


# ---- 3. values that cannot be read are not watched, never a crash ----------------------------------
def _meta_run():
    with torch.device("meta"):
        model, x = small_net(), torch.randn(3, 4)
    return model, x


def _fake_run():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake weights and inputs, run after the mode is left
        model, x = small_net(), torch.randn(3, 4)
    return model, x


@pytest.mark.parametrize("make", [_meta_run, _fake_run], ids=["meta", "fake"])
@pytest.mark.parametrize("mode", MODES)
def test_unreadable_values_are_noted_as_not_watched_in_both_modes(mode, make):
    model, x = make()
    with Guard(model, mode=mode) as guard:
        for _ in range(2):
            torch.log(model(x)).mean().backward()  # a loss outside the model too
    assert guard.detection is None
    assert "values were not watched: their numbers could not be read" in guard.report.reason


def test_the_sentinel_notes_unreadable_gradients_as_not_watched():
    model, x = _meta_run()
    with Guard(model, mode="sentinel") as guard:
        model(x).sum().backward()
    rows = [(frame.phase, row.role, row.kind) for frame in guard.report.frames for row in frame.rows]
    assert ("backward", "0.weight.grad", "unsupported") in rows
    assert ("forward", "output", "unsupported") in rows


def test_the_sentinel_still_finds_a_nan_gradient_beside_unreadable_ones():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[1].bias.register_hook(lambda grad: grad * float("nan"))
    meta = nn.Parameter(torch.empty(2, device="meta"))
    model.register_parameter("meta_weight", meta)
    meta.grad = torch.empty(2, device="meta")
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode="sentinel"):
        model(torch.ones(3, 4)).sum().backward()
    report = caught.value.report
    assert report.first_nonfinite.module_name == "1" and "bias.grad holds nan" in report.reason


# ---- 4. two guards at once: one detection, nothing silenced ----------------------------------------
def _steps(first, second, loss_outside: bool):
    x, big = torch.ones(3, 4), torch.full((3, 4), 1e3)
    if loss_outside:
        torch.log(first(x).abs()).mean().backward()
        torch.log(second(x).abs()).mean().backward()
    first(x).sum().backward()
    second(big).sum().backward()  # inf in "1" (Exp)


@pytest.mark.parametrize("loss_outside", [False, True], ids=["loss-inside", "loss-outside"])
@pytest.mark.parametrize("same_model", [True, False], ids=["one-model", "two-models"])
@pytest.mark.parametrize("modes", list(itertools.product(MODES, MODES)), ids="-".join)
def test_two_guards_raise_one_detection_and_no_silenced_hook_exception(modes, same_model,
                                                                       loss_outside):
    first = exp_net()
    second = first if same_model else exp_net()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(NonFiniteError) as caught, \
                Guard(first, mode=modes[0]), Guard(second, mode=modes[1]):
            _steps(first, second, loss_outside)
    assert caught.value.report.first_nonfinite.module_name == "1"
    assert [str(w.message) for w in seen] == []


@pytest.mark.parametrize("modes", list(itertools.product(MODES, MODES)), ids="-".join)
def test_after_one_guards_detection_both_guards_go_on_watching(modes):
    model = exp_net()
    guards = [Guard(model, mode=mode).attach() for mode in modes]
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(NonFiniteError):
                model(torch.full((3, 4), 1e3)).sum().backward()
            model(torch.ones(3, 4)).sum().backward()  # a healthy step: nothing raised
            for guard in guards:
                guard.detection = None
            with pytest.raises(NonFiniteError) as caught:
                model(torch.full((3, 4), 1e3)).sum().backward()
        assert caught.value.report.first_nonfinite.module_name == "1"
        assert [str(w.message) for w in seen] == []
    finally:
        for guard in guards:
            guard.detach()


def test_a_forward_that_raises_is_marked_raised_and_its_error_wins():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), Exp(), Boom())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="boom") as caught, Guard(model) as guard:
            model(torch.full((3, 4), 1e3))  # inf in "1", then "2" raises: its error wins
    assert [str(w.message) for w in seen] == []
    # what the guard saw before is kept, and said on the error (Python 3.11+)
    assert guard.detection.first_nonfinite.module_name == "1"
    if hasattr(caught.value, "add_note"):
        assert caught.value.__notes__[0].startswith("numguard found, before this error: 1 (Exp)")
    with pytest.raises(RuntimeError, match="boom"), Guard(model) as guard:
        model(torch.full((3, 4), 1.0))  # all finite: the calls that raised are marked so
    assert guard.detection is None
    raised = [frame.module_name for frame in guard.report.frames if frame.raised]
    assert raised == ["2", ""]
