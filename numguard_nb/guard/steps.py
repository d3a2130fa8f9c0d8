"""The optimizer steps seen while the guard is attached: what wrote weights found non-finite.

A detection of non-finite weights says where they came from only from what the guard saw:
- an optimizer step ran between the model's forward before (which found no non-finite weight)
  and the one that found them: that step wrote them, and it is named;
- no step ran in between: they changed outside the model's forward (an in-place write under
  `torch.no_grad()`, a checkpoint load, a hand-written update);
- the forward that found them is the first of the model the guard saw: they were already
  non-finite when it attached.

An optimizer's second step of guarded weights with no call of the model seen since the guard
attached means the model runs where the guard cannot see it (compiled after the guard attached:
torch.compile traces its hooks as no-ops): that is warned about, once per attach. (A first step
may apply gradients computed before the attach.)

Steps are watched with torch.optim's global step post-hook, registered on attach and removed on
detach. Each step is kept as a plain tuple of small facts, never a tensor (its fields below): the
optimizer (weakly, to look up at detection which of its parameter groups holds the weights), its
class, its place among the optimizers seen, its step number, the forward and the batch it
followed, and its groups' learning rates. At most MAX_STEPS are kept.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from typing import Dict, NamedTuple, Optional

import torch
from torch.nn.parameter import UninitializedParameter

from .. import numerics
from .._schema import (ORIGIN_BEFORE_ATTACH, ORIGIN_OPTIMIZER_STEP, ORIGIN_OUTSIDE_FORWARD,
                       ORIGIN_SINCE_ATTACH,
                       ORIGIN_SINCE_FORWARD)
from .._util import WeakHook, user_stacklevel
from ..report import OptimizerStep

__all__ = ["MAX_STEPS", "Origin", "StepWatch"]

# The steps kept: enough for many optimizers (or an inner loop of steps) between two forwards.
MAX_STEPS = 64
# Forwards kept per top-level module: a sentinel's checks are read a step or two late, and
# forget a step past 64 unread (`sentinel_checks.MAX_SEALED`).
FORWARDS_KEPT = 64

# Step record fields: (optimizer, by weak reference; class name; position among the optimizers
# seen, from 1; step number; counted by the guard; forwards begun before it; batch of the latest
# of them or None; learning rate of each parameter group, None where not a number).
(STEP_OPTIMIZER, STEP_CLASS, STEP_POSITION, STEP_NUMBER, STEP_COUNTED, STEP_FORWARD,
 STEP_BATCH, STEP_LRS) = range(8)

_NOT_HELD = object()  # an optimizer's parameter groups hold none of the weights


class Origin(NamedTuple):
    """How weights found non-finite got that way: `kind` one of _schema's ORIGIN_* ("" when the
    guard cannot tell), the optimizer step named (or None), and the batch of the model's forward
    before, which found no non-finite weight (None on its first forward)."""

    kind: str
    step: Optional[OptimizerStep]
    finite_batch: Optional[int]
    at_attach: bool = False  # seen non-finite when the guard attached (a sentinel looks then)


def _cannot_tell(watch: "StepWatch") -> None:
    watch.lost_after = watch.forwards  # a step it failed to note: what it wrote is unknown


def _remove(handles: list) -> None:
    while handles:
        handles.pop().remove()


class StepWatch:
    """The optimizer steps and the top-level forwards since the guard attached."""

    def __init__(self):
        self.forwards = 0  # top-level forwards begun since attach
        self.batch: Optional[int] = None  # the batch of the latest of them
        # module id of a top-level call -> its latest forwards, (number, batch), oldest first (a
        # check read later, a GPU's, asks about one a few steps back)
        self._roots: Dict[int, collections.deque] = {}
        self._steps: collections.deque = collections.deque(maxlen=MAX_STEPS)
        self.lost_after = -1  # the forwards begun before the latest step not kept (MAX_STEPS)
        # optimizer -> [position, steps seen, holds guarded weights (None: not looked up yet)]
        self._optimizers = weakref.WeakKeyDictionary()
        self._models: dict = {}  # the guard's models, whose weights an unwatched step updates
        self._warned = False  # about a step after no watched call of the model
        self._handles: list = []  # the hook's handle while attached
        weakref.finalize(self, _remove, self._handles)  # a guard dropped, models and all, attached
        # The norms of the gradients the models held when the guard attached, and at its first
        # optimizer step, on their devices (one launch per device; read only at a detection): a
        # run started again after one that went non-finite may add to a .grad never zeroed.
        self._grads_at_attach: list = []
        self._grads_at_first_step: Optional[list] = None
        # The weights' norms at attach, by parameter id, on their devices (read only at a
        # detection), say which were broken from the start (a sentinel's forwards never look at
        # the weights; code may write them before full mode's first forward).
        self._weights_at_attach: list = []
        self.gradients_watched = True  # the guard checks the gradients the steps apply

    def start(self, models: dict, weights: bool = False, gradients: bool = True) -> None:
        """Start watching steps (on attach) of optimizers of `models`' weights (name -> module):
        what earlier attaches saw is forgotten. `weights`: look at them now; `gradients`: the
        guard checks the gradients the steps apply."""
        self.forwards, self.batch, self.lost_after = 0, None, -1
        self.gradients_watched = gradients
        self._roots.clear()
        self._steps.clear()
        self._optimizers.clear()
        self._models, self._warned = models, False
        self._grads_at_attach, self._grads_at_first_step = _gradient_norms(models), None
        self._weights_at_attach = _weight_norms(models) if weights else []
        if not self._handles:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handles.append(register_optimizer_step_post_hook(
                WeakHook(self, "note_step", on_error=_cannot_tell)))

    def stop(self) -> None:
        """Remove the global hook (on detach; idempotent), and let go of the models (a session
        keeps its detached guard: a model deleted in the notebook must go)."""
        _remove(self._handles)
        self._models = {}

    def forward_began(self, root_id: int, batch: int) -> int:
        """A top-level forward of the module `root_id` began, in `batch` (once per pass); its
        number."""
        self.forwards += 1
        self.batch = batch
        forwards = self._roots.get(root_id)
        if forwards is None:
            forwards = self._roots[root_id] = collections.deque(maxlen=FORWARDS_KEPT)
        forwards.append((self.forwards, batch))
        return self.forwards

    def forward_ran_again(self, root_id: int, batch: int) -> None:
        """A re-run of a forward of `root_id` in `batch`: counted unless that forward was (the
        sentinel's check on a device counts a call as it runs, and re-runs it later)."""
        if not any(seen == batch for _, seen in self._roots.get(root_id, ())):
            self.forward_began(root_id, batch)

    def _forward_of(self, root_id: int, batch: Optional[int], number: Optional[int]) -> tuple:
        """(number of the forward of `root_id` numbered `number`, else the latest in `batch`, else
        its latest; number of the one before it, or None; that one's batch)."""
        forwards = list(self._roots.get(root_id, ()))
        at = next((i for i in range(len(forwards) - 1, -1, -1) if forwards[i][0] == number),
                  None)
        if at is None:
            at = next((i for i in range(len(forwards) - 1, -1, -1) if forwards[i][1] == batch),
                      len(forwards) - 1)
        if at < 0:
            return 0, None, None
        before = forwards[at - 1] if at > 0 else (None, None)
        return forwards[at][0], before[0], before[1]

    def note_step(self, optimizer) -> None:
        """An optimizer step ended (the global hook)."""
        if self._grads_at_first_step is None:
            self._grads_at_first_step = _gradient_norms(self._models)
        seen = self._optimizers.get(optimizer)
        if seen is None:
            seen = self._optimizers[optimizer] = [len(self._optimizers) + 1, 0, None]
        seen[1] += 1
        if self.forwards == 0 and seen[1] == 2 and not self._warned:
            self._warn_unwatched(optimizer, seen)
        own = _own_step_number(optimizer)
        if len(self._steps) == MAX_STEPS:
            self.lost_after = self._steps[0][STEP_FORWARD]
        self._steps.append((
            weakref.ref(optimizer), type(optimizer).__name__, seen[0],
            own if own is not None else seen[1], own is None, self.forwards, self.batch,
            tuple(_number(group.get("lr")) for group in optimizer.param_groups),
        ))

    def _warn_unwatched(self, optimizer, seen: list) -> None:
        if seen[2] is None:
            guarded = {id(p) for model in self._models.values() for p in model.parameters()}
            seen[2] = any(id(p) in guarded for group in optimizer.param_groups for p in group["params"])
        if not seen[2]:
            return
        self._warned = True
        warnings.warn(
            f"numguard: {type(optimizer).__name__}.step() updated the guarded weights twice, but the "
            "guard saw no call of the model since it attached: a model compiled after the guard "
            "attached runs unwatched; guard the model you call (Guard(torch.compile(model)))",
            stacklevel=user_stacklevel())

    def gradients_were_not_finite(self, at_first_step: bool = False) -> bool:
        """Whether a gradient the models held when the guard attached (or, `at_first_step`, at
        its first optimizer step: what that step applied) held inf or nan. A read: for a
        detection only."""
        norms = (self._grads_at_first_step or []) if at_first_step else self._grads_at_attach
        return any(not numerics.fine(float(numerics.read(vector.max()))) for vector in norms)

    def weights_origin(self, root_id: int, params, batch: Optional[int] = None,
                       number: Optional[int] = None) -> Origin:
        """How the weights `params` (parameters; none for buffers), found non-finite in the
        forward of the top-level module `root_id` numbered `number` (`forward_began`'s), else
        its latest in `batch`, else its latest, got that way."""
        latest, before, finite_batch = self._forward_of(root_id, batch, number)
        if params and self._broken_at_attach(params):
            return Origin(ORIGIN_BEFORE_ATTACH, None, None, at_attach=True)
        if before is None:  # its first forward since attach
            # A step that ran before it (after the guard attached) may have written them.
            earlier = [step for step in self._steps if step[STEP_FORWARD] < latest]
            step = self._first_holding(earlier[::-1], params)
            if params and self._seen_at_attach(params):  # finite then: written since
                if step is None:
                    return Origin(ORIGIN_SINCE_ATTACH, None, None)
                step.stale_gradients = self._stale_at_first_step(earlier)
                return Origin(ORIGIN_OPTIMIZER_STEP, step, None)
            return Origin(ORIGIN_BEFORE_ATTACH, step, None)
        if not params:  # buffers: no optimizer writes them
            return Origin("", None, finite_batch)
        since = [step for step in self._steps if before <= step[STEP_FORWARD] < latest]
        step = self._first_holding(since, params)
        if step is not None:
            step.stale_gradients = self._stale_at_first_step(since)
            return Origin(ORIGIN_OPTIMIZER_STEP, step, finite_batch)
        if self.lost_after >= before:  # steps of that time are not kept: cannot tell
            return Origin("", None, finite_batch)
        return Origin(ORIGIN_OUTSIDE_FORWARD, None, finite_batch)

    def _stale_at_first_step(self, steps: list) -> bool:
        """Whether `steps` (those that may have written the weights) hold the first step since
        attach, and it applied gradients already non-finite then (the backward's own were
        finite, else it was named; a loop that zeroes them first applied none of them)."""
        return (bool(self._steps) and self._steps[0] in steps and self.lost_after < 0
                and self.gradients_were_not_finite(at_first_step=True))

    def _broken_at_attach(self, params) -> bool:
        """Whether one of `params` held inf or nan when the guard attached (known where the
        weights were looked at then: `start(weights=True)`). A read: for a detection only."""
        wanted = {id(p) for p in params}
        for ids, norms in self._weights_at_attach:
            positions = [i for i, pid in enumerate(ids) if pid in wanted]
            if positions and any(not numerics.fine(float(x)) for x in numerics.read(
                    norms[torch.tensor(positions, device=norms.device)])):
                return True
        return False

    def _seen_at_attach(self, params) -> bool:
        """Whether every one of `params` was looked at when the guard attached."""
        seen = {pid for ids, _ in self._weights_at_attach for pid in ids}
        return all(id(p) in seen for p in params)

    def buffers_origin(self, root_id: int, batch: Optional[int] = None,
                       number: Optional[int] = None) -> Origin:
        """How buffers found non-finite in a forward of `root_id` (as `weights_origin` finds
        it) got that way: no optimizer writes them, so they were non-finite when the guard
        attached, or changed since the forward before (which found them finite)."""
        _, before, finite_batch = self._forward_of(root_id, batch, number)
        if before is None:
            return Origin(ORIGIN_BEFORE_ATTACH, None, None)
        return Origin(ORIGIN_SINCE_FORWARD, None, finite_batch)

    def _first_holding(self, steps, params) -> Optional[OptimizerStep]:
        """The first of `steps` whose optimizer holds one of `params` (or is gone), described;
        None when none does or no parameters are given."""
        if not params:
            return None
        for step in steps:
            group = _group_holding(step, params)
            if group is not _NOT_HELD:
                described = _described(step, group, len(self._optimizers))
                described.gradients_watched = self.gradients_watched
                return described
        return None


def _gradient_norms(models: dict) -> list:
    """Per device, the norms of the gradients `models`' parameters hold now (None-free list)."""
    by_device: dict = {}
    for model in models.values():
        for param in model.parameters():
            grad = param.grad
            if grad is not None and not grad.is_sparse and numerics.readable(grad):
                by_device.setdefault(grad.device, []).append(grad)
    norms = (numerics.grad_norms(grads) for grads in by_device.values())
    return [vector for vector in norms if vector is not None]


def _weight_norms(models: dict) -> list:
    """Per device, (the ids of `models`' parameters, their norms now): one launch per dtype."""
    by_device: dict = {}
    seen = set()
    for model in models.values():
        for param in model.parameters():
            if id(param) not in seen and not isinstance(param, UninitializedParameter) \
                    and not param.is_sparse and numerics.readable(param) and param.is_floating_point():
                seen.add(id(param))
                by_device.setdefault(param.device, []).append(param)
    found = []
    with torch.no_grad():
        for params in by_device.values():
            norms = numerics.grad_norms(params)  # (no_grad: no graph, and no detach to see)
            if norms is not None:
                found.append((tuple(id(p) for p in params), norms))
    return found


def _group_holding(step: tuple, params):
    """The index of the step's optimizer's parameter group holding one of `params`; None when
    unknown (the optimizer is gone); _NOT_HELD when none does."""
    optimizer = step[STEP_OPTIMIZER]()
    if optimizer is None:
        return None
    wanted = {id(param) for param in params}
    for index, group in enumerate(optimizer.param_groups):
        if any(id(param) in wanted for param in group["params"]):
            return index
    return _NOT_HELD


def _described(step: tuple, group: Optional[int], optimizers: int) -> OptimizerStep:
    lrs = step[STEP_LRS]
    lr = lrs[group] if group is not None and group < len(lrs) else (
        lrs[0] if len(set(lrs)) == 1 else None)
    optimizer = step[STEP_OPTIMIZER]()
    groups = optimizer.param_groups if optimizer is not None else []
    eps = _number(groups[group].get("eps")) if group is not None and group < len(groups) else None
    return OptimizerStep(
        optimizer=step[STEP_CLASS], number=step[STEP_NUMBER], counted=step[STEP_COUNTED],
        after_batch=step[STEP_BATCH], position=step[STEP_POSITION], optimizers=optimizers,
        param_group=group if group is not None and len(lrs) > 1 else None, lr=lr, eps=eps,
    )


def _number(value) -> Optional[float]:
    """A learning rate as a plain number; None for a tensor (reading one could wait for the
    device) or anything else."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _own_step_number(optimizer) -> Optional[int]:
    """The optimizer's own count of its steps, where it keeps one on the host (Adam's "step" in
    its state), else None. Every parameter's state counts the same steps: any one will do."""
    state = next(iter(optimizer.state.values()), None)
    step = state.get("step") if isinstance(state, dict) else None
    if isinstance(step, torch.Tensor):
        if step.device.type != "cpu" or step.numel() != 1:
            return None  # capturable or fused: on the device, where reading it waits
        return int(numerics.read(step, counted=False))  # a host tensor: nothing to wait for
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None
