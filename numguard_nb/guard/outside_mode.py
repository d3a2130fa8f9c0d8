"""The torch function mode the loss watch (`outside`) puts on a thread's stack, and each
thread's place in it: which watch's code runs there (`ThreadState.owner`, held weakly), whether
it is checked now, and when the mode leaves the stack (the next top-level call of a guarded
module, the next optimizer step, detach, or the watch's guard dropped while attached).

One mode object (`MODE`) is shared by every watch, so that it is on a thread's stack at most
once; it hands each torch function to its watch (`run_function`, `run_backward`) and, with
capture on, to the replay's recorder.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from .._util import caller_at_user_line
from .function_mode import handling, leave_when_put_back
from .function_mode import pop as _pop
from .function_mode import stack_at as _stack_at, stack_len as _stack_len
from .hooks import is_dynamo_compiling
from .passes import PassRecord, graph_task_id

__all__ = ["MODE", "ThreadState", "thread_state", "outside_mode_active", "outside_checking",
           "withdraw", "leave_region", "leave_if_ownerless", "hold_step_hook", "release_step_hook",
           "ENDS_REGION", "KEEPS_VALUES", "WRAPPER", "TENSOR_TO"]



def _functions(owner, names) -> set:
    return {getattr(owner, name) for name in names if hasattr(owner, name)}


# Calls that end the watched code: the backward it leads to runs unwatched.
ENDS_REGION = _functions(torch.Tensor, ("backward",)) | {torch.autograd.backward}
# Calls whose outputs hold only values their inputs held (views, copies, selections), or no new
# values at all: never summarised. (`Tensor.to` and the casts are not among them: float16 has a
# smaller range.)
KEEPS_VALUES = (
    _functions(torch.Tensor, (
        "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze",
        "unsqueeze", "permute", "transpose", "t", "expand", "expand_as", "contiguous", "clone",
        "detach", "detach_", "requires_grad_", "narrow", "select", "__getitem__", "__setitem__",
        "split", "chunk", "unbind", "flip", "roll", "movedim", "repeat", "tile", "index_select",
        "gather", "take", "masked_fill", "masked_fill_", "zero_", "fill_", "copy_", "retain_grad",
        "register_hook", "cpu", "cuda", "pin_memory", "share_memory_", "__repr__", "__format__",
        "numpy", "tolist", "item",
    ))
    | _functions(torch, (
        "cat", "concat", "stack", "hstack", "vstack", "where", "flatten", "reshape", "squeeze",
        "unsqueeze", "permute", "transpose", "narrow", "select", "split", "chunk", "unbind",
        "flip", "roll", "index_select", "gather", "take", "masked_fill", "clone", "zeros_like",
        "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
    ))
    | _functions(torch, (  # made from scalars and shapes: constants, masks, random draws
        "tensor", "as_tensor", "asarray", "from_numpy", "scalar_tensor", "zeros", "ones", "full",
        "empty", "empty_strided", "eye", "arange", "linspace", "logspace", "rand", "randn",
        "randint", "randperm", "normal", "_foreach_zero_",
    ))
    | {torch.autograd.grad}  # its gradients are checked by the node hooks and the guard
)
WRAPPER = types.MethodWrapperType  # tensor attributes read through __torch_function__ (`.grad`)


# ---- the mode, and each thread's place in it -----------------------------------------------------
class ThreadState(threading.local):
    """Where this thread stands: the watch whose code runs (`owner`), whether its functions are
    checked now (`active`; False: the mode may be on the stack, passing everything through), how
    many function modes lie below ours (`base`: the user's, entered before the guard attached),
    and the region's record."""

    def __init__(self):
        self._owner = None  # a weak reference: a guard dropped while attached goes with its models
        self.active = False
        self.base = 0
        self.pass_: Optional[PassRecord] = None
        self.ops = 0  # functions recorded in the region (their call index)
        # The first culprits of the code after a call, and a -inf mask a model put in its
        # output: judged by the loss of the next backward (`OutsideWatch._judge`).
        self.held = None
        self.held_mask = None
        self.calls_held = 0  # model calls since they were held, with no backward

    @property
    def owner(self) -> Optional[object]:
        owner = self._owner
        return owner() if owner is not None else None

    @owner.setter
    def owner(self, watch: Optional[object]) -> None:
        self._owner = weakref.ref(watch) if watch is not None else None


thread_state = ThreadState()


class OutsideMode(TorchFunctionMode):
    """The one mode every watch shares, so that it is on a thread's stack at most once."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # IPython (and pytest) leave frames holding this out of tracebacks: an error of the
        # user's own call shows the user's line, then torch's. Plain Python shows the two frames
        # of the watch (this one and run_function): a frame cannot leave a traceback it raised
        # through.
        __tracebackhide__ = True  # noqa: F841
        if kwargs is None:
            kwargs = {}
        state = thread_state
        if not state.active:  # the common case off the watched code: no owner called up
            if state._owner is not None and not _still_attached(state):
                _release_thread(state)
            return func(*args, **kwargs)
        watch = state.owner
        if watch is None or not watch.attached:  # detached, or dropped, from another thread
            _release_thread(state)
            return func(*args, **kwargs)
        if is_dynamo_compiling():
            return func(*args, **kwargs)
        if func is TENSOR_TO:  # in GradScaler.scale(loss)? the loop's scaler, found
            watch.guard.scaling.note_caller(sys._getframe(1))
        if func in ENDS_REGION:
            return watch.run_backward(state, func, args, kwargs)
        if func is _AUTOGRAD_GRAD:  # its outputs judge what is held, as a loss does
            loss = args[0] if args else kwargs.get("outputs")
            # with create_graph, a gradient penalty's: a loss comes after it (else its gradients
            # are the step's own, a hand-made update's)
            penalty = bool(kwargs.get("create_graph", args[4] if len(args) > 4 else False))
            if state.held is not None or state.held_mask is not None:
                watch.settle(state, loss=loss, before_the_loss=penalty)
            if watch.judge_loss is not None and watch.watching():
                watch.judge_loss(loss, before_the_loss=penalty)  # (a sentinel on a device)
        recorder = watch.recorder
        if recorder is not None and watch.watching():  # capture=True: kept for a CPU replay
            return _run_recorded(recorder, watch, state, func, args, kwargs)
        # (with a culprit held, a selection is watched: a `where` may drop its values; under
        # no_grad too where a GPU's region is read later: no loss judges what such code made)
        if type(func) is WRAPPER or (func in KEEPS_VALUES and state.held is None and (
                torch.is_grad_enabled() or watch.reads_at_once(args))):
            return caller_at_user_line()(func, args, kwargs)
        return watch.run_function(state, func, args, kwargs)


def _still_attached(state: ThreadState) -> bool:
    watch = state.owner
    return watch is not None and watch.attached


def _release_thread(state: ThreadState) -> None:
    """This thread's watch was detached (or its guard dropped) from another thread, whose stop
    could take the mode off no stack but its own: this thread forgets the watch, and the mode
    leaves its stack once torch puts it back after this call (else every torch function here
    would go on passing through Python, several times slower)."""
    if is_dynamo_compiling():  # traced into a graph: left for the next eager call
        return
    state.active = False
    state.owner, state.pass_ = None, None
    state.held = state.held_mask = None
    leave_when_put_back(MODE, _HANDLER_CODES)


def _run_recorded(recorder, watch, state, func, args, kwargs):
    __tracebackhide__ = True  # noqa: F841
    record = recorder.before(func, args, kwargs)
    if func in KEEPS_VALUES or type(func) is WRAPPER:
        out = caller_at_user_line()(func, args, kwargs)
    else:
        out = watch.run_function(state, func, args, kwargs)
    recorder.after(record, out)
    return out


MODE = OutsideMode()
TENSOR_TO = torch.Tensor.to
_AUTOGRAD_GRAD = torch.autograd.grad


def outside_mode_active() -> bool:
    """Whether this thread's torch function mode stack holds the watch's mode."""
    return any(_stack_at(i) is MODE for i in range(_stack_len()))


def outside_checking() -> bool:
    """Whether the torch functions this thread calls now are checked."""
    return thread_state.active and outside_mode_active()


def withdraw(state: ThreadState, detaching: bool = False) -> None:
    """Stop checking in this thread, and take the mode off its stack where it is on top (below a
    mode of the user's, it stays, passing everything through, until a later try). A detach while
    the mode handles a call (an `on_detect` that detaches, raised from the backward the mode
    runs) finds it off the stack until that call returns: it leaves as soon as torch puts it back
    (no later hook of the guard would take it off)."""
    state.active = False
    count = _stack_len()
    if count and _stack_at(count - 1) is MODE:
        _pop()
    elif detaching and handling(_HANDLER_CODES):
        leave_when_put_back(MODE, _HANDLER_CODES)


_HANDLER_CODES = frozenset((OutsideMode.__torch_function__.__code__, _run_recorded.__code__))


def leave_if_ownerless() -> None:
    """A watch was collected (its guard dropped while attached): where the mode is on top of this
    thread's stack with no watch of its own, it leaves (no hook of that guard would take it)."""
    state = thread_state
    for name in ("held", "held_mask"):  # a dropped guard's culprits go with it
        item = getattr(state, name)
        if item is not None and item.alive() is None:
            setattr(state, name, None)
    count = _stack_len()
    if state.owner is None and count and _stack_at(count - 1) is MODE:
        state.active = False
        _pop()


# Model calls a held culprit waits for a backward through (several calls feed one loss: an actor
# and a critic, two time steps): after that many, evaluation code with no backward, judged then.
MAX_CALLS_WITHOUT_BACKWARD = 8


def leave_region(final: bool = False) -> None:
    """The code watched in this thread is over: what it made is checked, and the mode leaves the
    stack. Not inside a backward: a forward re-run there (activation checkpointing), an
    optimizer stepped from a gradient hook. `final` (an optimizer step): what is held is judged
    now, no backward coming for it."""
    if graph_task_id() != -1:
        return
    state = thread_state
    checking, owner = state.active, state.owner
    withdraw(state)
    if state.held is not None or state.held_mask is not None:
        state.calls_held += 1
        final = final or state.calls_held > MAX_CALLS_WITHOUT_BACKWARD
    if owner is not None and (checking or (final and (state.held or state.held_mask))):
        owner.settle(state, final=final, at_model_call=True)


# torch.optim's global step pre-hook (its handle), one for all the watches attached, and how many
# hold it.
_step_hook: list = []
_step_hook_holders = [0]


def hold_step_hook(hold: list) -> None:
    if not hold[0]:
        hold[0] = True
        _step_hook_holders[0] += 1
        if not _step_hook:
            _step_hook.append(register_optimizer_step_pre_hook(_step_begins))


def release_step_hook(hold: list) -> None:
    if hold[0]:
        hold[0] = False
        _step_hook_holders[0] -= 1
        if _step_hook and not _step_hook_holders[0]:
            _step_hook.pop().remove()


@torch.compiler.disable  # run as it is in a compiled step too: traced, it would recompile
def _step_begins(optimizer, args, kwargs) -> None:
    """torch.optim's global step pre-hook: an optimizer step ends the watched code."""
    if thread_state.owner is not None:
        leave_region(final=True)
