"""The Guard: hooks on every module call, forward and backward, that find where inf/nan is produced.

Contract: `Guard(model_or_models, **options)` hooks every module (and, with `backward`, the
gradients) on `attach()` and removes every hook on `detach()`; `with guard:` always detaches (nested
blocks, in one thread or several, at the outermost exit). The first non-finite value produced raises
`NonFiniteError` (re-exported here, with `BatchLimitReached`), whose `.report` names the module;
`guard.report` is that detection or the latest frames, `guard.capture` the latest captured call
(`capture=True`), `begin_batch()` starts a batch for loops that never call the model itself.

Limits: copies of a guarded module (`copy.deepcopy`, pickle, `torch.save`) come out unwatched;
hooks do nothing while a model is compiled, traced or exported; a model compiled before attaching
is watched as one call, its wrapper's (a forward detection there is run again eagerly to name
the submodule); `mode="sentinel"` hooks no module (`Sentinel` checks per step instead).

    >>> with Guard(model) as guard:
    ...     model(**batch).loss.backward()    # NonFiniteError: .report names the module
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from functools import partial
from typing import Dict, Iterable, Optional

import torch
from torch import nn

from .. import _tree, rerun
from .. import stats as _stats
from .._util import register_tensor_hook, user_stacklevel
from .._schema import (
    BACKWARD, CAUSE_COMPILED, CAUSE_DATA, CAUSE_TRANSIENT, CODE_CAUSES, FORWARD, GRAD_INPUT, GRAD_OUTPUT, GRAD_PARAM, INPUT, LATEST,
    MODE_SENTINEL, OUTPUT, VALUE_NONE, VALUE_OTHER,
)
from ..errors import BatchLimitReached, NonFiniteError  # re-exported
from ..ops.recorder import OpRecorder
from ..report import Report
from . import detect, frames
from .headroom import Headroom
from .history import History
from .hooks import (
    GradHook, GradHooks, ModuleHooks, ParamHook, forward_raised, frame_local_of_call,
    inert_context, is_dynamo_compiling, running_calls,
)
from .options import OPTION_DOCS, GuardOptions, keyword_signature
from .outside import OutsideWatch
from .passes import (
    ENTRY_INDEX, ENTRY_KIND, ENTRY_SHAPE, ENTRY_TARGETS, BackwardPasses, BatchCounter,
    CallRecord, PassRecord, PassState, ThreadPasses, graph_task_id,
)
from ..distributed.flags import RankFlags
from .rank_reports import settle_after_reduction
from .steps import StepWatch
from .scaler import LossScaling
from .sentinel import Sentinel

__all__ = ["Guard", "NonFiniteError", "BatchLimitReached"]

# Roles of positional inputs, made once: every pre-hook names its inputs.
_INPUT_ROLES = tuple(f"input[{i}]" for i in range(16))
_UNNAMED = ("?", "?", None)  # a module not hooked itself (a DataParallel replica shares hooks)
_RAISED = object()  # the output the forward hook gets after a forward that raised
NEVER_ATTACHED = ("numguard: this Guard was never attached, so it watched nothing: run the training "
                  "code inside `with guard:` (or call guard.attach() first)")
# Said once, after a culprit whose code ran compiled: the compiled code ignores hooks added after
# it. Sentinel mode re-runs a failing call eagerly through the original model instead.
_COMPILED_NOTE = ("; it ran compiled (torch.compile), so its submodules were not watched: guard "
                  "the model before compiling it (or model._orig_mod) to find the one that made it,"
                  " or guard it with mode=\"sentinel\" (--sentinel), which keeps it compiled and "
                  "re-runs a failing call eagerly")



def _rerun_compiled(guard, report: Report, phase) -> Report:
    """A detection in a model that ran compiled names only its wrapper: as the sentinel does, the
    call is run again eagerly under a full guard, whose report names the submodule (with a note
    that the first detection came from compiled code); else the report says how to find it."""
    state = guard.threads.state
    kept, state.compiled_call = state.compiled_call, None
    if phase != FORWARD or kept is None:
        report.reason += _COMPILED_NOTE
        return report
    from .sentinel_rerun import rerun_compiled_call

    guard.paused = True  # the eager re-run calls the original model, never the guard's hooks
    try:
        found = rerun_compiled_call(guard, kept, report.first_nonfinite)
    except Exception:  # the re-run itself failed: the detection as it is, and how to go on
        found = None
    finally:
        guard.paused = False
    if found is None or found.first_nonfinite is None:
        report.reason += _COMPILED_NOTE
        return report
    if found.cause not in (CAUSE_TRANSIENT, CAUSE_COMPILED):  # those say what the re-run found
        found.reason += ("; first seen in compiled code (torch.compile), where only the model's "
                         "call is watched: the call was run again eagerly to name the module")
    return found


def _batch_of(guard_ref) -> int:
    """The batch a guard (held weakly) is running, for its loss scaling's late reads."""
    guard = guard_ref()
    return guard.batch_number if guard is not None else 0


