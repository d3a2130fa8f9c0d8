"""Who made the first non-finite value: the producer-vs-carrier rules, over a pass's recorded slots.

A value's *kinds* say what is wrong with it: a subset of {nan, +inf, -inf, overflow}. Kinds are
compared between what a call received and what it gave out: a -inf attention mask passing
through a call is no news, a +inf appearing next to it is. So the culprit is the first call
whose outputs (forward) or input and parameter gradients (backward) hold a kind that nothing it
received held; weights, buffers and the data fed to the model are named as such.

Every function reads slots (see `passes`) and a pass's host values. `rules` is anything with
`limit_max` (a float, or None) and `inf_allowed(module_name) -> bool`: a `GuardOptions` is one.
A culprit is `(call, bad slots, cause)`, the cause one of `_schema`'s CAUSE_* names.

Forward, the rules read the records and change nothing: what a call received from its children
is derived from them (`received_from_children`). Backward, where gradients are judged in arrival
order and sync mode feeds them one at a time, the search notes on the pass what each backward
call has received so far (`PassRecord.note_received`).
"""

from __future__ import annotations

import math
import sys

import torch

from .. import stats as _stats
from .._schema import (
    BACKWARD, BUFFER, CAUSE_BACKWARD, CAUSE_BACKWARD_INLINE, CAUSE_DATA, CAUSE_FORWARD,
    CAUSE_FORWARD_INLINE, CAUSE_LOSS_GRADIENT, CAUSE_UNATTRIBUTED, CAUSE_WEIGHTS, GRAD_INPUT,
    GRAD_OUTPUT, GRAD_PARAM, INPUT, MATMUL_MODULES, OUTPUT, PARAM, PROBLEM_NAN, PROBLEM_NEGINF,
    PROBLEM_OVERFLOW, PROBLEM_POSINF,
)
from .passes import FINE, SLOT_CATEGORY, SLOT_DTYPE, SLOT_INDEX, SLOT_ROLE, SLOT_SEQ, PassRecord

__all__ = [
    "NAN", "OVERFLOW", "INF_KINDS", "NONFINITE", "MASK", "has_problem", "value_kinds", "is_linear_map",
    "only_minus_inf",
    "forward_culprit", "received_from_children", "mask_maker", "is_mask", "backward_culprit", "first_nan", "find_in_forward",
    "find_in_backward", "find_in_trace",
]

NAN = frozenset((PROBLEM_NAN,))
OVERFLOW = frozenset((PROBLEM_OVERFLOW,))  # finite, but beyond limit_dtype's largest value
INF_KINDS = frozenset((PROBLEM_POSINF, PROBLEM_NEGINF, PROBLEM_OVERFLOW))  # what allow_inf allows
NONFINITE = frozenset((PROBLEM_NAN, PROBLEM_POSINF, PROBLEM_NEGINF))
MASK = frozenset((PROBLEM_NEGINF,))  # what an attention mask holds besides finite values


def has_problem(pass_: PassRecord, limit_max) -> bool:
    """Quick scan of a pass: any nan/inf (or, with `limit_max`, any value beyond it)?"""
    limit = limit_max if limit_max is not None else sys.float_info.max
    try:
        for values in pass_.values:
            # `not x <= limit` is true for nan, inf and overflow alike.
            if not values[1] <= limit or values[0] != values[0]:
                return True
    except TypeError:  # a row that could not be read back (None): skip those, at no cost above
        return any(not values[1] <= limit or values[0] != values[0]
                   for values in pass_.values if values is not None)
    return False


def value_kinds(pass_: PassRecord, slot: tuple, limit_max) -> frozenset:
    """What is wrong with one value: a subset of {'nan', '+inf', '-inf', 'overflow'}. A value
    without statistics (its numbers could not be read) has nothing wrong that anyone saw."""
    if slot[SLOT_INDEX] is None:
        return FINE
    values = pass_.values[slot[SLOT_INDEX]]
    if values is None:
        return FINE
    abs_min, abs_max = values[0], values[1]
    if math.isnan(abs_max) or math.isnan(abs_min):
        return NAN
    if abs_max == math.inf:
        _, _, _, posinf, neginf, _ = _stats.decode(values)
        return frozenset(k for k, present in ((PROBLEM_POSINF, posinf), (PROBLEM_NEGINF, neginf))
                         if present)
    if limit_max is not None and abs_max > limit_max and slot[SLOT_DTYPE] is not None \
            and slot[SLOT_DTYPE].is_floating_point:
        return OVERFLOW
    return FINE


