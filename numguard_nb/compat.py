"""Drop-ins for `transformers.debug_utils`: same signatures, printed format and exceptions.

Replacing `from transformers.debug_utils import DebugUnderflowOverflow, detect_overflow` with
`from numguard_nb import ...` is enough. Underneath is a `Guard` in HF's mode (forward only,
checked in every hook), so the detector also sees keyword inputs and nested outputs, and names
the module that *produces* inf/nan instead of the first one that carries it (an attention mask's
-inf no longer stops the run).
"""

from __future__ import annotations

import torch

from . import stats as _stats
from .guard import Guard
from .report import Report

_PREFIX = " " * 17
_HEADER = f"{'abs min':8} {'abs max':8} metadata"


class DebugUnderflowOverflow:
    """Hugging Face's underflow/overflow detector, on numguard's engine.

    Prints the last `max_frames_to_save` frames and raises ValueError at the first inf/nan;
    prints every frame of the batches in `trace_batch_nums`; raises ValueError at the end of
    the forward of batch `abort_after_batch_num + 1`... exactly as transformers does.
    """

    def __init__(self, model, max_frames_to_save=21, trace_batch_nums=None, abort_after_batch_num=None):
        self.model = model
        self.trace_batch_nums = list(trace_batch_nums or [])
        self.abort_after_batch_num = abort_after_batch_num
        self.batch_number = 0
        self._printed = {}  # traced batch -> frames printed so far
        self.guard = Guard(
            model, max_frames=max_frames_to_save, trace_batches=self.trace_batch_nums,
            backward=False, sync=True, on_trace=self._print_trace, on_detect=self._dump,
        )
        self.guard.attach()
        # transformers aborts at the end of batch N's forward (the guard waits for batch N+1).
        self._abort_handle = model.register_forward_hook(self._count_batch)

    @property
    def report(self) -> Report:
        return self.guard.report

    def remove(self) -> None:
        """Detach every hook (transformers' detector has no such method; it never detaches)."""
        self.guard.detach()
        self._abort_handle.remove()

    def _count_batch(self, module, args, output):
        self.batch_number += 1
        if self.abort_after_batch_num is not None and self.batch_number > self.abort_after_batch_num:
            raise ValueError(
                f"DebugUnderflowOverflow: aborting after {self.batch_number} batches due to"
                f" `abort_after_batch_num={self.abort_after_batch_num}` arg"
            )

    def _print_trace(self, report: Report) -> None:
        done = self._printed.get(report.batch_number, 0)
        if done == 0:
            print(f"\n\n{_PREFIX} *** Starting batch number={report.batch_number} ***")
            print(_HEADER)
        for frame in report.frames[done:]:
            print("\n".join(frame.hf_lines()))
        self._printed[report.batch_number] = len(report.frames)

    def _dump(self, report: Report) -> ValueError:
        for row in report.first_nonfinite.rows:
            if row.nan:
                print(f"{row.role} has nans")
            if row.inf:
                print(f"{row.role} has infs")
        print(f"\nDetected inf/nan during batch_number={report.batch_number}")
        print(f"Last {len(report.frames)} forward frames:")
        print(_HEADER)
        print("\n".join("\n".join(frame.hf_lines()) for frame in report.frames))
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
        posinf = bool(torch.isinf(var).any())
    detected = False
    if nan:
        detected = True
        print(f"{ctx} has nans")
    if posinf or neginf:
        detected = True
        print(f"{ctx} has infs")
    return detected
