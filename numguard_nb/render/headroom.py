"""Views of a run's headroom (`guard.headroom`): what would not fit in `limit_dtype`.

One line of summary (`headroom_summary`, also what `%numguard status` says), the text view
(`headroom_text`: the worst entries, one line each, with their share of the limit), the HTML
view (`headroom_html`, the same as a table) and the DataFrame (`headroom_frame`, every entry).
They read the headroom's entries and its first overflow's frame; they compute nothing.
"""

from __future__ import annotations

from typing import List, Optional

from .._schema import PROBLEM_OVERFLOW
from .._util import dtype_name, module_words
from ._format import esc

__all__ = ["headroom_summary", "headroom_text", "headroom_html", "headroom_frame", "MAX_SHOWN"]

MAX_SHOWN = 20  # entries in the text and HTML views; the DataFrame has them all
COLUMNS = ["module_name", "module_class", "phase", "role", "category", "dtype", "kind", "abs_max",
           "nonzero_abs_min", "share", "limit", "limit_dtype", "count", "batch_number",
           "call_index", "worst_batch", "last_batch"]
# The report's colours for a value beyond the largest value, and for one below the smallest.
_COLOUR = {PROBLEM_OVERFLOW: "background:#f6c1c1;color:#222"}
_UNDERFLOW_COLOUR = "background:#bcd4f6;color:#222"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 'es' if word.endswith('s') else 's'}"


def _batches(headroom) -> str:
    first, last = headroom.batches
    return f"batch {first}" if first == last else f"batches {first}-{last}"


def headroom_summary(headroom) -> str:
    """'in float16, 2 values would overflow (beyond its largest value 65504) and 1 would flush
    to zero (below its smallest subnormal 5.96e-08); batches 0-9'."""
    if headroom.limit_dtype is None:
        return ("headroom: no limit_dtype set (limit_dtype=torch.float16, say, collects what "
                "would not fit in it)")
    dtype = dtype_name(headroom.limit_dtype)
    largest = f"its largest value {headroom.limit_max:.5g}"
    smallest = f"its smallest subnormal {headroom.limit_tiny:.3g}"
    if headroom.batches is None:
        return f"headroom in {dtype}: nothing has run yet"
    seen = f"{_batches(headroom)}, {_plural(headroom.passes, 'pass')}"
    overflows, underflows = headroom.overflows, headroom.underflows
    if not overflows and not underflows:
        return f"in {dtype}, every value fits (none beyond {largest}, none below {smallest}); {seen}"
    parts = []
    if overflows:
        parts.append(f"{_plural(overflows, 'value')} would overflow (beyond {largest})")
    if underflows:
        values = str(underflows) if overflows else _plural(underflows, "value")
        parts.append(f"{values} would flush to zero (below {smallest})")
    return f"in {dtype}, {' and '.join(parts)}; {seen}"


def _how_far(entry) -> str:
    """'1e+05, 1.53x the largest' or '1e-12, 1.7e-05x the smallest'."""
    if entry.kind == PROBLEM_OVERFLOW:
        return f"{entry.abs_max:.3g}, {entry.share:.3g}x the largest"
    return f"{entry.nonzero_abs_min:.3g}, {entry.share:.2g}x the smallest"


def _when(entry) -> str:
    """'3 times, first in batch 0 (call 0)', and the worst batch where it differs."""
    times = "once" if entry.count == 1 else f"{entry.count} times"
    worst = f", worst in batch {entry.worst_batch}" if entry.worst_batch != entry.batch_number else ""
    return f"{times}, first in batch {entry.batch_number} (call {entry.call_index}){worst}"


def _module(entry) -> str:
    return module_words(entry.module_name, entry.module_class)


def _first_line(headroom) -> Optional[str]:
    """Where the first predicted overflow was made: the module, and the op and line if known."""
    frame = headroom.first
    if frame is None:
        return None
    rows = frame.flagged_rows
    what = f"{rows[0].role} " if rows else ""
    where = (f"{frame.words} {frame.phase} {what}in batch "
             f"{frame.batch_number} (call {frame.call_index})")
    if frame.op:
        where += f": {frame.op}" + (f" at {frame.source}" if frame.source else "")
    return f"first overflow: {where}"


