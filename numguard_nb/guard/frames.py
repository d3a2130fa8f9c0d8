"""From recorded slots to the report: frames and rows, the reason sentence, report assembly.

Frames are built only when a report needs them (a detection, a traced batch, `guard.report`):
most passes are clean and never shown, so a pass is kept as slots and host values
(`RecentPasses`) and turned into frames on demand. `options` is the Guard's `GuardOptions`.
"""

from __future__ import annotations

import collections
import operator
import threading
from typing import Optional

import torch

from .. import numerics, rerun
from .. import stats as _stats
from .._schema import (
    BUFFER, CAUSE_BACKWARD, CAUSE_BACKWARD_INLINE, CAUSE_DATA, CAUSE_FORWARD, CAUSE_FORWARD_INLINE,
    CAUSE_LOSS_GRADIENT, CAUSE_OUTSIDE, CAUSE_UNATTRIBUTED, CAUSE_WEIGHTS, DETECTION, FORWARD,
    GRAD_OUTPUT, INPUT, MASK_REACHED_LOSS, ORIGIN_BEFORE_ATTACH, ORIGIN_OPTIMIZER_STEP,
    ORIGIN_OUTSIDE_FORWARD, ORIGIN_SINCE_ATTACH, ORIGIN_SINCE_FORWARD, OUTPUT, PARAM,
    PROBLEM_NEGINF, STAGE_EVALUATION, TRACE, VALUE_UNSUPPORTED,
)
from .._util import compiled_original, dtype_name
from ..errors import NonFiniteError
from ..explain import hint_for
from ..report import MAX_SAMPLES_NAMED, Frame, Report, TensorRow, module_words
from . import detect
from .passes import (
    ENTRY_INDEX, ENTRY_REF, ENTRY_VERSION, SLOT_CATEGORY, SLOT_DTYPE, SLOT_INDEX, SLOT_KIND,
    SLOT_ROLE, SLOT_SEQ, SLOT_SHAPE, CallRecord, PassRecord,
)

__all__ = [
    "detection_error", "stage_now",
    "build_frame", "mask_source", "reason_sentence", "value_of", "name_samples", "weights_origin",
    "unwatched_note", "make_report", "detection_report",
    "add_to_trace", "add_op_location", "RecentPasses",
]


def build_frame(pass_: PassRecord, call: CallRecord, options, flagged=frozenset()) -> Frame:
    """The frame of one recorded call; rows whose slot's id is in `flagged` are marked."""
    rows = []
    for slot in call.slots:
        values = pass_.values[slot[SLOT_INDEX]] if slot[SLOT_INDEX] is not None else None
        row = TensorRow(
            role=slot[SLOT_ROLE], category=slot[SLOT_CATEGORY],
            # statistics that could not be read back: a value without them, as one never read
            kind=slot[SLOT_KIND] if values is not None or slot[SLOT_INDEX] is None
            else VALUE_UNSUPPORTED,
            dtype=dtype_name(slot[SLOT_DTYPE]) if slot[SLOT_DTYPE] is not None else None,
            shape=slot[SLOT_SHAPE],
            flagged=id(slot) in flagged,
        )
        if values is not None:
            (row.abs_min, row.abs_max, row.nan, row.posinf, row.neginf,
             row.nonzero_abs_min) = _stats.decode(values)
            _mark_limits(row, slot, options)
        rows.append(row)
    return Frame(
        module_name=call.module_name, module_class=call.module_class, phase=call.phase,
        batch_number=call.batch_number, call_index=call.call_index, rows=rows,
        raised=call.raised,
    )


def _mark_limits(row: TensorRow, slot: tuple, options) -> None:
    limit_max = options.limit_max
    if limit_max is None or not slot[SLOT_DTYPE].is_floating_point:
        return
    if row.abs_max is not None and not row.nonfinite and row.abs_max > limit_max:
        row.predicted_overflow = True
    if row.nonzero_abs_min is not None and row.nonzero_abs_min < options.limit_tiny:
        row.predicted_underflow = True
    if row.abs_max is not None and not row.nan:
        row.limit_share = row.abs_max / limit_max


