"""GuardOptions: the Guard's options checked once, into one immutable object."""

import dataclasses

import pytest
import torch
from torch import nn

from numguard_nb import Guard
from numguard_nb.guard import GuardOptions


def hooks_on(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_defaults_are_the_guards():
    options = GuardOptions()
    assert (options.max_frames, options.trace_batches, options.abort_after_batch) == (21, frozenset(), None)
    assert (options.backward, options.sync, options.ops, options.capture) == (True, False, False, False)
    assert (options.allow_inf, options.limit_dtype, options.limit_max, options.limit_tiny) == (False, None, None, None)
    assert Guard(nn.Linear(2, 2)).options == options


def test_values_are_normalised():
    options = GuardOptions(trace_batches=[3, 1, 3], allow_inf="*.attn", limit_dtype="torch.FP16")
    assert options.trace_batches == frozenset({1, 3})
    assert options.allow_inf == ("*.attn",)
    assert options.limit_dtype is torch.float16
    assert options.limit_max == 65504.0
    assert options.limit_tiny == 2.0 ** -24  # float16's smallest subnormal


@pytest.mark.parametrize("name", ["backward", "sync", "ops", "capture"])
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_a_switch_that_is_not_a_bool_is_a_one_line_value_error(name, value):
    with pytest.raises(ValueError) as caught:
        GuardOptions(**{name: value})
    message = str(caught.value)
    assert message == f"{name} must be True or False, got {value!r}" and "\n" not in message


def test_guard_rejects_a_switch_that_is_not_a_bool_before_hooking_anything():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="backward must be True or False, got 'no'"):
        Guard(model, backward="no").attach()
    assert hooks_on(model) == 0


@pytest.mark.parametrize("keywords,message", [
    (dict(max_frames=0), "max_frames must be a positive integer, got 0"),
    (dict(max_frames=True), "max_frames must be a positive integer, got True"),
    (dict(trace_batches=[1.5]), "trace_batches must be batch numbers like [1, 3], got [1.5]"),
    (dict(trace_batches=[-1, 2]), "trace_batches are 0-indexed batch numbers, got [-1, 2]"),
    (dict(abort_after_batch=-1), "abort_after_batch must be None or a batch number >= 0, got -1"),
    (dict(allow_inf=3), "allow_inf must be True/False or module-name globs like ['*.attn*'], got 3"),
    (dict(allow_inf=["a", 1]), "allow_inf globs must be strings, got ['a', 1]"),
    (dict(limit_dtype="int8"), "limit_dtype 'int8' is not a float dtype numguard knows: use float16 (fp16, "
     "half), bfloat16 (bf16), float8_e4m3fn (fp8_e4m3fn, fp8_e4m3, e4m3), float8_e5m2 (fp8_e5m2, e5m2), "
     "float8_e4m3fnuz (fp8_e4m3fnuz), float8_e5m2fnuz (fp8_e5m2fnuz)"),
    (dict(limit_dtype="fp64"), "limit_dtype is the narrower format a float32 run may move to, whose "
     "overflow and underflow the guard predicts: use float16 (fp16, half), bfloat16 (bf16), float8_e4m3fn "
     "(fp8_e4m3fn, fp8_e4m3, e4m3), float8_e5m2 (fp8_e5m2, e5m2), float8_e4m3fnuz (fp8_e4m3fnuz), "
     "float8_e5m2fnuz (fp8_e5m2fnuz); got 'fp64'"),
    (dict(stop_at_limit=True), "stop_at_limit needs limit_dtype, the narrower format whose overflow it "
     "stops at: add limit_dtype=torch.float16 (or bfloat16, float8_e4m3fn), or drop stop_at_limit"),
    (dict(limit_dtype=torch.int8), "limit_dtype must be a floating torch dtype such as torch.float16, got torch.int8"),
])
def test_bad_values_are_one_line_value_errors_naming_the_option(keywords, message):
    with pytest.raises(ValueError) as caught:
        GuardOptions(**keywords)
    assert str(caught.value) == message


@pytest.mark.parametrize("name", ["on_trace", "on_detect"])
def test_a_callback_that_cannot_be_called_is_a_type_error(name):
    with pytest.raises(TypeError, match=f"{name} must be a function taking a Report, got 1"):
        GuardOptions(**{name: 1})


def test_a_misspelt_option_is_a_type_error():
    with pytest.raises(TypeError, match="max_frame"):
        GuardOptions(max_frame=3)


def test_options_are_immutable_and_replace_checks_the_copy():
    options = GuardOptions(sync=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.sync = False
    assert options.replace(max_frames=5) == GuardOptions(sync=True, max_frames=5)
    with pytest.raises(ValueError, match="ops must be True or False"):
        options.replace(ops="yes")


def test_as_kwargs_builds_a_guard_with_the_same_options():
    options = GuardOptions(max_frames=4, trace_batches=[2], backward=False, allow_inf=["*.mask"],
                           limit_dtype=torch.bfloat16, on_detect=print, ops=True)
    guard = Guard(nn.Linear(2, 2), **options.as_kwargs())
    assert guard.options == options


def test_inf_allowed_matches_module_name_globs():
    options = GuardOptions(allow_inf=["*.attn", "mask"])
    assert options.inf_allowed("encoder.attn") and options.inf_allowed("mask")
    assert not options.inf_allowed("encoder.attn.proj") and not options.inf_allowed("masks")
    assert GuardOptions(allow_inf=True).inf_allowed("anything")
    assert not GuardOptions().inf_allowed("anything")


def test_the_guards_attributes_are_its_options_and_setting_one_is_checked():
    guard = Guard(nn.Linear(2, 2), sync=True, limit_dtype="bf16", trace_batches=(0,))
    assert guard.sync is True and guard.limit_dtype is torch.bfloat16
    assert guard.trace_batches == frozenset({0}) and guard.capture_enabled is False
    guard.capture_enabled = True
    guard.max_frames = 3
    assert guard.options.capture is True and guard.options.max_frames == 3
    with pytest.raises(ValueError, match="sync must be True or False"):
        guard.sync = "yes"
    assert guard.sync is True
