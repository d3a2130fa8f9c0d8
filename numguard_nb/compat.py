"""Drop-ins for `transformers.debug_utils`: same signatures, printed format and exceptions.

Replacing `from transformers.debug_utils import DebugUnderflowOverflow, detect_overflow` with
`from numguard_nb import ...` is enough. Underneath is a `Guard` in HF's mode (forward only,
checked in every hook), so the detector also sees keyword inputs and nested outputs, and names
the module that *produces* inf/nan instead of the first one that carries it (an attention mask's
-inf no longer stops the run).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from . import numerics
from . import stats as _stats
from ._schema import LATEST
from .guard import Guard
from .report import Report

_PREFIX = " " * 17
_HEADER = f"{'abs min':8} {'abs max':8} metadata"


class DebugUnderflowOverflow:
    """Hugging Face's underflow/overflow detector, on numguard's engine.

    Prints the last `max_frames_to_save` frames and raises ValueError at the first inf/nan;
    prints every frame of the batches in `trace_batch_nums`; raises ValueError at the end of
    the forward of batch `abort_after_batch_num`... exactly as transformers does: its lines, its
    "*** Starting batch number=N ***" separators, its "has nans"/"has infs" lines, its messages.
    """

    def __init__(self, model, max_frames_to_save=21, trace_batch_nums=None, abort_after_batch_num=None):
        self.model = model
        self.trace_batch_nums = list(trace_batch_nums or [])
        self.abort_after_batch_num = abort_after_batch_num
        # None keeps every frame, as transformers' unbounded deque does.
        self.max_frames_to_save = sys.maxsize if max_frames_to_save is None else max_frames_to_save
        self.batch_number = 0  # batches whose forward ended, as transformers counts them
        self._printed = {}  # traced batch -> frames printed so far
        self._last_traced = None  # transformers' saved frames start after the last traced batch
        # One frame more than shown: whether the first one shown starts its batch (a separator).
        self.guard = Guard(
            model, max_frames=self.max_frames_to_save + 1, trace_batches=self.trace_batch_nums,
            backward=False, sync=True, on_trace=self._print_trace, on_detect=self._dump,
        )
        self.guard.abs_min_everywhere = True  # transformers prints abs min for every row
        self.guard.attach()
        # transformers aborts at the end of batch N's forward, then at every later call; the
        # refusal goes first, before the guard starts a batch.
        self._refuse_handle = model.register_forward_pre_hook(self._refuse_after_abort,
                                                              prepend=True)
        self._abort_handle = model.register_forward_hook(self._count_batch)

    @property
    def detected_overflow(self) -> bool:
        """Whether inf or nan was found (transformers' attribute of that name)."""
        return self.guard.detection is not None

    @property
    def report(self) -> Report:
        report = self.guard.report
        if report.kind == LATEST:  # the frames transformers would keep
            return dataclasses.replace(report, frames=self._saved(report.frames)[1])
        return report

    def remove(self) -> None:
        """Detach every hook (transformers' detector has no such method; it never detaches)."""
        self.guard.detach()
        self._refuse_handle.remove()
        self._abort_handle.remove()

    # ---- batches and aborting ------------------------------------------------------------
    def _abort_error(self) -> ValueError:
        return ValueError(
            f"DebugUnderflowOverflow: aborting after {self.batch_number} batches due to"
            f" `abort_after_batch_num={self.abort_after_batch_num}` arg"
        )

    def _aborted(self) -> bool:
        limit = self.abort_after_batch_num
        return limit is not None and self.batch_number > limit

    def _refuse_after_abort(self, module, args):
        if self._aborted():
            raise self._abort_error()
        # transformers reads trace_batch_nums at every call: a notebook may change it meanwhile
        if set(self.guard.trace_batches) != set(self.trace_batch_nums):
            self.guard.trace_batches = self.trace_batch_nums

    def _count_batch(self, module, args, output):
        self.batch_number += 1
        if self._aborted():
            raise self._abort_error()

    # ---- printing ------------------------------------------------------------------------
    def _saved(self, frames: list) -> tuple:
        """(the frame before them or None, the frames transformers has saved) of `frames`: the
        last `max_frames_to_save`, none from before the last traced batch."""
        if self._last_traced is not None:
            frames = [frame for frame in frames if frame.batch_number > self._last_traced]
        first = max(0, len(frames) - self.max_frames_to_save)
        return (frames[first - 1] if first else None), frames[first:]

    @staticmethod
    def _frame_text(frame, previous) -> str:
        """A frame as transformers prints it: the first of a batch opens with its separator."""
        lines = "\n".join(frame.hf_lines())
        if previous is None or previous.batch_number != frame.batch_number:
            separator = f"{_PREFIX} *** Starting batch number={frame.batch_number} ***"
            return f"\n\n{separator}\n{_HEADER}\n{lines}"
        return lines

    @staticmethod
    def _print_problems(frame) -> None:
        """transformers' `detect_overflow` lines for each value of a frame."""
        for row in frame.rows:
            if row.nan:
                print(f"{row.role} has nans")
            if row.inf:
                print(f"{row.role} has infs")

    def _print_trace(self, report: Report) -> None:
        done = self._printed.get(report.batch_number, 0)
        self._last_traced = report.batch_number
        for index in range(done, len(report.frames)):
            frame = report.frames[index]
            self._print_problems(frame)
            print(self._frame_text(frame, report.frames[index - 1] if index else None))
        self._printed[report.batch_number] = len(report.frames)

    def _dump(self, report: Report) -> ValueError:
        previous, frames = self._saved(report.frames)
        report.frames = frames  # the report holds what was printed (and its culprit's frame)
        # transformers stops at the first frame holding inf/nan (an input, a weight or the
        # output), and counts a batch when the model's own call ends: where that first frame is
        # the model's own, the count has gone up already
        first = next((i for i, f in enumerate(frames)
                      if f.batch_number == report.batch_number and f.nonfinite), len(frames) - 1)
        stop = frames[first] if frames else report.first_nonfinite  # (max_frames_to_save=0)
        batch = report.batch_number + (1 if stop.module_name == "" else 0)
        self._print_problems(stop)
        texts = []
        for frame in frames[:first + 1]:
            texts.append(self._frame_text(frame, previous))
            previous = frame
        frames = frames[:first + 1]
        print(f"\nDetected inf/nan during batch_number={batch}")
        print(f"Last {len(frames)} forward frames:")
        print(_HEADER)
        print("\n".join(texts))
        print("\n\n")
        return ValueError(
            "DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
            "Please scroll up above this traceback to see the activation values prior to this event."
        )


def detect_overflow(var, ctx):
    """Print whether `var` holds nan or inf (prefixed by `ctx`) and return True if it does."""
    if not isinstance(var, torch.Tensor):
        raise TypeError(f"detect_overflow needs a tensor, got {type(var).__name__}")
    with torch.no_grad():
        vec = _stats.device_stats(var)
    if vec is None:
        return False
    _, _, nan, posinf, neginf, _ = _stats.decode(_stats.to_host([vec])[0])
    if posinf is None:  # a nan hides the infinities: look for them directly
        posinf = bool(numerics.read(torch.isinf(var).any()))
    detected = False
    if nan:
        detected = True
        print(f"{ctx} has nans")
    if posinf or neginf:
        detected = True
        print(f"{ctx} has infs")
    return detected
