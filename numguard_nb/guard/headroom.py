"""The headroom: what in a whole guarded run would not fit in `limit_dtype`.

`limit_dtype` asks "would this run overflow in float16 (bfloat16, float8)?". The run does not
stop at the first value beyond the dtype's range (unless `stop_at_limit`): at the end of each
pass, once its statistics are read back, the Guard hands the pass to `Headroom.collect`, which
finds
- predicted overflows: finite values beyond the dtype's largest finite value (they would be inf);
- predicted underflows: non-zero values below its smallest subnormal (they would flush to 0);
and credits each to the module call that made it. As in detection's producer rules, a value a
call only carried on is not credited to it again: an output counts when it reaches further than
anything the call received (its inputs, weights and its submodules' outputs; in backward, its
output gradients and its submodules' input gradients), weights and the data always; a value a
call's own code hands a submodule beyond all it had (Llama's `act(gate(x)) * up(x)` before
`down_proj`) counts for that call, as "input[0] of <submodule>" (not an additive mask's
`torch.finfo(float32).min`). Real inf and nan still stop the run: detection runs on
`options.stop_rules`, the options without the limit.

Memory is bounded by the model, not by the run: one `HeadroomEntry` per (module, phase, role,
kind) with the worst value, where it was, how many values went beyond the limit and in which
batch first; and the frame of the run's first predicted overflow (`first`, with the op and line
that made it when ops=True). Changing the guard's `limit_dtype` starts the headroom over.

The views (`to_text`, `_repr_html_`, `to_frame`) are in `render.headroom`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

from .._schema import (
    BACKWARD, BUFFER, CAUSE_BACKWARD, CAUSE_DATA, CAUSE_FORWARD, CAUSE_FORWARD_INLINE, CAUSE_LOSS_GRADIENT, CAUSE_WEIGHTS,
    CAUSE_BACKWARD_INLINE, GRAD_INPUT, GRAD_OUTPUT, GRAD_PARAM, INPUT, OUTPUT, PARAM, PROBLEM_OVERFLOW,
    PROBLEM_UNDERFLOW,
)
from .._util import PicklesWithoutLock, dtype_name
from ..report import Frame
from . import detect, frames
from .passes import SLOT_CATEGORY, SLOT_DTYPE, SLOT_INDEX, SLOT_ROLE, CallRecord, PassRecord

__all__ = ["Headroom", "HeadroomEntry"]

_INF = math.inf
# What a call received before any value: nothing large, nothing small.
_NOTHING = (0.0, _INF)
# Who made a value, by the category of its slot (output gradients: see `_cause`).
_HANDED = " of "  # a value a call's own code handed a submodule: "input[0] of <submodule>"
_CAUSE_OF = {OUTPUT: CAUSE_FORWARD, GRAD_INPUT: CAUSE_BACKWARD, GRAD_PARAM: CAUSE_BACKWARD,
             PARAM: CAUSE_WEIGHTS, BUFFER: CAUSE_WEIGHTS, INPUT: CAUSE_DATA}


@dataclass
class HeadroomEntry:
    """One value of one module (by phase and role) that went beyond the limit, over the run."""

    module_name: str
    module_class: str
    phase: str  # FORWARD or BACKWARD
    role: str  # "output", "weight", "grad_input[0]", ... as in the report's rows
    category: str  # OUTPUT, PARAM, GRAD_INPUT, ... (`_schema`)
    dtype: str  # the value's own dtype, as run
    kind: str  # PROBLEM_OVERFLOW or PROBLEM_UNDERFLOW
    abs_max: float  # of the value at its worst
    nonzero_abs_min: Optional[float]  # smallest non-zero |value| at its worst (None: all zero)
    # How far beyond the limit at its worst: abs max / the largest finite value (> 1) for an
    # overflow; smallest non-zero / the smallest subnormal (< 1) for an underflow.
    share: float
    count: int  # values beyond the limit (each call, each pass)
    batch_number: int  # the first batch it happened in
    call_index: int  # the module's call (within that batch) it first happened in
    worst_batch: int  # the batch of its worst value
    last_batch: int  # the latest batch it happened in

    @property
    def label(self) -> str:
        return self.module_name or self.module_class

    def _outdone_by(self, share: float) -> bool:
        """Does a value with this share go further beyond the limit than the worst so far?"""
        return share > self.share if self.kind == PROBLEM_OVERFLOW else share < self.share


def _severity(entry: HeadroomEntry):
    """Overflows (inf in the dtype) before underflows (zeros), each the furthest out first."""
    if entry.kind == PROBLEM_OVERFLOW:
        return (0, -entry.share)
    return (1, entry.share)


class Headroom(PicklesWithoutLock):
    """Every predicted overflow and underflow of a guarded run (`guard.headroom`), by module.

    `len(headroom)` entries, iterated (and shown) the worst first; `first` is the frame of the
    run's first predicted overflow; `to_frame()` a pandas DataFrame of the entries; `to_text()`
    and the notebook view sum it up. `passes` counts the passes looked at, `batches` the first
    and last batch they belonged to.
    """

    def __init__(self):
        self.limit_dtype = None  # the torch dtype the entries are about (None: none yet)
        self.limit_max: Optional[float] = None
        self.limit_tiny: Optional[float] = None
        self.first: Optional[Frame] = None  # the run's first predicted overflow
        self.passes = 0
        self.batches: Optional[tuple] = None  # (first, last) batch number seen
        self._entries: Dict[tuple, HeadroomEntry] = {}
        super().__init__()  # its lock: passes end in the threads that run them

    # ---- collecting ---------------------------------------------------------------------------
    def collect(self, pass_: PassRecord, options, locate: Optional[Callable] = None) -> None:
        """Note what `pass_` (read back) holds beyond `options.limit_dtype`'s range. `locate(frame,
        call, cause, rules)` names the op that made the run's first predicted overflow (the
        Guard's op localisation), when given."""
        if options.limit_max is None or not pass_.calls:
            return
        with self._lock:
            if options.limit_dtype is not self.limit_dtype:
                self._start(options)
            self.passes += 1
            batch = pass_.calls[0].batch_number
            first, last = self.batches or (batch, batch)
            self.batches = (min(first, batch), max(last, batch))
        limit_max, limit_tiny = options.limit_max, options.limit_tiny
        if not _any_beyond(pass_.values, limit_max, limit_tiny):
            return
        made = _backward_made if pass_.calls[0].phase == BACKWARD else _forward_made
        found = made(pass_, limit_max, limit_tiny)
        with self._lock:
            for call, slot, kind, value in found:
                self._note(call, slot, kind, value)
        if self.first is None:
            first = next(((call, slot) for call, slot, kind, _ in found
                          if kind == PROBLEM_OVERFLOW), None)
            if first is not None:
                self._keep_first(pass_, *first, options, locate)

    def collect_and_check(self, pass_: PassRecord, options,
                          locate: Optional[Callable] = None) -> bool:
        """`collect`, then whether the pass holds what detection stops on (`options.stop_rules`):
        nan or inf, and with stop_at_limit a predicted overflow too."""
        self.collect(pass_, options, locate)
        return detect.has_problem(pass_, options.stop_rules.limit_max)

    def _start(self, options) -> None:
        self.limit_dtype = options.limit_dtype
        self.limit_max, self.limit_tiny = options.limit_max, options.limit_tiny
        self.first = None
        self.passes = 0
        self.batches = None
        self._entries = {}

    def _note(self, call: CallRecord, slot: tuple, kind: str, value: tuple) -> None:
        abs_max, nonzero = value
        share = (abs_max / self.limit_max if kind == PROBLEM_OVERFLOW
                 else nonzero / self.limit_tiny)
        batch = call.batch_number
        key = (call.module_name, call.phase, slot[SLOT_ROLE], kind)
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = HeadroomEntry(
                module_name=call.module_name, module_class=call.module_class, phase=call.phase,
                role=slot[SLOT_ROLE], category=slot[SLOT_CATEGORY],
                dtype=dtype_name(slot[SLOT_DTYPE]), kind=kind, abs_max=abs_max,
                nonzero_abs_min=nonzero, share=share, count=1, batch_number=batch,
                call_index=call.call_index, worst_batch=batch, last_batch=batch)
            return
        entry.count += 1
        entry.last_batch = max(entry.last_batch, batch)
        if entry._outdone_by(share):
            entry.abs_max, entry.nonzero_abs_min, entry.share = abs_max, nonzero, share
            entry.worst_batch = batch

    def _keep_first(self, pass_: PassRecord, call: CallRecord, slot: tuple, options,
                    locate: Optional[Callable]) -> None:
        """The frame of the run's first predicted overflow, with the op that made it where the
        Guard can re-run the step (not with stop_at_limit: the run stops there, and the
        detection's report names the op)."""
        frame = frames.build_frame(pass_, call, options, {id(slot)})
        cause = _cause(call, slot)
        if locate is not None and not options.stop_at_limit \
                and cause in (CAUSE_FORWARD, CAUSE_FORWARD_INLINE, CAUSE_BACKWARD):
            locate(frame, call, cause, options)
        with self._lock:
            if self.first is None:
                self.first = frame

    # ---- reading ------------------------------------------------------------------------------
    def entries(self) -> List[HeadroomEntry]:
        """The entries, the worst first: overflows by share, then underflows."""
        with self._lock:
            entries = list(self._entries.values())
        return sorted(entries, key=_severity)  # stable: ties stay in the order they came

    @property
    def overflows(self) -> int:
        """How many entries are predicted overflows."""
        return sum(entry.kind == PROBLEM_OVERFLOW for entry in self.entries())

    @property
    def underflows(self) -> int:
        """How many entries are predicted underflows."""
        return sum(entry.kind == PROBLEM_UNDERFLOW for entry in self.entries())

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[HeadroomEntry]:
        return iter(self.entries())

    def summary(self) -> str:
        """One line: what would not fit, in which dtype, over how many batches."""
        from ..render.headroom import headroom_summary

        return headroom_summary(self)

    def to_text(self) -> str:
        """The worst entries, one line each (the notebook's text view)."""
        from ..render.headroom import headroom_text

        return headroom_text(self)

    def to_frame(self):
        """A pandas DataFrame, one row per entry, the worst first."""
        from ..render.headroom import headroom_frame

        return headroom_frame(self)

    def _repr_html_(self) -> str:
        from ..render.headroom import headroom_html

        return headroom_html(self)

    def __repr__(self) -> str:
        return self.to_text()


def _cause(call: CallRecord, slot: tuple) -> str:
    """Who made a value, as detection's causes name it."""
    category = slot[SLOT_CATEGORY]
    if category == OUTPUT and _HANDED in slot[SLOT_ROLE]:
        return CAUSE_FORWARD_INLINE
    if category == GRAD_OUTPUT:
        forward = call.forward
        top = forward is None or forward.parent is None
        return CAUSE_LOSS_GRADIENT if top else CAUSE_BACKWARD_INLINE
    return _CAUSE_OF.get(category, CAUSE_FORWARD)


# ---- which values of a pass go beyond the limits, and who made them ------------------------------
def _any_beyond(values: list, limit_max: float, limit_tiny: float) -> bool:
    """Quick scan: does any row of the pass reach beyond `limit_max` (finite) or hold a non-zero
    value below `limit_tiny`? (Integer rows may answer yes: `_forward_made` and `_backward_made`
    look at dtypes.)"""
    for row in values:
        if row is not None and (limit_max < row[1] < _INF or (len(row) > 3 and 0.0 < row[3] < limit_tiny)):
            return True
    return False


def _value(values: list, slot: tuple) -> Optional[tuple]:
    """(abs max, smallest non-zero |value| or None) of a finite floating value; None for the
    rest (integers, values never read, nan and inf: detection's)."""
    index, dtype = slot[SLOT_INDEX], slot[SLOT_DTYPE]
    if index is None or dtype is None or not dtype.is_floating_point:
        return None
    row = values[index]
    if row is None or not row[1] < _INF:
        return None
    nonzero = row[3] if len(row) > 3 and 0.0 < row[3] < _INF else None
    return row[1], nonzero


def _received(got: list, value: tuple) -> None:
    """A call received `value`: widen what it has received ([largest, smallest non-zero])."""
    if value[0] > got[0]:
        got[0] = value[0]
    if value[1] is not None and value[1] < got[1]:
        got[1] = value[1]


class _Made:
    """What a pass's calls made beyond the limits: (call, slot, kind, value), in the order found,
    each value (by its statistics index: one tensor seen by several calls) credited once."""

    def __init__(self, limit_max: float, limit_tiny: float):
        self.limit_max = limit_max
        self.limit_tiny = limit_tiny
        self.found: list = []
        self._credited: set = set()

    def credit(self, call: CallRecord, slot: tuple, value: tuple, got) -> None:
        """Credit `value` to `call` for each limit it goes beyond further than anything in `got`
        (what the call received; `_NOTHING` for values that are their own source), unless what
        it received was beyond that limit already: in that dtype it was handed inf (or 0), and
        carried it on (a Dropout's 1/(1-p) after an overflowing Linear)."""
        abs_max, nonzero = value
        kinds = []
        if self.limit_max < abs_max and got[0] < abs_max and got[0] <= self.limit_max:
            kinds.append(PROBLEM_OVERFLOW)
        if nonzero is not None and nonzero < self.limit_tiny and nonzero < got[1] \
                and got[1] >= self.limit_tiny:
            kinds.append(PROBLEM_UNDERFLOW)
        for kind in kinds:
            if (slot[SLOT_INDEX], kind) not in self._credited:
                self._credited.add((slot[SLOT_INDEX], kind))
                self.found.append((call, slot, kind, value))


def _forward_made(pass_: PassRecord, limit_max: float, limit_tiny: float) -> list:
    """(call, slot, kind, value) of each value beyond the limits a forward pass's calls made, in
    closing order: outputs reaching further than what the call received, weights, the data, and
    what a call's own code handed a submodule (`act(gate(x)) * up(x)` before `down`: credited
    to the call, as "input[0] of <submodule>")."""
    values, made = pass_.values, _Made(limit_max, limit_tiny)
    received: Dict[int, list] = {}  # id(call) -> [largest, smallest non-zero] it received
    handed: Dict[int, list] = {}  # id(call) -> the same, of its inputs and weights alone
    for call in pass_.calls:
        got = handed[id(call)] = list(_NOTHING)
        for slot in call.slots:
            value = _value(values, slot) if slot[SLOT_CATEGORY] != OUTPUT else None
            if value is not None:
                _received(got, value)
    for call in pass_.calls:  # closing order: a call's children come before it
        got = received.setdefault(id(call), list(_NOTHING))
        outputs, inputs = [], []
        for slot in call.slots:
            value = _value(values, slot)
            if value is None:
                continue
            category = slot[SLOT_CATEGORY]
            if category == OUTPUT:
                outputs.append((slot, value))
                continue
            _received(got, value)
            if category != INPUT or call.parent is None:  # weights and buffers; the data
                made.credit(call, slot, value, _NOTHING)
            else:
                inputs.append((slot, value))
        parent_got = (received.setdefault(id(call.parent), list(_NOTHING))
                      if call.parent is not None else None)
        if inputs:  # beyond what the parent had by then: its own code made it
            had = list(parent_got)
            _received(had, handed[id(call.parent)])
            for slot, value in inputs:
                if detect.is_mask_fill(values, slot):
                    continue  # an additive mask's torch.finfo(float32).min, built by the parent
                made.credit(call.parent, (f"{slot[SLOT_ROLE]}{_HANDED}{call.module_name}", OUTPUT)
                            + tuple(slot[SLOT_CATEGORY + 1:]), value, had)
        for slot, value in outputs:
            made.credit(call, slot, value, got)
            if parent_got is not None:  # what a child gives out, its parent receives
                _received(parent_got, value)
    return made.found


def _backward_made(pass_: PassRecord, limit_max: float, limit_tiny: float) -> list:
    """(call, slot, kind, value) of each gradient beyond the limits a backward pass's calls
    made, in arrival order: input and parameter gradients reaching further than the output
    gradients (and submodules' input gradients) the call had received; output gradients that
    reach further than what the enclosing call received (its own code made them; at the top,
    the loss)."""
    values, made = pass_.values, _Made(limit_max, limit_tiny)
    received: Dict[int, list] = {}  # id(forward call) -> [largest, smallest non-zero] received
    slots, owner = pass_.slots_in_arrival_order()
    for slot in slots:
        value = _value(values, slot)
        if value is None:
            continue
        call = owner[id(slot)]
        forward = call.forward
        parent = forward.parent if forward is not None else None
        category = slot[SLOT_CATEGORY]
        if category == GRAD_OUTPUT:
            # made by the enclosing call's own code (at the top: by the loss)
            made.credit(call, slot, value,
                        received.get(id(parent), _NOTHING) if parent is not None else _NOTHING)
            _received(received.setdefault(id(forward), list(_NOTHING)), value)
        else:
            made.credit(call, slot, value, received.get(id(forward), _NOTHING))
            if category == GRAD_INPUT and parent is not None:
                _received(received.setdefault(id(parent), list(_NOTHING)), value)
    return made.found
