"""The Guard: hooks on every module call, forward and backward, that find where inf/nan is produced.

How it stays fast and harmless:
- statistics are small vectors computed on the tensor's device (`stats.device_stats`) and read
  with one transfer at the end of each top-level forward and each backward (`sync=False`); on
  CPU, where there is nothing to wait for, they are numbers from the start;
- backward is watched with tensor hooks (on outputs, inputs and parameters), never with
  `register_full_backward_hook`, which wraps tensors in views and breaks in-place modules;
- hooks keep only names and indices, never tensors; per-pass caches hold weak references;
- every module hook and parameter hook is removed on detach, which `with` guarantees.

The Guard records (`passes`) and keeps the pass lifecycle; what a pass means is decided in
`detect` and shown through `frames`; op localisation (`ops.recorder`) and the CPU replay's
capture (`replay.Capture`) are fed from its hooks.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from functools import partial
from typing import Dict, Iterable, List, Optional, Union

import torch
from torch import nn

from .. import _tree
from .. import stats as _stats
from .._schema import (
    BACKWARD, BUFFER, CODE_CAUSES, FORWARD, GRAD_INPUT, GRAD_OUTPUT, GRAD_PARAM, INPUT, LATEST,
    OUTPUT, PARAM, VALUE_NONE, VALUE_OTHER,
)
from ..callstate import take as take_call_state
from ..errors import BatchLimitReached, NonFiniteError
from ..ops.recorder import OpRecorder
from ..report import Report
from . import detect, frames
from .options import GuardOptions
from .passes import ENTRY_INDEX, ENTRY_KIND, ENTRY_SHAPE, ENTRY_TARGETS, CallRecord, PassRecord

__all__ = ["Guard", "NonFiniteError", "BatchLimitReached"]

# Roles of positional inputs, made once: every pre-hook names its inputs.
_INPUT_ROLES = tuple(f"input[{i}]" for i in range(16))


def _is_running(module: nn.Module) -> bool:
    """Whether `module` is being called further up this thread's stack (it calls itself), besides
    the call whose pre-hook is asking."""
    calls = 0
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is module:
            calls += 1
            if calls > 1:
                return True
        frame = frame.f_back
    return False


_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: 0)


def _graph_task_id() -> int:
    """Id of the autograd graph task running this hook (-1 outside backward)."""
    return _current_graph_task_id()


class _GradHook:
    """The one hook a tensor gets: hands its gradient to the guard with the calls it belongs to.
    (One object, where a partial of a bound method is two for the garbage collector to track.)"""

    __slots__ = ("guard", "targets")

    def __init__(self, guard: "Guard", targets: list):
        self.guard = guard
        self.targets = targets

    def __call__(self, grad):
        return self.guard._on_grad(self.targets, grad)


class _ModuleHooks:
    """The hooks the guard puts on modules and parameters, and what it learns placing them (each
    module's name in reports); all removed and forgotten on detach."""

    def __init__(self):
        self.handles: list = []
        self.names: Dict[int, str] = {}  # id(module) -> its name in reports
        self.modules: Dict[int, nn.Module] = {}  # id(module) -> module
        self.primary_root_id: Optional[int] = None  # the first model: its calls start batches
        self.hooked_params: set = set()  # ids of parameters with a gradient hook
        # One weak reference per parameter and buffer for the guard's lifetime: CPython hands it
        # out again for every weakref.ref(param) of a pass, where a first one costs microseconds.
        self.lasting_refs: list = []

    def add(self, guard: "Guard", models: Dict[str, nn.Module], watch_backward: bool) -> None:
        """Hook every module of `models` (once each, under its name with the model's prefix)."""
        for prefix, root in models.items():
            if self.primary_root_id is None:
                self.primary_root_id = id(root)
            for name, module in root.named_modules():
                if id(module) not in self.names:
                    full = name if not prefix else (f"{prefix}.{name}" if name else prefix)
                    self._add_module(guard, module, full, watch_backward)

    def _add_module(self, guard: "Guard", module: nn.Module, name: str, watch_backward: bool) -> None:
        self.names[id(module)] = name
        self.modules[id(module)] = module
        self.lasting_refs.extend(
            weakref.ref(t) for t in itertools.chain(module._parameters.values(), module._buffers.values())
            if t is not None)
        handles = self.handles
        handles.append(module.register_forward_pre_hook(guard._pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(guard._post_hook, with_kwargs=True))
        # Runs only when forward raised: closes the call the normal hook never saw.
        handles.append(module.register_forward_hook(guard._post_hook_on_error, always_call=True))
        if watch_backward:
            for pname, param in module.named_parameters(recurse=False):
                if param.requires_grad and id(param) not in self.hooked_params:
                    self.hooked_params.add(id(param))
                    handles.append(param.register_hook(partial(guard._on_param_grad, module, pname)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.names.clear()  # cleared, never replaced: the guard reads it as `_names`
        self.modules.clear()
        self.hooked_params.clear()
        self.lasting_refs.clear()
        self.primary_root_id = None


class _GradHooks:
    """The gradient hooks the guard puts on tensors, and their handles (removed on detach).

    A tensor seen in forward gets one hook per pass (and version), fanned out to every call that
    saw it; its handle is dead once the tensor's graph is freed. A leaf tensor (a parameter used
    as an input, say) gets one hook for the guard's lifetime: a hook per forward would pile up on
    it, since leaves never die."""

    def __init__(self, guard: "Guard"):
        self.guard = guard
        self.handles: list = []  # hooks on tensors of a graph
        self.leaf_handles: list = []
        self.leaf_targets: Dict[int, list] = {}  # id(leaf tensor) -> [weakref, targets]

    def leaf_targets_of(self, leaf: torch.Tensor) -> list:
        """The targets of the one hook of `leaf`, hooking it the first time."""
        known = self.leaf_targets.get(id(leaf))
        if known is not None and known[0]() is leaf:
            return known[1]
        targets: list = []
        self.leaf_targets[id(leaf)] = [weakref.ref(leaf), targets]
        self.leaf_handles.append(leaf.register_hook(_GradHook(self.guard, targets)))
        return targets

    def drop_dead(self) -> None:
        """Forget the handles of hooks on freed graphs, which need no removal."""
        self.handles = [h for h in self.handles if h.hooks_dict_ref() is not None]

    def backward_done(self) -> None:
        for _, targets in self.leaf_targets.values():
            targets.clear()  # the calls that used the leaves are done with

    def remove(self) -> None:
        for handle in itertools.chain(self.handles, self.leaf_handles):
            handle.remove()
        self.handles.clear()
        self.leaf_handles.clear()
        self.leaf_targets.clear()


class _Option:
    """A Guard attribute that is one of its options: read from `guard.options`; set through a
    checked copy of them (`guard.sync = True` is checked like `Guard(..., sync=True)`)."""

    def __init__(self, option: str):
        self.option = option

    def __get__(self, guard, owner=None):
        return self if guard is None else getattr(guard.options, self.option)

    def __set__(self, guard, value) -> None:
        guard._use_options(guard.options.replace(**{self.option: value}))


def _normalise_models(model_or_models, allow_none: bool = False) -> Dict[str, nn.Module]:
    if isinstance(model_or_models, nn.Module):
        return {"": model_or_models}
    if isinstance(model_or_models, dict):
        items = list(model_or_models.items())
    elif isinstance(model_or_models, Iterable) and not isinstance(model_or_models, (str, bytes)):
        items = [(f"model{i}", m) for i, m in enumerate(model_or_models)]
    else:
        items = [("", model_or_models)]
    for name, module in items:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Guard needs torch.nn.Module objects, got {type(module).__name__}"
                f"{' for ' + repr(name) if name else ''}: pass the model (or a list of models)"
            )
    if not items:
        if allow_none:  # a guard pointed at nothing for now (retarget)
            return {}
        raise ValueError("Guard needs at least one torch.nn.Module to watch")
    # A model that is a submodule of another is already watched through it.
    kept = []
    for name, module in items:
        if any(module is not other and any(module is sub for sub in other.modules())
               for _, other in items):
            continue
        if any(module is other for _, other in kept):
            continue
        kept.append((name, module))
    if len(kept) == 1:
        return {"": kept[0][1]}
    return dict(kept)


class Guard:
    """Watch a model's forward and backward passes and stop at the first inf/nan produced.

    >>> with Guard(model) as guard:
    ...     loss = model(**batch).loss
    ...     loss.backward()

    raises `NonFiniteError` (a FloatingPointError) with `.report` naming the module that produced
    the first non-finite value, with the `max_frames` frames leading up to it.

    Args:
        model_or_models: a module, a list of modules, or a dict of name -> module (names are then
            used as prefixes; a loss module can be watched alongside the model).
        max_frames: frames kept in the report, leading up to the culprit.
        trace_batches: batch numbers (0-indexed calls of the first model) whose every frame is
            recorded in `guard.traces[batch]`, without stopping on inf/nan.
        abort_after_batch: raise `BatchLimitReached` when batch `abort_after_batch + 1` starts.
        backward: also watch gradients (module outputs, inputs, parameters).
        sync: read statistics in every hook and raise there (slower; for when the process would
            crash before the pass ends).
        allow_inf: True, or module-name globs, for modules that legitimately produce +-inf.
        limit_dtype: e.g. torch.float16: values beyond its largest finite value count as an
            overflow (predicted) and non-zero values below its smallest are flagged as underflow.
        on_trace: called with each traced batch's report after each of its passes.
        on_detect: called with the report before `NonFiniteError` is raised; if it returns an
            exception, that exception is raised instead.
        ops: on a detection, re-run the failing step inside the culprit module to name the first
            ATen op that turned non-finite and the source line that called it.
        capture: keep host copies of the last calls' inputs and a host snapshot of the weights,
            to replay a call on CPU after an asynchronous CUDA error (`guard.capture`).

    The options are checked into `guard.options` (a `GuardOptions`); each is also an attribute
    (`guard.sync`, ...; `capture` is `guard.capture_enabled`), settable between attaches.
    """

    max_frames = _Option("max_frames")
    trace_batches = _Option("trace_batches")
    abort_after_batch = _Option("abort_after_batch")
    backward = _Option("backward")
    sync = _Option("sync")
    allow_inf = _Option("allow_inf")
    limit_dtype = _Option("limit_dtype")
    on_trace = _Option("on_trace")
    on_detect = _Option("on_detect")
    ops = _Option("ops")
    # Whether attach takes a capture (the magics turn it off when the weights' host copy stops
    # fitting in memory); `capture` is the latest captured call.
    capture_enabled = _Option("capture")

    def __init__(
        self,
        model_or_models,
        *,
        max_frames: int = 21,
        trace_batches: Iterable[int] = (),
        abort_after_batch: Optional[int] = None,
        backward: bool = True,
        sync: bool = False,
        allow_inf: Union[bool, str, Iterable[str]] = False,
        limit_dtype=None,
        on_trace=None,
        on_detect=None,
        ops: bool = False,
        capture: bool = False,
    ):
        self.models = _normalise_models(model_or_models)
        self._op_recorder: Optional[OpRecorder] = None  # kept while ops=True
        self._use_options(GuardOptions(
            max_frames=max_frames, trace_batches=trace_batches,
            abort_after_batch=abort_after_batch, backward=backward, sync=sync,
            allow_inf=allow_inf, limit_dtype=limit_dtype, on_trace=on_trace,
            on_detect=on_detect, ops=ops, capture=capture,
        ))
        self._capture = None  # replay.Capture, made on attach

        self.detection: Optional[Report] = None  # set when a non-finite value was found
        self.traces: Dict[int, Report] = {}
        self.batch_number = 0  # the batch being run (or last run)
        self._batches_started = 0
        self._paused = False  # True while the guard re-runs a step itself (op localisation)
        self._batches_counted_by_caller = False  # begin_batch() was called
        self._module_hooks = _ModuleHooks()
        self._names = self._module_hooks.names  # read in every pre-hook: no lookup through
        self._grad_hooks = _GradHooks(self)
        self._attached = False
        self._sign_hints: dict = {}  # (module id, role) -> one sign last time (stats.device_stats)
        self._recent = frames.RecentPasses()  # context for a report of a later pass
        self._reset_pass_state()

    def _use_options(self, options: GuardOptions) -> None:
        self.options = options
        # Read by the hooks on every module call: plain attributes, not options lookups.
        self._watch_backward = options.backward
        self._sync = options.sync
        self._nonzero_min = options.limit_dtype is not None
        self._op_recorder = (self._op_recorder or OpRecorder()) if options.ops else None

    # ---- attach / detach ------------------------------------------------------------------
    def attach(self) -> "Guard":
        """Register the hooks (idempotent). Prefer `with Guard(...)`, which always detaches."""
        if self._attached:
            return self
        self._reset_pass_state()
        try:
            self._module_hooks.add(self, self.models, self._watch_backward)
            if self.options.capture:
                from ..replay import Capture

                self._capture = None  # never an earlier attach's capture, should this one fail
                self._capture = Capture(self.models)
        except BaseException:
            self.detach()
            raise
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove every hook this guard registered (idempotent)."""
        self._module_hooks.remove()
        self._grad_hooks.remove()
        if self._capture is not None:
            self._capture.stop_watching_optimizers()  # the capture itself stays, for replay
        self._sign_hints.clear()
        if self._op_recorder is not None:
            self._op_recorder.clear()
        self._attached = False
        self._reset_pass_state()
        _stats.release_workspace()

    def retarget(self, model_or_models) -> None:
        """Point a detached guard at other models (rebuilt in a notebook cell; an empty dict: none
        for now), checked as in the constructor; batch count, traces and detection are kept."""
        if self._attached:
            raise RuntimeError("numguard: detach the guard before pointing it at other models")
        self.models = _normalise_models(model_or_models, allow_none=True)

    @property
    def attached(self) -> bool:
        return self._attached

    def __enter__(self) -> "Guard":
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget a pass that never finished (e.g. interrupted with Ctrl-C)."""
        self._reset_pass_state()

    def _reset_pass_state(self) -> None:
        self._stack: List[CallRecord] = []
        self._closed_normally: Optional[CallRecord] = None
        self._forward: Optional[PassRecord] = None
        self._backward_passes: Dict[int, PassRecord] = {}  # autograd graph task id -> its pass
        self._call_counts: Dict[int, int] = {}
        self._first_calls: Dict[int, CallRecord] = {}
        self._tracing = False

    @property
    def capture(self):
        """The latest captured call (replayable on CPU), or None without capture=True."""
        return self._capture.latest if self._capture is not None else None

    @property
    def report(self) -> Report:
        """The detection report if there was one, else a report of the last frames seen."""
        if self.detection is not None:
            return self.detection
        return frames.make_report(self._recent.frames(self.options), None, LATEST, "", "",
                                  self.batch_number, self.options)

    # ---- forward --------------------------------------------------------------------------
    def _pre_hook(self, module, args, kwargs):
        if self._paused:
            return
        module_id = id(module)
        stack = self._stack
        if stack and stack[0].module_id == module_id and not _is_running(module):
            # The last pass never finished (Ctrl-C skips the hooks that close calls).
            self._reset_pass_state()
            stack = self._stack
        if not stack:
            # Activation checkpointing re-runs forward inside backward: no new batch then.
            recomputing = _graph_task_id() != -1
            self._begin_forward(module_id, recomputing)
            if not recomputing:
                # The state the call starts in (RNG, autocast, grad mode), to re-run it from.
                state = (take_call_state() if self._op_recorder is not None or self._capture is not None
                         else None)
                if self._capture is not None:
                    self._capture.record(self._names[module_id], module, args, kwargs, state=state)
                if self._op_recorder is not None:
                    self._op_recorder.remember_call(module, args, kwargs, state, self._call_counts)
        index = self._call_counts.get(module_id, 0)
        self._call_counts[module_id] = index + 1
        # A call with nothing around it is top-level, whether or not it is a guarded root (a
        # LightningModule's training_step calls its submodules directly).
        call = CallRecord(
            module_id, self._names.get(module_id, "?"), type(module).__name__, FORWARD,
            self.batch_number, index, not stack,
        )
        if index == 0:
            self._first_calls[module_id] = call
        if stack:
            call.parent = stack[-1]
            call.root_id = stack[0].module_id
        pass_ = self._forward
        watch_grads = self._watch_backward and torch.is_grad_enabled()
        for pname, param in module._parameters.items():
            if param is not None:
                self._add(pass_, call, pname, PARAM, param, False)
        for bname, buffer in module._buffers.items():
            # Running statistics go bad like weights; integer/bool buffers cannot.
            if buffer is not None and buffer.is_floating_point():
                self._add(pass_, call, bname, BUFFER, buffer, False)
        for i, value in enumerate(args):
            role = _INPUT_ROLES[i] if i < len(_INPUT_ROLES) else f"input[{i}]"
            self._add_nested(pass_, call, role, INPUT, value, watch_grads)
        for key, value in kwargs.items():
            self._add_nested(pass_, call, f"input[{key}]", INPUT, value, watch_grads)
        stack.append(call)

    def _post_hook(self, module, args, kwargs, output):
        if self._paused:
            return
        call = self._pop_call(id(module))
        if call is None:
            return
        self._closed_normally = call
        watch_grads = self._watch_backward and torch.is_grad_enabled()
        self._add_nested(self._forward, call, "output", OUTPUT, output, watch_grads)
        if self._op_recorder is not None and watch_grads and not self._stack:
            self._op_recorder.keep_root_grads(call.module_id, output, self._grad_hooks.handles)
        self._finish_call(call)

    def _post_hook_on_error(self, module, args, output):
        # Runs after every call; the call is still open only when forward itself raised.
        if self._paused:
            return
        closed = self._closed_normally
        if closed is not None and closed.module_id == id(module):
            self._closed_normally = None
            return
        if self._stack and self._stack[-1].module_id == id(module):
            call = self._pop_call(id(module))
            call.raised = True
            self._finish_call(call, raising=True)

    def _pop_call(self, module_id) -> Optional[CallRecord]:
        stack = self._stack
        while stack:
            call = stack.pop()
            if call.module_id == module_id:
                return call
        return None  # hooks attached mid-call, or state reset: nothing to close

    def _finish_call(self, call: CallRecord, raising: bool = False) -> None:
        pass_ = self._forward
        call.seq = next(pass_.seq)
        pass_.calls.append(call)
        if self._sync and not raising and not self._tracing:
            pass_.read_back()
            culprit = detect.forward_culprit(pass_, [call], self.options)
            if culprit is not None:
                self._detect(pass_, FORWARD, *culprit)
        if not self._stack:
            self._end_forward(raising)

    # ---- batches and passes ---------------------------------------------------------------
    def begin_batch(self) -> None:
        """Start the next batch now. For loops that never call the guarded model itself (a
        LightningModule's training_step calls its submodules): once called, only these calls
        count batches."""
        self._batches_counted_by_caller = True
        self._start_batch()

    def _start_batch(self) -> None:
        batch = self._batches_started
        limit = self.options.abort_after_batch
        if limit is not None and batch > limit:
            raise BatchLimitReached(
                f"numguard: stopped before batch {batch} because abort_after_batch="
                f"{limit} (batches 0..{limit} ran)"
            )
        self._batches_started += 1
        self.batch_number = batch
        self._call_counts.clear()
        self._first_calls.clear()
        self._tracing = batch in self.options.trace_batches

    def _begin_forward(self, module_id, recomputing: bool) -> None:
        if self._backward_passes and not recomputing:
            self._backward_passes.clear()  # backward passes that raised before their end
        if module_id == self._module_hooks.primary_root_id and not recomputing \
                and not self._batches_counted_by_caller:
            self._start_batch()
        self._forward = PassRecord()
        if len(self._grad_hooks.handles) > 4096:
            self._grad_hooks.drop_dead()  # keep the list bounded over long runs

    def _end_forward(self, raising: bool) -> None:
        pass_ = self._forward
        self._forward = None
        pass_.read_back()
        if self._tracing:
            self._record_trace(pass_)
            return
        if not raising and detect.has_problem(pass_, self.options.limit_max):
            culprit = detect.find_in_forward(pass_, self.options)
            if culprit is not None:
                self._detect(pass_, FORWARD, *culprit)
        self._recent.remember(pass_, self.options.max_frames)

    # ---- values ---------------------------------------------------------------------------
    def _add_nested(self, pass_: PassRecord, call: CallRecord, role, category, value, watch_grads) -> None:
        if isinstance(value, torch.Tensor):  # the common case, without walking
            self._add(pass_, call, role, category, value, watch_grads)
            return
        for leaf_role, leaf in _tree.named_leaves(value, role):
            self._add(pass_, call, leaf_role, category, leaf, watch_grads)

    def _add(self, pass_: PassRecord, call: CallRecord, role, category, value, watch_grads) -> None:
        """Add a slot for one value of a call; for gradients-to-be, hook the tensor."""
        if not isinstance(value, torch.Tensor):
            kind = VALUE_NONE if value is None else VALUE_OTHER
            call.slots.append((role, category, kind, None, None, None, 0))
            return
        entry = pass_.summarise(value, (call.module_id, role), self._nonzero_min, self._sign_hints)
        call.slots.append(
            (role, category, entry[ENTRY_KIND], value.dtype, entry[ENTRY_SHAPE], entry[ENTRY_INDEX], 0))
        if watch_grads and value.requires_grad and category != PARAM:
            # Targets lie flat, (call, role, category) after one another: no tuple per target.
            if value.is_leaf:
                targets = self._grad_hooks.leaf_targets_of(value)
            elif entry[ENTRY_TARGETS] is None:
                # One hook per tensor (and version), fanned out to every call that saw it.
                targets = entry[ENTRY_TARGETS] = []
                self._grad_hooks.handles.append(value.register_hook(_GradHook(self, targets)))
            else:
                targets = entry[ENTRY_TARGETS]
            targets += (call, "grad_" + role, GRAD_OUTPUT if category == OUTPUT else GRAD_INPUT)

    # ---- backward -------------------------------------------------------------------------
    def _backward_state(self) -> PassRecord:
        task = _graph_task_id()
        pass_ = self._backward_passes.get(task)
        if pass_ is None:
            pass_ = self._backward_passes[task] = PassRecord()
            # Read everything back once, when the engine finishes this backward pass.
            torch.autograd.Variable._execution_engine.queue_callback(
                partial(self._end_backward, task)
            )
        return pass_

    def _on_grad(self, targets, grad):
        if self._attached and not self._paused and grad is not None:
            self._record_grad(targets, grad)
        return None

    def _on_param_grad(self, module, pname, grad):
        if not self._attached or self._paused or grad is None:
            return None
        forward_call = self._first_calls.get(id(module))
        if forward_call is None:
            # Its weights were used without calling it (F.linear(x, sub.weight)): a call of its
            # own still gives the gradient a frame.
            forward_call = self._first_calls[id(module)] = CallRecord(
                id(module), self._names.get(id(module), "?"), type(module).__name__, FORWARD,
                self.batch_number, 0, False,
            )
        self._record_grad((forward_call, pname + ".grad", GRAD_PARAM), grad)
        return None

    def _record_grad(self, targets, grad) -> None:
        """Summarise one gradient once and add it to every call it belongs to (`targets`: forward
        call, role, category, one after another)."""
        pass_ = self._backward_state()
        site = (targets[0].module_id, targets[1]) if targets else None
        entry = pass_.summarise(grad, site, self._nonzero_min, self._sign_hints)
        index, shape, kind = entry[ENTRY_INDEX], entry[ENTRY_SHAPE], entry[ENTRY_KIND]
        # Targets were registered in forward order; backward reaches them in reverse (a tensor
        # that is A's output and B's input is B's input gradient before it is A's output's).
        for position in range(len(targets) - 3, -1, -3):
            forward_call, role, category = targets[position:position + 3]
            call = pass_.backward_call(forward_call)
            slot = (role, category, kind, grad.dtype, shape, index, next(pass_.seq))
            call.slots.append(slot)
            if self._sync and not self._tracing:
                pass_.read_back()
                culprit = detect.backward_culprit(pass_, [slot], {id(slot): call}, self.options)
                if culprit is not None:
                    self._detect(pass_, BACKWARD, *culprit)

    def _end_backward(self, task) -> None:
        pass_ = self._backward_passes.pop(task, None)
        if pass_ is None or not self._attached:
            return
        try:
            self._finish_backward(pass_)
        finally:
            if self._op_recorder is not None:
                self._op_recorder.forget_grads()  # held for a re-run only until this pass ends
            self._grad_hooks.backward_done()

    def _finish_backward(self, pass_: PassRecord) -> None:
        self._grad_hooks.drop_dead()  # the graph this pass ran on has been consumed
        pass_.read_back()
        if self._tracing:
            self._record_trace(pass_)
            return
        if detect.has_problem(pass_, self.options.limit_max):
            culprit = detect.find_in_backward(pass_, self.options)
            if culprit is not None:
                self._detect(pass_, BACKWARD, *culprit)
        self._recent.remember(pass_, self.options.max_frames)

    # ---- reports --------------------------------------------------------------------------
    def _detect(self, pass_: PassRecord, phase, call: CallRecord, bad_slots, cause) -> None:
        """Build the report for a detection and raise it."""
        options = self.options
        culprit = frames.build_frame(pass_, call, options, {id(s) for s in bad_slots})
        if self._op_recorder is not None and cause in CODE_CAUSES:
            self._paused = True  # the re-run of the step must not reach the hooks
            try:
                where = self._op_recorder.localise(
                    call.root_id, self._module_hooks.modules.get(call.module_id), call.module_id,
                    call.call_index, cause, options.limit_max, options.inf_allowed(call.module_name))
            finally:
                self._paused = False
            frames.add_op_location(culprit, where)
        self.detection = frames.detection_report(
            pass_, phase, call, bad_slots, culprit, cause, self._recent.frames(options), options,
            self.batch_number)
        self._reset_pass_state()
        error = options.on_detect(self.detection) if options.on_detect is not None else None
        raise error if isinstance(error, BaseException) else NonFiniteError(self.detection)

    def _record_trace(self, pass_: PassRecord) -> None:
        # A trace notes where a non-finite value would have been caught, without stopping.
        culprit = detect.find_in_trace(pass_, self.options)
        report = self.traces[self.batch_number] = frames.add_to_trace(
            self.traces.get(self.batch_number), pass_, culprit, self.options, self.batch_number)
        if self.options.on_trace is not None:
            self.options.on_trace(report)

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        names = ", ".join(type(m).__name__ for m in self.models.values())
        return f"<numguard Guard on {names}: {state}, batch {self.batch_number}>"
