"""The tabular view of a `Report`: a pandas DataFrame with one row per tensor of every frame.

`report.to_frame()` returns it; the widget shows one module's slice of it. pandas is imported
only when a table is asked for.
"""

from __future__ import annotations

__all__ = ["COLUMNS", "report_frame"]

COLUMNS = [
    "frame", "batch_number", "phase", "call_index", "module_name", "module_class",
    "role", "category", "kind", "dtype", "shape", "abs_min", "abs_max", "nan",
    "posinf", "neginf", "range_share", "nonzero_abs_min", "predicted_overflow",
    "predicted_underflow", "flagged",
]


def report_frame(report):
    """The DataFrame: frame-level columns (index in `report.frames`, batch, phase, call, module)
    followed by the row's fields, in `COLUMNS` order."""
    import pandas as pd

    records = []
    for index, frame in enumerate(report.frames):
        for row in frame.rows:
            records.append((
                index, frame.batch_number, frame.phase, frame.call_index, frame.module_name,
                frame.module_class, row.role, row.category, row.kind, row.dtype, row.shape,
                row.abs_min, row.abs_max, row.nan, row.posinf, row.neginf, row.range_share,
                row.nonzero_abs_min, row.predicted_overflow, row.predicted_underflow,
                row.flagged,
            ))
    table = pd.DataFrame.from_records(records, columns=COLUMNS)
    for column in _NUMBERS:
        values = [record[COLUMNS.index(column)] for record in records]
        table[column] = pd.Series(_numbers_or_missing(pd, values), index=table.index, name=column)
    # A value without a dtype (None, a non-tensor): <NA> too, never NaN.
    table["dtype"] = pd.array([record[COLUMNS.index("dtype")] for record in records], dtype="string")
    if report.rank is not None:  # several processes: which rank this is, and which made it
        table["rank"], table["world_size"] = report.rank, report.world_size
        table["source_rank"] = pd.array([report.source_rank] * len(table), dtype="Int64")
    return table


# Statistics a row may lack (a None output, an empty tensor): <NA>, never NaN, which would read as
# a tensor holding nan (pandas' string <NA> for the dtype).
_NUMBERS = ("abs_min", "abs_max", "range_share", "nonzero_abs_min")


def _numbers_or_missing(pd, values: list):
    import numpy as np

    missing = np.array([value is None for value in values], dtype=bool)
    numbers = np.array([0.0 if value is None else value for value in values], dtype=np.float64)
    return pd.arrays.FloatingArray(numbers, missing)