def _holds(rows, of: str = "", beyond: str = "") -> str:
    """'output holds +inf; output[1] reaches 8e+04' (a predicted overflow: finite, beyond the
    limit, which `beyond` may say); `of` follows each role ('grad_output of emb holds nan'); a
    row of data says which samples hold it ('input[0] holds nan in samples 1 and 3 of 32')."""
    return "; ".join(
        f"{row.role}{of} holds {row.nonfinite_words}"
        f"{' in ' + row.samples_words if row.samples_words else ''}" if row.nonfinite
        else f"{row.role}{of} reaches {row.abs_max:.3g}{beyond}" for row in rows)


def _data_words(rows) -> str:
    """What the data holds, in words: 'nan', '-inf', '+inf and -inf', 'nan and +inf'."""
    words = [word for word, present in (("nan", any(row.nan for row in rows)),
                                        ("+inf", any(row.posinf for row in rows)),
                                        ("-inf", any(row.neginf for row in rows))) if present]
    return " and ".join(words)


def mask_source(pass_: PassRecord, call: CallRecord, cause: str, options) -> str:
    """Where the -inf a forward culprit received came from ('' when it received none): the
    guarded call that made it (`detect.mask_maker`), else its caller's own code."""
    if cause != CAUSE_FORWARD:
        return ""
    limit_max = options.limit_max
    if (PROBLEM_NEGINF not in detect.received_from_children(pass_, call, limit_max)
            and not _holds_neginf(pass_, call, limit_max)):
        return ""
    maker = detect.mask_maker(pass_, call, limit_max)
    if maker is not None:
        return module_words(maker.module_name, maker.module_class)
    root = call
    while root.parent is not None:
        root = root.parent
    if _holds_neginf(pass_, root, limit_max):
        return f"the data fed to {root.module_name or root.module_class}"
    if call.parent is not None:
        return f"the code of {call.parent.module_name or call.parent.module_class}"
    return ""


def _holds_neginf(pass_: PassRecord, call: CallRecord, limit_max) -> bool:
    """Was `call` handed a -inf in its inputs?"""
    return any(slot[SLOT_CATEGORY] == INPUT and PROBLEM_NEGINF in detect.value_kinds(
        pass_, slot, limit_max) for slot in call.slots)


def reason_sentence(cause: str, frame: Frame, options, evidence: Optional[Frame] = None,
                    mask_from: str = "", origin=None) -> str:
    """The one sentence a report gives for its culprit `frame`. `evidence`: for a gradient made
    in a module's own code, the frame of the submodule that received it. `mask_from`: where the
    -inf a forward culprit received came from (`mask_source`). `origin`: for non-finite weights,
    how they got that way (`steps.Origin`), or None."""
    inline = cause in (CAUSE_FORWARD_INLINE, CAUSE_BACKWARD_INLINE) and evidence is not None
    rows = evidence.flagged_rows if inline else frame.flagged_rows
    where = frame.words
    call = f"call {frame.call_index} of batch {frame.batch_number}"
    # Finite values beyond limit_dtype's largest value, and nothing non-finite.
    predicted = any(row.predicted_overflow for row in rows) and not any(r.nonfinite for r in rows)
    limit = (f"{dtype_name(options.limit_dtype)}'s largest value {options.limit_max:.5g}"
             if options.limit_dtype is not None else "")
    what = _holds(rows, f" of {evidence.label}" if inline else "",
                  f", beyond {limit}" if limit and not predicted else "")
    gradient = f"a gradient beyond {limit}" if predicted else "a non-finite gradient"
    below = "stayed below it (predicted overflow)"
    if cause == CAUSE_OUTSIDE:
        return _outside_reason(frame, what)
    if cause == CAUSE_WEIGHTS and predicted:
        return f"the weights of {where} in batch {frame.batch_number} exceed {limit} ({what})"
    if cause == CAUSE_WEIGHTS:
        return _weights_sentence(where, frame.batch_number, rows, what, origin)
    if cause == CAUSE_DATA and predicted:
        return f"the data fed to {where} in batch {frame.batch_number} is beyond {limit} ({what})"
    if cause == CAUSE_DATA:
        return (f"the data fed to {where} in batch {frame.batch_number} holds "
                f"{_data_words(rows)} ({what})")
    if cause == CAUSE_LOSS_GRADIENT:
        return (f"the gradient entering {where} in backward of batch {frame.batch_number} is "
                f"already {'beyond ' + limit if predicted else 'non-finite'} ({what}"
                f"{', a predicted overflow' if predicted else ''}): the loss or code outside the "
                "guarded modules produced it")
    if cause == CAUSE_UNATTRIBUTED:
        return (f"nan first shows in {where} in {frame.phase} ({call}: {what}), but numguard "
                "could not tell which module produced it (the frames below show where it first "
                "appears)")
    if inline and cause == CAUSE_FORWARD_INLINE and predicted:
        return (f"{where} produced a value beyond {limit} in forward ({call}), in its own code "
                f"between its submodules: {what}, which its inputs and weights did not reach (a "
                f"predicted overflow, handed to {evidence.label})")
    if inline and cause == CAUSE_FORWARD_INLINE:
        turned = [row for row in evidence.rows if row.category == OUTPUT and row.nonfinite]
        overflow = ("" if any(row.nan for row in rows) or not turned else  # (a nan handed on)
                    f" (an overflow, which {evidence.label} turned into {_data_words(turned)})")
        return (f"{where} produced a non-finite value in forward ({call}), in its own code between "
                f"its submodules: {what}, which its inputs and weights did not hold{overflow}")
    if inline:
        return (f"{where} produced {gradient} in backward ({call}), in its own code between its "
                f"submodules: {what}, while the gradients {frame.label} received "
                f"{below if predicted else 'were finite'}")
    if cause in (CAUSE_BACKWARD, CAUSE_BACKWARD_INLINE):
        received = ", ".join(dict.fromkeys(  # an inf it was allowed to receive, say
            row.nonfinite_words for row in frame.rows
            if row.category == GRAD_OUTPUT and row.nonfinite_words))
        got = below if predicted else f"held only {received}" if received else "was finite"
        return (f"{where} produced {gradient} in backward ({call}): {what}, while the gradient it "
                f"received {got}")
    if predicted:
        return (f"{where} produced a value beyond {limit} in forward ({call}): {what}, while its "
                f"inputs and weights {below}")
    if mask_from:
        return (f"{where} produced a non-finite value in forward ({call}): {what}, which its "
                f"inputs and weights did not hold; the -inf mask it received came from {mask_from}")
    if rows and all(row.neginf and not row.nan and not row.posinf for row in rows) \
            and not detect.is_linear_map(frame.module_class):  # an overflow is no mask
        return (f"{where} produced a non-finite value in forward ({call}): {what}, which its "
                f"inputs and weights did not hold, {MASK_REACHED_LOSS}")
    return (f"{where} produced a non-finite value in forward ({call}): {what}, which its inputs "
            "and weights did not hold")


