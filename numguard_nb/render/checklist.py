"""Text and HTML views of the pipeline doctor's checklist (`numguard_nb.doctor.PipelineReport`).

One line per step: a mark (passed, failed, not run), the step's name and what it found; a
failed step adds its fix and, when an exception was behind it, where to find the traceback.
The report is read through its fields (`summary()`, `steps`: name, ok, message, hint,
traceback), so this module needs nothing from the doctor.
"""

from __future__ import annotations

from ._format import esc

__all__ = ["checklist_text", "checklist_html"]

_TEXT_MARKS = {True: "✓", False: "✗", None: "·"}
_HTML_COLORS = {True: "#1a7f37", False: "#cf222e", None: "#6e7781"}


def checklist_text(report) -> str:
    """The summary line, then one aligned line per step, its fix and traceback note below it."""
    width = max((len(step.name) for step in report.steps), default=0)
    indent = " " * (width + 6)  # under the message: "  ✓ " + name column + "  "
    lines = [report.summary()]
    for step in report.steps:
        lines.append(f"  {_TEXT_MARKS[step.ok]} {step.name:<{width}}  {step.message}")
        if step.hint:
            lines.append(f"{indent}fix: {step.hint}")
        if step.traceback:
            lines.append(f"{indent}(traceback: report.step({step.name!r}).traceback)")
    return "\n".join(lines)


def checklist_html(report) -> str:
    """The summary in bold and a table of the steps, a traceback folded under its step."""
    rows = []
    for step in report.steps:
        color = _HTML_COLORS[step.ok]
        detail = esc(step.message)
        if step.hint:
            detail += f"<br><b>fix:</b> {esc(step.hint)}"
        if step.traceback:
            detail += (
                "<details><summary>traceback</summary>"
                f"<pre style='white-space:pre-wrap'>{esc(step.traceback)}</pre></details>"
            )
        rows.append(
            f"<tr><td style='color:{color};font-weight:bold'>{_TEXT_MARKS[step.ok]}</td>"
            f"<td style='text-align:left'><code>{esc(step.name)}</code></td>"
            f"<td style='text-align:left'>{detail}</td></tr>"
        )
    return (
        f"<div><p><b>{esc(report.summary())}</b></p>"
        f"<table>{''.join(rows)}</table></div>"
    )
