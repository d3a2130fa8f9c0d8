"""The sentinel's checks on an asynchronous device (CUDA): computed there, read when ready.

Each top-level call's outputs give one value (`numerics.output_flag`), each backward pass the
norms of the gradients (`numerics.grad_norms`); they gather in the open step and are sealed into
one `numerics.DeferredRead` at the end of the backward pass (or at once for a call no backward
follows). A sealed step is looked at, never waited for, at the next top-level call and at the
end of the next backward pass; a value found not fine runs the action it came with (the
sentinel's re-run, which raises), in the order the values were made.

An optimizer step must not write weights from gradients not yet known to be finite, so that the
re-run starts from the weights of the failing step. At its step pre-hook (torch.optim's global
one) a step still unread is:
- for an optimizer that skips its step on a device flag (fused Adam, AdamW, SGD, Adagrad: the
  flag a GradScaler passes as `found_inf`), handed over as that flag: no read;
- for any other (foreach or for-loop), read there, waiting for it: one read per step.
A step given a closure (LBFGS, Lightning's automatic optimization) runs the forward and backward
inside `step`, after the pre-hook: the closure is wrapped, and the same is done when it returns.

`detach` reads what is still unread, waiting, and keeps a detection for `raise_found`.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections import deque
from functools import partial
from typing import Callable, Optional

import torch

from .. import _tree, numerics
from .._util import WeakHook
from .hooks import inert_context
from .outside_mode import MAX_CALLS_WITHOUT_BACKWARD
from ..errors import NonFiniteError

__all__ = ["StepChecks", "MasksForTheLoss", "check_gradients_later", "SURE_ANY", "SURE_NAN"]

_FOUND_INF = "found_inf"
MAX_SEALED = 64  # steps sealed and never looked at (no later call, no optimizer): past this, forgotten
# Gradients a step's outputs got from outside the model, kept on the device until the step is
# read: past this many bytes (a language model's logits), each is replaced by its norm.
MAX_KEPT_GRAD_BYTES = 64 * 2**20


# What a value not fine says of its step before its action has judged it (`StepChecks.add`):
SURE_ANY = "any"  # nan or +inf: a detection (the gradients without a scaler; a model's outputs)
SURE_NAN = "nan"  # nan only: +inf may be allowed (allow_inf, or accepted in a re-run)
# None: nothing yet. Its action may find it harmless: the loss code's values (a -inf mask, a nan
# it discards), a -inf the loss judges, gradients a GradScaler skips the step for itself.


class _Sealed:
    """One step's values, in flight to the host, and what to do with each that is not fine."""

    __slots__ = ("read", "actions", "device_values", "finish", "in_step", "sure")

    def __init__(self, values: list, actions: list, finish: list, in_step: bool, sure: list):
        self.device_values = values  # kept on the device for an optimizer's found_inf
        self.read = numerics.DeferredRead(values)
        self.actions = actions
        self.finish = finish
        self.in_step = in_step  # acted on in program order, as every rank does (see `look`)
        self.sure = sure  # per value: SURE_ANY, SURE_NAN or None

    def found_inf(self, device: torch.device) -> Optional[torch.Tensor]:
        """1.0 where a value says for sure that the step is a detection, else 0.0: a float32
        flag on `device`, never read; None where no value can say it."""
        flat = self.read.on_device
        if flat is not None and all(sure == SURE_ANY for sure in self.sure):
            return (~(flat < numerics._INF).all()).float().to(device, non_blocking=True)
        bad = []
        for sure in (SURE_ANY, SURE_NAN):
            values = [v.reshape(-1).to(device, non_blocking=True)
                      for v, kind in zip(self.device_values, self.sure) if kind == sure]
            if values:
                values = torch.cat(values) if len(values) > 1 else values[0]
                bad.append(~(values < numerics._INF) if sure == SURE_ANY else values.isnan())
        if not bad:
            return None
        return (torch.cat(bad) if len(bad) > 1 else bad[0]).any().float()


class _MaskNote:
    """A call whose outputs may hold -inf (`flag`: +inf where they do; read later: `held`),
    until a loss judges it."""

    __slots__ = ("call", "flag", "held", "kept")

    def __init__(self, call, flag: torch.Tensor):
        self.call, self.flag, self.held = call, flag, False
        self.kept = False  # through a gradient penalty's backward: not through a second one


def _note_mask(note: _MaskNote, values: list) -> None:
    note.held = True  # its outputs held -inf


