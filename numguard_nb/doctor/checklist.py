"""The doctor's result: a checklist of steps, each passed, failed (with the fix) or not run.

`PipelineReport` is what `check_pipeline` returns; its text and HTML come from
`numguard_nb.render.checklist`. A check signals a diagnosed failure by raising `StepFailed`,
which never leaves `check_pipeline`: the run turns it into a failed `PipelineStep`. `listed`
and `format_number` put names and numbers into the steps' messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..render.checklist import checklist_html, checklist_text
from ..errors import StepFailed

__all__ = ["STEP_NAMES", "PipelineStep", "PipelineReport", "StepFailed", "listed", "format_number"]

STEP_NAMES = ("data", "collate", "forward", "loss", "backward", "optimizer", "overfit")

# How many names a message lists before it says "and N more".
NAMES_SHOWN = 6


@dataclass
class PipelineStep:
    """One step of the check: ``ok`` is True, False, or None when it did not run."""

    name: str
    ok: bool | None
    message: str
    hint: str = ""
    exception: BaseException | None = None
    traceback: str = ""


@dataclass
class PipelineReport:
    """The checklist ``check_pipeline`` returns; renders as text and as HTML."""

    subject: str
    steps: list[PipelineStep]

    @property
    def ok(self) -> bool:
        return all(step.ok is True for step in self.steps)

    @property
    def failed_step(self) -> PipelineStep | None:
        return next((step for step in self.steps if step.ok is False), None)

    def step(self, name: str) -> PipelineStep:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(f"no step named {name!r}; the steps are {', '.join(STEP_NAMES)}")

    def summary(self) -> str:
        failed = self.failed_step
        if failed is None:
            return f"Pipeline check for {self.subject}: all {len(self.steps)} steps passed"
        return f"Pipeline check for {self.subject}: failed at '{failed.name}'"

    def to_text(self) -> str:
        return checklist_text(self)

    __str__ = to_text
    __repr__ = to_text

    def _repr_html_(self) -> str:
        return checklist_html(self)


def listed(names) -> str:
    """Names for a message: 'a, b, c', or the first NAMES_SHOWN and 'and N more'."""
    names = [str(name) for name in names]
    extra = len(names) - NAMES_SHOWN
    shown = ", ".join(names[:NAMES_SHOWN])
    return f"{shown} and {extra} more" if extra > 0 else shown


def format_number(value: Any) -> str:
    """A number for a message, 4 significant digits (a tensor by its mean)."""
    number = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
    return f"{number:.4g}"