def _pop_call(stack: list, module_id) -> Optional[CallRecord]:
    while stack:
        call = stack.pop()
        if call.module_id == module_id:
            return call
    return None  # hooks attached mid-call, or state reset: nothing to close


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

    `model_or_models`: a module, a list of modules, or a dict name -> module (names become
    prefixes; a loss module can be watched beside the model). The options are checked into
    `guard.options` (a `GuardOptions`); each is also an attribute (`guard.sync`, ...; `capture`
    is `guard.capture_enabled`), settable between attaches.

    Threads may call a guarded model at once: each runs its own pass, and a nan made in one is
    raised in that thread. `with guard:` nested in `with guard:` keeps the hooks until the
    outermost block ends. Copies of the model made meanwhile (deepcopy, pickle) are not watched.
    """

    max_frames, trace_batches, mode = _Option("max_frames"), _Option("trace_batches"), _Option("mode")
    abort_after_batch, backward, sync = _Option("abort_after_batch"), _Option("backward"), _Option("sync")
    allow_inf, limit_dtype, stop_at_limit = _Option("allow_inf"), _Option("limit_dtype"), _Option("stop_at_limit")
    on_trace, on_detect, ops, history_every = map(_Option, ("on_trace", "on_detect", "ops", "history_every"))
    # Whether attach takes a capture (off in the magics when the weights' host copy stops fitting)
    capture_enabled, scaler, max_skipped_steps = (_Option(name) for name in (
        "capture", "scaler", "max_skipped_steps"))

    def twin(self, models: Dict[str, nn.Module], options: GuardOptions) -> "Guard":
        return type(self)(models, **options.as_kwargs())  # for the sentinel's re-runs

    def __init__(self, model_or_models, **options):
        self.models = _normalise_models(model_or_models)
        self._op_recorder: Optional[OpRecorder] = None  # kept while ops=True
        self._use_options(GuardOptions.from_keywords(options))
        self._capture = None  # replay.Capture, made on attach
        self.detection: Optional[Report] = None  # set when a non-finite value was found
        self.traces: Dict[int, Report] = {}
        self.history = History()  # sampled batches' ranges, with history_every (`see`)
        self.headroom = Headroom()  # what would not fit in limit_dtype, over the run
        self.scaling = LossScaling(partial(_batch_of, weakref.ref(self)))  # GradScaler's skips
        self.skipped_steps = self.scaling.skipped_steps  # the steps it skipped (SkippedStep)
        self.batch_number = 0  # the batch being run (or last run, in any thread)
        self.batches = BatchCounter()
        self._lifecycle_lock = threading.RLock()  # attach, detach and `with` from threads
        self._entered = 0  # `with` blocks this guard is in (nested, or in several threads)
        self.paused = False  # True while the guard re-runs a step itself (op localisation)
        self.rerun_task = -1  # a sentinel's re-run: the backward whose end started it
        self.module_hooks = ModuleHooks()
        self._names = self.module_hooks.names  # read in every pre-hook: no lookup through
        self._grad_hooks = GradHooks(self, self.module_hooks.param_hooks)
        self._sentinel = Sentinel(self)  # mode="sentinel": its checks, and its re-runs
        self._ranks = None  # DDP: the flags its gradient all-reduce carries (`ranks`)
        self.outside = OutsideWatch(self)  # the code between top-level calls (a loss)
        self._attached = self._ever_attached = False  # (a guard never attached says so)
        self._sign_hints: dict = {}  # (module id, role) -> one sign last time (stats.device_stats)
        self.recent = frames.RecentPasses()  # context for a report of a later pass
        self._first_calls: Dict[int, CallRecord] = {}  # module id -> first call, in any thread
        self.tracing = False  # the latest batch is traced (read in backward, in any thread)
        self.abs_min_everywhere = False  # every pass measures abs min (`_measures_abs_min`)
        self.steps = StepWatch()  # optimizer steps while attached: what wrote non-finite weights
        _forget_passes(self)  # each thread's forward pass and the backward passes: none yet

    def _use_options(self, options: GuardOptions) -> None:
        self.options = options
        # Read by the hooks on every module call: plain attributes, not options lookups.
        self.watch_backward = options.backward
        self.synchronous = options.sync
        self._nonzero_min = options.limit_dtype is not None
        self._op_recorder = (self._op_recorder or OpRecorder()) if options.ops else None

    # ---- attach / detach ------------------------------------------------------------------
    def attach(self) -> "Guard":
        """Register the hooks (idempotent). Prefer `with Guard(...)`, which always detaches."""
        with self._lifecycle_lock:
            if self._attached:
                return self
            _forget_passes(self)
            self.batches.attached(self.models)
            if self.options.mode == MODE_SENTINEL:  # no hooks on modules: checks per step
                self._attached = self._sentinel.attach()
                self._ever_attached = self._ever_attached or self._attached
                self.outside.start()  # the loss is checked as in full mode
                return self
            try:
                # (gradients with inf allowed are not all checked finite)
                self.steps.start(self.models, weights=True, gradients=self.watch_backward and not self.options.allow_inf)
                if self.rerun_task == -1:  # (a sentinel's re-run raises on its own rank)
                    self._ranks = RankFlags.attach_any(self.models)  # DDP: which rank made it
                self.module_hooks.add(self, self.models, self.watch_backward)
                if self.options.capture:
                    from ..replay import Capture

                    self._capture = None  # never an earlier attach's capture, should this one fail
                    self._capture = Capture(self.models)
                self.outside.start(self._capture)
            except BaseException:
                self.detach()
                raise
            self._attached = self._ever_attached = True
            return self

    def detach(self) -> None:
        """Remove every hook this guard registered (idempotent), even inside nested `with`s. A
        detection found then (read late on a GPU) is kept: `raise_found()` raises it, as `with` does."""
        with self._lifecycle_lock:
            self._entered = 0
            self._attached = False  # first: a backward's end queued already does nothing
            self._sentinel.detach()
            self.module_hooks.remove()
            self._grad_hooks.remove()
            self.steps.stop()
            self.outside.stop()
            self._ranks = self._ranks and self._ranks.detach(self.outside)  # (None)
            if self._capture is not None:
                self._capture.stop_watching_optimizers()  # the capture itself stays, for replay
            self._sign_hints.clear()
            self.scaling.detach()  # the scaler's own update() back
            if self._op_recorder is not None:
                self._op_recorder.clear()
            _forget_passes(self)
            _stats.release_workspace()

    def retarget(self, model_or_models) -> None:
        """Point a detached guard at other models ({}: none yet); batches, traces are kept."""
        if self._attached:
            raise RuntimeError("numguard: detach the guard before pointing it at other models")
        self.models = _normalise_models(model_or_models, allow_none=True)

    attached = property(lambda self: self._attached)

    def __enter__(self) -> "Guard":
        with self._lifecycle_lock:
            self._entered += 1  # a failed attach detaches, which sets it back to 0
            return self.attach()

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._lifecycle_lock:
            self._entered -= 1
            if self._entered <= 0:
                self.detach()
                _raise_found_on_exit(self, exc)

    def raise_found(self, when: bool = True) -> None:
        """Raise (`when`; else drop) what the last detach found, as a `with` block's exit does."""
        first = self._sentinel.checks.unraised  # (raised first: the other is dropped)
        try:
            self._sentinel.checks.raise_found(when)
        finally:
            self.outside.raise_found(when and first is None)

    def reset(self) -> None:
        """Forget unfinished passes (Ctrl-C) in every thread, and an unconfirmed overflow."""
        _forget_passes(self)
        self.scaling.forget_step()
        self._sentinel.aside.put_back(any_thread=True)  # (after an interrupt)

    rank_flags = property(lambda self: self._ranks if self._ranks is not None else self._sentinel.ranks,
                          doc="Several ranks: its DDP or FSDP2 model's `distributed.flags`, or None.")

    capture = property(lambda self: self._capture.latest if self._capture is not None else None,
                       doc="The latest captured call (replayable on CPU), or None without capture=True.")

    @property
    def report(self) -> Report:
        """The detection report if there was one, else a report of the last frames seen (of a
        guard never attached: a warning, and a report that says so)."""
        return self.latest_report() if self._ever_attached else _never_attached(self.latest_report())

    def latest_report(self) -> Report:
        """`report` for the views that attach the guard themselves (the magics, the callbacks)."""
        if self.detection is not None or self.options.mode == MODE_SENTINEL:
            return self.detection or self._sentinel.report()
        return self.outside.noted(self.scaling.noted(frames.make_report(
            self.recent.frames(self.options), None, LATEST, "", "", self.batch_number, self.options)))

    # ---- forward --------------------------------------------------------------------------
    def pre_hook(self, module, args, kwargs):
        if is_dynamo_compiling() or self.paused:
            return
        state = self.threads.state
        stack = state.stack
        module_id = id(module)
        name, cls, caller = self._names.get(module_id, _UNNAMED)
        if stack and caller != stack[-1].module_id:
            # Called from outside the innermost open call: do the open calls still run?
            if not state.keep_running_calls(running_calls()):
                _forget_pass(self, state)
        if not stack:
            if inert_context():
                return  # compiled, traced or exported: not run on values the guard can read
            self.outside.enter_model()
            # Activation checkpointing re-runs forward inside backward: no new batch (`rerun_task`)
            recomputing = graph_task_id() not in (-1, self.rerun_task)
            self._begin_forward(state, module_id, recomputing)
            if not recomputing:
                # The state the call starts in (RNG, autocast, grad mode), to re-run it from.
                call_state = (rerun.take()
                              if self._op_recorder is not None or self._capture is not None else None)
                if self._capture is not None:
                    self._capture.record(name, module, args, kwargs, state=call_state)
                if self._op_recorder is not None:
                    self._op_recorder.remember_call(module, args, kwargs, call_state,
                                                    state.call_counts, state.batch_number)
        index = state.call_counts.get(module_id, 0)
        state.call_counts[module_id] = index + 1
        # A call with nothing around it is top-level, whether or not it is a guarded root (a
        # LightningModule's training_step calls its submodules directly).
        call = CallRecord(module_id, name, cls, FORWARD, state.batch_number, index, not stack)
        call.finite_backward = detect.backward_makes_no_nan(type(module))
        if index == 0:
            self._first_calls[module_id] = state.first_calls[module_id] = call
        _place(call, stack, self._first_calls.get(module_id) if index else None)
        pass_, slots, nonzero_min, hints = state.forward, call.slots, self._nonzero_min, self._sign_hints
        watch_grads = self.watch_backward and torch.is_grad_enabled()
        pass_.add_weight_slots(module, module_id, slots, nonzero_min, hints)
        for i, value in enumerate(args):
            role = _INPUT_ROLES[i] if i < len(_INPUT_ROLES) else f"input[{i}]"
            self._add(pass_, call, role, INPUT, value, watch_grads)
        for key, value in kwargs.items():
            self._add(pass_, call, f"input[{key}]", INPUT, value, watch_grads)
        stack.append(call)

    def post_hook(self, module, args, kwargs, output=_RAISED):
        if is_dynamo_compiling() or self.paused:
            return
        state = self.threads.state
        stack = state.stack
        if output is _RAISED or forward_raised():  # its forward (or another hook) raised
            if stack and stack[-1].module_id == id(module):
                call = stack.pop()
                call.raised = True
                self._finish_call(state, call, raising=True)
            return
        call = _pop_call(stack, id(module))
        if call is None:
            return
        watch_grads = self.watch_backward and torch.is_grad_enabled()
        for role, leaf in _output_leaves(output):  # (a distribution's attributes too)
            self._add(state.forward, call, role, OUTPUT, leaf, watch_grads)
        if module._buffers:  # (under ops=True, what a forward writes is copied from then on)
            state.forward.note_written_buffers(call, module, self._nonzero_min, self._sign_hints, self._op_recorder)
        if self._capture is not None and not stack:
            self._capture.note_output(output)  # the code after the call reads it
        if self._op_recorder is not None and watch_grads and not stack:
            self._op_recorder.keep_root_grads(call.module_id, output, self._grad_hooks.handles)
        self._finish_call(state, call)

    def _finish_call(self, state: PassState, call: CallRecord, raising: bool = False) -> None:
        pass_ = state.forward
        pass_.close(call)
        if self.synchronous and not raising and not state.tracing:
            pass_.read_back()
            culprit = _culprit(pass_, detect.forward_culprit, [call], self.options.stop_rules)
            if culprit is not None:
                self._detect(pass_, FORWARD, *culprit)
                if state.forward is not pass_:
                    return  # held for the other ranks (`rank_reports`): its pass is forgotten
        if not state.stack:
            self._end_forward(state, raising)
            if not raising:  # (a forward that raised: no code of the user's follows to watch)
                self.outside.leave_model()

    # ---- batches and passes ---------------------------------------------------------------
    def begin_batch(self) -> None:
        """Start the next batch now. For loops that never call the guarded model itself (a
        LightningModule's training_step calls its submodules): once called, only these calls
        count batches."""
        self.batches.by_caller = True
        self._start_batch(self.threads.state)

    def _start_batch(self, state: PassState) -> None:
        batch = state.batch_number = self.batch_number = self.batches.next(self.options.abort_after_batch)
        state.call_counts.clear()
        state.first_calls.clear()
        state.tracing = self.tracing = batch in self.options.trace_batches
        self._first_calls.clear()
        state.forget_leaf_targets()

    def _begin_forward(self, state: PassState, module_id, recomputing: bool) -> None:
        if not recomputing:
            if self._backward_passes:
                self._backward_passes.forget_open()
            if self._names.get(module_id, _UNNAMED)[2] is None and self.batches.starts(module_id):
                self._start_batch(state)
            self.steps.forward_began(module_id, state.batch_number)
            if self.watch_backward and torch.is_grad_enabled():
                self.module_hooks.rehook_changed(self)
        state.forward = PassRecord(_measures_abs_min(self, state.batch_number))
        state.forward.summarise_weights(self.module_hooks.weights_under(module_id), self._nonzero_min)
        state.forget_when_gone(frame_local_of_call())
        self._grad_hooks.drop_dead()  # keep the list bounded over long runs

    def _end_forward(self, state: PassState, raising: bool) -> None:
        pass_ = state.forward
        state.forward = None
        pass_.read_back()
        self.history.see(pass_, state.batch_number, self.options)
        if state.tracing:
            _record_trace(self, pass_, state.batch_number)
            return
        if raising:
            _note_on_the_error(self, pass_)
        elif self.headroom.collect_and_check(pass_, self.options, partial(_locate_op, self)):
            culprit = _culprit(pass_, detect.find_in_forward, self.options.stop_rules)
            if culprit is not None:
                self._detect(pass_, FORWARD, *culprit)
        self.recent.remember(pass_, self.options.max_frames)

    # ---- values ---------------------------------------------------------------------------
    def _add(self, pass_: PassRecord, call: CallRecord, role, category, value, watch_grads) -> None:
        """Add a slot for one value of a call (one per leaf of a nested value); for
        gradients-to-be, hook the tensor."""
        if not isinstance(value, torch.Tensor):  # (None, as most keyword arguments are: no walk)
            for leaf_role, leaf in ((role, None),) if value is None else _tree.named_leaves(value, role):
                if isinstance(leaf, torch.Tensor):
                    self._add(pass_, call, leaf_role, category, leaf, watch_grads)
                else:
                    kind = VALUE_NONE if leaf is None else VALUE_OTHER
                    call.slots.append((leaf_role, category, kind, None, None, None, 0))
            return
        entry = pass_.summarise(value, (call.module_id, role), self._nonzero_min, self._sign_hints)
        call.slots.append(
            (role, category, entry[ENTRY_KIND], value.dtype, entry[ENTRY_SHAPE], entry[ENTRY_INDEX], 0))
        if watch_grads and value.requires_grad:
            # Targets lie flat, (call, role, category) after one another: no tuple per target.
            leaf = value.is_leaf
            if leaf:
                targets = self._grad_hooks.leaf_targets_of(value).of_this_thread()
            elif entry[ENTRY_TARGETS] is None:
                # One hook per tensor (and version), fanned out to every call that saw it.
                targets = entry[ENTRY_TARGETS] = []
                self._grad_hooks.handles.append(register_tensor_hook(value, GradHook(self, targets)))
            else:
                targets = entry[ENTRY_TARGETS]
            targets += (call, "grad_" + role, GRAD_OUTPUT if category == OUTPUT else GRAD_INPUT)
            if leaf:
                self.threads.state.note_leaf_targets(targets)

    # ---- backward -------------------------------------------------------------------------
    def _backward_state(self) -> PassRecord:
        # Read everything back once, when the engine finishes this backward pass.
        _, pass_, opened = self._backward_passes.open(
            lambda: PassRecord(_measures_abs_min(self, self.batch_number), self.module_hooks.holding),
            self._end_backward)
        if opened and self._ranks is not None:  # then, after DDP's reduction, what ranks learnt
            settle_after_reduction(self._ranks, self)
        return pass_

    def _on_grad(self, targets, grad):
        if self._attached and not self.paused and grad is not None and not is_dynamo_compiling():
            self._record_grad(targets, grad)
        return None

    def _on_leaf_grad(self, leaf_targets, grad):
        """A leaf's gradient, for the calls of the thread running this backward (`LeafTargets`)."""
        if not self._attached or self.paused or grad is None or is_dynamo_compiling():
            return None
        for targets in leaf_targets.delivering():
            self._record_grad(tuple(targets), grad)  # a copy: its thread may start a batch
            self._backward_state().delivered.append(targets)
        return None

    def _on_param_grad(self, hook: ParamHook, grad):
        if not self._attached or self.paused or grad is None or is_dynamo_compiling():
            return None
        pass_ = self._backward_passes.get(graph_task_id()) or self._backward_state()
        targets = (hook.forward_call(self.threads.state, self), hook.role, GRAD_PARAM)
        self._record_grad(targets, grad, hook.grad_as_is(self, grad, pass_), pass_)
        if hook.input_targets:  # the calls it was an input of
            self._on_leaf_grad(hook.input_targets, grad)
        return None

    def _record_grad(self, targets, grad, later=None, pass_=None) -> None:
        """Summarise one gradient once and log it for every call it belongs to (`targets`: forward
        call, role, category, one after another; `pass_`: its backward, where known)."""
        pass_ = pass_ or self._backward_passes.get(graph_task_id()) or self._backward_state()  # (no call once open)
        site = (targets[0].module_id, targets[1]) if targets else None
        entry = pass_.summarise(grad, site, self._nonzero_min, self._sign_hints, later=later)
        if not self.synchronous or self.tracing:
            pass_.log_gradient(targets, entry, grad.dtype)  # slots made when the pass is read
            return
        for slot, call in pass_.slots_of(targets, entry[ENTRY_INDEX], entry[ENTRY_KIND], grad.dtype,
                                         entry[ENTRY_SHAPE]):
            pass_.read_back()
            culprit = detect.backward_culprit(pass_, [slot], {id(slot): call}, self.options.stop_rules)
            if culprit is not None and not self.scaling.excuses(self.options, pass_, *culprit):
                self._detect(pass_, BACKWARD, *culprit)

    def _end_backward(self, task) -> None:
        pass_ = self._backward_passes.pop(task, None)
        if pass_ is None or not self._attached:
            return
        try:
            self._grad_hooks.drop_dead(force=True)  # the graph this pass ran on has been consumed
            pass_.read_back()
            self.history.see(pass_, self.batch_number, self.options)
            if self.tracing:
                _record_trace(self, pass_, self.batch_number)
                return
            if self.headroom.collect_and_check(pass_, self.options, partial(_locate_op, self)):
                culprit = detect.find_in_backward(pass_, self.options.stop_rules)
                if culprit is not None and not self.scaling.excuses(self.options, pass_, *culprit):
                    self._detect(pass_, BACKWARD, *culprit)
            self.recent.remember(pass_, self.options.max_frames)
        finally:
            if self._op_recorder is not None:
                self._op_recorder.forget_grads()  # held for a re-run only until this pass ends
            for targets in pass_.delivered:  # their calls' backward is done
                targets.clear()

    # ---- reports --------------------------------------------------------------------------
    def _detect(self, pass_: PassRecord, phase, call: CallRecord, bad_slots, cause, held=False) -> None:
        """Build the report for a detection and raise it. A -inf mask reaching the model's output
        (illegal actions' logits) is judged by the loss first, as the code after it (`outside`)."""
        if cause == CAUSE_DATA and phase == FORWARD:  # the code between the models made them?
            self.outside.raise_held_fed_to_a_model([frames.value_of(pass_, slot) for slot in bad_slots])
        if not held and phase == FORWARD and detect.only_minus_inf(pass_, call, bad_slots, cause) \
                and self.outside.hold(pass_, call, self, ("_detect", (pass_, phase, call,
                                                                        bad_slots, cause, True))):
            return
        options = self.options
        if self._ranks is not None and self._ranks.held is not None:
            return  # the first detection is held: raised once every rank knows (rank_reports)
        pass_.measure_abs_min()
        culprit = frames.build_frame(pass_, call, options, {id(s) for s in bad_slots})
        _locate_op(self, culprit, call, cause, options.stop_rules)
        batch = call.batch_number if phase == FORWARD else self.batch_number
        self.detection = frames.detection_report(
            pass_, phase, call, bad_slots, culprit, cause, self.recent.frames(options), options,
            batch, self.steps)
        self.detection.history_note = self.history.note(call, bad_slots)
        if cause in CODE_CAUSES and call.module_id in self.module_hooks.compiled:
            self.detection = _rerun_compiled(self, self.detection, phase)
        self.detection.reason += self.scaling.refusal()
        if self._ranks is not None:  # DDP: this rank's own hooks saw the value made
            self.detection.source_rank = self._ranks.rank
        pass_.release()
        _forget_pass(self, self.threads.state)
        error = frames.detection_error(self, self.detection)
        if self._ranks is not None and self._ranks.hold(error, phase == FORWARD):
            return  # DDP: raised at the backward's end, when every rank knows (`ranks`)
        raise error

    def __repr__(self) -> str:
        return (f"<numguard Guard on {', '.join(type(m).__name__ for m in self.models.values())}: "
                f"{'at' if self._attached else 'de'}tached, batch {self.batch_number}>")