def forward_culprit(pass_: PassRecord, calls, rules):
    """(call, bad slots, cause) of the first of `calls` (in closing order) that produced a
    non-finite value, or None.

    The data and masks: a nan in the data is always the data's; an inf or -inf in the data is
    the data's once it turns into something new in any call, or reaches the model's output; a
    -inf mask (made from finite values by a mask builder, or passed in as zeros and -inf) is
    no culprit by itself, but its consumer is once it makes nan or +inf (`mask_maker` says
    where the -inf came from), and the mask's maker (or the data) is once the -inf reaches the
    model's output."""
    limit_max = rules.limit_max
    for call in calls:
        received = received_from_children(pass_, call, limit_max)
        from_parent = set()  # what came in through the call's inputs
        bad_params, bad_inputs, produced = [], [], []
        for slot in call.slots:
            kinds = value_kinds(pass_, slot, limit_max)
            if not kinds:
                continue
            category = slot[SLOT_CATEGORY]
            if category == PARAM or (category == BUFFER and (PROBLEM_NAN in kinds or (
                    PROBLEM_POSINF in kinds and slot[SLOT_ROLE] in RUNNING_STATISTICS))):
                bad_params.append(slot)  # (a running variance that overflowed is no mask)
                received |= kinds
            elif category == BUFFER:  # a stored -inf mask is something it received
                received |= kinds
            elif category == INPUT:
                received |= kinds
                from_parent |= kinds
                if call.is_root and (PROBLEM_NAN in kinds or PROBLEM_OVERFLOW in kinds):
                    bad_inputs.append(slot)  # (data beyond limit_dtype's range: with stop_at_limit)
        if bad_params:
            return call, bad_params, CAUSE_WEIGHTS
        if bad_inputs:
            return call, bad_inputs, CAUSE_DATA
        if call.raised and not rules.inf_allowed(call.module_name):
            # (no output: what it handed its submodules is what its code made)
            handed = _handed_new(pass_, call, received, limit_max)
            if handed:
                return call, handed, CAUSE_FORWARD_INLINE
        if PROBLEM_OVERFLOW in from_parent and call.parent is not None:
            inline = _inline_overflow(pass_, call, rules)  # (a product past limit_dtype's range
            if inline is not None:  # handed to a Linear that brings it back within)
                return inline
        allowed = rules.inf_allowed(call.module_name)
        given, made = set(), set()
        for slot in call.slots:
            if slot[SLOT_CATEGORY] != OUTPUT:
                continue
            kinds = value_kinds(pass_, slot, limit_max)
            given |= kinds
            new = kinds - received
            if allowed:
                new = new - INF_KINDS
            if new:
                produced.append(slot)
                made |= new
        if produced and from_parent & NONFINITE:
            data = _data_culprit(pass_, call, limit_max)
            if data is not None:  # the data's inf turned into something new here
                return data
        if produced and (not made <= MASK or is_linear_map(call.module_class)):
            # (an enclosing call's own code may have made the +inf it turned into this)
            return _inline_overflow(pass_, call, rules) or (call, produced, CAUSE_FORWARD)
        if call.parent is None and given & NONFINITE:
            reached = _reached_output(pass_, call, given, produced, rules)
            if reached is not None:
                return reached
    return None


# A normalisation's running statistics: +inf there is an overflow (a running minimum may start
# at +inf, a stored mask hold -inf).
RUNNING_STATISTICS = frozenset(("running_var", "running_mean"))


def _inline_overflow(pass_: PassRecord, call, rules):
    """(the enclosing call, `call`'s inputs holding +inf, CAUSE_FORWARD_INLINE) when the +inf
    `call` received was made by that call's own code between its submodules (an overflow, never
    a mask: `torch.exp(scores)` before a Linear or a softmax module), or None: when a call that
    closed before gave out a +inf (an allowed one: it carried it), the enclosing calls were
    handed one, or that call may make inf (`allow_inf`). For a linear map (a Linear, a conv)
    -inf counts too: no mask is fed to a matmul, and an fp16 product (`act(gate) * up`) that
    overflows may do so to -inf alone."""
    limit_max = rules.limit_max
    kinds = {PROBLEM_POSINF, PROBLEM_OVERFLOW}  # (an overflow of limit_dtype: with stop_at_limit)
    if is_linear_map(call.module_class):
        kinds.add(PROBLEM_NEGINF)

    def holds(slot) -> bool:
        found = value_kinds(pass_, slot, limit_max) & kinds
        return bool(found) and not (found == OVERFLOW and is_mask_fill(pass_.values, slot))

    inputs = [slot for slot in call.slots if slot[SLOT_CATEGORY] == INPUT and holds(slot)]
    if not inputs:
        return None
    for other in pass_.calls:
        if other.seq < call.seq and other is not call and any(
                slot[SLOT_CATEGORY] == OUTPUT and holds(slot) for slot in other.slots):
            return None
    maker = call.parent
    while maker is not None and any(
            slot[SLOT_CATEGORY] in (INPUT, PARAM, BUFFER) and holds(slot) for slot in maker.slots):
        maker = maker.parent
    if maker is None or rules.inf_allowed(maker.module_name):
        return None
    return maker, inputs, CAUSE_FORWARD_INLINE


