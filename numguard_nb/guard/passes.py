"""What the Guard records during a pass: call records, slots, per-tensor cache entries, and the
pass's one read-back of statistics from the device.

Contract: a `CallRecord` is one module call in one phase; its slots are plain tuples, indexed by
`SLOT_ROLE` ... `SLOT_SEQ`: (role, category, value kind, dtype, shape, stats index in the pass or
None, arrival order). A `PassRecord` summarises each tensor once per pass (`summarise`,
`weight_slot`) into a cache entry, a list indexed by `ENTRY_REF` ... `ENTRY_KIND`: [reference,
version, stats index or None, gradient targets or None, shape, value kind]; `read_back()` is the
pass's one read-back. A backward logs its gradients (`log_gradient`) and makes their calls and
slots only when its `calls` are read. On a device a pass writes its weights' and its parameter
gradients' rows together (`summarise_weights`, `summarise`'s `later`; `Holding`: what its
guard's backwards learnt of where it cannot). `PassState`: one thread's place in a forward pass (its open calls, its pass,
its batch; one per thread, `ThreadPasses`); `BackwardPasses`: the backward passes in progress.

Limits: the reference is weak for values, the tensor itself for weights and buffers (their module
holds them anyway); backward passes an error left open are forgotten past `MAX_OPEN`.

    pass_ = PassRecord()
    slot = pass_.weight_slot(lin.weight, "weight", PARAM, (id(lin), "weight"), False, {})
    pass_.read_back()                  # pass_.values[slot[SLOT_INDEX]]: its statistics, on the host
"""

from __future__ import annotations

import itertools
import threading
import weakref
from functools import partial
from typing import Callable, Dict, List, Optional

import torch

from .. import numerics
from .. import stats as _stats
from .._schema import BACKWARD, BUFFER, OUTPUT, PARAM, VALUE_EMPTY, VALUE_TENSOR, VALUE_UNSUPPORTED, WRITTEN_IN_FORWARD
from ..errors import BatchLimitReached

__all__ = [
    "SLOT_ROLE", "SLOT_CATEGORY", "SLOT_KIND", "SLOT_DTYPE", "SLOT_SHAPE", "SLOT_INDEX", "SLOT_SEQ",
    "ENTRY_REF", "ENTRY_VERSION", "ENTRY_INDEX", "ENTRY_TARGETS", "ENTRY_SHAPE", "ENTRY_KIND",
    "FINE", "CallRecord", "PassRecord", "PassState", "ThreadPasses", "BackwardPasses",
    "BatchCounter",
]

# Slot fields (see the module docstring).
SLOT_ROLE, SLOT_CATEGORY, SLOT_KIND, SLOT_DTYPE, SLOT_SHAPE, SLOT_INDEX, SLOT_SEQ = range(7)
# Cache-entry fields (see the module docstring).
ENTRY_REF, ENTRY_VERSION, ENTRY_INDEX, ENTRY_TARGETS, ENTRY_SHAPE, ENTRY_KIND = range(6)

# The problem kinds of a value with nothing wrong with it (see detect.value_kinds).
FINE = frozenset()

_LATER = -1  # in `PassRecord.vectors`: a gradient's row, written at the pass's read
_MAKING_SLOTS = threading.Lock()  # a backward's logged gradients made into slots (`calls`)


def _same_gradient(param, ptr: int, version: int) -> bool:
    """Whether `param.grad` is still the gradient its hook saw (`ptr`, `version`)."""
    grad = param.grad
    try:
        return grad is not None and grad.data_ptr() == ptr and grad._version == version
    except Exception:  # (a hook set a tensor without storage, a sparse one: not the same)
        return False


class Holding:
    """What a guard's backward passes learnt of the parameters whose `.grad` was not the
    gradient their hook saw by the backward's end (`PassRecord.summarise`): summarised as they
    come. The first backwards after attaching learn it without deferring any gradient."""

    __slots__ = ("changed_grads", "to_learn")

    def __init__(self):
        self.changed_grads: set = set()  # ids of parameters (the guard's: alive while attached)
        self.to_learn = LEARNING_PASSES

    def learns(self) -> bool:
        if self.to_learn:
            self.to_learn -= 1
            return True
        return False


LEARNING_PASSES = 2


