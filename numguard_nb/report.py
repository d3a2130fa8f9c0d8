"""The report: one representation of what the guard saw, feeding every view.

A `Report` holds `Frame`s (one module call, forward or backward) made of `TensorRow`s (one
tensor's summary); `Report.compare` (`compare_reports`) matches two reports and returns a
`Comparison`. This module holds the data and what is derived from it; statistics are computed
by the engine, never here, and the views live in `render/`.

The views of these objects (`to_text`, `to_frame`, `_repr_html_`, `_repr_mimebundle_`,
`hf_line`, `hf_lines`) delegate to `render`, which never imports this module: it reads the
objects through their fields and methods, and the helpers both sides use (dtype limits, number
and module wording) live in `_util`. The imports stay inside the methods so that loading a
report loads no view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

from ._schema import (  # re-exported: the report's vocabulary
    BACKWARD, BUFFER, DETECTION, FORWARD, GRAD_INPUT, GRAD_OUTPUT, GRAD_PARAM, INPUT, LATEST,
    OUTPUT, PARAM, TRACE, VALUE_TENSOR,
)
from ._util import (  # re-exported: their home is a leaf, so the views need not import this module
    dtype_max, dtype_smallest_normal, format_abs_max, format_ratio, module_words,
)

__all__ = [
    "TensorRow", "MAX_SAMPLES_NAMED", "OptimizerStep", "Frame", "Report", "Comparison",
    "compare_reports", "dtype_max", "dtype_smallest_normal", "format_abs_max", "format_ratio",
    "module_words", "BACKWARD", "BUFFER", "DETECTION", "FORWARD", "GRAD_INPUT", "GRAD_OUTPUT",
    "GRAD_PARAM", "INPUT", "LATEST", "OUTPUT", "PARAM", "TRACE", "VALUE_TENSOR",
]


@dataclass
class TensorRow:
    """One value seen by a module call: a parameter, an input, an output or a gradient."""

    role: str  # "weight", "input[0]", "input[attention_mask]", "output[0]", "grad_output", "weight.grad"
    category: str  # PARAM, BUFFER, INPUT, OUTPUT, GRAD_OUTPUT, GRAD_INPUT or GRAD_PARAM
    kind: str = VALUE_TENSOR  # one of _schema's VALUE_* kinds
    dtype: Optional[str] = None
    shape: Optional[Tuple[int, ...]] = None
    abs_min: Optional[float] = None
    abs_max: Optional[float] = None
    nan: bool = False
    posinf: Optional[bool] = False  # None: unknown (hidden by a nan in the same tensor)
    neginf: Optional[bool] = False
    nonzero_abs_min: Optional[float] = None  # only measured with limit_dtype
    predicted_overflow: bool = False  # finite here, but beyond limit_dtype's largest value
    predicted_underflow: bool = False  # non-zero values that would flush to zero in limit_dtype
    limit_share: Optional[float] = None  # abs max as a share of limit_dtype's largest value
    flagged: bool = False  # this row is where the first non-finite value was produced
    # Data that holds inf/nan (cause "data"): the indices along dim 0 of the samples holding
    # them, the first MAX_SAMPLES_NAMED only, and how many samples hold them; None when unknown.
    nonfinite_samples: Optional[Tuple[int, ...]] = None
    nonfinite_sample_count: Optional[int] = None
    # The same along dim 1 (a table's columns, an image's channels): None when unknown.
    nonfinite_features: Optional[Tuple[int, ...]] = None
    nonfinite_feature_count: Optional[int] = None
    # The samples of a batch whose dim 0 is not them (a PackedSequence's data: its rows are time
    # steps); None: dim 0.
    batch_size: Optional[int] = None

    @property
    def inf(self) -> bool:
        return bool(self.posinf or self.neginf) or (
            self.abs_max is not None and self.abs_max == math.inf
        )

    @property
    def nonfinite(self) -> bool:
        return self.nan or self.inf

    @property
    def range_share(self) -> Optional[float]:
        """abs max as a share of the largest finite value of the tensor's dtype."""
        limit = dtype_max(self.dtype)
        if limit is None or self.abs_max is None or math.isnan(self.abs_max):
            return None
        return self.abs_max / limit

    @property
    def nonfinite_words(self) -> str:
        """The non-finite values it holds, in words: 'nan', '+inf and -inf', 'nan, -inf', ''."""
        words = []
        if self.nan:
            words.append("nan")
        if self.posinf and self.neginf:
            words.append("+inf and -inf")
        elif self.posinf:
            words.append("+inf")
        elif self.neginf:
            words.append("-inf")
        elif self.inf:
            words.append("inf")
        return ", ".join(words)

    @property
    def problems(self) -> str:
        """What is wrong with this value, in words ('' when nothing is)."""
        words = [self.nonfinite_words] if self.nonfinite_words else []
        if self.predicted_overflow:
            words.append("overflow predicted")
        if self.predicted_underflow:
            words.append("underflow predicted")
        return ", ".join(words)

    @property
    def sample_list(self) -> str:
        """'1, 3 (2 of 32)': the samples holding inf/nan, as a view lists them ('' unknown)."""
        if not self.nonfinite_samples:
            return ""
        more = ", \u2026" if self.nonfinite_sample_count > len(self.nonfinite_samples) else ""
        return (f"{', '.join(map(str, self.nonfinite_samples))}{more} "
                f"({self.nonfinite_sample_count}{self._of_batch})")

    @property
    def samples_words(self) -> str:
        """'samples 1 and 3 of 32', 'sample 0 of 1', '20 of 32 samples, starting with 0, 1, ...
        and 7': the samples holding inf/nan, in a sentence ('' unknown)."""
        shown, count = self.nonfinite_samples, self.nonfinite_sample_count
        if not shown:
            return ""
        names = [str(index) for index in shown]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        if count > len(shown):
            return f"{count}{self._of_batch} samples, starting with {listed}"
        return f"sample{'s' if count != 1 else ''} {listed}{self._of_batch}"

    @property
    def samples_in_batch(self) -> Optional[int]:
        if self.batch_size is not None:
            return self.batch_size
        return self.shape[0] if self.shape else None

    @property
    def _of_batch(self) -> str:
        total = self.samples_in_batch
        return f" of {total}" if total is not None else ""

    def hf_line(self) -> str:
        """This row in Hugging Face's DebugUnderflowOverflow format (`render.text`)."""
        from .render.text import row_line

        return row_line(self)