class MasksForTheLoss:
    """On an asynchronous device, the -inf a call's outputs hold is a mask unless the loss of
    the backward that follows is not finite (as on the host, where the loss code's watch holds
    it: `outside.hold`). Each call's -inf flag is read with its step; as the backward starts
    (`judge_later`), one value joins them: the calls' flag where the loss is not finite, else
    fine. A fused optimizer skips on it, every rank learns it with the gradients' reduction
    (`share`), and where it is not fine the calls whose outputs held -inf are run again
    (`rerun`: the sentinel's re-run, which raises). Notes no loss judged are dropped at the
    backward's end (`forget`)."""

    def __init__(self, checks: "StepChecks", rerun: Callable, share: Callable):
        self._checks = checks
        self._rerun = rerun  # (call, values) -> raises what a re-run of the call finds
        self._share = share  # (value) -> every rank learns it (several ranks), or nothing
        self._notes: deque = deque(maxlen=MAX_CALLS_WITHOUT_BACKWARD)
        self._kept = False  # judged by a gradient penalty: kept through its backward's end
        self.note: Optional[Callable[[str], None]] = None  # (its name): a -inf the loss showed a mask

    def add(self, call, flag: torch.Tensor) -> None:
        note = _MaskNote(call, flag)
        self._notes.append(note)
        self._checks.add(flag, partial(_note_mask, note), sure=None)

    def judge_later(self, loss, before_the_loss: bool = False) -> Optional[list]:
        """The loss a backward starts from (a tensor, or several): judged when it is read.
        `before_the_loss`: `torch.autograd.grad`'s outputs (a gradient penalty): the notes stay
        for the loss that follows. Returns the notes it judges (None: no judgment)."""
        if not self._notes:
            return None
        notes = list(self._notes)
        if before_the_loss:
            self._kept = True
        else:
            self._notes.clear()
        tensors = [t for t in _tree.tensors(loss) if t.is_floating_point() or t.is_complex()]
        flags = numerics.output_flags(tensors) if tensors else None
        if flags is None:
            return None
        with torch.no_grad():
            high, low = flags
            size = high if low is None else torch.maximum(high, low)  # nan, or inf either way
            masks = torch.stack([note.flag.to(size.device, non_blocking=True).reshape(())
                                 for note in notes]).amax().reshape(1)
            finite = size.isfinite()
            value = masks.masked_fill(finite, -math.inf)  # fine unless both
            harmless = masks.masked_fill(~finite, -math.inf)  # a mask: said, no detection
        self._checks.add(value, partial(_late_loss, self._rerun, notes))
        if self.note is not None:
            self._checks.add(harmless, partial(_late_mask, self.note, notes), sure=None)
        self._share(value)
        return notes

    def forget(self) -> None:
        if not self._kept:
            self._notes.clear()
            return
        self._kept = False  # (a penalty's backward ends: the loss after it judges them, once)
        notes = [note for note in self._notes if not note.kept]
        self._notes.clear()
        for note in notes:
            note.kept = True
            self._notes.append(note)


def _late_loss(rerun: Callable, notes: list, values: list) -> None:
    """The loss was not finite: the first call whose outputs held -inf is run again."""
    for note in notes:
        if note.held:
            rerun(note.call, [math.nan])


def _late_mask(say: Callable, notes: list, values: list) -> None:
    """A call's outputs held -inf and the loss was finite: a mask, said as the host's loss
    watch says it."""
    held = next((note for note in notes if note.held), None)
    if held is not None:
        say(held.call.entry.name or held.call.entry.cls)


def _remove_all(handles: list) -> None:
    while handles:
        handles.pop().remove()


_MISSING = object()
# optimizer -> [its found_inf before a sentinel lent one (a GradScaler's, or _MISSING), the flags
# lent since]: shared by every sentinel, so that the first step post-hook takes them all back
# (two sentinels may lend to one optimizer, the second folding the first's flag into its own).
_LENDING = weakref.WeakKeyDictionary()


def _lend(optimizer, flag: torch.Tensor) -> None:
    entry = _LENDING.get(optimizer)
    if entry is None:
        entry = _LENDING[optimizer] = [getattr(optimizer, _FOUND_INF, _MISSING), []]
    theirs = getattr(optimizer, _FOUND_INF, None)  # a GradScaler's, or another sentinel's
    lent = flag if theirs is None else torch.maximum(theirs, flag.to(theirs.device))
    setattr(optimizer, _FOUND_INF, lent)
    entry[1].append(lent)


