"""Compare two reports: the first module whose abs max differs by more than a factor.

Hugging Face's debugging guide traces the batch that worked and the one that did not
("batch 149 worked, batch 150 did not") and compares the numbers by eye. `compare_reports`
does the comparison: frames are matched on (module, phase, call number), tensors on (category,
role), and the first tensor, in the frame order of the first report, whose abs max differs by
more than `factor` (or is finite in one report and inf/nan in the other) is named.

    >>> good.compare(bad)            # Report.compare -> compare_reports(good, bad, factor=10)
    <numguard comparison: encoder.block.1.layer.1.DenseReluDense.wo (Linear) forward call 0, output:
     abs max 1.2e+03 -> inf (inf x)>

The comparison is computed in `numguard_nb.report`, next to the reports it reads (so that
`Report.compare` imports nothing above it), and shown by `numguard_nb.render.compare`; this
module is where users import it from.
"""

from __future__ import annotations

from .report import Comparison, compare_reports

__all__ = ["Comparison", "compare_reports"]
