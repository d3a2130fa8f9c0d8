"""A small inline SVG chart: log10(abs max) across the frames leading to the culprit.

One point per frame (the largest abs max among what the call produced: its outputs forward,
its input and parameter gradients backward), the dtype's largest finite value drawn as a dashed
line, non-finite frames as red marks at the top. The culprit and the steepest rise (the largest
step up from one frame to the next) are labelled with their module. No plotting dependency, no
JavaScript: point tooltips are SVG <title> elements.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from .._schema import BACKWARD, GRAD_INPUT, GRAD_PARAM, OUTPUT, VALUE_TENSOR
from .._util import dtype_max
from ._format import esc

__all__ = ["chart_svg", "chart_points", "steepest_rise"]

WIDTH = 560
HEIGHT = 150
_LEFT, _RIGHT, _TOP, _BOTTOM = 44, 10, 12, 22
# Above this many frames the points are drawn as a line only (no per-point marks/tooltips).
MAX_MARKED_POINTS = 300


def _produced(frame) -> list:
    wanted = (GRAD_INPUT, GRAD_PARAM) if frame.phase == BACKWARD else (OUTPUT,)
    rows = [r for r in frame.rows if r.category in wanted and r.kind == VALUE_TENSOR]
    return rows or [r for r in frame.rows if r.kind == VALUE_TENSOR]


def chart_points(report) -> Tuple[list, Optional[int]]:
    """[(frame, abs max or None, non-finite)] for the frames up to the culprit, and its position."""
    frames = report.frames
    culprit = report.first_nonfinite
    stop = None
    if culprit is not None:
        for index, frame in enumerate(frames):
            if frame is culprit:
                stop = index
                break
        if stop is None:
            stop = len(frames) - 1 if frames else None
    if stop is not None:
        frames = frames[: stop + 1]
    points = []
    for frame in frames:
        value = None
        bad = False
        for row in _produced(frame):
            # An abs max of nan counts as non-finite here even where the row's flags missed it.
            if row.nonfinite or (row.abs_max is not None and not math.isfinite(row.abs_max)):
                bad = True
            elif row.abs_max is not None and (value is None or row.abs_max > value):
                value = row.abs_max
        points.append((frame, value, bad))
    return points, stop


def _limit(report, points) -> Tuple[Optional[str], Optional[float]]:
    """The dtype whose largest value is drawn: limit_dtype, else the culprit's, else the commonest."""
    if report.limit_dtype:
        return report.limit_dtype, dtype_max(report.limit_dtype)
    culprit = report.first_nonfinite
    if culprit is not None:
        for row in culprit.flagged_rows or culprit.rows:
            if dtype_max(row.dtype) is not None:
                return row.dtype, dtype_max(row.dtype)
    counts = {}
    for frame, _, _ in points:
        for row in _produced(frame):
            if dtype_max(row.dtype) is not None:
                counts[row.dtype] = counts.get(row.dtype, 0) + 1
    if not counts:
        return None, None
    name = max(counts, key=lambda k: counts[k])
    return name, dtype_max(name)


def _num(x: float) -> str:
    return f"{x:.1f}"


def steepest_rise(points) -> Optional[Tuple[int, float]]:
    """(position, factor) of the point with the largest rise of abs max from the point before it
    (both finite and above zero), or None where nothing rises."""
    best = None
    for i in range(1, len(points)):
        before, value = points[i - 1][1], points[i][1]
        if before and value and before > 0 and value > before and (best is None or value / before > best[1]):
            best = (i, value / before)
    return best


def _text_width(text: str) -> float:
    return 5.0 * len(text)  # about, at font-size 9


def _label(text: str, x: float, y: float, css: str, colour: str) -> str:
    """`text` ending at x (left of what it names), or starting there where it would cross the axis."""
    anchor = "end"
    if x - _text_width(text) < _LEFT:
        x, anchor = x + 12, "start"
    return (f'<text class="ng-label {css}" x="{_num(x)}" y="{_num(y)}" font-size="9" '
            f'text-anchor="{anchor}" fill="{colour}">{esc(text)}</text>')