# The largest finite values of the floating dtypes: an additive mask is filled with
# `torch.finfo(dtype).min` (transformers' causal masks), no overflow of limit_dtype.
MASK_FILLS = frozenset(float(torch.finfo(dtype).max) for dtype in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64))


def is_mask_fill(values: list, slot: tuple) -> bool:
    """Whether a value's largest magnitude is a dtype's largest finite value: a mask's fill."""
    index = slot[SLOT_INDEX]
    row = values[index] if index is not None and values is not None else None
    return row is not None and row[1] in MASK_FILLS


def _handed_new(pass_: PassRecord, call, received: set, limit_max) -> list:
    """The inputs of `call`'s direct children holding a problem `call` did not receive (from its
    own inputs, weights, or a child before): what its own code made between its submodules."""
    news = set(received)
    for child in sorted(pass_.children.get(id(call), ()), key=lambda c: c.seq):
        handed = [slot for slot in child.slots if slot[SLOT_CATEGORY] == INPUT
                  and value_kinds(pass_, slot, limit_max) - news - MASK]
        if handed:
            return handed
        for slot in child.slots:
            if slot[SLOT_CATEGORY] == OUTPUT:
                news |= value_kinds(pass_, slot, limit_max)
    return []


def received_from_children(pass_: PassRecord, call, limit_max) -> set:
    """What `call`'s direct children gave out beyond what it handed them (an allowed inf, a
    stored mask, a mask one built): news `call` received. What a child only passed on came from
    `call`, which may have made it."""
    received = set()
    for child in pass_.children.get(id(call), ()):
        given, handed = set(), set()
        for slot in child.slots:
            category = slot[SLOT_CATEGORY]
            if category == OUTPUT:
                given |= value_kinds(pass_, slot, limit_max)
            elif category == INPUT:
                handed |= value_kinds(pass_, slot, limit_max)
        received |= given - handed
    return received


def only_minus_inf(pass_: PassRecord, call, bad_slots, cause) -> bool:
    """Whether a module's forward culprit made nothing but -inf, and no overflow (a matmul's): a
    mask that reached the model's output (illegal actions' logits), harmful only if the loss is
    not finite. (An -inf in the data is the data's at once.)"""
    kinds = set()
    for slot in bad_slots:
        kinds |= value_kinds(pass_, slot, None)
    return kinds == {PROBLEM_NEGINF} and cause == CAUSE_FORWARD and not is_linear_map(call.module_class)


def is_linear_map(module_class: str) -> bool:
    """Whether a module of this class computes a matmul or a convolution of its input: a -inf
    it makes from finite values passed the dtype's largest value (an fp16 overflow), whatever
    its sign; never a mask."""
    return module_class in MATMUL_MODULES


# torch.nn's and transformers' modules whose backward makes no nan from finite values of a
# moderate size: matmuls, normalisations with an eps, smooth or piecewise-linear activations,
# dropout and reshapes (large gradients can overflow inside them: inf - inf is nan). A new nan in
# the input gradient of one, which received only such gradients, was made by another use of its
# input: an input's gradient sums them all. (Not softmax: -inf in, nan back.)
FINITE_BACKWARD_MODULES = MATMUL_MODULES | frozenset((
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
    "LazyBatchNorm2d", "LazyBatchNorm3d", "LayerNorm", "GroupNorm", "InstanceNorm1d",
    "InstanceNorm2d", "InstanceNorm3d", "RMSNorm",
    "ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "ELU", "CELU", "SELU", "GELU", "SiLU", "Mish",
    "Hardtanh", "Hardsigmoid", "Hardswish", "Softplus", "Softsign", "Tanh", "Sigmoid",
    "Tanhshrink", "Softshrink", "Hardshrink", "GLU",
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout",
    "Identity", "Flatten", "Unflatten",
    "NewGELUActivation", "GELUActivation", "FastGELUActivation", "QuickGELUActivation",
    "GELUTanh", "PytorchGELUTanh", "AccurateGELUActivation", "SiLUActivation", "MishActivation",
    "LinearActivation", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "T5LayerNorm",
))
_HOMES = ("torch.nn.", "transformers.")
_finite_backward_of: dict = {}  # module class -> backward_makes_no_nan


