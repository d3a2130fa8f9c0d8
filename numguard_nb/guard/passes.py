"""What the Guard records during a pass: call records, slots, per-tensor cache entries, and the
pass's one read-back of statistics from the device.

A *slot* is a row before the pass is read back: what one value of a call was, and where its
statistics sit. It is a plain tuple of strings, numbers and a dtype, which the garbage collector
stops tracking at its first look (objects would stay tracked, and thousands per step make full
collections frequent). Its fields, by index:

    (role, category, value kind, dtype, shape, stats index in the pass or None, arrival order)

A *cache entry* is what a pass knows about one tensor, so that a tensor seen by several calls is
summarised (and, for gradients, hooked) once. A list, since its gradient targets are filled in
later:

    [weak reference, version, stats index or None, gradient targets or None, shape, value kind]
"""

from __future__ import annotations

import itertools
import weakref
from typing import Dict, Optional

import torch

from .. import stats as _stats
from .._schema import BACKWARD, VALUE_EMPTY, VALUE_TENSOR, VALUE_UNSUPPORTED

__all__ = [
    "SLOT_ROLE", "SLOT_CATEGORY", "SLOT_KIND", "SLOT_DTYPE", "SLOT_SHAPE", "SLOT_INDEX", "SLOT_SEQ",
    "ENTRY_REF", "ENTRY_VERSION", "ENTRY_INDEX", "ENTRY_TARGETS", "ENTRY_SHAPE", "ENTRY_KIND",
    "FINE", "CallRecord", "PassRecord",
]

# Slot fields (see the module docstring).
SLOT_ROLE, SLOT_CATEGORY, SLOT_KIND, SLOT_DTYPE, SLOT_SHAPE, SLOT_INDEX, SLOT_SEQ = range(7)
# Cache-entry fields (see the module docstring).
ENTRY_REF, ENTRY_VERSION, ENTRY_INDEX, ENTRY_TARGETS, ENTRY_SHAPE, ENTRY_KIND = range(6)

# The problem kinds of a value with nothing wrong with it (see detect.value_kinds).
FINE = frozenset()

_set_grad_enabled = torch._C._set_grad_enabled  # torch.no_grad without its Python-level overhead


class CallRecord:
    """One module call in one phase, as recorded during the pass (names and indices only)."""

    __slots__ = (
        "module_id", "module_name", "module_class", "phase", "batch_number", "call_index",
        "slots", "seq", "is_root", "raised", "backward", "parent", "child_kinds", "root_id",
        "forward", "__weakref__",
    )

    def __init__(self, module_id, name, cls, phase, batch_number, call_index, is_root):
        self.module_id = module_id
        self.module_name = name
        self.module_class = cls
        self.phase = phase
        self.batch_number = batch_number
        self.call_index = call_index
        self.slots: list = []
        self.seq = 0
        self.is_root = is_root
        self.raised = False
        self.backward: Optional[tuple] = None  # (backward pass, backward call) of a forward call
        self.parent: Optional[CallRecord] = None  # the enclosing call, in forward
        self.child_kinds = FINE  # what its direct children's outputs held: it received them
        self.root_id = module_id  # the top-level module whose call this is part of
        self.forward: Optional[CallRecord] = None  # for a backward call: its forward call


class PassRecord:
    """One forward or backward pass: its calls, its tensor cache and its pending statistics."""

    __slots__ = ("calls", "vectors", "values", "cache", "seq", "received", "received_by_module")

    def __init__(self):
        self.calls: list = []
        self.vectors: list = []  # stats vectors still on the device
        self.values: list = []  # stats read back to the host, same indexing
        self.cache: dict = {}  # id(tensor) -> cache entry: one summary (and hook) per tensor
        self.seq = itertools.count()  # arrival order of calls and gradient slots
        # backward: what each forward call's backward has received so far (its output gradients
        # and its direct children's input gradients), by id of the forward call and by module.
        self.received: Dict[int, set] = {}
        self.received_by_module: Dict[int, set] = {}

    def summarise(self, t: torch.Tensor, site, nonzero_min: bool, sign_hints: dict) -> list:
        """The cache entry of `t` in this pass, computing its statistics the first time. `site`
        (module id, role) says where it was seen, for `stats.device_stats`' sign hints."""
        inference = t.is_inference()  # inference tensors have no version counter to cache on
        if not inference:
            key = id(t)
            entry = self.cache.get(key)
            version = t._version
            if entry is not None and entry[ENTRY_REF]() is t and entry[ENTRY_VERSION] == version:
                return entry
        vec = None
        numel = t.numel()
        if numel:
            grad_was_enabled = torch.is_grad_enabled()
            if grad_was_enabled:
                _set_grad_enabled(False)
            try:
                vec = _stats.device_stats(t, nonzero_min, sign_hints, site)
            finally:
                if grad_was_enabled:
                    _set_grad_enabled(True)
        index = None
        if vec is not None:
            index = len(self.vectors)
            self.vectors.append(vec)
        kind = VALUE_TENSOR if index is not None else (VALUE_EMPTY if numel == 0 else VALUE_UNSUPPORTED)
        if inference:
            return [None, None, index, None, _stats.shape_of(t), kind]
        entry = self.cache[key] = [weakref.ref(t), version, index, None, _stats.shape_of(t), kind]
        return entry

    def backward_call(self, forward_call: CallRecord) -> CallRecord:
        """The backward counterpart of a forward call in this backward pass (made on first use:
        a graph can be backpropagated more than once)."""
        known = forward_call.backward
        if known is not None and known[0] is self:
            return known[1]
        call = CallRecord(
            forward_call.module_id, forward_call.module_name, forward_call.module_class,
            BACKWARD, forward_call.batch_number, forward_call.call_index, forward_call.is_root,
        )
        call.root_id = forward_call.root_id
        call.forward = forward_call
        forward_call.backward = (self, call)
        call.seq = next(self.seq)
        self.calls.append(call)
        return call

    def note_received(self, forward_call: Optional[CallRecord], kinds) -> None:
        """Backward: the backward of `forward_call` has received gradients holding `kinds`."""
        if forward_call is None or not kinds:
            return
        self.received.setdefault(id(forward_call), set()).update(kinds)
        self.received_by_module.setdefault(forward_call.module_id, set()).update(kinds)

    def read_back(self) -> None:
        """Move every pending statistic to the host: the pass's one synchronisation."""
        if len(self.values) < len(self.vectors):
            self.values.extend(_stats.to_host(self.vectors[len(self.values):]))

    def release(self) -> None:
        """Drop what only the recording needed, once read back: device memory and tensor refs."""
        self.vectors = []
        self.cache = {}

    def slots_in_arrival_order(self):
        """(every slot of the pass by arrival order, slot id -> the call it belongs to)."""
        slots = sorted((slot for call in self.calls for slot in call.slots), key=_arrival)
        owner = {id(slot): call for call in self.calls for slot in call.slots}
        return slots, owner


def _arrival(slot: tuple) -> int:
    return slot[SLOT_SEQ]
