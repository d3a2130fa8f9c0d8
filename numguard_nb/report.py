"""The report: one representation of what the guard saw, feeding every view.

A `Report` holds `Frame`s (one module call, forward or backward) made of `TensorRow`s (one
tensor's summary). The views (Hugging Face's text format, a pandas DataFrame, static HTML, the
widget tree) only read these objects; statistics are computed by the engine, never here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

from ._schema import (  # noqa: F401  (re-exported: the report's vocabulary)
    BACKWARD, BUFFER, DETECTION, FORWARD, GRAD_INPUT, GRAD_OUTPUT, GRAD_PARAM, INPUT, LATEST,
    OUTPUT, PARAM, TRACE,
)

# Largest finite value of the floating dtypes people train in, by dtype name.
_FLOAT_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
}


# Smallest positive normal value: below it a value is subnormal (losing precision on its way to 0).
_FLOAT_SMALLEST_NORMAL = {
    "float16": 6.103515625e-05,
    "bfloat16": 1.1754943508222875e-38,
    "float32": 1.1754943508222875e-38,
    "float64": 2.2250738585072014e-308,
}


def _finfo_value(dtype_name: Optional[str], known: dict, attribute: str) -> Optional[float]:
    if dtype_name is None:
        return None
    if dtype_name in known:
        return known[dtype_name]
    import torch

    dtype = getattr(torch, dtype_name, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return float(getattr(torch.finfo(dtype), attribute))
    return None


def dtype_smallest_normal(dtype_name: Optional[str]) -> Optional[float]:
    """Smallest positive normal value of a floating dtype given by name, or None."""
    return _finfo_value(dtype_name, _FLOAT_SMALLEST_NORMAL, "smallest_normal")


def dtype_max(dtype_name: Optional[str]) -> Optional[float]:
    """Largest finite value of a floating dtype given by name, or None for other dtypes."""
    return _finfo_value(dtype_name, _FLOAT_MAX, "max")


@dataclass
class TensorRow:
    """One value seen by a module call: a parameter, an input, an output or a gradient."""

    role: str  # "weight", "input[0]", "input[attention_mask]", "output[0]", "grad_output", "weight.grad"
    category: str  # PARAM, BUFFER, INPUT, OUTPUT, GRAD_OUTPUT, GRAD_INPUT or GRAD_PARAM
    kind: str = "tensor"  # "tensor", "none", "not a tensor", "empty", "unsupported"
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
    def problems(self) -> str:
        """What is wrong with this value, in words ('' when nothing is)."""
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
        if self.predicted_overflow:
            words.append("overflow predicted")
        if self.predicted_underflow:
            words.append("underflow predicted")
        return ", ".join(words)

    def hf_line(self) -> str:
        """This row in Hugging Face's DebugUnderflowOverflow format."""
        if self.kind == "tensor":
            return f"{self.abs_min:8.2e} {self.abs_max:8.2e} {self.role}"
        if self.kind == "none":
            return f"{'None':>17} {self.role}"
        if self.kind == "empty":
            return f"{'empty tensor':>17} {self.role}"
        if self.kind == "unsupported":
            return f"{'no statistics':>17} {self.role}"
        return f"{'not a tensor':>17} {self.role}"


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

    @property
    def label(self) -> str:
        return self.module_name or self.module_class

    @property
    def flagged_rows(self) -> list:
        return [row for row in self.rows if row.flagged]

    @property
    def nonfinite(self) -> bool:
        return any(row.nonfinite for row in self.rows)

    def hf_lines(self) -> list:
        suffix = "" if self.phase == FORWARD else " (backward)"
        head = f"{' ' * 17} {self.module_name} {self.module_class}{suffix}"
        return [head] + [row.hf_line() for row in self.rows]

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
    kind: str = LATEST
    reason: str = ""  # one sentence naming the culprit, empty when nothing is wrong
    # "forward", "backward", "backward-inline" (a module's own code between its submodules),
    # "weights", "data", "loss-gradient", "unattributed" or ""
    cause: str = ""
    rank: Optional[int] = None
    world_size: Optional[int] = None
    limit_dtype: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.first_nonfinite is None

    @property
    def phase(self) -> Optional[str]:
        return self.first_nonfinite.phase if self.first_nonfinite is not None else None

    def summary(self) -> str:
        """One line: the culprit and the batch, or that all was finite."""
        where = f" [rank {self.rank}/{self.world_size}]" if self.rank is not None else ""
        if self.first_nonfinite is not None:
            return f"{self.reason}{where}"
        if self.kind == TRACE:
            return f"trace of batch {self.batch_number}: {len(self.frames)} frames, all finite{where}"
        if any(frame.nonfinite for frame in self.frames):
            return (f"no inf/nan produced in the last {len(self.frames)} frames (batch "
                    f"{self.batch_number}); some carry +-inf that only passed through (masks){where}")
        return f"no inf/nan in the last {len(self.frames)} frames (batch {self.batch_number}){where}"

    def compare(self, other: "Report", factor: float = 10.0):
        """The first module whose abs max differs by more than `factor` between two reports
        (e.g. the traces of a batch that worked and one that did not)."""
        from .compare import compare_reports

        return compare_reports(self, other, factor=factor)

    # ---- views -------------------------------------------------------------------------
    def to_text(self) -> str:
        """Hugging Face's DebugUnderflowOverflow text format (plus backward frames, if any)."""
        rank = f" (rank {self.rank}/{self.world_size})" if self.rank is not None else ""
        phases = {frame.phase for frame in self.frames}
        which = "forward" if phases <= {FORWARD} else "forward and backward"
        if self.kind == TRACE:
            lines = [
                f"{' ' * 17} *** Starting batch number={self.batch_number} ***{rank}",
                f"{'abs min':8} {'abs max':8} metadata",
            ]
            for frame in self.frames:
                lines.extend(frame.hf_lines())
            lines.append(f"{' ' * 17} *** Finished batch number={self.batch_number} ***")
        else:
            if self.first_nonfinite is not None:
                lines = [f"Detected inf/nan during batch_number={self.batch_number}{rank}"]
            else:
                lines = [f"No inf/nan detected up to batch_number={self.batch_number}{rank}"]
            lines.append(f"Last {len(self.frames)} {which} frames:")
            lines.append(f"{'abs min':8} {'abs max':8} metadata")
            for frame in self.frames:
                lines.extend(frame.hf_lines())
        if self.first_nonfinite is not None:
            lines.append("")
            lines.append(self.reason)
            frame = self.first_nonfinite
            if frame.op:
                lines.append(f"first non-finite op: {frame.op}")
            if frame.source:
                lines.append(f"called from: {frame.source}")
            if frame.op_note and not frame.op:
                lines.append(f"op localisation: {frame.op_note}")
        return "\n".join(lines)

    def to_frame(self):
        """A pandas DataFrame with one row per tensor of every frame."""
        import pandas as pd

        columns = [
            "frame", "batch_number", "phase", "call_index", "module_name", "module_class",
            "role", "category", "kind", "dtype", "shape", "abs_min", "abs_max", "nan",
            "posinf", "neginf", "range_share", "nonzero_abs_min", "predicted_overflow",
            "predicted_underflow", "flagged",
        ]
        records = []
        for index, frame in enumerate(self.frames):
            for row in frame.rows:
                records.append((
                    index, frame.batch_number, frame.phase, frame.call_index, frame.module_name,
                    frame.module_class, row.role, row.category, row.kind, row.dtype, row.shape,
                    row.abs_min, row.abs_max, row.nan, row.posinf, row.neginf, row.range_share,
                    row.nonzero_abs_min, row.predicted_overflow, row.predicted_underflow,
                    row.flagged,
                ))
        return pd.DataFrame.from_records(records, columns=columns)

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