# Data rows name at most this many of the samples that hold inf/nan (TensorRow.nonfinite_samples).
MAX_SAMPLES_NAMED = 8


@dataclass
class OptimizerStep:
    """An optimizer step the guard saw (`Report.optimizer_step`): the one that wrote weights a
    detection found non-finite, or that ran before the guard's first forward of the model."""

    optimizer: str  # its class name: "Adam"
    number: int  # its step number: the optimizer's own count where it keeps one (Adam's "step")
    counted: bool = False  # `number` counts only the steps the guard saw since it attached
    after_batch: Optional[int] = None  # the batch whose forward ran last before it (None: none)
    position: int = 1  # among the optimizers the guard saw step, by their first step (from 1)
    optimizers: int = 1  # how many optimizers the guard saw step
    param_group: Optional[int] = None  # the index of the group holding the weights, if known
    lr: Optional[float] = None  # that group's learning rate at the step
    eps: Optional[float] = None  # that group's eps (Adam's and others'), where it has one
    # Its gradients were already non-finite when the guard attached (a .grad never zeroed)
    stale_gradients: bool = False
    # the guard checked the backward's gradients finite (watching it, no inf allowed)
    gradients_watched: bool = True

    def cannot_have_made(self, dtypes) -> bool:
        """Whether this step cannot have made weights of `dtypes` (names) non-finite from finite
        gradients and state: an Adam or AdamW step moves a weight by about its learning rate at
        most (|m| / (sqrt(v) + eps), with eps above 0 and not rounded to 0 in float16)."""
        return (self.optimizer in ("Adam", "AdamW") and self.eps is not None and self.eps > 0
                and self.lr is not None and abs(self.lr) < 1e30 and "float16" not in dtypes
                and self.gradients_watched and not self.stale_gradients)

    @property
    def words(self) -> str:
        """'Adam step 41, after batch 40 (param group 0, lr 0.001)'."""
        if self.counted:
            name = f"the {_ordinal(self.number)} {self.optimizer} step since the guard attached"
        else:
            name = f"{self.optimizer} step {self.number}"
        when = (f"after batch {self.after_batch}" if self.after_batch is not None
                else "before the first batch the guard saw")
        details = []
        if self.optimizers > 1:
            details.append(f"optimizer {self.position} of {self.optimizers}")
        if self.param_group is not None:
            details.append(f"param group {self.param_group}")
        if self.lr is not None:
            details.append(f"lr {self.lr:g}")
        return f"{name}, {when}" + (f" ({', '.join(details)})" if details else "")


