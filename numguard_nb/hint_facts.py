"""What the hints read from a report with a culprit (`facts_of`): the culprit frame, its flagged
rows, the dtype whose limit matters, the autograd node and ATen op op localisation named, the
source line; and how a hint prints numbers and limits. Pure: it reads a `Report`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from ._schema import (
    BUFFER, CAUSE_FORWARD_INLINE, FORWARD, GRAD_OUTPUT, INPUT, OUTSIDE_MODULE, PARAM,
    VALUE_TENSOR,
)
from .report import Frame, Report, TensorRow, dtype_max

__all__ = ["Facts", "facts_of", "format_number", "limit_text", "largest", "kinds_of", "roles_of",
           "is_operand", "MASK_FILLS", "OPS_ADVICE"]

# How to have the op and the line named, where op localisation did not run (the magics say it
# in their own words).
OPS_ADVICE = "Rerun with `Guard(model, ops=True)` to name the op and the line."


# ---- numbers -------------------------------------------------------------------------------
def format_number(value: float) -> str:
    """A number as a hint prints it: '65504', '240', '4.39e+27', '0.365', 'inf'."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"


def limit_text(dtype: Optional[str]) -> str:
    """"float16's largest value 65504", or '' for a dtype without one."""
    limit = dtype_max(dtype)
    return f"{dtype}'s largest value {format_number(limit)}" if limit is not None else ""


def largest(rows) -> Optional[TensorRow]:
    """The row with the largest finite abs max, or None."""
    best = None
    for row in rows:
        value = row.abs_max
        if row.kind == VALUE_TENSOR and value is not None and math.isfinite(value) \
                and (best is None or value > best.abs_max):
            best = row
    return best


# The largest finite values of the floating dtypes: an additive mask's fill (`finfo.min`).
MASK_FILLS = frozenset(dtype_max(name) for name in ("float16", "bfloat16", "float32", "float64"))


def is_operand(row: TensorRow) -> bool:
    """Whether a row holds values an op can overflow on: floats, not integer ids or labels, nor
    an additive mask (filled with a dtype's largest value)."""
    return dtype_max(row.dtype) is not None and row.abs_max not in MASK_FILLS


def kinds_of(rows) -> str:
    """'nan', '+inf', '+inf and -inf', 'nan and -inf': what the rows hold."""
    words = []
    if any(row.nan for row in rows):
        words.append("nan")
    pos, neg = any(row.posinf for row in rows), any(row.neginf for row in rows)
    if pos or neg:
        words.append("+inf and -inf" if pos and neg else "+inf" if pos else "-inf")
    elif any(row.inf for row in rows):
        words.append("inf")
    return " and ".join(words)


def roles_of(rows) -> str:
    """'output, output[1]', or 'values' for no rows (a report built by hand)."""
    return ", ".join(row.role for row in rows) or "values"


