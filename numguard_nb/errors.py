"""Every exception numguard_nb raises, in one place (re-exported where users meet them).

No imports from the rest of the package: the engine, the replay and the notebook layer all
raise these, and a leaf module keeps them free of cycles.
"""

from __future__ import annotations

import sys

__all__ = ["NonFiniteError", "BatchLimitReached", "ReplayError", "CaptureTooLarge", "StepFailed",
           "red_name"]


def red_name(name: str) -> str:
    """An exception's name as IPython shows its own: red, unless its colours are off
    (`%colors nocolor`)."""
    ipython = sys.modules.get("IPython")  # (never imported here: the engine runs without it)
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and str(getattr(shell, "colors", "")).lower() == "nocolor":
        return name
    return f"\x1b[0;31m{name}\x1b[0m"


class NonFiniteError(FloatingPointError):
    """A non-finite value was produced; `.report` says where, and what led to it.

    Its message is the verdict: the culprit, the first non-finite op and its line, and the hint,
    so that a script, a terminal IPython and a notebook all show them where the error lands,
    caught or not."""

    def __init__(self, report):
        self.report = report
        super().__init__("\n".join(_verdict(report) + [_WHERE_THE_REPORT_IS]))

    def __reduce__(self):  # keeps .report across pickling (multiprocessing, torch.distributed)
        return type(self), (self.report,)

    def _render_traceback_(self):
        # IPython shows these lines instead of a traceback through the hooks (no IPython import).
        # With the extension loaded, the report is displayed first and kept as `_numguard`.
        shown = _show_uncaught(self)
        lines = _verdict(self.report)
        return [f"{red_name(type(self).__name__)}: {lines[0]}"] + lines[1:] + [shown or _WHERE_THE_REPORT_IS]


_WHERE_THE_REPORT_IS = ("the whole report (its frames, .to_text(), .to_frame()): err.report after "
                        "`except numguard_nb.NonFiniteError as err`, or guard.report")

# Set by the notebook layer while the extension is loaded: shows an uncaught error's report as
# the magics show theirs, and returns the line that says where it is kept ('' if not shown).
_show_uncaught = lambda error: ""  # noqa: E731


def set_uncaught_display(show) -> None:
    """`show(error) -> str` displays the report of a NonFiniteError nobody caught (None: stop)."""
    global _show_uncaught
    _show_uncaught = show if show is not None else (lambda error: "")


def _verdict(report) -> list:
    """The summary (with the rank), then the hint, the op and the line that made the value."""
    try:
        return [report.summary()] + report.verdict_lines()[1:]
    except Exception:  # a report from another version, or of another kind: its summary alone
        return [str(getattr(report, "reason", "") or report)]


class BatchLimitReached(RuntimeError):
    """Raised when the model is called for a batch past `abort_after_batch`."""

    def _render_traceback_(self):
        return [f"{red_name(type(self).__name__)}: {self}"]


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