def _take_back(optimizer) -> None:
    """Restore the found_inf `optimizer` had before the sentinels lent theirs."""
    entry = _LENDING.pop(optimizer, None)
    if entry is None:
        return
    original, lent = entry
    if any(getattr(optimizer, _FOUND_INF, None) is flag for flag in lent):
        if original is _MISSING:
            delattr(optimizer, _FOUND_INF)
        else:
            setattr(optimizer, _FOUND_INF, original)


def _first_device(optimizer) -> Optional[torch.device]:
    return next((p.device for group in optimizer.param_groups for p in group["params"]), None)


def _skips_on_flag(optimizer) -> bool:
    """Whether `optimizer.step` skips on a `found_inf` device flag (its fused implementation)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return all(group.get("fused") for group in optimizer.param_groups)


class StepChecks:
    """The open step's values and the sealed steps not yet read, for one sentinel."""

    def __init__(self, parameters: Callable[[], list]):
        self._parameters = parameters  # the guarded parameters
        self.guarded_ids: Optional[frozenset] = None  # their ids (None: look them up again)
        self._values: list = []  # the open step's device values
        self._actions: list = []  # per value: called with its host floats when not fine
        self._finish: list = []  # called once the step is read, fine or not
        self._sure: list = []  # per value: what a value not fine says before it is judged
        # Called when a step no reduction carried raises: this rank's flags shared for the next
        # reduction go (several ranks: the sentinel's `RankFlags.forget_step`).
        self.forget_shared: Optional[Callable[[], None]] = None
        self._acting = False  # an action runs (`look`): a detach from it reads nothing more
        self._sealed: deque = deque()
        self._handles: list = []  # torch's global step hooks (gone with this object too)
        weakref.finalize(self, _remove_all, self._handles)
        self._lent_to = weakref.WeakSet()  # optimizers lent a found_inf, not taken back yet
        # optimizer -> (its parameter groups' sizes, whether it steps a guarded parameter)
        self._holding = weakref.WeakKeyDictionary()
        self.unraised: Optional[BaseException] = None

    def start(self) -> None:
        """Watch the optimizer steps (torch's global hooks, holding this weakly)."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook, register_optimizer_step_pre_hook,
        )
        if not self._handles:
            self._handles += [
                register_optimizer_step_pre_hook(
                    WeakHook(self, "_before_step", raises=(NonFiniteError,), takes=3, returns=True)),
                register_optimizer_step_post_hook(WeakHook(self, "_after_step"))]

    def stop(self) -> None:
        """Read what is unread (waiting) and stop; a detection is kept for `raise_found`."""
        _remove_all(self._handles)
        for optimizer in list(self._lent_to):  # (a step that never reached its post-hook)
            _take_back(optimizer)
        self._lent_to = weakref.WeakSet()
        try:
            if not self._acting:  # (a detach from an action's detection: the steps after it
                self.seal()       # ran from what the failing step left, and go unread)
                self.look(wait=True)
        except NonFiniteError as error:
            self.unraised = self.unraised or error
        finally:
            self._drop()

    def raise_found(self, when: bool = True) -> None:
        error, self.unraised = self.unraised, None
        if error is not None and when:
            raise error

    @property
    def pending(self) -> bool:
        return bool(self._values or self._sealed)

    @property
    def open_values(self) -> int:
        return len(self._values)

    # ---- gathering -----------------------------------------------------------------------------
    def add(self, value: torch.Tensor, action: Callable[[list], None],
            finish: Optional[Callable[[], None]] = None, first: bool = False,
            sure: Optional[str] = SURE_ANY) -> None:
        """A float32 vector on the device, and what to do with its host values if one is not
        fine (`numerics.fine`); `finish` runs once it is read either way. `first`: acted on
        before the values added earlier. `sure`: which values not fine make a fused optimizer
        skip the step while it is unread (SURE_ANY, SURE_NAN, None: see them)."""
        position = 0 if first else len(self._values)
        self._values.insert(position, value)
        self._actions.insert(position, action)
        self._sure.insert(position, sure)
        if finish is not None:
            self._finish.append(finish)

    def seal(self, in_step: bool = False) -> None:
        """The open step is complete: start bringing its values to the host. `in_step`: acted
        on at the same point of the program on every rank (a DDP or FSDP2 step's)."""
        if not self._values:
            return
        if len(self._sealed) >= MAX_SEALED:
            self._sealed.popleft()
        self._sealed.append(_Sealed(self._values, self._actions, self._finish, in_step, self._sure))
        self._values, self._actions, self._finish, self._sure = [], [], [], []

    # ---- reading -------------------------------------------------------------------------------
    def look(self, wait: bool = False) -> None:
        """Act on the sealed steps whose values are on the host, oldest first (all of them,
        waiting, with `wait`). An action that raises drops the steps after it: they ran from
        what the failing step left.

        A step sealed `in_step` (several ranks) is acted on once a later step is sealed, waiting
        for it then (the device finished it long before: no stall), and never sooner: every
        rank acts on it at the same point of the program, where no collective is pending, so
        that none raises while another waits for it in a collective."""
        if wait and self._sealed:
            self._sealed[-1].read.values(wait=True)  # one wait: the steps before it are done too
        # A step sealed in_step with a later one sealed is acted on now on every rank: the steps
        # before it too (a no_sync micro-step's), waiting, so that no rank acts on them later.
        due = max((i for i, sealed in enumerate(list(self._sealed)[:-1]) if sealed.in_step),
                  default=-1)
        while self._sealed:
            sealed = self._sealed[0]
            if sealed.in_step and not wait and due < 0:
                return  # (the newest: every rank acts on it once a later step is sealed)
            values = sealed.read.values(wait or due >= 0, counted=False)
            if values is None:
                return
            self._sealed.popleft()
            due -= 1
            self._acting = True
            try:
                for vector, action in zip(values, sealed.actions):
                    if not all(numerics.fine(x) for x in vector):
                        action(vector)
            except BaseException:
                if not sealed.in_step and self.forget_shared is not None:
                    self.forget_shared()  # (no reduction carried it: not on the next one)
                self._drop()
                raise
            finally:
                self._acting = False
                for finish in sealed.finish:
                    finish()

    def _drop(self) -> None:
        for sealed in self._sealed:
            for finish in sealed.finish:
                finish()
        self._sealed.clear()
        for finish in self._finish:
            finish()
        self._values, self._actions, self._finish, self._sure = [], [], [], []

    # ---- the optimizer step --------------------------------------------------------------------
    def _before_step(self, optimizer, args: tuple, kwargs: dict):
        if optimizer in self._lent_to:  # its last step never reached the post-hook (raised)
            self._lent_to.discard(optimizer)
            _take_back(optimizer)
        if not self._holds(optimizer) or inert_context():
            return None  # (a step captured into a CUDA graph: no event asked, no flag baked into it)
        at = 1 if args and args[0] is optimizer else 0  # (torch passes `self` in `args`)
        closure = kwargs.get("closure", args[at] if len(args) > at and _closure_first(optimizer) else None)
        if not callable(closure):
            self._before_update(optimizer)
            return None
        checked = partial(_checked_closure, weakref.ref(self), optimizer, closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": checked}
        return tuple(args[:at]) + (checked,) + tuple(args[at + 1:]), kwargs

    def _before_update(self, optimizer) -> None:
        """The step is about to write the weights from the gradients it has."""
        if not self._sealed:
            return
        self.look()
        if not self._sealed:
            return
        device = _first_device(optimizer)
        if _skips_on_flag(optimizer) and device is not None:
            flags = [flag for flag in (sealed.found_inf(device) for sealed in self._sealed)
                     if flag is not None]
            if flags:
                flag = flags[0]
                for other in flags[1:]:
                    flag = torch.maximum(flag, other)
                _lend(optimizer, flag)
                self._lent_to.add(optimizer)
            return
        self.look(wait=True)  # the one read of a step that cannot skip on a device flag

    def _holds(self, optimizer) -> bool:
        """Whether `optimizer` steps a guarded parameter (worked out again when its groups change)."""
        if self.guarded_ids is None:
            self.guarded_ids = frozenset(id(p) for p in self._parameters())
            self._holding = weakref.WeakKeyDictionary()
        sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
        known = self._holding.get(optimizer)
        if known is None or known[0] != sizes:
            known = self._holding[optimizer] = (sizes, any(
                id(p) in self.guarded_ids for group in optimizer.param_groups for p in group["params"]))
        return known[1]

    def _after_step(self, optimizer) -> None:
        if optimizer in self._lent_to:
            self._lent_to.discard(optimizer)
            _take_back(optimizer)


_CLOSURE_FIRST: dict = {}  # optimizer class -> whether its step's first argument is `closure`


def _closure_first(optimizer) -> bool:
    """Whether the class's own step takes `closure` first (the class's: an instance's step may be
    patched, accelerate's takes *args, and the answer is kept for the class)."""
    kind = type(optimizer)
    known = _CLOSURE_FIRST.get(kind)
    if known is None:
        try:
            names = list(inspect.signature(kind.step).parameters)[1:2]  # (after self)
        except (TypeError, ValueError, AttributeError):
            names = []
        known = _CLOSURE_FIRST[kind] = names == ["closure"]
    return known


def _checked_closure(checks_ref, optimizer, closure):
    """A step's closure, then what the step pre-hook does before the weights are written: the
    closure's own forward and backward are checked too."""
    loss = closure()
    checks = checks_ref()
    if checks is not None:
        try:
            checks._before_update(optimizer)
        except NonFiniteError:
            raise
        except Exception:  # (as WeakHook: the watch's own trouble never breaks the step)
            pass
    return loss


# ---- the sentinel's gradients, checked on the device -----------------------------------------
def check_gradients_later(sentinel, calls: list, parameters: list) -> list:
    """On an asynchronous device: one flag of the gradients per device (their norms where a
    GradScaler is watched), read when ready. The calls keep the gradients their outputs got
    until then (a re-run needs them); returns the calls whose gradients can go now."""
    groups = gradients_by_device(parameters)
    # One flag per device unless a GradScaler needs the names of the gradients it overflowed
    # (its skipped steps are recorded with them): per-parameter norms cost far more host time.
    per_parameter = sentinel.guard.scaling.scaler_of(sentinel.guard.options) is not None
    if per_parameter:  # read after this step's scaler.update(), perhaps
        sentinel.guard.scaling.expect_late(sentinel.guard.options)
    # A scaler seen scaling the loss skips a step whose gradients it finds not finite itself
    # (and its warm-up's overflows are no reason to skip the steps after them).
    skipped_by_scaler = sentinel.guard.scaling.skips_for_itself(sentinel.guard.options)
    for group, grads_by_dtype in groups:
        flag = None if per_parameter else numerics.nonfinite_flag(grads_by_dtype)
        norms = None if flag is not None else numerics.grad_norms(
            [g for grads in grads_by_dtype for g in grads])  # in `group`'s order
        sentinel.checks.add(flag if norms is None else norms,
                            partial(_late_backward_problem, sentinel, calls, parameters,
                                    None if norms is None else group),
                            partial(_forget_gradients, calls),
                            sure=None if skipped_by_scaler else SURE_ANY)
    verdict = sentinel.ranks.take_fresh_verdict() if sentinel.ranks is not None else None
    if verdict is not None:  # acted on first: what every rank made, as every rank learnt it
        sentinel.checks.add(verdict, partial(_late_rank_problem, sentinel, calls), first=True)
    if not groups and verdict is None:
        return calls
    drop_large_gradients(calls)
    sentinel.checks.seal(in_step=verdict is not None)
    sentinel.checks.look()  # earlier steps, if their values are there
    return []


def _late_rank_problem(sentinel, calls: list, verdict: list) -> None:
    """DDP/FSDP2 on a device: a step's reduction said a rank made inf/nan (read at the same
    point on every rank). Another rank's: raised here; this rank's own: its checks that
    follow name it (FSDP2: every rank re-runs the step together first)."""
    sentinel.across_ranks(calls, None, sentinel.ranks.producers_of(verdict), own_named_later=True)
    for call in calls:
        call.ranks_settled = True


def _late_backward_problem(sentinel, calls: list, parameters: list,
                           group: Optional[list], norms: list) -> None:
    """Gradients held inf or nan (read after their backward): run the calls again; raise.
    `group`: the parameters whose norms `norms` are, or None for one flag of them all."""
    if group is None:
        sentinel.gradients_problem(calls, parameters, [], flagged=True)
    else:
        sentinel.gradients_problem(calls, parameters, nonfinite_gradients(
            sentinel.parameter_names(), group, norms))


def _forget_gradients(calls: list) -> None:
    for call in calls:
        call.grads = [None] * len(call.grads)


def gradients_by_device(parameters: list) -> list:
    """Per device: (the parameters whose gradients hold numbers to check, their gradients in
    lists by dtype, in the same order). Each gradient is looked at as it is now (a parameter can
    change device, dtype or size in place, or come to life lazily): nothing is kept between steps.
    A sparse gradient is checked through its stored values, a complex one as floats."""
    groups: dict = {}
    plain, strided = torch.Tensor, torch.strided
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        if type(grad) is not plain or grad.layout is not strided:  # the rare kinds
            if grad.is_sparse and grad.is_floating_point():
                grad = grad._values()  # (the stored values: uncoalesced is fine for a check)
            elif not (grad.layout is strided and grad.is_floating_point()
                      and numerics.readable(grad)):
                continue
        elif not grad.is_floating_point():
            if not grad.is_complex():
                continue
            grad = torch.view_as_real(grad)  # (a Fourier layer's weight: its numbers, as floats)
        key = (grad.device, grad.dtype)
        group = groups.get(key)
        if group is None:
            group = groups[key] = ([], [])
        group[0].append(p)
        group[1].append(grad)
    by_device: dict = {}
    for (device, _), (params, grads) in groups.items():
        if device.type != "meta":  # (no numbers: nothing to check)
            entry = by_device.setdefault(device, ([], []))
            entry[0].extend(params)
            entry[1].append(grads)
    return list(by_device.values())


def nonfinite_gradients(names: dict, parameters: list, norms: list) -> list:
    """[(name, gradient)] of the parameters whose gradient's norm (read after the backward) is
    not fine, each shown by a host stand-in of its shape holding that norm (nan, or inf of
    unknown sign): the gradient itself is gone or rewritten by then."""
    bad = []
    for p, norm in zip(parameters, norms):
        if not numerics.fine(norm):
            dtype = p.dtype if p.dtype.is_floating_point else torch.float32
            bad.append((names.get(id(p), "?"), torch.full(tuple(p.shape), norm, dtype=dtype)))
    return bad


class GradStandIn:
    """What is kept of a large gradient an output got from outside the model, while its step is
    read later: its shape, dtype, device and norm (on the device). A re-run's backward starts
    from a uniform gradient of the same norm (`materialise`, on the problem path only)."""

    __slots__ = ("shape", "dtype", "device", "norm")

    def __init__(self, grad: torch.Tensor):
        self.shape, self.dtype, self.device = grad.shape, grad.dtype, grad.device
        with torch.no_grad():  # (foreach: no float32 copy of a half-precision gradient)
            self.norm = torch._foreach_norm([grad], 2, dtype=torch.float32)[0]

    def materialise(self) -> torch.Tensor:
        numel = max(1, self.shape.numel())
        return torch.full(self.shape, float(self.norm) / numel ** 0.5, dtype=self.dtype,
                          device=self.device)


def kept_gradient(grad: torch.Tensor, may_defer: bool):
    """What a call keeps of the gradient an output got from outside it: the gradient, or on an
    asynchronous device, where it is larger than `MAX_KEPT_GRAD_BYTES`, a `GradStandIn` (the
    gradient then goes when the backward is done with it, as without the guard)."""
    if may_defer and numerics.deferred(grad) \
            and grad.numel() * grad.element_size() > MAX_KEPT_GRAD_BYTES:
        return GradStandIn(grad)
    return grad


def drop_large_gradients(calls: list) -> bool:
    """Replace the kept output gradients of `calls` by `GradStandIn`s where they hold more than
    `MAX_KEPT_GRAD_BYTES` together (the memory stays as without the guard); whether it did."""
    grads = [g for call in calls for g in call.grads if isinstance(g, torch.Tensor)]
    if sum(g.numel() * g.element_size() for g in grads) <= MAX_KEPT_GRAD_BYTES:
        return False
    for call in calls:
        call.grads = [GradStandIn(g) if isinstance(g, torch.Tensor) else g for g in call.grads]
    return True


def stood_in(calls: list) -> str:
    """What a report says where a re-run's backward started from `GradStandIn`s."""
    sizes = [s.shape.numel() * s.dtype.itemsize for call in calls for s in call.grads
             if isinstance(s, GradStandIn)]
    if not sizes:
        return ""
    return (f"; the gradient the model's output got from the code outside it ({sum(sizes) / 2**20:.0f}"
            " MiB) was not kept on the device while the step's check was read: the re-run's "
            "backward started from a uniform gradient of the same norm")