def _output_leaves(output):
    """`_tree.named_output_leaves`, with no walk for a tensor (the common case)."""
    return (("output", output),) if isinstance(output, torch.Tensor) else _tree.named_output_leaves(output)


def _place(call: CallRecord, stack: list, first: Optional[CallRecord]) -> None:
    """Where a call sits: inside the innermost open call; one recomputed alone in backward
    (reentrant activation checkpointing runs the block by itself) where the module's `first`
    call of the batch sat, so that a gradient its parent's own code gives it is the parent's,
    not the loss's."""
    if stack:
        call.parent, call.root_id = stack[-1], stack[0].module_id
    elif first is not None and first is not call and graph_task_id() != -1:
        call.recomputed_in = first.parent


def _note_on_the_error(guard: Guard, pass_: PassRecord) -> None:
    """The forward raised an error of its own (a distribution's validation of a nan parameter, an
    assert on nan): a value its calls made non-finite before is the likely cause. Kept as the
    detection and added to the error's notes (torch only warns of what a hook raises there)."""
    error = sys.exc_info()[1]
    if not isinstance(error, Exception) or isinstance(error, (NonFiniteError, BatchLimitReached)) \
            or graph_task_id() != -1:  # (a recomputation in backward that torch stops early)
        return
    culprit = _culprit(pass_, detect.find_in_forward, guard.options.stop_rules)
    try:
        if culprit is not None:
            guard._detect(pass_, FORWARD, *culprit)
    except Exception:  # (NonFiniteError, or what on_detect gave instead)
        if guard.detection is not None and hasattr(error, "add_note"):  # (Python 3.11+)
            error.add_note(f"numguard found, before this error: {guard.detection.summary()} "
                           "(guard.report holds it)")