def _ordinal(number: int) -> str:
    """'1st', '2nd', '3rd', '11th', '42nd'."""
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


@dataclass
class Frame:
    """One module call: its weights, inputs and outputs (forward) or its gradients (backward)."""

    module_name: str  # qualified, as in named_modules() ("" for the model itself)
    module_class: str
    phase: str  # FORWARD or BACKWARD
    batch_number: int
    call_index: int  # how many times this module had already been called in this batch
    rows: list = field(default_factory=list)
    raised: bool = False  # the call ended with an exception
    op: Optional[str] = None  # the first ATen op that turned non-finite (op localisation)
    source: Optional[str] = None  # "file:line: code" of the Python line that called it
    op_note: Optional[str] = None  # what op localisation found, or why it could not
    op_made: tuple = ()  # what that op made: "nan", "inf" (its module's output may differ)

    @property
    def label(self) -> str:
        return self.module_name or self.module_class

    @property
    def words(self) -> str:
        """Its module in a sentence (`module_words`)."""
        return module_words(self.module_name, self.module_class)

    @property
    def flagged_rows(self) -> list:
        return [row for row in self.rows if row.flagged]

    @property
    def predicted(self) -> bool:
        """Its flagged values only went beyond limit_dtype's range (stop_at_limit), finite."""
        rows = self.flagged_rows
        return any(r.predicted_overflow for r in rows) and not any(r.nonfinite for r in rows)

    @property
    def op_words(self) -> str:
        """How the views name `op`: the first op that made a non-finite value, or (a predicted
        overflow) one beyond limit_dtype's range."""
        return "first op past limit_dtype's range" if self.predicted else "first non-finite op"

    @property
    def nonfinite(self) -> bool:
        return any(row.nonfinite for row in self.rows)

    def hf_lines(self) -> list:
        """This frame in Hugging Face's DebugUnderflowOverflow format (`render.text`)."""
        from .render.text import frame_lines

        return frame_lines(self)

    def __repr__(self) -> str:
        return (
            f"<Frame {self.phase} {self.label} ({self.module_class}) batch={self.batch_number}"
            f" call={self.call_index} rows={len(self.rows)}>"
        )