def backward_makes_no_nan(module_type: type) -> bool:
    """Whether a module of this class makes no nan in backward from finite values of a moderate
    size: a linear map (by its name, as before: transformers' Conv1D, bitsandbytes' layers), or
    one of torch.nn's or transformers' own classes above (a user's class of the same name may
    do anything)."""
    known = _finite_backward_of.get(module_type)
    if known is None:
        name = module_type.__name__
        known = _finite_backward_of[module_type] = name in MATMUL_MODULES or (
            name in FINITE_BACKWARD_MODULES
            and (getattr(module_type, "__module__", "") or "").startswith(_HOMES))
    return known


def _received_moderately(pass_: PassRecord, call, dtype) -> bool:
    """Whether the gradients a backward call received are all far below its dtype's largest
    value (below its square root): no sum or product of them inside its backward overflows."""
    try:
        bound = math.sqrt(torch.finfo(dtype).max)
    except (TypeError, ValueError):
        return False
    largest = 0.0
    for slot in call.slots:
        if slot[SLOT_CATEGORY] == GRAD_OUTPUT:
            index = slot[SLOT_INDEX]
            row = pass_.values[index] if index is not None else None
            if row is None:
                return False
            largest = max(largest, row[1])
    return largest < bound


def _data_culprit(pass_: PassRecord, call, limit_max, masks_too=False):
    """(top-level call, its non-finite inputs, data) when the data fed to the model holds nan
    or an inf (what `call` received from its parents may have come from there), or None. A
    mask passed in (zeros and -inf) counts only with `masks_too`."""
    root = call
    while root.parent is not None:
        root = root.parent
    bad = [slot for slot in root.slots if slot[SLOT_CATEGORY] == INPUT
           and value_kinds(pass_, slot, limit_max) & NONFINITE
           and (masks_too or not is_mask(pass_, slot, limit_max))]
    return (root, bad, CAUSE_DATA) if bad else None


def is_mask(pass_: PassRecord, slot: tuple, limit_max) -> bool:
    """Does the value look like an additive mask: -inf next to zeros, nothing else wrong?"""
    return value_kinds(pass_, slot, limit_max) == MASK and pass_.values[slot[SLOT_INDEX]][0] == 0


def _reached_output(pass_: PassRecord, root, given, produced, rules):
    """A top-level call's output holds an inf or nan (a model's output goes to the loss): the
    data's doing when the data held one, else a -inf's maker's (a guarded call, or the call's
    own code: `produced`), or None (a stored mask buffer, an allowed maker)."""
    limit_max = rules.limit_max
    data = _data_culprit(pass_, root, limit_max, masks_too=True)
    if data is not None:
        return data
    if PROBLEM_NEGINF not in given:
        return None
    if produced:
        return root, produced, CAUSE_FORWARD
    maker = mask_maker(pass_, root, limit_max)
    if maker is None or rules.inf_allowed(maker.module_name):
        return None
    bad = [slot for slot in maker.slots if slot[SLOT_CATEGORY] == OUTPUT
           and PROBLEM_NEGINF in value_kinds(pass_, slot, limit_max)]
    return maker, bad, CAUSE_FORWARD


