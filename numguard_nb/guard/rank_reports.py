"""The guard's side of several ranks: a detection held until every rank knows, and the report of
a rank whose values broke because of another rank's.

`distributed.flags.RankFlags` carries, on the gradient reduction every rank makes anyway, which rank's
own values broke. Here the guard acts on it:

- `settle_after_reduction(flags, guard)`: full mode and `ops=True` hold a forward detection
  (`RankFlags.hold`) so that the rank still joins the reduction; at the end of that backward,
  after DDP's own callbacks, the held detection is raised, or, where another rank made the value,
  this rank raises `received_report`.
- `received_report(seen, source, in_forward, options)`: "received from rank r through the
  gradient all-reduce", with this rank's gradients as found; `cause == "other-rank"` and
  `report.source_rank == r`.

Every rank stops at the same step, so no rank waits on a collective the others never make.
"""

from __future__ import annotations

from functools import partial

import torch

from .. import numerics
from .._schema import CAUSE_OTHER_RANK, DETECTION
from .._util import qualified_name
from ..errors import NonFiniteError
from ..report import Frame, Report
from . import frames
from .sentinel_rerun import gradient_frame

__all__ = ["settle_after_reduction", "received_report", "hold_until_every_rank_knows"]


def hold_until_every_rank_knows(guard, error: BaseException, in_forward: bool = True) -> bool:
    """Several ranks, a detection of the loss code's (made before the backward, or by its nodes
    in it): hold it, so that this rank still joins the reduction, which tells every rank; raised
    at the backward's end (`_settle`, the sentinel's own). False: one process, or no backward
    will come (no grad)."""
    flags = guard.rank_flags
    if flags is None or not flags.hold(error, in_forward):
        return False
    report = getattr(error, "report", None)
    if report is not None and report.source_rank is None:
        report.source_rank = flags.rank  # this rank's own code made it
        if isinstance(error, NonFiniteError):
            NonFiniteError.__init__(error, report)  # its message says so too
    return True


def settle_after_reduction(flags, guard) -> None:
    """Settle this backward at its end, after DDP's reduction (queued once more from the
    engine's callbacks, so that it runs after DDP's own, queued meanwhile)."""
    queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(partial(queue, partial(_settle, flags, guard)))


def _settle(flags, guard) -> None:
    """Raise the forward detection held, or a report of what another rank made."""
    ranks = flags.take_fresh()  # (this step's flags consumed either way)
    if ranks is None and flags.held is not None:  # a no_sync micro-step: nothing was reduced
        if flags.forward_problem is not True:  # (a backward's own: as this rank's gradients)
            flags.local = torch.ones((), dtype=torch.bool)
        return  # it rides on the next reduction: every rank stops there
    held = flags.take_held()
    if held is not None:
        raise held
    if guard.tracing:
        return  # a traced batch runs on without stopping on every rank: none stops alone
    source = min(set(ranks[0]) | set(ranks[1]), default=None) if ranks else None
    if source is None or flags.rank in ranks[0]:
        return  # nothing, or this rank's own gradients: its guard names them
    name, model = next(iter(guard.models.items()))
    bad = numerics.nonfinite_of((qualified_name(name, key), p.grad)
                                for key, p in model.named_parameters() if p.grad is not None)
    seen = gradient_frame(name, type(model).__name__, guard.batch_number, 0, bad)
    raise frames.detection_error(guard, received_report(seen, source, source in ranks[1],
                                                        guard.options))


def received_report(seen: Frame, source: int, in_forward: bool, options) -> Report:
    """The report of a rank whose values broke because of another rank's: `seen`, this rank's
    gradients as found (or an empty frame), `source` the rank that made it, `in_forward` whether
    that rank's sentinel found it in its forward."""
    made = (f"rank {source} found inf/nan in its forward" if in_forward else
            f"rank {source}'s own gradients held inf/nan before the reduction")
    holds = "; ".join(f"{row.role} holds {row.nonfinite_words}" for row in seen.flagged_rows
                      if row.nonfinite_words)
    what = f"the gradients of {seen.words} ({holds})" if holds else "this rank's step"
    reason = (f"inf/nan in {what} in backward of batch {seen.batch_number}, received from rank "
              f"{source} through the gradient all-reduce: {made}, and this rank's own gradients "
              "were finite before it")
    report = frames.make_report([seen], seen, DETECTION, reason, CAUSE_OTHER_RANK,
                                seen.batch_number, options)
    report.source_rank = source
    report.hint = (f"Rank {source}'s report names the module, op and line that made it; this "
                   "rank stops at the same step, so that no rank waits on a collective the others "
                   "never make.")
    return report