@dataclass
class Report:
    """What the guard saw: the frames leading up to the first non-finite value, or a trace."""

    frames: list
    first_nonfinite: Optional[Frame] = None
    batch_number: int = 0
    kind: str = LATEST  # DETECTION, TRACE or LATEST
    reason: str = ""  # one sentence naming the culprit, empty when nothing is wrong
    cause: str = ""  # one of _schema.CAUSES ("" when nothing is wrong)
    rank: Optional[int] = None
    world_size: Optional[int] = None
    # Under DDP: the rank whose own values went non-finite first (this one, or the one whose value
    # reached this rank through the gradient all-reduce); None where the ranks could not tell.
    source_rank: Optional[int] = None
    limit_dtype: Optional[str] = None
    # The device type autocast ran on where it was found ("" where it was off): what a hint that
    # turns autocast off for a layer names.
    autocast_device: str = ""
    # Why the culprit went non-finite and what to try, with the numbers (`explain.hint_for`);
    # set by the engine on a detection, empty when nothing is wrong.
    hint: str = ""
    # Weights found non-finite (cause "weights"): how they got that way, one of _schema's
    # ORIGIN_* ("" when the guard cannot tell), and the optimizer step it names, if any.
    weights_origin: str = ""
    optimizer_step: Optional[OptimizerStep] = None
    # How the culprit's value moved over the sampled batches before (the guard's history_every).
    history_note: str = ""
    # Who found it: FOUND_BY_HOOKS ("") as the values were made, or FOUND_BY_RERUN ("re-run")
    # when a sentinel (mode="sentinel") re-ran the failing call with the full guard.
    found_by: str = ""
    # What the loop ran besides training when the values were made (`Guard.batches.stage`, said
    # by the training callbacks: "validation batch 1, after training batch 2"), or
    # STAGE_EVALUATION where the model was in eval mode; "" in training; None: not known.
    stage: Optional[str] = None
    # The guarded model's class where the guard watches one model ("" otherwise): the module
    # tree's root, whose own call may not have ended (a forward detection).
    model_class: str = ""
    # What the guarded model is called in the user's code, for the code a hint suggests
    # (`net[2].float()`): the notebook layer knows its name.
    model_variable: str = "model"

    @property
    def ok(self) -> bool:
        return self.first_nonfinite is None

    @property
    def phase(self) -> Optional[str]:
        return self.first_nonfinite.phase if self.first_nonfinite is not None else None

    def summary(self) -> str:
        """One line: the culprit and the batch, or that all was finite."""
        where = f" [rank {self.rank}/{self.world_size}]" if self.rank is not None else ""
        if self.source_rank is not None and self.rank is not None:
            where = f" [rank {self.rank}/{self.world_size}, made on rank {self.source_rank}]"
        if self.first_nonfinite is not None:
            return f"{self.reason}{where}"
        # Without a culprit, the reason says what was not watched (values whose numbers could
        # not be read): never a bare all-clear then.
        note = f"; {self.reason}" if self.reason else ""
        if self.kind == TRACE:
            return (f"trace of batch {self.batch_number}: {len(self.frames)} frames, all finite"
                    f"{note}{where}")
        carried = [frame for frame in self.frames if frame.nonfinite]
        if carried:
            what = ("nan or inf they were given" if any(row.nan for frame in carried
                                                        for row in frame.rows)
                    else "+-inf that only passed through (masks)")
            return (f"no inf/nan produced in the last {len(self.frames)} frames (batch "
                    f"{self.batch_number}); some carry {what}{note}{where}")
        if not self.frames:  # checked on a device, where no frame is kept
            return f"no inf/nan found (batch {self.batch_number}){note}{where}"
        return (f"no inf/nan in the last {len(self.frames)} frames (batch {self.batch_number})"
                f"{note}{where}")

    def compare(self, other: "Report", factor: float = 10.0) -> "Comparison":
        """The first module whose abs max differs by more than `factor` between two reports
        (e.g. the traces of a batch that worked and one that did not)."""
        return compare_reports(self, other, factor=factor)

    # ---- views (render/) ---------------------------------------------------------------
    def to_text(self) -> str:
        """Hugging Face's DebugUnderflowOverflow text format (plus backward frames, if any)."""
        from .render.text import report_text

        return report_text(self)

    def verdict_lines(self) -> list:
        """The reason, the hint, the first non-finite op and the line that made it ([] when
        nothing is wrong): what a NonFiniteError says."""
        from .render.text import verdict_lines

        return verdict_lines(self)

    def to_frame(self):
        """A pandas DataFrame with one row per tensor of every frame."""
        from .render.table import report_frame

        return report_frame(self)

    def _repr_html_(self) -> str:
        from .render.html import report_html

        return report_html(self)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """The interactive tree where a kernel has widgets, with HTML and text as fallbacks."""
        from .render.widget import report_bundle

        return report_bundle(self)

    def __repr__(self) -> str:
        return f"<numguard Report: {self.summary()}>"

    def __str__(self) -> str:
        return self.to_text()


# ---- comparing two reports -----------------------------------------------------------------
# Hugging Face's debugging guide traces the batch that worked and the one that did not ("batch
# 149 worked, batch 150 did not") and compares the numbers by eye; `compare_reports` does it.
# It lives here, with the reports it reads, so that `Report.compare` needs no upward import.


@dataclass
class Comparison:
    """Result of `compare_reports`. Falsy when no module differs by more than `factor`."""

    factor: float
    a_label: str
    b_label: str
    frames_compared: int = 0
    only_in_a: int = 0
    only_in_b: int = 0
    module_name: Optional[str] = None  # None: nothing differs by more than the factor
    module_class: Optional[str] = None
    phase: Optional[str] = None
    call_index: Optional[int] = None
    role: Optional[str] = None
    category: Optional[str] = None
    a_value: Optional[float] = None  # abs max in the first report
    b_value: Optional[float] = None  # abs max in the second report
    ratio: Optional[float] = None  # larger / smaller (inf when one side is 0 or non-finite)
    frame_position: Optional[int] = None  # index of the frame in the first report's frames
    details: list = field(default_factory=list, repr=False)  # the next differing tensors, if any

    @property
    def found(self) -> bool:
        return self.module_name is not None

    def __bool__(self) -> bool:
        return self.found

    @property
    def where(self) -> str:
        if not self.found:
            return ""
        label = self.module_name or self.module_class or "the model"
        return f"{label} ({self.module_class}) {self.phase} call {self.call_index}, {self.role}"

    @property
    def unmatched_note(self) -> str:
        """'; 2 only in batch 3, 1 only in batch 4' for frames without a match ('' if none)."""
        words = []
        if self.only_in_a:
            words.append(f"{self.only_in_a} only in {self.a_label}")
        if self.only_in_b:
            words.append(f"{self.only_in_b} only in {self.b_label}")
        return "; " + ", ".join(words) if words else ""

    def summary(self) -> str:
        if not self.found:
            return (f"no module's abs max differs by more than {self.factor:g}x between "
                    f"{self.a_label} and {self.b_label} ({self.frames_compared} matching frames"
                    f"{self.unmatched_note})")
        return (f"first difference > {self.factor:g}x: {self.where}: abs max "
                f"{format_abs_max(self.a_value)} in {self.a_label} vs "
                f"{format_abs_max(self.b_value)} in {self.b_label} ({format_ratio(self.ratio)})")

    def __repr__(self) -> str:
        return f"<numguard comparison: {self.summary()}>"

    def _repr_html_(self) -> str:
        from .render.compare import comparison_html

        return comparison_html(self)