_set_grad_enabled = torch._C._set_grad_enabled  # torch.no_grad without its Python-level overhead


class CallRecord:
    """One module call in one phase, as recorded during the pass (names and indices only)."""

    __slots__ = (
        "module_id", "module_name", "module_class", "phase", "batch_number", "call_index",
        "slots", "seq", "is_root", "raised", "parent", "root_id",
        "forward", "finite_backward", "recomputed_in", "__weakref__",
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
        self.parent: Optional[CallRecord] = None  # the enclosing call, in forward
        self.root_id = module_id  # the top-level module whose call this is part of
        self.forward: Optional[CallRecord] = None  # for a backward call: its forward call
        self.finite_backward = False  # its module's backward makes no nan (detect's rule)
        # A call recomputed alone in backward (reentrant activation checkpointing): the call
        # its module's first call of the batch sat in, in that earlier pass (backward's rules)
        self.recomputed_in: Optional[CallRecord] = None


def _is_entry_of(entry: list, t: torch.Tensor) -> bool:
    """Whether a cache entry under `id(t)` is `t`'s, not a dead tensor's that had its id. (A held
    entry is `t` itself: it is alive, so no other has its id.)"""
    ref = entry[ENTRY_REF]
    return ref is t or (type(ref) is weakref.ref and ref() is t)


class PassRecord:
    """One forward or backward pass: its calls, its tensor cache and its pending statistics."""

    __slots__ = ("_calls", "children", "vectors", "values", "cache", "seq", "received",
                 "received_by_module", "thread", "delivered", "backward_calls", "sink",
                 "grads_later", "holding", "grads_checked", "weight_ptrs", "gradients",
                 "writes_grads")

    def __init__(self, abs_min: bool = True, holding: Optional["Holding"] = None):
        self._calls: list = []  # (`calls`: with the gradients logged made into slots first)
        # backward: (targets, stats index, value kind, dtype, shape) of each gradient in arrival
        # order, made into its calls' slots only when the pass's calls are read (`calls`): a
        # backward's hooks do no more than this, and a healthy pass nobody reports on never does
        self.gradients: list = []
        self.children: Dict[int, list] = {}  # forward: id(call) -> its direct children, closed
        self.vectors: list = []  # stats vectors still on the device (or their handles in `sink`)
        # where device rows are written; without `abs_min`, one reduction a row (`stats.RowSink`)
        self.sink = _stats.RowSink(abs_min)
        self.values: list = []  # stats read back to the host, same indexing
        self.cache: dict = {}  # id(tensor) -> cache entry: one summary (and hook) per tensor
        self.seq = itertools.count()  # arrival order of calls and gradient slots
        # backward: what each forward call's backward has received so far (its output gradients
        # and its direct children's input gradients), by id of the forward call and by module.
        self.received: Dict[int, set] = {}
        self.received_by_module: Dict[int, set] = {}
        self.thread = threading.get_ident()  # the thread that started it
        # backward: the target lists of leaves whose gradient came (`GradHooks.leaf_targets_of`)
        self.delivered: List[list] = []
        # backward: id of a forward call -> its backward call here. Kept by the backward pass,
        # not on the forward call: a link back would make a reference cycle of every pass,
        # freed only by the garbage collector's full collections.
        self.backward_calls: Dict[int, CallRecord] = {}
        # backward: what the guard's backwards learnt (None: every gradient summarised as it comes)
        self.holding = holding
        # backward: (parameter, index in `vectors`, the gradient's data pointer and version) of
        # gradients whose rows are written together at the pass's read from `.grad` (`summarise`)
        self.grads_later: list = []
        # A backward that learns defers nothing: (parameter, data pointer, version) of the
        # gradients its hooks saw, to find `.grad` the same at its read
        self.grads_checked: Optional[list] = [] if holding is not None and holding.learns() else None
        self.weight_ptrs: dict = {}  # id -> data pointer of the weights summarised at its start
        # backward: whether it writes its leaves' gradients into `.grad` with no process group
        # reducing them (`hooks.ParamHook.grad_as_is`), once asked: the same for all its leaves
        self.writes_grads: Optional[bool] = None

    def summarise(self, t: torch.Tensor, site, nonzero_min: bool, sign_hints: dict,
                  held: bool = False, later=None) -> list:
        """The cache entry of `t` in this pass, computing its statistics the first time. `site`
        (module id, role) says where it was seen, for `stats.device_stats`' sign hints; `held`:
        `t` is a weight or buffer, referenced strongly (see the module docstring). `later`: the
        parameter `t` is the gradient of, which `t` becomes the `.grad` of as it is (no grad
        before, no other hook): where rows are lean and on a device, its row is written at the
        pass's read from that `.grad`, with the others' (`stats.device_stats_many`: a few
        launches for all, not one each; holding `t` meanwhile would make autograd copy it), if
        `.grad` is still `t` then (its data pointer and version). Where it is not (a hook on the
        AccumulateGrad node wrote it: Horovod, Apex; an optimizer stepping in backward; a copy
        to the weight's layout), the row is none and the parameter's gradient is summarised as
        it comes from then on. The first backwards after attaching check that without deferring."""
        inference = t.is_inference()  # inference tensors have no version counter to cache on
        if not inference:
            key = id(t)
            entry = self.cache.get(key)
            version = t._version
            # A held entry under this id is `t` itself (it is alive, so no other has its id).
            if entry is not None and entry[ENTRY_VERSION] == version and (
                    entry[ENTRY_REF] is t or entry[ENTRY_REF]() is t):
                return entry
        vec = None
        numel = t.numel()
        if later is not None and self.holding is not None and not (nonzero_min or self.sink.abs_min) \
                and _stats.written_together(t):
            if self.grads_checked is not None:
                self.grads_checked.append((later, t.data_ptr(), t._version))
            elif id(later) not in self.holding.changed_grads:
                self.grads_later.append((later, len(self.vectors), t.data_ptr(), t._version))
                vec = _LATER
        if vec is None and numel:
            grad_was_enabled = torch.is_grad_enabled()
            if grad_was_enabled:
                _set_grad_enabled(False)
            try:
                vec = _stats.device_stats(t, nonzero_min, sign_hints, site, self.sink)
            finally:
                if grad_was_enabled:
                    _set_grad_enabled(True)
        index = None
        if vec is not None:
            index = len(self.vectors)
            self.vectors.append(vec)
        kind = VALUE_TENSOR if index is not None else (VALUE_EMPTY if numel == 0 else VALUE_UNSUPPORTED)
        try:  # (`stats.shape_of`, inline: a value of every module call goes through here)
            shape = tuple(t.shape)
        except Exception:  # (a strided nested tensor has none)
            shape = None
        if inference:
            return [None, None, index, None, shape, kind]
        entry = self.cache[key] = [t if held else weakref.ref(t), version, index, None, shape, kind]
        return entry

    def summarise_weights(self, tensors: list, nonzero_min: bool) -> None:
        """Summarise the weights and buffers a forward is about to read, at its start and all
        together: a few multi-tensor reductions per device and dtype (`RowSink.write_many`) in
        place of a launch per tensor at each module's call, where a GPU's host time sets a
        step's pace. A call then finds its weights' entries here (`weight_slot`), unless they
        changed since (their version, or their data pointer: `.data` set): summarised again then. Lean rows on a device
        only; elsewhere (CPU read at once, abs min measured) each call summarises its own."""
        if nonzero_min or self.sink.abs_min or not tensors:
            return
        grad_was_enabled = torch.is_grad_enabled()
        if grad_was_enabled:
            _set_grad_enabled(False)
        try:
            handles = _stats.device_stats_many(tensors, self.sink)
        finally:
            if grad_was_enabled:
                _set_grad_enabled(True)
        for t, handle in zip(tensors, handles):
            if handle is not None:
                self.cache[id(t)] = [t, t._version, len(self.vectors), None, _stats.shape_of(t),
                                     VALUE_TENSOR]
                self.weight_ptrs[id(t)] = t.data_ptr()
                self.vectors.append(handle)

    def weight_slot(self, t: torch.Tensor, role: str, category: str, site, nonzero_min: bool,
                    sign_hints: dict) -> tuple:
        """The slot of a weight or buffer (`category`), summarised once per pass and held."""
        if self.weight_ptrs and self.weight_ptrs.get(id(t), 0) != t.data_ptr() and id(t) in self.weight_ptrs:
            del self.weight_ptrs[id(t)]  # `.data` set since the pass's start: summarised again
            self.cache.pop(id(t), None)
        entry = self.summarise(t, site, nonzero_min, sign_hints, True)
        return (role, category, entry[ENTRY_KIND], t.dtype, entry[ENTRY_SHAPE], entry[ENTRY_INDEX], 0)

    def add_weight_slots(self, module, module_id: int, slots: list, nonzero_min: bool,
                         sign_hints: dict) -> None:
        """The slots of a call's parameters and floating buffers, at its start."""
        cache, ptrs = self.cache, self.weight_ptrs
        for name, param in module._parameters.items():
            if param is None:
                continue
            # The common case inline (a module call's hottest loop): summarised at the pass's
            # start or by an earlier call, the same tensor and data since. (`weight_slot` else.)
            entry = cache.get(id(param))
            if entry is not None and entry[ENTRY_REF] is param and entry[ENTRY_VERSION] == param._version \
                    and ptrs.get(id(param)) in (None, param.data_ptr()):
                slots.append((name, PARAM, entry[ENTRY_KIND], param.dtype, entry[ENTRY_SHAPE],
                              entry[ENTRY_INDEX], 0))
            else:
                slots.append(self.weight_slot(param, name, PARAM, (module_id, name), nonzero_min, sign_hints))
        for name, buffer in module._buffers.items():
            # Running statistics go bad like weights; integer/bool buffers cannot.
            if buffer is not None and buffer.is_floating_point():
                slots.append(self.weight_slot(buffer, name, BUFFER, (module_id, name), nonzero_min, sign_hints))

    def note_written_buffers(self, call: CallRecord, module, nonzero_min: bool, sign_hints: dict,
                             recorder=None) -> None:
        """Buffers a forward call changed in place or assigned anew (an EMA, a codebook's
        statistics): what it wrote is something it produced, summarised again as one of its
        outputs ("embed (after forward)"). (A change through `.data`, or BatchNorm's kernel
        updating its running statistics, moves no version counter: the next call finds what
        they hold.) `recorder` (an `ops.OpRecorder`, under ops=True) learns which were written."""
        written = []
        for name, buffer in module._buffers.items():
            if buffer is None or not buffer.is_floating_point() or buffer.is_inference():
                continue  # (an inference tensor keeps no version to tell by)
            entry = self.cache.get(id(buffer))  # what the call's start summarised; none: a new one
            if entry is None or not _is_entry_of(entry, buffer) or entry[ENTRY_VERSION] != buffer._version:
                call.slots.append(self.weight_slot(buffer, name + WRITTEN_IN_FORWARD, OUTPUT,
                                                   (call.module_id, name), nonzero_min, sign_hints))
                written.append(name)
        if written and recorder is not None:
            recorder.note_written(module, written)

    @property
    def calls(self) -> list:
        """The pass's calls, forward in closing order, backward in the order their first
        gradient came (the gradients logged made into slots first: `slots_of`)."""
        if self.gradients:
            self._slot_gradients()
        return self._calls

    def count_calls(self, up_to: int) -> int:
        """How many calls the pass has, counted no further than `up_to`, without making the
        logged gradients' slots (a backward call for each forward call a gradient targets)."""
        if not self.gradients:
            return min(len(self._calls), up_to)
        forward_calls = set(self.backward_calls)  # (ids of the forward calls of those made)
        for targets, *_ in self.gradients:
            for position in range(0, len(targets), 3):
                forward_calls.add(id(targets[position]))
            if len(forward_calls) >= up_to:
                return up_to
        return len(forward_calls)

    def log_gradient(self, targets, entry: list, dtype) -> None:
        """A gradient has come for `targets` (forward call, role, category, one after another),
        summarised as `entry`: its slots are made when the calls are read, for the targets it
        had when it came (a tuple: a list of targets a forward still open adds to is copied)."""
        self.gradients.append((tuple(targets), entry[ENTRY_INDEX], entry[ENTRY_KIND], dtype,
                               entry[ENTRY_SHAPE]))

    def _slot_gradients(self) -> None:
        # One thread at a time; the log emptied once its slots are all made, so that a reader
        # finding it empty finds every slot made (threads reading one pass: `RecentPasses`).
        with _MAKING_SLOTS:
            logged = self.gradients
            for gradient in logged:
                for _ in self._make_slots(*gradient):
                    pass
            self.gradients = []

    def slots_of(self, targets, index, kind, dtype, shape):
        """Make the slots of one gradient in its backward calls (those logged before it made
        first): an iterator of (slot, call), each made as it is asked for."""
        if self.gradients:
            self._slot_gradients()
        return self._make_slots(targets, index, kind, dtype, shape)

    def _make_slots(self, targets, index, kind, dtype, shape):
        # Targets were registered in forward order; backward reaches them in reverse (a tensor
        # that is A's output and B's input is B's input gradient before it is A's output's).
        for position in range(len(targets) - 3, -1, -3):
            forward_call, role, category = targets[position:position + 3]
            call = self.backward_calls.get(id(forward_call)) or self.backward_call(forward_call)
            slot = (role, category, kind, dtype, shape, index, next(self.seq))
            call.slots.append(slot)
            yield slot, call

    def close(self, call: CallRecord) -> None:
        """A forward call has closed: next in the pass's order, and among its parent's children."""
        call.seq = next(self.seq)
        self._calls.append(call)
        if call.parent is not None:
            self.children.setdefault(id(call.parent), []).append(call)

    def backward_call(self, forward_call: CallRecord) -> CallRecord:
        """The backward counterpart of a forward call in this backward pass (made on first use:
        a graph can be backpropagated more than once)."""
        known = self.backward_calls.get(id(forward_call))  # (its .forward keeps the id taken)
        if known is not None:
            return known
        call = CallRecord(
            forward_call.module_id, forward_call.module_name, forward_call.module_class,
            BACKWARD, forward_call.batch_number, forward_call.call_index, forward_call.is_root,
        )
        call.root_id = forward_call.root_id
        call.forward = forward_call
        self.backward_calls[id(forward_call)] = call
        call.seq = next(self.seq)
        self._calls.append(call)
        return call

    def note_received(self, forward_call: Optional[CallRecord], kinds) -> None:
        """Backward: the backward of `forward_call` has received gradients holding `kinds`."""
        if forward_call is None or not kinds:
            return
        self.received.setdefault(id(forward_call), set()).update(kinds)
        self.received_by_module.setdefault(forward_call.module_id, set()).update(kinds)

    def read_back(self) -> None:
        """Move every pending statistic to the host: the pass's one synchronisation."""
        if self.grads_later:
            self._write_grads_later()
        if self.grads_checked:
            checked, self.grads_checked = self.grads_checked, []
            for param, ptr, version in checked:
                if not _same_gradient(param, ptr, version):
                    self.holding.changed_grads.add(id(param))
        if len(self.values) < len(self.vectors):
            numerics.count_read()
            self.values.extend(_stats.to_host(self.vectors[len(self.values):], self.sink))

    def _write_grads_later(self) -> None:
        """The rows of the gradients `summarise` left for now, from their parameters' `.grad`
        (None for one no longer the gradient: no statistics, never another value's)."""
        later, self.grads_later = self.grads_later, []
        same = []
        for param, index, ptr, version in later:
            if _same_gradient(param, ptr, version):
                same.append((param.grad, index))
            else:
                self.vectors[index] = None
                self.holding.changed_grads.add(id(param))
        with torch.no_grad():
            handles = _stats.device_stats_many([grad for grad, _ in same], self.sink)
            for (grad, index), handle in zip(same, handles):
                self.vectors[index] = handle if handle is not None else \
                    _stats.device_stats(grad, False, None, None, self.sink)

    def measure_abs_min(self, minus_inf_only: bool = False) -> bool:
        """Measure the abs min a lean pass left unmeasured (`stats.UNMEASURED`), for a report
        (`minus_inf_only`: of values holding -inf, which mask rules judge by their zeros), with
        one read: of the values still alive and unchanged since they were summarised, by their
        version and, for writes that move none (`.data`, BatchNorm's kernel), their abs max.
        Whether any was measured."""
        values, found = self.values, []
        for entry in list(self.cache.values()):  # (another autograd thread may add entries)
            index = entry[ENTRY_INDEX]
            row = values[index] if index is not None and index < len(values) else None
            if row is None or row[0] != _stats.UNMEASURED or (minus_inf_only and not row[2] < 0):
                continue
            ref = entry[ENTRY_REF]
            t = ref if isinstance(ref, torch.Tensor) else ref()
            if t is not None and t._version == entry[ENTRY_VERSION]:
                found.append((index, t))
        if not found:
            return False
        numerics.count_read()
        with torch.no_grad():
            measured = _stats.smallest_magnitudes([t for _, t in found])
        changed = False
        for (index, _), pair in zip(found, measured):
            if pair is not None and pair[1] == values[index][1]:
                values[index] = (pair[0],) + tuple(values[index][1:])
                changed = True
        return changed

    def summarised(self, t: torch.Tensor) -> bool:
        """Whether the pass summarised `t` (the very tensor) and still holds its entry."""
        entry = self.cache.get(id(t))
        return entry is not None and _is_entry_of(entry, t)

    def release(self) -> None:
        """Drop what only the recording needed, once read back: device memory and tensor refs."""
        self.vectors = []
        self.cache = {}
        self.grads_later = []
        self.sink.release()

    def slots_in_arrival_order(self):
        """(every slot of the pass by arrival order, slot id -> the call it belongs to)."""
        slots = sorted((slot for call in self.calls for slot in call.slots), key=_arrival)
        owner = {id(slot): call for call in self.calls for slot in call.slots}
        return slots, owner


def _arrival(slot: tuple) -> int:
    return slot[SLOT_SEQ]


# A thread's calls kept per leaf, and leaves kept, while no batch starts and no gradient comes.
MAX_LEAF_CALLS = 256
MAX_LEAF_LISTS = 1024


class PassState:
    """One thread's place in a forward pass: the calls open on its stack, the pass they record
    into, and the batch it is running (threads calling one model each run their own batches)."""

    __slots__ = ("stack", "forward", "call_counts", "tracing", "batch_number", "root_frame_ref",
                 "leaf_lists", "_kept_lists", "first_calls", "compiled_call")

    def __init__(self, batch_number: int = 0):
        self.root_frame_ref = None  # see `watch_top_level_call`
        self.stack: List[CallRecord] = []
        self.forward: Optional[PassRecord] = None
        self.call_counts: Dict[int, int] = {}  # module id -> its calls so far in the batch
        self.first_calls: Dict[int, CallRecord] = {}  # module id -> its first call in the batch
        self.tracing = False  # the batch is one of `trace_batches`
        self.batch_number = batch_number
        # this thread's target lists of the leaves it fed to modules in its batch, by id
        self.leaf_lists: Dict[int, list] = {}
        self._kept_lists = 0  # after the last pruning
        # The top-level call of a compiled model running now (its module, inputs and call
        # state, by reference): re-run eagerly on a detection (`hooks._CompiledWeights`).
        self.compiled_call: Optional[tuple] = None

    def note_leaf_targets(self, targets: list) -> None:
        """This thread added a call to a leaf's target list (`hooks.LeafTargets`). Bounded where
        a batch never starts (calls of a guarded model other than the first) and a leaf's
        gradient never comes: lists emptied by a backward are dropped, and past the caps the
        oldest calls are forgotten."""
        if len(targets) > 3 * MAX_LEAF_CALLS:
            del targets[:len(targets) - 3 * (MAX_LEAF_CALLS // 2)]
        lists = self.leaf_lists
        if id(targets) in lists:
            return
        lists[id(targets)] = targets
        if len(lists) > 2 * self._kept_lists + 16:
            kept = {key: value for key, value in lists.items() if value}
            if len(kept) > MAX_LEAF_LISTS:
                for key in list(kept)[:len(kept) - MAX_LEAF_LISTS // 2]:
                    kept.pop(key).clear()
            self.leaf_lists, self._kept_lists = kept, len(kept)

    def forget_leaf_targets(self) -> None:
        """A new batch: the calls this thread gave the leaves in the last one are done with (its
        backward came and went, or never came: evaluation with grad on)."""
        for targets in self.leaf_lists.values():
            targets.clear()
        self.leaf_lists, self._kept_lists = {}, 0

    def reset(self) -> None:
        """Forget the pass in progress (kept: the batch number)."""
        self.stack.clear()  # in place: the hooks hold it
        self.forward = None
        self.call_counts.clear()
        self.first_calls.clear()
        self.tracing = False

    def forget_when_gone(self, frame_local) -> None:
        """Forget the pass just started if the frame of its top-level call goes before it ends:
        an interrupt (Ctrl-C) skips the hooks that close calls. `frame_local`: an object that
        lives as long as that frame, or None (then the guard finds out at the next call made from
        outside the pass's open calls)."""
        if frame_local is not None:
            self.root_frame_ref = weakref.ref(frame_local, partial(_forget_if_open, self, self.forward))

    def keep_running_calls(self, running: Dict[int, int]) -> int:
        """Drop the open calls whose forward no longer runs (an interrupt skipped the hooks
        that close calls); `running`: module id -> its calls running up the thread's stack.
        Returns how many calls stay open."""
        kept = 0
        for call in self.stack:
            if running.get(call.module_id, 0) <= 0:
                break
            running[call.module_id] -= 1
            kept += 1
        del self.stack[kept:]
        return kept


def _forget_if_open(state: PassState, pass_: PassRecord, _gone) -> None:
    if state.forward is pass_:
        state.reset()


# graph_task_id(): id of the autograd graph task running the caller (-1 outside backward); torch's
# own function, called as it is (a gradient hook's hottest line asks it).
graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


class BackwardPasses(dict):
    """The backward passes in progress: autograd graph task id -> what one of the guard's parts
    keeps of it (full mode and the loss watch: a PassRecord; the sentinel: the calls it went
    through). The one lifecycle: opened on first use in a pass, closed once, at its end."""

    # Backward passes that ended in an exception are never closed by autograd; past this many
    # open ones, they are all forgotten.
    MAX_OPEN = 64

    def open(self, make: Callable, at_end: Callable) -> tuple:
        """(task, state, opened) of the backward pass running the caller: its state, made by
        `make()` on first use, when `at_end(task)` is queued to run once autograd ends it."""
        task = graph_task_id()
        state = self.get(task)
        if state is not None:
            return task, state, False
        if len(self) > self.MAX_OPEN:
            self.clear()  # passes an error or a culprit ended early
        state = self[task] = make()
        torch.autograd.Variable._execution_engine.queue_callback(partial(at_end, task))
        return task, state, True

    def forget_open(self) -> None:
        """This thread starts a forward pass, so it is in no backward: the passes it opened
        raised before their end."""
        me = threading.get_ident()
        for task, pass_ in list(self.items()):  # a snapshot: other threads add theirs
            if pass_.thread == me:
                self.pop(task, None)
        if len(self) > self.MAX_OPEN:
            self.clear()


class ThreadPasses(threading.local):
    """`.state`: the calling thread's `PassState`, made on its first use in each thread, in the
    batch `current_batch()` says is running."""

    def __init__(self, current_batch: Callable[[], int]):
        self.state = PassState(current_batch())


class BatchCounter:
    """Numbers batches, in whichever thread they start; stops at `abort_after_batch`. Says
    which model's top-level calls start them: the first of the guard's models or, with
    `from_first_call` (the magics given no names: the namespace's order puts a loss module, a
    teacher or an old model first), the first one called."""

    def __init__(self):
        self.started = 0
        self._lock = threading.Lock()
        self.model_id: Optional[int] = None  # the model whose calls start batches
        self.from_first_call = False
        self.by_caller = False  # the guard's begin_batch() starts them: no call does
        # What the loop runs now besides training batches, said by its caller ("" for training)
        self.stage = ""

    def attached(self, models: dict) -> None:
        """The guard attaches to `models` (name -> module)."""
        model_ids = [id(model) for model in models.values()]
        if not self.from_first_call:
            self.model_id = next(iter(model_ids), None)
        elif self.model_id not in model_ids:
            self.model_id = None  # the next model called

    def starts(self, model_id: int) -> bool:
        """Whether a top-level call of this model (its id) starts a batch."""
        if self.by_caller:
            return False
        if self.model_id is None:
            self.model_id = model_id
        return model_id == self.model_id

    def next(self, limit: Optional[int]) -> int:
        """The number of the batch starting now; BatchLimitReached past batch `limit`."""
        with self._lock:
            batch = self.started
            if limit is not None and batch > limit:
                raise BatchLimitReached(
                    f"numguard: stopped before batch {batch} because abort_after_batch="
                    f"{limit} (batches 0..{limit} ran)"
                )
            self.started += 1
            return batch