def chart_svg(report, width: int = WIDTH, height: int = HEIGHT) -> str:
    """The chart as an <svg class="ng-chart"> element ('' when there is nothing to draw)."""
    points, culprit_at = chart_points(report)
    if not points:
        return ""
    dtype, limit = _limit(report, points)
    logs = [math.log10(v) for _, v, _ in points if v is not None and v > 0]
    limit_log = math.log10(limit) if limit else None
    if logs:
        lo = math.floor(min(logs))
        hi = math.ceil(max(logs))
    else:
        lo, hi = 0, 1
    if limit_log is not None:
        hi = max(hi, math.ceil(limit_log))
    if hi - lo < 2:
        hi = lo + 2
    plot_w = width - _LEFT - _RIGHT
    plot_h = height - _TOP - _BOTTOM
    n = len(points)

    def x_of(i: int) -> float:
        return _LEFT + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def y_of(value_log: float) -> float:
        return _TOP + plot_h * (hi - value_log) / (hi - lo)

    title = "log10(abs max) of each frame's outputs"
    if culprit_at is not None:
        title += ", up to the culprit"
    out = [
        f'<svg class="ng-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" role="img" aria-label="{esc(title)}">',
        f"<title>{esc(title)}</title>",
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ddd"/>',
    ]
    # y ticks: about five powers of ten
    step = max(1, math.ceil((hi - lo) / 5))
    tick = lo
    while tick <= hi:
        y = y_of(tick)
        out.append(
            f'<line x1="{_LEFT}" y1="{_num(y)}" x2="{_LEFT + plot_w}" y2="{_num(y)}" stroke="#eee"/>'
            f'<text x="{_LEFT - 4}" y="{_num(y + 3)}" font-size="9" text-anchor="end" fill="#666">1e{tick}</text>'
        )
        tick += step
    if limit_log is not None:
        y = y_of(limit_log)
        out.append(
            f'<line class="ng-limit" x1="{_LEFT}" y1="{_num(y)}" x2="{_LEFT + plot_w}" y2="{_num(y)}"'
            f' stroke="#c00" stroke-dasharray="4 3"/>'
            f'<text x="{_LEFT + 3}" y="{_num(y - 3)}" font-size="9" fill="#c00">'
            f"{esc(dtype)} max {limit:.5g}</text>"
        )
    # the line through the finite points
    segment: list = []
    segments = []
    for i, (_, value, _) in enumerate(points):
        if value is not None and value > 0:
            segment.append(f"{_num(x_of(i))},{_num(y_of(math.log10(value)))}")
        elif segment:
            segments.append(segment)
            segment = []
    if segment:
        segments.append(segment)
    for seg in segments:
        if len(seg) > 1:
            out.append(f'<polyline fill="none" stroke="#3a6ea5" stroke-width="1.2" points="{" ".join(seg)}"/>')
    marked = n <= MAX_MARKED_POINTS
    for i, (frame, value, bad) in enumerate(points):
        is_culprit = i == culprit_at
        if not (marked or is_culprit or bad):
            continue
        label = f"{frame.words} {frame.phase} call {frame.call_index}"
        x = _num(x_of(i))
        if bad:
            y = _TOP + 1
            text = f"{label}: inf/nan"
            out.append(
                f'<path class="ng-point ng-point-bad" d="M{x},{_num(y + 7)} l-4,-7 l8,0 z" fill="#c00">'
                f"<title>{esc(text)}</title></path>"
            )
        if value is not None and value > 0:
            y = _num(y_of(math.log10(value)))
            text = f"{label}: abs max {value:.3g}"
            colour = "#c00" if is_culprit else "#3a6ea5"
            radius = 3.5 if is_culprit else 2
            out.append(
                f'<circle class="ng-point{" ng-point-culprit" if is_culprit else ""}" cx="{x}" cy="{y}"'
                f' r="{radius}" fill="{colour}"><title>{esc(text)}</title></circle>'
            )
    out.extend(_labels(points, culprit_at, x_of, y_of, y_of(limit_log) if limit_log is not None else None))
    out.append(
        f'<text x="{_LEFT}" y="{height - 6}" font-size="9" fill="#666">frame 0</text>'
        f'<text x="{_LEFT + plot_w}" y="{height - 6}" font-size="9" text-anchor="end" fill="#666">'
        f"frame {n - 1}{' (culprit)' if culprit_at is not None else ''}</text>"
    )
    out.append("</svg>")
    return "".join(out)


def _free_y(y: float, taken: List[float], limit_y: Optional[float]) -> float:
    """A baseline at or below `y` whose text clears the limit line and the labels placed so far."""
    for _ in range(len(taken) + 2):
        if limit_y is not None and y - 8 <= limit_y <= y + 3:
            y = limit_y + 11
        elif any(abs(y - other) < 11 for other in taken):
            y = max(other for other in taken if abs(y - other) < 11) + 11
        else:
            break
    return y


def _labels(points, culprit_at: Optional[int], x_of, y_of, limit_y: Optional[float]) -> List[str]:
    """The culprit's module, left of its mark; the steepest rise's with its factor, above the
    rise's end, left of the middle of the rising segment; both clear of the limit line."""
    labels, taken = [], []
    if culprit_at is not None:
        frame, value, bad = points[culprit_at]
        y = _TOP + 10 if bad or not value or value <= 0 else y_of(math.log10(value)) + 3
        taken.append(_free_y(y, taken, limit_y))
        labels.append(_label(frame.label, x_of(culprit_at) - 8, taken[-1], "ng-label-culprit", "#c00"))
    rise = steepest_rise(points)
    if rise is not None:
        at, factor = rise
        frame, value, _ = points[at]
        taken.append(_free_y(y_of(math.log10(value)) - 4, taken, limit_y))
        name = "" if at == culprit_at else f"{frame.label} "  # named once
        labels.append(_label(f"{name}\u00d7{factor:.3g}", (x_of(at - 1) + x_of(at)) / 2 - 2, taken[-1],
                             "ng-label-rise", "#3a6ea5"))
    return labels
