"""Every exception numguard_nb raises, in one place (re-exported where users meet them).

No imports from the rest of the package: the engine, the replay and the notebook layer all
raise these, and a leaf module keeps them free of cycles.
"""

from __future__ import annotations

__all__ = ["NonFiniteError", "BatchLimitReached", "ReplayError", "CaptureTooLarge", "StepFailed"]


def _red(name: str) -> str:
    return f"\x1b[0;31m{name}\x1b[0m"


class NonFiniteError(FloatingPointError):
    """A non-finite value was produced; `.report` says where, and what led to it."""

    def __init__(self, report):
        self.report = report
        super().__init__(f"{report.summary()} (see .report for the frames leading to it)")

    def __reduce__(self):  # keeps .report across pickling (multiprocessing, torch.distributed)
        return type(self), (self.report,)

    def _render_traceback_(self):
        # IPython prints this instead of a traceback through the hooks (no IPython import).
        return [f"{_red(type(self).__name__)}: {self.report.summary()}",
                "the frames that led to it: err.report (or guard.report)"]


class BatchLimitReached(RuntimeError):
    """Raised when the model is called for a batch past `abort_after_batch`."""

    def _render_traceback_(self):
        return [f"{_red(type(self).__name__)}: {self}"]


class ReplayError(ValueError):
    """A replay cannot be made from what it was given; the message says what to do."""


class CaptureTooLarge(MemoryError):
    """The weight snapshot that capture needs does not fit in host memory."""


class StepFailed(Exception):
    """A step of the pipeline doctor failed with a diagnosis (it never leaves `check_pipeline`,
    which turns it into the step's result); `cause` is the exception behind it, if any."""

    def __init__(self, message: str, hint: str = "", cause: BaseException | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.cause = cause