def _raise_found_on_exit(guard: Guard, exc: Optional[BaseException]) -> None:
    """A `with` block's exit: raise what detaching found; after an error of the block's own (the
    loop's nan check, raised before a GPU's values were read), add it to that error's notes."""
    found = guard._sentinel.checks.unraised or guard.outside.unraised
    if exc is not None and found is not None and hasattr(exc, "add_note"):  # (Python 3.11+)
        exc.add_note(f"numguard found, as the guard detached: {str(found).splitlines()[0]} "
                     "(guard.report holds it)")
    guard.raise_found(exc is None)


def _forget_passes(guard: Guard) -> None:
    """Forget every thread's passes and the backward passes in progress."""
    guard.threads = ThreadPasses(lambda: guard.batch_number)
    guard._grad_hooks.forget_targets()  # the threads' calls given to leaves go with them
    guard._backward_passes = BackwardPasses()
    guard._first_calls.clear()
    guard.tracing = False


def _forget_pass(guard: Guard, state: PassState) -> None:
    """Forget this thread's forward pass (and the backward pass running here, if any)."""
    state.reset()
    guard._first_calls.clear()
    guard._backward_passes.pop(graph_task_id(), None)


def _culprit(pass_: PassRecord, find, *args):
    """`find(pass_, *args)`; again where a lean pass left the abs min of a value holding -inf
    unmeasured, which the mask rules judge by its zeros (only on a detection: masks of zeros
    and -inf alone are of one sign, measured already)."""
    culprit = find(pass_, *args)
    if culprit is not None and pass_.measure_abs_min(minus_inf_only=True):
        culprit = find(pass_, *args)
    return culprit