def mask_maker(pass_: PassRecord, call, limit_max):
    """The call that made the -inf `call` received, from values without one (a mask builder):
    the one whose output is the very value `call` received, through the calls that carried it;
    else the last such maker before it; None when no guarded call made it (an enclosing call's
    own code did)."""
    # What it received, or (a top-level call's output) gave out: the Guard's cache gives a value
    # seen by several calls one stats index.
    wanted = {slot[SLOT_INDEX] for slot in call.slots if slot[SLOT_CATEGORY] in (INPUT, OUTPUT)
              and PROBLEM_NEGINF in value_kinds(pass_, slot, limit_max)}
    last_maker = None
    earlier = [other for other in pass_.calls if other.seq < call.seq and other is not call]
    for other in reversed(earlier):
        outputs = [slot for slot in other.slots if slot[SLOT_CATEGORY] == OUTPUT
                   and PROBLEM_NEGINF in value_kinds(pass_, slot, limit_max)]
        if not outputs:
            continue
        received = [slot for slot in other.slots if slot[SLOT_CATEGORY] in (INPUT, PARAM, BUFFER)
                    and PROBLEM_NEGINF in value_kinds(pass_, slot, limit_max)]
        makes = not received and PROBLEM_NEGINF not in received_from_children(pass_, other,
                                                                                limit_max)
        if any(slot[SLOT_INDEX] in wanted for slot in outputs):
            if makes:
                return other
            wanted |= {slot[SLOT_INDEX] for slot in received}  # carried: follow it back
        elif makes and last_maker is None:
            last_maker = other
    return last_maker


def backward_culprit(pass_: PassRecord, slots, owner, rules):
    """The first gradient (in arrival order) made non-finite by a call: a call's input or
    parameter gradient holding what its output gradients (and its children's input gradients)
    did not, or an output gradient its parent's own code made between its submodules.
    `owner` maps id(slot) to its backward call. Slots must come in arrival order, across calls
    of this function too (sync mode)."""
    limit_max = rules.limit_max
    received, by_module = pass_.received, pass_.received_by_module
    for slot in slots:
        kinds = value_kinds(pass_, slot, limit_max)
        call = owner[id(slot)]
        forward = call.forward
        parent = (forward.parent or forward.recomputed_in) if forward is not None else None
        category = slot[SLOT_CATEGORY]
        if category == GRAD_OUTPUT:
            if kinds:
                if parent is None:
                    return call, [slot], CAUSE_LOSS_GRADIENT
                if kinds - received.get(id(parent), FINE):
                    return pass_.backward_call(parent), [slot], CAUSE_BACKWARD_INLINE
            pass_.note_received(forward, kinds)
            continue
        if kinds:
            if category == GRAD_PARAM:  # summed over every call of the module
                got = by_module.get(call.module_id, FINE)
            else:
                got = received.get(id(forward), FINE)
            new = kinds - got
            if rules.inf_allowed(call.module_name):
                new = new - INF_KINDS
            if (new and new <= NAN and category == GRAD_INPUT and not got & INF_KINDS
                    and forward is not None and forward.finite_backward
                    and _received_moderately(pass_, call, slot[SLOT_DTYPE])):
                # From finite values this module's backward makes no nan (an overflow is inf;
                # inf received, allowed, makes inf - inf). An input's gradient sums every use of
                # the input: another use made it (the parent's own code beside this module, as
                # `torch.where(h > 0, sqrt(h), 0)`).
                continue
            if new:
                return call, [slot], CAUSE_BACKWARD
        if category == GRAD_INPUT and parent is not None:
            pass_.note_received(parent, kinds)
    return None


def first_nan(pass_: PassRecord, calls):
    """A nan the producer rules could not attribute (never let one pass in silence): the
    first of `calls` holding one."""
    for call in calls:
        # nan is nan whatever the limit: no rules needed
        bad = [slot for slot in call.slots if PROBLEM_NAN in value_kinds(pass_, slot, None)]
        if bad:
            return call, bad, CAUSE_UNATTRIBUTED
    return None


def find_in_forward(pass_: PassRecord, rules):
    """The culprit of a finished forward pass, a nan no rule attributes included, or None."""
    return forward_culprit(pass_, pass_.calls, rules) or first_nan(pass_, pass_.calls)


def find_in_backward(pass_: PassRecord, rules):
    """The culprit of a finished backward pass, a nan no rule attributes included, or None."""
    slots, owner = pass_.slots_in_arrival_order()
    return backward_culprit(pass_, slots, owner, rules) or first_nan(
        pass_, sorted(pass_.calls, key=_first_arrival))


def find_in_trace(pass_: PassRecord, rules):
    """The culprit of a finished pass of a traced batch, or None: what the rules attribute only
    (a trace records every frame anyway)."""
    if any(call.phase == BACKWARD for call in pass_.calls):
        slots, owner = pass_.slots_in_arrival_order()
        return backward_culprit(pass_, slots, owner, rules)
    return forward_culprit(pass_, pass_.calls, rules)


def _first_arrival(call) -> int:
    return min((slot[SLOT_SEQ] for slot in call.slots), default=call.seq)