def _abs_max_ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """How many times larger the larger abs max is; inf when exactly one is non-finite or zero."""
    if a is None or b is None:
        return None
    a_bad = not math.isfinite(a)
    b_bad = not math.isfinite(b)
    if a_bad or b_bad:
        if a_bad and b_bad:
            return 1.0  # both inf/nan: the same failure, not a difference
        return math.inf
    big, small = max(a, b), min(a, b)
    if big == 0:
        return 1.0
    if small == 0:
        return math.inf
    return big / small


def _own_batch(report: Report) -> list:
    """A report's frames of its own batch (a detection's frames go back to earlier batches)."""
    return [f for f in report.frames if f.batch_number == report.batch_number] or report.frames


def compare_reports(a: Report, b: Report, factor: float = 10.0, details: int = 5) -> Comparison:
    """The first module (frame order of `a`) whose abs max differs by more than `factor` in `b`.

    Frames are matched on (module_name, phase, call_index) and tensors on (category, role).
    The result names the module, the tensor, both values and their ratio; it is falsy (and says
    so) when nothing differs by more than `factor`. `details` more differing tensors are listed in
    `.details` (the first one included).
    """
    if not isinstance(a, Report) or not isinstance(b, Report):
        raise TypeError(
            f"compare_reports needs two numguard Reports, got {type(a).__name__} and {type(b).__name__}"
        )
    try:
        factor = float(factor)
    except (TypeError, ValueError):
        raise ValueError(f"factor must be a number > 1, got {factor!r}") from None
    if not factor > 1:
        raise ValueError(f"factor must be a number > 1 (e.g. 10), got {factor!r}")
    a_label, b_label = f"batch {a.batch_number}", f"batch {b.batch_number}"
    if a_label == b_label:
        a_label, b_label = f"A ({a_label})", f"B ({b_label})"
    result = Comparison(factor=factor, a_label=a_label, b_label=b_label)
    b_frames = {}
    for frame in _own_batch(b):
        b_frames.setdefault((frame.module_name, frame.phase, frame.call_index), frame)
    matched = set()
    own = {id(frame) for frame in _own_batch(a)}
    for position, frame in enumerate(a.frames):
        if id(frame) not in own:
            continue
        key = (frame.module_name, frame.phase, frame.call_index)
        other = b_frames.get(key)
        if other is None or key in matched:
            result.only_in_a += other is None
            continue
        matched.add(key)
        result.frames_compared += 1
        other_rows = {(row.category, row.role): row for row in other.rows if row.kind == VALUE_TENSOR}
        for row in frame.rows:
            if row.kind != VALUE_TENSOR:
                continue
            twin = other_rows.get((row.category, row.role))
            if twin is None:
                continue
            ratio = _abs_max_ratio(row.abs_max, twin.abs_max)
            if ratio is None or not ratio > factor:
                continue
            entry = {
                "module_name": frame.module_name, "module_class": frame.module_class,
                "phase": frame.phase, "call_index": frame.call_index, "role": row.role,
                "category": row.category, "a_value": row.abs_max, "b_value": twin.abs_max,
                "ratio": ratio, "frame_position": position,
            }
            if not result.found:
                for name, value in entry.items():
                    setattr(result, name, value)
            if len(result.details) < details:
                result.details.append(entry)
    result.only_in_b = sum(1 for key in b_frames if key not in matched)
    return result