def _weights_sentence(where: str, batch: int, rows, what: str, origin) -> str:
    """Weights (or buffers) found non-finite, and what the guard saw write them (`origin`)."""
    buffers = all(row.category == BUFFER for row in rows)
    head = (f"the {'buffers' if buffers else 'weights'} of {where} are non-finite in batch "
            f"{batch} ({what})")
    kind, step = (origin.kind, origin.step) if origin is not None else ("", None)
    if kind == ORIGIN_OPTIMIZER_STEP:
        if step.cannot_have_made({row.dtype for row in rows}):
            return (f"{head}, and they changed since an optimizer step that cannot have made them "
                    f"from the backward's finite gradients: {step.words}; code around it changed "
                    "the gradients or the weights")
        stale = (", from gradients whose .grad already held inf/nan when the guard attached"
                 if step.stale_gradients else "")
        return f"{head}, and an optimizer step wrote them: {step.words}{stale}"
    if kind == ORIGIN_SINCE_ATTACH:
        return (f"{head}, and they changed outside the model's forward since the guard attached, "
                "which found them finite: the guard saw no optimizer step since")
    if kind == ORIGIN_OUTSIDE_FORWARD:
        return (f"{head}, and they changed outside the model's forward: the guard saw no "
                f"optimizer step since the model's previous forward (batch {origin.finite_batch}"
                "), which found no non-finite weight")
    if kind == ORIGIN_BEFORE_ATTACH and origin.at_attach:
        return f"{head}: they were already non-finite when the guard attached"
    if kind == ORIGIN_BEFORE_ATTACH:
        first = f"{head}, in the guard's first forward of the model: they were already non-finite"
        if step is not None:
            return f"{first} when it attached, or an optimizer step wrote them since: {step.words}"
        return f"{first} when it attached"
    if kind == ORIGIN_SINCE_FORWARD:
        return (f"{head}: they held none when the forward of batch {origin.finite_batch} began, "
                f"so that forward (an update inside {where}) or code run after it wrote them")
    if buffers:
        return f"{head}: running statistics went bad in an earlier batch"
    return f"{head}: an optimizer step or code outside the model's forward wrote them"