def _measures_abs_min(guard: Guard, batch: int) -> bool:
    """Whether the device rows of a pass of `batch` measure abs min (a second reduction each,
    `stats.RowSink`): where every row is shown (traced batches, history's samples, and every
    pass of a guard that says so: a re-run's, the drop-in's). Elsewhere a detection measures
    the values it shows that are still alive (`PassRecord.measure_abs_min`)."""
    options = guard.options
    return (guard.abs_min_everywhere or batch in options.trace_batches
            or History.samples_batch(batch, options))


def _never_attached(report: Report) -> Report:
    """The report of a guard never attached: Guard(model) alone watches nothing (Hugging Face's
    detector hooks the model as it is made), so a report says so, and a warning how to attach."""
    warnings.warn(NEVER_ATTACHED, stacklevel=user_stacklevel())
    report.reason = NEVER_ATTACHED[len("numguard: "):]
    return report


def _locate_op(guard: Guard, frame, call: CallRecord, cause, rules) -> None:
    """ops=True: name the op and line of a code culprit, re-running the step (hooks paused)."""
    if guard._op_recorder is not None and cause in CODE_CAUSES:
        guard.paused = True  # the re-run of the step must not reach the hooks
        try:
            frames.add_op_location(frame, guard._op_recorder.localise(
                call.root_id, guard.module_hooks.modules.get(call.module_id), call.module_id,
                call.call_index, call.batch_number, cause, rules.limit_max,
                rules.inf_allowed(call.module_name)))
        finally:
            guard.paused = False


def _record_trace(guard: Guard, pass_: PassRecord, batch: int) -> None:
    # A trace notes where a non-finite value would have been caught, without stopping.
    guard.headroom.collect(pass_, guard.options, partial(_locate_op, guard))
    culprit = detect.find_in_trace(pass_, guard.options)
    report = guard.traces[batch] = frames.add_to_trace(
        guard.traces.get(batch), pass_, culprit, guard.options, batch, guard.steps)
    if guard.options.on_trace is not None:
        guard.options.on_trace(report)


Guard.__doc__ += OPTION_DOCS  # documented where they are checked: help(Guard) shows them
Guard.__init__.__signature__ = keyword_signature("self", "model_or_models")  # help(), Shift-Tab
