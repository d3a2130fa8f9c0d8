"""Hugging Face's DebugUnderflowOverflow text format of a `Report`.

The lines are the ones `transformers.debug_utils.DebugUnderflowOverflow` prints, so a report
reads like the tool people already know: per frame a head line (module name and class), then
one line per tensor (`abs min`, `abs max`, role). Backward frames, which Hugging Face's tool
does not have, say so in their head line. Then the verdict: the reason, the hint (why, and
what to try), the op and the line. `report.to_text()`, `str(report)` and the mimebundle's
text/plain use `report_text`; the demo prints the verdict first (`verdict_lines`), then the
frames (`dump_lines`).
"""

from __future__ import annotations

from .._schema import (
    FORWARD, FOUND_BY_RERUN, TRACE, VALUE_EMPTY, VALUE_NONE, VALUE_TENSOR, VALUE_UNSUPPORTED,
)

__all__ = [
    "COLUMNS_LINE", "row_line", "frame_lines", "dump_lines", "verdict_lines", "report_text",
]

_INDENT = " " * 17  # the width of the two number columns and their separator
COLUMNS_LINE = f"{'abs min':8} {'abs max':8} metadata"

# What stands in the number columns of a row that has no statistics, by row kind.
_NO_NUMBERS = {VALUE_NONE: "None", VALUE_EMPTY: "empty tensor", VALUE_UNSUPPORTED: "no statistics"}


def row_line(row) -> str:
    """One tensor: `abs min abs max role`, or what the value was instead of a tensor."""
    if row.kind == VALUE_TENSOR:
        # (abs min unmeasured: a value of both signs that a GPU's lean row summarised)
        low = f"{row.abs_min:8.2e}" if row.abs_min is not None else f"{'-':>8}"
        return f"{low} {row.abs_max:8.2e} {row.role}"
    return f"{_NO_NUMBERS.get(row.kind, 'not a tensor'):>17} {row.role}"


def frame_lines(frame) -> list:
    """One module call: its head line, then a line per tensor."""
    suffix = "" if frame.phase == FORWARD else " (backward)"
    head = f"{_INDENT} {frame.module_name} {frame.module_class}{suffix}"
    return [head] + [row_line(row) for row in frame.rows]


def dump_lines(report) -> list:
    """The frames as Hugging Face's tool dumps them: a traced batch between its start and finish lines,
    or the frames before the first inf/nan under a 'Detected inf/nan' line."""
    rank = f" (rank {report.rank}/{report.world_size})" if report.rank is not None else ""
    if rank and report.source_rank is not None:
        rank = f" (rank {report.rank}/{report.world_size}, made on rank {report.source_rank})"
    phases = {frame.phase for frame in report.frames}
    which = "forward" if phases <= {FORWARD} else "forward and backward"
    if report.kind == TRACE:
        lines = [
            f"{_INDENT} *** Starting batch number={report.batch_number} ***{rank}",
            COLUMNS_LINE,
        ]
        for frame in report.frames:
            lines.extend(frame_lines(frame))
        lines.append(f"{_INDENT} *** Finished batch number={report.batch_number} ***")
        return lines
    if report.first_nonfinite is not None and report.first_nonfinite.predicted:
        lines = [f"Detected a value beyond {report.limit_dtype}'s range during batch_number="
                 f"{report.batch_number}{rank}"]
    elif report.first_nonfinite is not None:
        lines = [f"Detected inf/nan during batch_number={report.batch_number}{rank}"]
    else:
        lines = [f"No inf/nan detected up to batch_number={report.batch_number}{rank}"]
    lines.append(f"Last {len(report.frames)} {which} frames:")
    lines.append(COLUMNS_LINE)
    previous = None
    for frame in report.frames:  # (earlier batches' frames come first, as in transformers)
        if previous is not None and frame.batch_number != previous.batch_number:
            lines.append(f"{_INDENT} *** Starting batch number={frame.batch_number} ***")
        lines.extend(frame_lines(frame))
        previous = frame
    return lines


def verdict_lines(report) -> list:
    """The verdict on the culprit: the reason, the hint (why, and what to try), the samples of
    the data that hold inf/nan, the op and the line that produced it; [] when nothing is
    wrong."""
    frame = report.first_nonfinite
    if frame is None:
        return []
    lines = [report.reason]
    if report.hint:
        lines.append(f"hint: {report.hint}")
    lines.extend(f"samples holding inf/nan in {row.role}: {row.sample_list}"
                 for row in frame.flagged_rows if row.sample_list)
    lines += note_lines(report)
    if frame.op:
        lines.append(f"{frame.op_words}: {frame.op}")
    if frame.source:
        lines.append(f"called from: {frame.source}")
    if frame.op_note and not frame.op:
        lines.append(f"op localisation: {frame.op_note}")
    return lines


# How a detection was found, where it was not by the hooks as the values were made.
_FOUND_BY = {FOUND_BY_RERUN: 're-running the failing call with the full guard (mode="sentinel")'}


def note_lines(report) -> list:
    """The culprit's recent history (history_every) and how the detection was found (a
    sentinel's re-run), where there is something to say."""
    lines = [f"history: {report.history_note}"] if report.history_note else []
    if report.found_by in _FOUND_BY:
        lines.append(f"found by: {_FOUND_BY[report.found_by]}")
    return lines


def report_text(report) -> str:
    """The whole report: the frames as Hugging Face prints them, then the verdict (the reason,
    the hint, and where the culprit was called from)."""
    lines = dump_lines(report)
    verdict = verdict_lines(report)
    if verdict:
        lines.append("")
        lines.extend(verdict)
    return "\n".join(lines)