def value_of(pass_: PassRecord, slot: tuple):
    """The tensor a slot of the pass summarised, or None: a value the pass held weakly and that
    is gone, or that changed in place since (weights and buffers it holds). Before release."""
    index = slot[SLOT_INDEX]
    if index is None:
        return None
    for entry in pass_.cache.values():
        if entry[ENTRY_INDEX] == index:
            ref = entry[ENTRY_REF]
            value = ref if isinstance(ref, torch.Tensor) else ref()
            return value if value is not None and value._version == entry[ENTRY_VERSION] else None
    return None


def name_samples(pass_: PassRecord, call: CallRecord, flagged_ids, frame: Frame) -> None:
    """On the flagged data rows of `frame` (the frame of `call`), which samples (indices along
    dim 0) hold the inf/nan: read from the inputs themselves, once per detection (a read-back
    from the device). A row whose value is gone keeps None."""
    for slot, row in zip(call.slots, frame.rows):
        if id(slot) not in flagged_ids or slot[SLOT_CATEGORY] != INPUT:
            continue
        value = value_of(pass_, slot)
        if value is None or value.dim() == 0 or value.numel() == 0 or not (
                value.is_floating_point() or value.is_complex()):
            continue
        try:
            with torch.no_grad():
                bad = ~torch.isfinite(value)
                held = (bad.flatten(1).any(1) if bad.dim() > 1 else bad).nonzero().flatten()
                packed = _packed_samples(pass_, call, slot, value)
                if packed is not None:  # a PackedSequence's rows: time steps of its samples
                    samples, row.batch_size = packed
                    held = samples[held].unique()
                row.nonfinite_samples = tuple(numerics.read(held[:MAX_SAMPLES_NAMED]))
                row.nonfinite_sample_count = held.numel()
                if bad.dim() > 1:  # which columns (channels): one broken feature for every sample
                    features = bad.transpose(0, 1).flatten(1).any(1).nonzero().flatten()
                    row.nonfinite_features = tuple(numerics.read(features[:MAX_SAMPLES_NAMED]))
                    row.nonfinite_feature_count = features.numel()
        except Exception:  # a tensor subclass that cannot be read this way: samples unknown
            row.nonfinite_samples = row.nonfinite_sample_count = None


def _packed_samples(pass_: PassRecord, call: CallRecord, slot: tuple, data: torch.Tensor):
    """(the sample of each row, the number of samples) where `data` is a PackedSequence's data
    (its slot `R[0]`, beside `R[1]`, batch_sizes, and `R[2]`, sorted_indices): rows are time
    steps, each step's samples in sorted order. None for any other input."""
    role = slot[SLOT_ROLE]
    if not role.endswith("[0]"):
        return None
    siblings = {s[SLOT_ROLE]: s for s in call.slots if s[SLOT_CATEGORY] == INPUT}
    sizes_slot, order_slot = siblings.get(role[:-3] + "[1]"), siblings.get(role[:-3] + "[2]")
    sizes = value_of(pass_, sizes_slot) if sizes_slot is not None else None
    if sizes is None or sizes.dtype != torch.int64 or sizes.dim() != 1 or not sizes.numel():
        return None
    steps = numerics.read(sizes)  # (a PackedSequence's batch_sizes are on the host)
    if sum(steps) != data.shape[0] or any(b > a for a, b in zip(steps, steps[1:])):
        return None
    samples = torch.cat([torch.arange(n) for n in steps]).to(data.device)
    order = value_of(pass_, order_slot) if order_slot is not None else None
    if order is not None and order.dtype == torch.int64 and order.shape == (steps[0],):
        samples = order.to(data.device)[samples]
    return samples, steps[0]


def weights_origin(pass_: PassRecord, call: CallRecord, bad_slots, steps):
    """How the non-finite weights of `call` (`bad_slots`) got that way (`steps.Origin`), from
    the optimizer steps the guard saw (`steps`, a `StepWatch`; None: unknown)."""
    if steps is None:
        return None
    if all(slot[SLOT_CATEGORY] == BUFFER for slot in bad_slots):
        return steps.buffers_origin(call.root_id, call.batch_number)
    params = [value for value in (value_of(pass_, slot) for slot in bad_slots
                                  if slot[SLOT_CATEGORY] == PARAM) if value is not None]
    return steps.weights_origin(call.root_id, params, call.batch_number)


