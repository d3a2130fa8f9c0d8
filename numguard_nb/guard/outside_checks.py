"""The watch's records and its backward half: the torch functions run outside the guarded
modules (`OutsideCall`), the rules that find which one made a value non-finite, and the hooks on
the autograd nodes they created (`BackwardWatch`, the base of `outside.OutsideWatch`).

In backward a node is the culprit when the gradients it gives hold a kind those it received did
not, provided the function that made it gave finite values (else it passed on what it was given:
the data's doing); it is named with the forward line that created it. Its gradients are checked
at once on the host; on a GPU at the end of the backward, or, under a sentinel, read when the
device has them (`deferred`).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import math

import torch

from .. import numerics
from .._util import LiveHandles
from .._schema import (
    BACKWARD, CAUSE_OUTSIDE, FORWARD, GRAD_INPUT, GRAD_OUTPUT, INPUT, OUTPUT, OUTSIDE_MODULE,
    PROBLEM_NEGINF, VALUE_NONE,
)
from . import detect
from .hooks import is_dynamo_compiling
from .outside_ops import aten_ops, likeliest, node_op
from .passes import FINE, SLOT_CATEGORY, BackwardPasses, CallRecord, PassRecord, graph_task_id

__all__ = ["BackwardWatch", "OutsideCall", "dropped_after", "fed_to_the_graph", "from_the_mask"]

IMMEDIATE_DEVICES = frozenset(("cpu",))  # checked op by op: no device to wait for
# A region's or a backward's record: one reduction a device row (abs min is measured for a
# report, `OutsideWatch._raise`).
_LEAN_PASS = partial(PassRecord, abs_min=False)
# How many nodes one function may create that get a hook (a composite makes a few).
MAX_NODES_PER_OP = 16
_INF_KINDS = detect.INF_KINDS
_MASK = detect.MASK
_HALF = (torch.float16, torch.bfloat16)  # summed in float32: their own sums overflow early
_set_grad_enabled = torch._C._set_grad_enabled


class OutsideCall(CallRecord):
    """A torch function run outside the guarded modules (forward), or an autograd node created
    there running in backward: a call record named `<outside>`, with what names it."""

    __slots__ = ("func", "where", "meta", "received", "pass_", "clean", "checked", "op", "in_graph",
                 "stage")

    def __init__(self, cls: str, phase: str, batch_number: int, index: int):
        super().__init__(0, OUTSIDE_MODULE, cls, phase, batch_number, index, True)
        self.func = None  # forward: the torch function
        self.where: Optional[tuple] = None  # the user's line (`user_where`) that ran or made it
        self.meta = None  # forward, read later: (args, kwargs) with `Meta`s, to name its op
        self.received = FINE  # forward: the problem kinds of its scalar arguments
        # forward, read later: its region until read (then `clean` is known; no cycle is left)
        self.pass_: Optional[PassRecord] = None
        self.clean: Optional[bool] = None  # forward: gave nothing non-finite beyond a -inf mask
        self.checked = False  # checked when recorded (its values were on the host)
        self.op: Optional[str] = None  # its ATen op ('SqrtBackward0: aten.sqrt.default'), once named
        # forward: an output of it is in autograd's graph (a loss's backward can judge it; one
        # made under no_grad, an evaluation's loss, no loss can)
        self.in_graph = True
        self.stage: Optional[str] = None  # forward: what the loop ran then (`Report.stage`)


def _received(pass_: PassRecord, call: OutsideCall, category: str) -> set:
    """The problem kinds a recorded call was given: its slots of `category`, and its scalars."""
    kinds = set(call.received)
    for slot in call.slots:
        if slot[SLOT_CATEGORY] == category:
            kinds |= detect.value_kinds(pass_, slot, None)
    return kinds


# The ops that turn a -inf they are given into +inf: a negation, a product or quotient by a
# negative number, a difference (`aten.neg.default`, `aten.mul.Tensor`, ...)
_SIGN_FLIPS = ("aten.neg.", "aten.mul.", "aten.div.", "aten.sub.", "aten.rsub.",
               "aten.nll_loss")  # (the negative log-likelihood of a masked class: +inf)


def from_the_mask(pass_: PassRecord, call: OutsideCall, bad) -> bool:
    """Whether a forward call's new values (`bad`, its slots) are the -inf mask it was given,
    negated (a label-smoothed cross-entropy sums the log-probabilities of every class, the
    masked ones too, and negates them): the mask's maker is the one to name. (An op that makes
    its own inf, an `exp` that overflows, is named itself.)"""
    if call.phase != FORWARD or PROBLEM_NEGINF not in _received(pass_, call, INPUT) \
            or not (call.op or "").startswith(_SIGN_FLIPS):
        return False
    return all(detect.value_kinds(pass_, slot, None) <= _INF_KINDS for slot in bad)


def fed_to_the_graph(pass_: PassRecord, call: OutsideCall) -> bool:
    """Whether code after `call` in its region that autograd records was given non-finite
    values (a target made under no_grad, read by the loss: the loss then judges them)."""
    return any(later.seq > call.seq and later.phase == FORWARD and later.in_graph
               and _received(pass_, later, INPUT) for later in pass_.calls)


def dropped_after(pass_: PassRecord, call: Optional[OutsideCall]) -> bool:
    """With no loss to judge by (an evaluation or an acting loop under no_grad): whether the code
    after `call` in its region (None: all of it, a later region's) dropped the non-finite values
    (a call given some that gave out none: `where`, `masked_fill`, `nan_to_num`) and nothing after
    that holds any."""
    dropped, after = False, call.seq if call is not None else -1
    for later in pass_.calls:
        if later.seq <= after or getattr(later.func, "__name__", "").endswith("_like"):
            continue  # (zeros_like and the like read only the shape: they drop nothing)
        made = any(detect.value_kinds(pass_, slot, None) for slot in later.slots
                   if slot[SLOT_CATEGORY] == OUTPUT)
        if made:
            dropped = False  # (not yet: a value after the drop holds some)
        elif _received(pass_, later, INPUT):
            dropped = True
    return dropped


def _made_new(pass_: PassRecord, call: OutsideCall, inf_allowed: bool) -> list:
    """The slots of a recorded call holding a problem kind it was not given: outputs (forward)
    or the gradients a node gives (backward). A function given non-finite values beyond a -inf
    mask is never blamed: the data or a module made them."""
    forward = call.phase == FORWARD
    received = _received(pass_, call, INPUT if forward else GRAD_OUTPUT)
    if forward and received - _MASK:
        return []
    made = OUTPUT if forward else GRAD_INPUT
    bad = []
    for slot in call.slots:
        if slot[SLOT_CATEGORY] == made:
            new = detect.value_kinds(pass_, slot, None) - received
            if inf_allowed:
                new = new - _INF_KINDS
            if new:
                bad.append(slot)
    return bad


def _learn_clean(pass_: PassRecord, call: OutsideCall, inf_allowed: bool) -> None:
    """Note whether a read-back forward call gave finite values (a -inf mask aside, and the
    infinities the guard allows): only then are the gradients of the nodes it made the nodes'
    own doing (else a non-finite value it was given, and passed on, makes them). An allowed
    inf is not passed on as a nan: the nan its node makes from it is new (CTC's infinite loss
    of a target that cannot fit)."""
    made = set()
    for slot in call.slots:
        if slot[SLOT_CATEGORY] == OUTPUT:
            made |= detect.value_kinds(pass_, slot, None)
    call.clean = made <= (_MASK | _INF_KINDS if inf_allowed else _MASK)
    call.pass_ = None


class _NodeHook:
    """The post-hook of one autograd node created outside the modules. Holds its forward call,
    never the node (a reference to it would keep its graph alive through the hook)."""

    __slots__ = ("watch", "forward", "node")

    def __init__(self, watch: "BackwardWatch", forward: OutsideCall, node: str):
        self.watch = watch
        self.forward = forward
        self.node = node  # 'SqrtBackward0'

    def __call__(self, grad_inputs, grad_outputs):
        self.watch.on_node(self, grad_inputs, grad_outputs)


def _finite(t: torch.Tensor) -> bool:
    """Whether a tensor on the host holds only finite values, from its sum (an inf or nan in it
    makes the sum non-finite; a sum that overflows only sends the value to the full check)."""
    if not t.numel():
        return True
    grad_was_enabled = torch.is_grad_enabled()
    if grad_was_enabled:
        _set_grad_enabled(False)
    try:
        with numerics.unseen():  # (by a user's dispatch mode)
            total = t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum()
        return math.isfinite(numerics.read(total))
    finally:
        if grad_was_enabled:
            _set_grad_enabled(True)


class BackwardWatch:
    """The backward half of `outside.OutsideWatch`: hooks on the nodes the watched functions
    created, and the check of the gradients they give."""

    def __init__(self):
        self.node_handles = LiveHandles(slack=16)  # node hooks (removed on stop)
        self.backward_passes = BackwardPasses()  # graph task id -> the watched nodes' pass
        self.deferred = None  # a sentinel's `StepChecks`: device values read when ready
        self.judge_loss = None  # a sentinel's: given the loss each backward starts from

    def _unhook_nodes(self) -> None:
        self.node_handles.remove_all()
        self.backward_passes.clear()

    def _immediate(self, tensors) -> bool:
        return self.guard.synchronous or all(t.device.type in IMMEDIATE_DEVICES for t in tensors)

    def reads_at_once(self, args) -> bool:
        """Whether a call given `args` is checked at once (its first tensor on the host), not
        in a region read later."""
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return first is None or self._immediate((first,))

    def _hook_nodes(self, call: OutsideCall, outputs, first_node: int) -> None:
        """Put a post-hook on each autograd node the function created: those reached from its
        outputs' nodes numbered from `first_node` on (this thread's numbering, taken before it
        ran; its inputs' nodes come before)."""
        todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
        found: list = []
        while todo and len(found) < MAX_NODES_PER_OP:
            node = todo.pop()
            if type(node).__name__ == "AccumulateGrad" or node._sequence_nr() < first_node \
                    or any(node is other for other in found):
                continue
            found.append(node)
            todo.extend(fn for fn, _ in node.next_functions if fn is not None)
        for node in found:
            self.node_handles.add(node.register_hook(_NodeHook(self, call, node.name())))

    def on_node(self, hook: _NodeHook, grad_inputs, grad_outputs) -> None:
        """A watched node ran in backward: where the gradients it gives are on the host and
        finite, nothing more; else record what it received and gave, and check it (at once on
        the host, at the end of the backward on a device)."""
        forward = hook.forward
        if not self.attached or self.guard.paused or forward.clean is False \
                or is_dynamo_compiling():
            return
        culprit = None
        try:
            given = [g for g in grad_inputs if isinstance(g, torch.Tensor) and g.is_floating_point()]
            if not given or (self._immediate(given) and all(_finite(g) for g in given)):
                return  # the common case: finite gradients, nothing recorded
            _, pass_, _ = self.backward_passes.open(_LEAN_PASS, self._end_backward)
            call = OutsideCall(hook.node, BACKWARD, forward.batch_number, forward.call_index)
            call.forward, call.where = forward, forward.where
            grads = []
            for category, role, values in ((GRAD_OUTPUT, "grad_output", grad_outputs),
                                           (GRAD_INPUT, "grad_input", grad_inputs)):
                for index, grad in enumerate(values):
                    name = role if len(values) == 1 else f"{role}[{index}]"
                    if isinstance(grad, torch.Tensor) and grad.is_floating_point():
                        call.slots.append(self._slot(pass_, grad, name, category))
                        grads.append(grad)
                    else:
                        call.slots.append((name, category, VALUE_NONE, None, None, None,
                                           next(pass_.seq)))
            call.seq = next(pass_.seq)
            pass_.calls.append(call)
            call.checked = self._immediate(grads)
            if call.checked:
                culprit = self._node_culprit(pass_, call)
        except Exception:  # never break the user's backward over the watch's own trouble
            return
        if culprit is not None:
            self.backward_passes.pop(graph_task_id(), None)
            self._raise_backward(*culprit)

    def _node_culprit(self, pass_: PassRecord, call: OutsideCall):
        """(pass, call, bad slots) when a node gave a problem kind it was not given, and the
        function that created it was given finite values; else None."""
        pass_.read_back()
        bad = _made_new(pass_, call, self._inf_allowed())
        forward = call.forward
        if not bad:
            return None
        if forward.clean is None and forward.pass_ is not None:
            forward.pass_.read_back()
            _learn_clean(forward.pass_, forward, self._inf_allowed())
        if not forward.clean:
            return None
        if forward.op is None:
            ops = aten_ops(forward.func, *forward.meta, on_values=False)[0] if forward.meta \
                else []
            forward.op = likeliest(ops, call.module_class) or node_op(call.module_class,
                                                                     forward.func)
        call.op = f"{call.module_class}: {forward.op}"
        return pass_, call, bad

    def _end_backward(self, task) -> None:
        """The end of a backward that ran watched nodes: check those not checked yet (under a
        sentinel on a GPU: when the device has their value, `_read_later`)."""
        pass_ = self.backward_passes.pop(task, None)
        if pass_ is None or not self.attached:
            return
        if not self._read_later(pass_, partial(self._late_nodes, pass_)):
            self._late_nodes(pass_)

    def _late_nodes(self, pass_: PassRecord, values=None) -> None:
        culprit = None
        try:
            for call in pass_.calls:
                culprit = culprit or (None if call.checked else self._node_culprit(pass_, call))
        except Exception:  # never break the user's backward over the watch's own trouble
            culprit = None
        if culprit is not None:
            self._raise_backward(*culprit)
        pass_.release()

    def _reads_later(self) -> bool:
        """Whether regions are read later (a sentinel on a GPU)."""
        return self.deferred is not None and not self.guard.synchronous

    def _region_read_later(self, pass_: Optional[PassRecord]) -> bool:
        """Whether `pass_`'s rows will be read later (a sentinel's, on a GPU)."""
        if pass_ is None or not self._reads_later():
            return False
        row = next((vec for vec in pass_.vectors if vec is not None), None)
        if row is None:
            return False
        device = pass_.sink.device_of(row) if type(row) is int else (
            row[1].device if isinstance(row[1], torch.Tensor) else None)
        return device is not None and device.type in numerics.DEFERRED_DEVICE_TYPES

    def _read_later(self, pass_: PassRecord, action) -> bool:
        """Hand the pass's statistics to the sentinel's checks as one value on the device, with
        `action` for when it is not fine; False where they are on the host (or no sentinel)."""
        if not self._reads_later():
            return False
        value = numerics.stats_flag(pass_.vectors, pass_.sink)
        if value is None:
            return False
        # (never sure: the code may discard what it made, or have made a -inf mask). Its rows
        # go back once read, fine or not: else every step made new blocks of rows (and their
        # views: a few ms a step on a GPU)
        self.deferred.add(value, action, finish=pass_.release, sure=None)
        return True

    def _raise_backward(self, pass_: PassRecord, call: OutsideCall, bad) -> None:
        """Raise a node's culprit, unless it is an overflow the loss scaler skips the step for
        (recorded in `guard.skipped_steps`, as the model's own gradients are)."""
        guard = self.guard
        if guard.scaling.excuses(guard.options, pass_, call, bad, CAUSE_OUTSIDE):
            return
        self._raise(pass_, call, bad)
