"""Loss scaling: the backward overflows a GradScaler handles by skipping the step are let through
and recorded; the ones skipping does not cure are raised.

Contract: `LossScaling.excuses` lets a non-finite gradient made in backward through while the
scaler (the one seen running `scale(loss)`, else the `scaler` option's) is enabled, its scale is
above 1 and `max_skipped_steps`, when set, is not reached. Each step the scaler then skipped is a
`SkippedStep` (`guard.skipped_steps`, `skipped_summary`). `is_loss_scaler` and `loss_scaler_of`
recognise a scaler or find a trainer's.

Limits: forward values are never let through, nor an overflow once 16 batches passed without
`scaler.update()`; a step the scaler took is not recorded; a healthy run's scaler is untouched,
except where the guard reads its checks after the step (a sentinel on a GPU): there each
`update()` keeps that step's found-inf flags and scale on the device (references and one copy,
never read) for the overflow read later to know whether its step was skipped.

    >>> with Guard(model, scaler=scaler) as guard:
    ...     train()                    # the first float16 steps overflow on purpose
    >>> guard.skipped_steps            # [SkippedStep(batch=0, scale=65536.0, ...), ...]

How it works: docs/mixed_precision.md.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from .._schema import BACKWARD
from ..report import Frame, Report
from . import detect, frames

__all__ = ["SkippedStep", "LossScaling", "is_loss_scaler", "loss_scaler_of", "skipped_summary"]

# Batches an overflow is let through for while the scaler's update() is not called (a scaler the
# loop does not use), unless max_skipped_steps says fewer.
_UPDATE_WINDOW = 16
# Steps whose found-inf flags are kept for an overflow read after its step's update(): a
# sentinel's checks are read a step or two late (its StepChecks forget steps past 64 unread).
_ENDED_KEPT = 64
_SCALE_CODE = torch.amp.GradScaler.scale.__code__  # torch.cuda.amp's GradScaler inherits it
# Frames from a `Tensor.to` up to `scale`: scale(list) -> apply_scale -> _MultiDeviceReplicator.get
_SCALE_DEPTH = 4

# Where training objects keep their GradScaler: accelerate's Accelerator (trainer.accelerator),
# an AcceleratedOptimizer or an older Hugging Face Trainer (.scaler), Lightning's Trainer.
_SCALER_PATHS = (
    ("accelerator", "scaler"),
    ("scaler",),
    ("precision_plugin", "scaler"),
    ("strategy", "precision_plugin", "scaler"),
)


def is_loss_scaler(obj) -> bool:
    """A GradScaler, or an object that works like one: its class has `get_scale`, `is_enabled`
    and `update` (looked up on the class, so no instance `__getattr__` runs)."""
    kind = type(obj)
    return not isinstance(obj, type) and all(
        callable(getattr(kind, name, None)) for name in ("get_scale", "is_enabled", "update"))


def loss_scaler_of(obj):
    """The enabled GradScaler `obj` is or trains with, or None: accelerate's
    (`trainer.accelerator.scaler`, an AcceleratedOptimizer's `.scaler`), an older Hugging Face
    Trainer's `trainer.scaler`, Lightning's (`trainer.precision_plugin.scaler`,
    `trainer.strategy.precision_plugin.scaler`)."""
    for path in ((),) + _SCALER_PATHS:
        found = obj
        for name in path:
            try:
                found = getattr(found, name, None)
            except Exception:  # a property that cannot answer yet (a trainer not set up)
                found = None
            if found is None:
                break
        if found is not None and is_loss_scaler(found) and found.is_enabled():
            return found
    return None


@dataclass(frozen=True)
class SkippedStep:
    """An optimizer step the loss scaler skipped because its gradients were not finite."""

    batch: int  # the batch whose backward first made a non-finite gradient in that step
    scale: float  # the loss scale of that step: what the loss was multiplied by
    module: str  # the module whose gradient it was, qualified ("" for the model itself)
    cause: str  # _schema's CAUSE_*: made in backward, or entering the model from the loss
    values: str  # what the gradient held: "+inf", "nan", "+inf and -inf", ...
    frame: Frame = field(repr=False, compare=False)  # that backward call, the gradient flagged

    def __str__(self) -> str:
        rows = self.frame.flagged_rows
        where = f"{rows[0].role} of {self.frame.label}" if rows else self.frame.label
        return f"batch {self.batch} (scale {self.scale:g}): {self.values} in {where}"


def skipped_summary(steps: List[SkippedStep], scaler_name: str = "GradScaler") -> str:
    """'GradScaler skipped 4 steps (batches 0-3, scale 65536 down to 8192); the first: ...', or
    '' when none was skipped."""
    if not steps:
        return ""
    count = f"{len(steps)} step{'s' if len(steps) > 1 else ''}"
    batches = _batch_ranges([step.batch for step in steps])
    scales = (f"scale {steps[0].scale:g}" if len(steps) == 1
              else f"scale {steps[0].scale:g} down to {steps[-1].scale:g}")
    return f"{scaler_name} skipped {count} ({batches}, {scales}); the first: {steps[0]}"


def _batch_ranges(batches: List[int]) -> str:
    """'batch 3', 'batches 0-3, 7'."""
    ranges: List[List[int]] = []
    for batch in sorted(set(batches)):
        if ranges and batch == ranges[-1][1] + 1:
            ranges[-1][1] = batch
        else:
            ranges.append([batch, batch])
    words = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in ranges]
    return f"batch{'es' if len(batches) > 1 else ''} {', '.join(words)}"


def _found_inf_flags(scaler) -> list:
    """The found-inf flags `scaler.step` left this iteration (device tensors, one per device and
    optimizer; `update` acts on them, then starts fresh ones): [] where it keeps none."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return []
    return [flag for state in states.values() if isinstance(state, dict)
            for flag in state.get("found_inf_per_device", {}).values()]


def _found_inf(flags: list) -> Optional[bool]:
    """Whether flags of `_found_inf_flags` say the step was skipped; None for no flags."""
    if not flags:
        return None
    return any(float(flag) != 0 for flag in flags)  # one host read per device


@dataclass
class _EndedStep:
    """A step whose update() ran before its overflow was read (a sentinel's late read)."""

    index: int  # the how-manieth update() the watch saw
    batch: int  # the batch last run when it came: the step holds the batches up to this one
    flags: list  # the found-inf flags it acted on ([]: the scaler keeps none)
    scale: Optional[torch.Tensor]  # a copy of the scale it acted on (None: not a GradScaler)
    skipped: Optional[bool] = None  # once an overflow of it was read: whether it was skipped


class _UpdateWatch:
    """Stands in for `scaler.update` on the instance: tells the LossScaling whether the step that
    just ended was skipped, then updates as the scaler's own method does."""

    def __init__(self, watch: "LossScaling", scaler):
        self.watch = watch
        self.scaler = scaler
        self.original = scaler.update  # the class's method, bound, or another wrapper
        # another wrapper already on the instance, put back on detach (None: there was none)
        self.replaced = vars(scaler).get("update")

    def __call__(self, *args, **kwargs):
        return self.watch.updating(self, args, kwargs)

    def __reduce__(self):
        # A copy of the scaler (pickle, deepcopy) gets its class's own update, unwatched.
        return getattr, (self.scaler, "update")


class LossScaling:
    """The Guard's side of loss scaling: which backward overflows it lets through (`excuses`),
    the steps the scaler then skipped (`skipped_steps`, kept across attaches), and the sentence
    a detection gets when the rule stops letting them through (`refusal`)."""

    def __init__(self, current_batch: Callable[[], int] = lambda: 0):
        self.skipped_steps: List[SkippedStep] = []
        self._in_a_row = 0  # the steps skipped in a row up to the one `_last_skipped`
        self._current_batch = current_batch  # the guard's batch being run
        self._updates = 0  # update() calls seen by the watch (an index for each step)
        self._last_skipped = -2  # the index of the last step recorded skipped
        self._read_late = False  # overflows may be read after their step's update (`expect_late`)
        self._ended: deque = deque(maxlen=_ENDED_KEPT)  # _EndedStep of the late reads' steps
        self.scaler_name = "GradScaler"  # the class of the scaler watched last
        self._pending: Optional[SkippedStep] = None  # this step's overflow, until update()
        self._pending_batches: set = set()  # batches of this step whose backward overflowed
        self._skipped_batches: set = set()  # every batch of a skipped step that overflowed
        self._update_watch: Optional[_UpdateWatch] = None
        self._refusal = ""  # why the last overflow was not let through ('' if it was)
        self._found = None  # a weak reference to the scaler seen scaling the loss (`found`)

    # ---- the scaler ---------------------------------------------------------------------------
    def note_caller(self, frame) -> None:
        """A torch function called by `frame` ran while the guard watched: where that is
        `GradScaler.scale(loss)` (or, for several losses, its replicator a few frames below),
        the loop scales its loss with that scaler (the one the rule applies to)."""
        for _ in range(_SCALE_DEPTH):
            if frame is None or frame.f_code is _SCALE_CODE:
                break
            frame = frame.f_back
        if frame is None or frame.f_code is not _SCALE_CODE:
            return
        scaler = frame.f_locals.get("self")
        if is_loss_scaler(scaler) and (self._found is None or self._found() is not scaler):
            self._found = weakref.ref(scaler)

    def scaler_of(self, options):
        """The scaler the rule applies to: the one found scaling the loss, else the option's (a
        scaler the loop does not call, a notebook's from an earlier run, cannot have made the
        overflow nor skip its step)."""
        found = self._found() if self._found is not None else None
        return found if found is not None else options.scaler

    def skips_for_itself(self, options) -> bool:
        """Whether the scaler the rule applies to is enabled and was seen scaling the loss: its
        `step` then skips a step whose gradients are not finite on its own flag."""
        scaler = self._found() if self._found is not None else None
        return scaler is not None and scaler is self.scaler_of(options) and scaler.is_enabled()

    # ---- the rule ---------------------------------------------------------------------------
    def excuses(self, options, pass_, call, bad_slots, cause) -> bool:
        """Whether a backward culprit is an overflow the scaler (`scaler_of`) handles by
        skipping the step: record it and let it through. When not, `refusal` says why, for the
        detection about to be raised."""
        scaler = self.scaler_of(options)
        self._refusal = ""
        if scaler is None or not scaler.is_enabled():
            return False
        ended = self._ended_step_of(call.batch_number, scaler)
        if ended is not None:
            return self._excuses_ended(ended, scaler, options, pass_, call, bad_slots, cause)
        pending = self._pending
        if pending is not None and self._update_watch.scaler is scaler:
            if call.batch_number - pending.batch < (options.max_skipped_steps or _UPDATE_WINDOW):
                self._pending_batches.add(call.batch_number)  # the same step: recorded already
                return True
            self._refusal = (f"; {type(scaler).__name__}.update() has not been called since batch "
                             f"{pending.batch}: pass the scaler whose update() the loop calls")
            return False
        scale = float(scaler.get_scale())
        if self._refused(options, scaler, scale, self._updates):
            return False
        self._watch(scaler)
        self._pending = self._skipped_step(scale, options, pass_, call, bad_slots, cause)
        self._pending_batches = {call.batch_number}
        return True

    def _refused(self, options, scaler, scale: float, index: int) -> bool:
        """Whether an overflow of the step `index` is no longer the scaler's to cure: its scale
        is 1 or below, or `max_skipped_steps` steps in a row before it were skipped."""
        before = self._in_a_row if self._last_skipped == index - 1 else 0
        capped = options.max_skipped_steps is not None and before >= options.max_skipped_steps
        if scale <= 1 or capped:  # a scale of 1 and below can no longer be what overflows
            self._refusal = self._refusal_note(type(scaler).__name__, scale, before)
            return True
        return False

    @staticmethod
    def _skipped_step(scale, options, pass_, call, bad_slots, cause) -> SkippedStep:
        frame = frames.build_frame(pass_, call, options, {id(slot) for slot in bad_slots})
        values = " and ".join(sorted({kind for slot in bad_slots
                                   for kind in detect.value_kinds(pass_, slot, options.limit_max)}))
        return SkippedStep(call.batch_number, scale, call.module_name, cause, values, frame)

    def _count_skipped(self, step: SkippedStep, batches: set, index: int) -> None:
        self.skipped_steps.append(step)
        self._skipped_batches |= batches
        self._in_a_row = self._in_a_row + 1 if self._last_skipped == index - 1 else 1
        self._last_skipped = index

    # ---- overflows read after their step's update() (a sentinel on a GPU) ---------------------
    def expect_late(self, options) -> None:
        """Overflows of this step may be read after its `update()`: watch the scaler from now
        on, keeping each step's verdict on the device (no host read) to look up then."""
        scaler = self.scaler_of(options)
        if scaler is not None and scaler.is_enabled():
            self._watch(scaler)
            self._read_late = True

    def _ended_step_of(self, batch: int, scaler) -> Optional[_EndedStep]:
        """The step holding `batch` whose update() already ran, or None (not yet: on time)."""
        if not self._ended or self._update_watch is None or self._update_watch.scaler is not scaler:
            return None
        return next((ended for ended in self._ended if ended.batch >= batch), None)

    def _excuses_ended(self, ended: _EndedStep, scaler, options, pass_, call, bad_slots,
                       cause) -> bool:
        if ended.skipped is not None:  # that step's overflow was recorded already
            if ended.skipped:
                self._skipped_batches.add(call.batch_number)
            return True
        scale = float(ended.scale) if ended.scale is not None else float(scaler.get_scale())
        if self._refused(options, scaler, scale, ended.index):
            return False
        skipped = _found_inf(ended.flags)
        ended.skipped = skipped = True if skipped is None else skipped  # (no flags: as on time)
        if skipped:
            step = self._skipped_step(scale, options, pass_, call, bad_slots, cause)
            self._count_skipped(step, {call.batch_number}, ended.index)
        return True

    def _refusal_note(self, name: str, scale: float, in_a_row: int) -> str:
        if in_a_row:
            steps = self.skipped_steps[-in_a_row:]
            return (f"; {name} skipped the {len(steps)} step{'s' if len(steps) > 1 else ''} "
                    f"before ({_batch_ranges([s.batch for s in steps])}, scale "
                    f"{steps[0].scale:g} down to {scale:g}) and the gradients are still not "
                    "finite: lowering the loss scale does not cure this")
        if scale <= 1:
            return f"; {name}'s scale is {scale:g}, so loss scaling did not make this overflow"
        return ""

    def refusal(self) -> str:
        """'; GradScaler skipped the 16 steps before ...': why the overflow being raised was not
        let through ('' when no loss scaler was asked); said once."""
        note, self._refusal = self._refusal, ""
        return note

    # ---- was the step skipped? --------------------------------------------------------------
    def _watch(self, scaler) -> None:
        """Wrap `scaler.update` on the instance (once; another scaler's wrap is removed)."""
        if self._update_watch is not None and self._update_watch.scaler is scaler:
            return
        self._unwrap()
        self._update_watch = _UpdateWatch(self, scaler)
        scaler.update = self._update_watch
        self.scaler_name = type(scaler).__name__

    def updating(self, update_watch: _UpdateWatch, args, kwargs):
        """`scaler.update(...)`: the end of a step. A step that overflowed where the guard
        watches is recorded when the scaler skipped it; any other step ends a run of skips."""
        scaler, original = update_watch.scaler, update_watch.original
        if update_watch is not self._update_watch:  # removed meanwhile, kept by another wrapper
            return original(*args, **kwargs)
        pending, self._pending = self._pending, None
        index, self._updates = self._updates, self._updates + 1
        flags = _found_inf_flags(scaler)
        if self._read_late:  # kept on the device, for an overflow of this step read later
            scale = getattr(scaler, "_scale", None)
            self._ended.append(_EndedStep(index, self._current_batch(), flags, (
                scale.detach().clone() if isinstance(scale, torch.Tensor) else None),
                True if pending is not None else None))
        if pending is None:
            return original(*args, **kwargs)
        skipped = _found_inf(flags)
        scale_before = scaler.get_scale() if skipped is None else math.nan
        result = original(*args, **kwargs)
        if skipped is None:
            skipped = scaler.get_scale() < scale_before
        if skipped:
            self._count_skipped(pending, self._pending_batches, index)
        elif self._read_late:
            self._ended[-1].skipped = False
        # (not skipped: the non-finite gradient reached no parameter the scaler's optimizers update)
        return result

    def forget_step(self) -> None:
        """Forget the overflow of the step in progress (interrupted: its update() never came)."""
        self._pending = None
        self._pending_batches = set()

    def detach(self) -> None:
        """Give the scaler its own `update` back; forget the step in progress and the scaler
        found."""
        self._found = None
        self._unwrap()

    def _unwrap(self) -> None:
        update_watch, self._update_watch = self._update_watch, None
        self.forget_step()
        self._read_late = False
        self._ended.clear()
        if update_watch is None or vars(update_watch.scaler).get("update") is not update_watch:
            return  # none, or wrapped again since: that wrapper's call passes through to update
        if update_watch.replaced is not None:
            update_watch.scaler.update = update_watch.replaced
        else:
            del update_watch.scaler.update

    # ---- what a report says -----------------------------------------------------------------
    def summary(self) -> str:
        """One clause on the skipped steps ('' when none)."""
        return skipped_summary(self.skipped_steps, self.scaler_name)

    def noted(self, report: Report) -> Report:
        """A report of the last frames seen, without the backward frames of skipped steps (their
        overflow is in `skipped_steps`), saying how many steps the scaler skipped."""
        if not self.skipped_steps:
            return report
        report.frames = [frame for frame in report.frames if not (
            frame.phase == BACKWARD and frame.batch_number in self._skipped_batches)]
        report.reason = "; ".join(note for note in (report.reason, self.summary()) if note)
        return report