# ---- what the rules read -------------------------------------------------------------------
@dataclass
class Facts:
    """What the rules read from a report with a culprit, worked out once."""

    report: Report
    frame: Frame  # the culprit
    flagged: list  # its flagged rows (its non-finite ones when none is flagged)
    dtype: Optional[str]  # whose limit matters: limit_dtype for a predicted overflow
    node: str  # autograd node op localisation named, without "Backward<n>"; "" when none
    op: str  # the ATen op it named, without "aten." and the overload; "" when none
    line: str  # the code of the source line it named; "" when none

    @property
    def cause(self) -> str:
        return self.report.cause

    @property
    def forward(self) -> bool:
        return self.frame.phase == FORWARD

    @property
    def where(self) -> str:
        frame = self.frame
        if frame.module_name == OUTSIDE_MODULE:
            return "the code outside the guarded modules"
        return frame.words

    @property
    def nan(self) -> bool:
        return any(row.nan for row in self.flagged)

    @property
    def inf(self) -> bool:
        return any(row.inf for row in self.flagged)

    @property
    def predicted(self) -> bool:
        return self.frame.predicted

    @property
    def found(self) -> str:
        """What the culprit produced: 'nan', '+inf and -inf', '7.2e+04' (a predicted overflow)."""
        if self.predicted:
            top = largest(self.flagged)
            return f"{format_number(top.abs_max)}" if top is not None else "a value that large"
        return kinds_of(self.flagged) or "a non-finite value"

    @property
    def received(self) -> list:
        """The non-finite values the culprit was given (inputs, weights, incoming gradients)."""
        return [row for row in self.frame.rows
                if row.category in (INPUT, PARAM, BUFFER, GRAD_OUTPUT) and row.nonfinite]

    @property
    def op_words(self) -> str:
        """'`aten.mm.default`', '`SqrtBackward0` (`aten.div.Tensor`)', or '' without an op."""
        text = self.frame.op or ""
        if ": " in text:
            node, _, op = text.partition(": ")
            return f"`{node}` (`{op}`)"
        return f"`{text}`" if text else ""

    @property
    def in_op(self) -> str:
        """' in `aten.mm.default`', or ''."""
        return f" in {self.op_words}" if self.op_words else ""

    @property
    def named_op(self) -> str:
        """' `aten.mm.default`' (after a noun: 'the matmul `aten.mm.default`'), or ''."""
        return f" {self.op_words}" if self.op_words else ""

    @property
    def at_line(self) -> str:
        return f" at `{self.line}`" if self.line else ""

    def rows_of(self, *categories) -> list:
        return [row for row in self.frame.rows if row.category in categories]

    def reached(self) -> str:
        """'its input reached 240 and its weight 10': the largest values the culprit was given."""
        parts = []
        given = () if self.report.cause == CAUSE_FORWARD_INLINE else (  # (its op's input is none)
            ((INPUT,), "input"), ((GRAD_OUTPUT,), "incoming gradient"), ((PARAM, BUFFER), "weight"))
        for categories, noun in given:
            top = largest([row for row in self.rows_of(*categories) if is_operand(row)])
            if top is not None and top.abs_max > 0:
                verb = "reached " if not parts else ""
                parts.append(f"its {noun} {verb}{format_number(top.abs_max)}")
        return " and ".join(parts)

    def sources(self) -> str:
        """Without op localisation: how to have the op and the line named. (Where it ran and
        found no single op, its note says why, next to the hint in the views.)"""
        frame = self.frame
        if frame.op or frame.op_note:
            return ""
        return " " + OPS_ADVICE


def parse_op(op: Optional[str]):
    """(node, op) from a frame's op: 'SqrtBackward0: aten.div.Tensor' -> ('Sqrt', 'div'),
    'aten.mm.default' -> ('', 'mm'), 'aten::addmm' -> ('', 'addmm')."""
    if not op:
        return "", ""
    node, _, aten = op.rpartition(": ")
    node = re.sub(r"Backward\d*$", "", node.strip())
    aten = aten.strip()
    for prefix in ("aten::", "aten."):
        if aten.startswith(prefix):
            aten = aten[len(prefix):]
    name = aten.split(".")[0].lstrip("_")
    return node, name[:-1] if name.endswith("_") else name


def source_code(source: Optional[str]) -> str:
    """The code of 'file.py:12: h = self.wo(h)' (or of 'Cell In[5], line 3: loss = ...')."""
    if not source:
        return ""
    match = re.match(r"^.*?(?::|, line )\d+: (.*)$", source)
    return (match.group(1) if match else source).strip()


def facts_of(report: Report) -> Facts:
    """The facts of a report with a culprit (`report.first_nonfinite` set)."""
    frame = report.first_nonfinite
    flagged = frame.flagged_rows or [row for row in frame.rows if row.nonfinite]
    dtype = next((row.dtype for row in flagged if row.dtype), None)
    if report.limit_dtype and any(row.predicted_overflow for row in flagged) \
            and not any(row.nonfinite for row in flagged):
        dtype = report.limit_dtype
    node, op = parse_op(frame.op)
    return Facts(report=report, frame=frame, flagged=flagged, dtype=dtype, node=node, op=op,
                 line=source_code(frame.source))
