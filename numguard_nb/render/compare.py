"""HTML view of a `Comparison` (`Report.compare`, `compare_reports`): the first module whose abs
max differs by more than the factor, then a table of the differing tensors found."""

from __future__ import annotations

from .._util import format_abs_max, format_ratio
from ._format import esc

__all__ = ["comparison_html"]


def comparison_html(comparison) -> str:
    """A one-line verdict when nothing differs; else the first difference and the table."""
    if not comparison.found:
        return (f'<div class="ng-compare ng-compare-same">{esc(comparison.summary())}</div>')
    rows = "".join(
        f"<tr><td style=\"text-align:left\"><code>{esc(d['module_name'] or d['module_class'])}</code></td>"
        f"<td>{esc(d['phase'])}</td><td>{d['call_index']}</td><td style=\"text-align:left\">{esc(d['role'])}</td>"
        f"<td>{esc(format_abs_max(d['a_value']))}</td><td>{esc(format_abs_max(d['b_value']))}</td>"
        f"<td>{esc(format_ratio(d['ratio']))}</td></tr>"
        for d in comparison.details
    )
    return (
        '<div class="ng-compare">'
        f'<div class="ng-summary" style="font-weight:bold">first module whose abs max differs by more than '
        f"{comparison.factor:g}x: <code>{esc(comparison.module_name or comparison.module_class)}</code> "
        f"({esc(comparison.module_class)})</div>"
        f'<div class="ng-meta">{esc(comparison.phase)} call {comparison.call_index}, {esc(comparison.role)}: '
        f"abs max <b>{esc(format_abs_max(comparison.a_value))}</b> in {esc(comparison.a_label)} vs "
        f"<b>{esc(format_abs_max(comparison.b_value))}</b> in {esc(comparison.b_label)} "
        f"({esc(format_ratio(comparison.ratio))}); {comparison.frames_compared} matching frames"
        f"{esc(comparison.unmatched_note)}</div>"
        '<table class="ng-compare-table"><tr><th>module</th><th>phase</th><th>call</th><th>tensor</th>'
        f"<th>{esc(comparison.a_label)}</th><th>{esc(comparison.b_label)}</th><th>ratio</th></tr>{rows}</table></div>"
    )