def _note_origin(report: Report, origin) -> None:
    if origin is not None:
        report.weights_origin, report.optimizer_step = origin.kind, origin.step


def _outside_reason(frame: Frame, what: str) -> str:
    """The sentence for a culprit in the code outside the guarded modules (`guard.outside`): a
    torch function (forward) or an autograd node it created (backward), with the user's line."""
    at = f" at {frame.source.split(': ', 1)[0]}" if frame.source else ""
    if frame.phase == FORWARD:
        op = f" ({frame.op})" if frame.op else ""
        return (f"code outside the guarded modules produced a non-finite value in batch "
                f"{frame.batch_number}: in {frame.module_class}{op}{at}, {what}, which its "
                "inputs did not hold")
    return (f"the autograd node {frame.module_class}, created outside the guarded modules{at}, "
            f"produced a non-finite gradient in backward of batch {frame.batch_number}: {what}, "
            "while the gradient it received was finite")


def unwatched_note(frames) -> str:
    """What a report with no culprit must say instead of an all-clear when some of its values had
    no numbers to read ('' when every value was read)."""
    unread = _unread(frames)
    if not unread:
        return ""
    values = "value was" if unread == 1 else "values were"
    return (f"{unread} {values} not watched: their numbers could not be read (tensors inside "
            "torch.func transforms such as vmap and grad, the fake or meta tensors of "
            "torch.export and tracing, quantized tensors), so an inf/nan in them goes unreported")


def _unread(frames) -> int:
    """How many values of `frames` had no numbers to read (VALUE_UNSUPPORTED)."""
    return sum(row.kind == VALUE_UNSUPPORTED for frame in frames for row in frame.rows)


def make_report(frames, culprit, kind, reason, cause, batch_number, options) -> Report:
    """A Report of `frames`, with the process's rank where torch.distributed runs. A report
    without a culprit gets, as its reason, the note on values that were not watched (if any)."""
    rank = world = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if culprit is None and not reason:
        reason = unwatched_note(frames)
    autocast = next((device for device in rerun.AUTOCAST_DEVICES if rerun.autocast_dtype(device)), "")
    return Report(
        frames=frames, first_nonfinite=culprit, batch_number=batch_number, kind=kind,
        reason=reason, cause=cause, rank=rank, world_size=world,
        limit_dtype=dtype_name(options.limit_dtype) if options.limit_dtype else None,
        autocast_device=autocast,
    )


def detection_error(guard, report: Report) -> BaseException:
    """The one way every mode stops on a detection: the report kept as `guard.detection`, the
    `on_detect` option called with it, and the exception to raise: the one it returned, or
    `NonFiniteError(report)`."""
    if report.stage is None:  # (a sentinel's check read later says its call's)
        report.stage = stage_now(guard)
    if len(guard.models) == 1 and not report.model_class:
        model = next(iter(guard.models.values()))
        report.model_class = type(compiled_original(model) or model).__name__
    guard.detection = report
    on_detect = guard.options.on_detect
    error = on_detect(report) if on_detect is not None else None
    return error if isinstance(error, BaseException) else NonFiniteError(report)


def stage_now(guard, module=None) -> str:
    """What the loop runs now besides training (`Report.stage`): what its caller said, else
    an evaluation where `module` (or any of the guard's models) is in eval mode."""
    if guard.batches.stage:
        return guard.batches.stage
    modules = (module,) if module is not None else guard.models.values()
    return "" if all(m.training for m in modules) else STAGE_EVALUATION


