"""Compare two reports: the first module whose abs max differs by more than a factor.

Hugging Face's debugging guide traces the batch that worked and the one that did not
("batch 149 worked, batch 150 did not") and compares the numbers by eye. `compare_reports`
does the comparison: frames are matched on (module, phase, call number), tensors on (category,
role), and the first tensor, in the frame order of the first report, whose abs max differs by
more than `factor` (or is finite in one report and inf/nan in the other) is named.

    >>> good.compare(bad)            # Report.compare -> compare_reports(good, bad, factor=10)
    <numguard comparison: encoder.block.1.layer.1.DenseReluDense.wo (Linear) forward call 0, output:
     abs max 1.2e+03 -> inf (inf x)>
"""

from __future__ import annotations

import html as _html
import math
from dataclasses import dataclass, field
from typing import Optional

from .report import Report

__all__ = ["Comparison", "compare_reports"]


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

    def summary(self) -> str:
        if not self.found:
            return (f"no module's abs max differs by more than {self.factor:g}x between "
                    f"{self.a_label} and {self.b_label} ({self.frames_compared} matching frames"
                    f"{self._unmatched()})")
        return (f"first difference > {self.factor:g}x: {self.where}: abs max "
                f"{_fmt(self.a_value)} in {self.a_label} vs {_fmt(self.b_value)} in {self.b_label}"
                f" ({_fmt_ratio(self.ratio)})")

    def _unmatched(self) -> str:
        words = []
        if self.only_in_a:
            words.append(f"{self.only_in_a} only in {self.a_label}")
        if self.only_in_b:
            words.append(f"{self.only_in_b} only in {self.b_label}")
        return "; " + ", ".join(words) if words else ""

    def __repr__(self) -> str:
        return f"<numguard comparison: {self.summary()}>"

    def _repr_html_(self) -> str:
        esc = lambda v: _html.escape(str(v), quote=True)  # noqa: E731
        if not self.found:
            return (f'<div class="ng-compare ng-compare-same">{esc(self.summary())}</div>')
        rows = "".join(
            f"<tr><td style=\"text-align:left\"><code>{esc(d['module_name'] or d['module_class'])}</code></td>"
            f"<td>{esc(d['phase'])}</td><td>{d['call_index']}</td><td style=\"text-align:left\">{esc(d['role'])}</td>"
            f"<td>{esc(_fmt(d['a_value']))}</td><td>{esc(_fmt(d['b_value']))}</td>"
            f"<td>{esc(_fmt_ratio(d['ratio']))}</td></tr>"
            for d in self.details
        )
        return (
            '<div class="ng-compare">'
            f'<div class="ng-summary" style="font-weight:bold">first module whose abs max differs by more than '
            f"{self.factor:g}x: <code>{esc(self.module_name or self.module_class)}</code> "
            f"({esc(self.module_class)})</div>"
            f'<div class="ng-meta">{esc(self.phase)} call {self.call_index}, {esc(self.role)}: abs max '
            f"<b>{esc(_fmt(self.a_value))}</b> in {esc(self.a_label)} vs <b>{esc(_fmt(self.b_value))}</b> in "
            f"{esc(self.b_label)} ({esc(_fmt_ratio(self.ratio))}); {self.frames_compared} matching frames"
            f"{esc(self._unmatched())}</div>"
            '<table class="ng-compare-table"><tr><th>module</th><th>phase</th><th>call</th><th>tensor</th>'
            f"<th>{esc(self.a_label)}</th><th>{esc(self.b_label)}</th><th>ratio</th></tr>{rows}</table></div>"
        )


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}"


def _fmt_ratio(ratio: Optional[float]) -> str:
    if ratio is None:
        return "-"
    if math.isinf(ratio):
        return "finite vs inf/nan or 0"
    return f"{ratio:.3g}x"


def _label(report: Report) -> str:
    return f"batch {report.batch_number}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
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
    a_label, b_label = _label(a), _label(b)
    if a_label == b_label:
        a_label, b_label = f"A ({a_label})", f"B ({b_label})"
    result = Comparison(factor=factor, a_label=a_label, b_label=b_label)
    b_frames = {}
    for frame in b.frames:
        b_frames.setdefault((frame.module_name, frame.phase, frame.call_index), frame)
    matched = set()
    for position, frame in enumerate(a.frames):
        key = (frame.module_name, frame.phase, frame.call_index)
        other = b_frames.get(key)
        if other is None or key in matched:
            result.only_in_a += other is None
            continue
        matched.add(key)
        result.frames_compared += 1
        other_rows = {(row.category, row.role): row for row in other.rows if row.kind == "tensor"}
        for row in frame.rows:
            if row.kind != "tensor":
                continue
            twin = other_rows.get((row.category, row.role))
            if twin is None:
                continue
            ratio = _ratio(row.abs_max, twin.abs_max)
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