def headroom_text(headroom) -> str:
    """The summary, the first overflow, then the worst entries, one aligned line each."""
    lines = [headroom_summary(headroom)]
    first = _first_line(headroom)
    if first:
        lines.append(first)
    entries = headroom.entries()
    shown = entries[:MAX_SHOWN]
    if shown:
        columns = [[e.kind, _module(e), e.phase, e.role, _how_far(e), _when(e)] for e in shown]
        widths = [max(len(row[i]) for row in columns) for i in range(5)]
        for row in columns:
            cells = [text.ljust(width) for text, width in zip(row, widths)]
            lines.append("  " + "  ".join(cells + [row[5]]))
    if len(entries) > len(shown):
        lines.append(f"  ... and {len(entries) - len(shown)} more (.to_frame() has them all)")
    return "\n".join(lines)


def _html_row(entry) -> str:
    colour = _COLOUR.get(entry.kind, _UNDERFLOW_COLOUR)
    return (
        f'<tr class="ng-headroom-{esc(entry.kind)}"><td style="{colour}">{esc(entry.kind)}</td>'
        f'<td style="text-align:left"><code>{esc(entry.label)}</code> '
        f'<span class="ng-class" style="color:#666">{esc(entry.module_class)}</span></td>'
        f"<td>{esc(entry.phase)}</td><td style=\"text-align:left\">{esc(entry.role)}</td>"
        f"<td>{esc(entry.dtype)}</td><td>{esc(_how_far(entry))}</td><td>{esc(_when(entry))}</td></tr>"
    )


def headroom_html(headroom) -> str:
    """The summary, the first overflow, and a table of the worst entries."""
    parts = [f'<div class="ng-headroom"><div class="ng-summary" style="font-weight:bold">'
             f"{esc(headroom_summary(headroom))}</div>"]
    first = _first_line(headroom)
    if first:
        parts.append(f'<div class="ng-meta" style="color:#666">{esc(first)}</div>')
    entries = headroom.entries()
    shown = entries[:MAX_SHOWN]
    if shown:
        parts.append(
            '<table class="ng-headroom-table" style="border-collapse:collapse;font-size:12px">'
            "<tr><th>kind</th><th>module</th><th>phase</th>"
            "<th>value</th><th>dtype</th><th>at its worst</th><th>when</th></tr>"
            + "".join(_html_row(entry) for entry in shown) + "</table>")
    if len(entries) > len(shown):
        parts.append(f'<div class="ng-meta" style="color:#666">... and {len(entries) - len(shown)} '
                     "more (.to_frame() has them all)</div>")
    parts.append("</div>")
    return "".join(parts)


def headroom_frame(headroom):
    """A pandas DataFrame, one row per entry, the worst first (`COLUMNS`)."""
    import pandas as pd

    limit_dtype = dtype_name(headroom.limit_dtype) if headroom.limit_dtype is not None else None
    rows: List[dict] = []
    for entry in headroom.entries():
        limit = headroom.limit_max if entry.kind == PROBLEM_OVERFLOW else headroom.limit_tiny
        rows.append({
            "module_name": entry.module_name, "module_class": entry.module_class,
            "phase": entry.phase, "role": entry.role, "category": entry.category,
            "dtype": entry.dtype, "kind": entry.kind, "abs_max": entry.abs_max,
            "nonzero_abs_min": entry.nonzero_abs_min, "share": entry.share, "limit": limit,
            "limit_dtype": limit_dtype, "count": entry.count, "batch_number": entry.batch_number,
            "call_index": entry.call_index, "worst_batch": entry.worst_batch,
            "last_batch": entry.last_batch,
        })
    return pd.DataFrame(rows, columns=COLUMNS)
