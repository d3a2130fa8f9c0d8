"""The batches a sentinel runs with the full hooks: those in `trace_batches`, those the numerics
history samples (`history_every`) and the full looks (`full_every`: the last batch of each N).

A full guard is attached for such a batch (its hooks join from the call that starts it); it keeps
its traces, history, headroom and skipped steps in the sentinel's guard. When another batch
starts it is paused, and detached at the next backward's end or on detach: never inside a module
call, whose hooks torch has already listed. The detached guard is attached again for the next
such batch: a guard made for each would leave its reference cycles to the garbage collector.
"""

from __future__ import annotations

from ..report import Report
from .frames import RecentPasses, stage_now
from .sentinel_rerun import full_guard

__all__ = ["SampledBatches"]


class SampledBatches:
    """The full guard of one sentinel's traced and sampled batches."""

    def __init__(self, guard):
        self.guard = guard
        self.tracer = None  # a full guard watching a traced batch with all its hooks
        self._spare = None  # the last one, detached, with the options it was made for
        self._options = None  # the options the tracer was made for
        self.batches_in_full = 0  # traced and sampled batches run so far
        self._last_recent = None  # the frames of the last one, once its guard is detached

    def start(self, batch: int, module, args, kwargs) -> None:
        """A batch starts (in the pre-hook of the call that starts it)."""
        guard, tracer = self.guard, self.tracer
        every, full = guard.options.history_every, guard.options.full_every
        sampled = (every and batch % every == 0) or (full and batch % full == full - 1)
        if batch not in guard.options.trace_batches and not sampled:
            if tracer is not None:
                tracer.paused = True
            return
        self.batches_in_full += 1
        joining = tracer is None
        if joining:
            tracer = self.tracer = self._made_for(guard.options) or self._new(batch)
            tracer.attach()
        tracer.paused = False
        tracer.batches.started = batch
        tracer.begin_batch()
        if joining:  # attached inside this call: its pre-hook missed it
            tracer.pre_hook(module, args, kwargs)

    def _made_for(self, options):
        """The spare guard, if it was made for these options; its context starts empty (the
        frames of a batch N batches ago are no context for this one)."""
        spare, self._spare = self._spare, None
        if spare is None or spare[1] is not options:
            return None
        spare[0].recent = RecentPasses()
        return spare[0]

    def _new(self, batch: int):
        guard = self.guard
        tracer = full_guard(guard, guard.models, batch, on_detect=self._detected)
        self._options = guard.options
        tracer.traces, tracer.history, tracer.headroom = guard.traces, guard.history, guard.headroom
        tracer.scaling, tracer.skipped_steps = guard.scaling, guard.skipped_steps
        return tracer

    def latest_frames(self, options) -> list:
        """The last frames the full guard saw (of the last traced or sampled batch)."""
        recent = self.tracer.recent if self.tracer is not None else self._last_recent
        return recent.frames(options) if recent is not None else []

    def running(self) -> bool:
        return self.tracer is not None and not self.tracer.paused

    def stop(self, paused_only: bool = False) -> None:
        """Detach the full guard: if it is paused (`paused_only`, kept for the next such batch),
        or at all (the sentinel's detach, which keeps nothing)."""
        tracer = self.tracer
        if tracer is not None and (tracer.paused or not paused_only):
            self.tracer = None
            self._last_recent = tracer.recent
            tracer.paused = True  # a hook of a call running now may still be called
            tracer.detach()
            if paused_only and tracer.detection is None:
                self._spare = (tracer, self._options)
        if not paused_only:
            self._spare = None

    def _detected(self, report: Report):
        """A batch run with the full hooks stopped at a detection: it is the sentinel's guard's."""
        self.guard.detection = report
        report.stage = stage_now(self.guard)  # (its twin's batches know no stage)
        on_detect = self.guard.options.on_detect
        return on_detect(report) if on_detect is not None else None