def detection_report(pass_: PassRecord, phase: str, call: CallRecord, bad_slots, culprit: Frame,
                     cause: str, context: list, options, batch_number: int,
                     steps=None) -> Report:
    """The report of a detection: the culprit's frame (`culprit`, built already), after the
    frames of the pass that led up to it and, before those, `context` (earlier passes' frames).
    `steps`: the guard's `StepWatch`, which says what wrote non-finite weights."""
    flagged = {id(s) for s in bad_slots}
    if cause == CAUSE_DATA:
        name_samples(pass_, call, flagged, culprit)
    origin = weights_origin(pass_, call, bad_slots, steps) if cause == CAUSE_WEIGHTS else None
    if cause == CAUSE_FORWARD_INLINE:  # up to the submodule it handed the value to (open still)
        limit = max(c.seq for c in pass_.calls if any(id(s) in flagged for s in c.slots))
        led_up = [c for c in pass_.calls if c is not call and c.seq <= limit]
    elif phase == FORWARD:
        led_up = [c for c in pass_.calls if c.seq < call.seq]
    else:
        limit = min(s[SLOT_SEQ] for s in bad_slots)
        led_up = [c for c in pass_.calls if c is not call and c.seq <= limit]
    max_frames = options.max_frames
    led_up_frames = [build_frame(pass_, c, options, flagged) for c in led_up[-max_frames:]]
    frames = (context + led_up_frames + [culprit])[-max_frames:]
    # A gradient made in a module's own code shows in the submodule that received it.
    evidence = next((f for f in led_up_frames if f.flagged_rows), None)
    reason = reason_sentence(cause, culprit, options, evidence,
                             mask_source(pass_, call, cause, options), origin)
    unread = _unread(frames)
    if unread and cause != CAUSE_DATA:  # (what it received may have come from them)
        reason += (f"; but {unread} value{'s' if unread > 1 else ''} of the calls before could "
                   f"not be read (inside a torch.func transform such as vmap, fake or quantized "
                   "tensors): it may have come from there")
    report = make_report(frames, culprit, DETECTION, reason, cause, batch_number, options)
    _note_origin(report, origin)
    report.hint = hint_for(report)  # after op localisation: the hint may name the op and line
    return report


def add_to_trace(report: Optional[Report], pass_: PassRecord, culprit, options,
                 batch_number: int, steps=None) -> Report:
    """`report` (a new one when None) with every frame of the pass added; the first culprit
    found in the batch (`(call, bad slots, cause)` or None) is noted, without stopping.
    `steps`: as for `detection_report`."""
    flagged = {id(s) for s in culprit[1]} if culprit is not None else set()
    calls = sorted(pass_.calls, key=lambda c: c.seq)
    frames = [build_frame(pass_, c, options, flagged) for c in calls]
    if report is None:
        report = make_report([], None, TRACE, "", "", batch_number, options)
    report.frames.extend(frames)
    if report.first_nonfinite is None:
        report.reason = unwatched_note(report.frames)
    if culprit is not None and report.first_nonfinite is None:
        call, bad_slots, cause = culprit
        frame = frames[calls.index(call)]
        evidence = next((f for f in frames if f.flagged_rows and f is not frame), None)
        if cause == CAUSE_DATA:
            name_samples(pass_, call, flagged, frame)
        origin = weights_origin(pass_, call, bad_slots, steps) if cause == CAUSE_WEIGHTS else None
        report.first_nonfinite = frame
        report.cause = cause
        report.reason = reason_sentence(cause, frame, options, evidence,
                                        mask_source(pass_, call, cause, options), origin)
        _note_origin(report, origin)
        report.hint = hint_for(report)
    return report


def add_op_location(frame: Frame, where) -> None:
    """Put an `ops.OpLocation` found for the culprit on its frame."""
    frame.op_note = where.note
    if where.reproduced:
        frame.op = f"{where.node}: {where.op}" if where.node else where.op
        frame.source, frame.op_made = where.source, where.made


_SEQ = operator.attrgetter("seq")


class RecentPasses:
    """The last passes, kept whole and turned into frames only when a report
    needs them as context."""

    def __init__(self):
        self.passes: collections.deque = collections.deque()
        self._lock = threading.Lock()  # passes of several threads end at once

    def remember(self, pass_: PassRecord, max_frames: int) -> None:
        """Keep the pass (it has been read back) as context for a later report."""
        pass_.release()
        with self._lock:
            self.passes.append(pass_)
            # Keep just enough passes to fill max_frames frames of context (a backward's calls
            # counted without making its gradients' slots).
            while len(self.passes) > 1 and sum(
                    p.count_calls(max_frames) for p in list(self.passes)[1:]) >= max_frames:
                self.passes.popleft()

    def frames(self, options) -> list:
        """The last `options.max_frames` frames of the kept passes."""
        with self._lock:  # (reading a backward's calls makes its slots: one thread at a time)
            kept = [(p, sorted(p.calls, key=_SEQ)[-options.max_frames:]) for p in self.passes]
        frames = [build_frame(p, c, options) for p, calls in kept for c in calls]
        return frames[-options.max_frames:]
