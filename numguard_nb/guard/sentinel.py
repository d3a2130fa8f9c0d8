"""Sentinel mode (`Guard(model, mode="sentinel")`): the guard left on for a whole run at almost no
cost, and the full diagnosis when a step breaks.

Contract: it checks what a step cannot hide (each top-level call's outputs and the buffers it
wrote, the code between a call and its backward, the gradients after each backward) and, on the
first problem, runs the failing call(s) again under the full guard (`sentinel_rerun`) and raises
that report (`found_by="re-run"`), before an optimizer step writes weights from those gradients.
A healthy step's outputs and gradients are bit-identical, and on a GPU it waits for nothing
(`sentinel_checks`). Under DDP and FSDP2 every rank stops at the same point (`ranks`).

Limits: a value the model clamps or masks inside itself is not seen; a fault the re-run does
not repeat is reported as transient; full hooks run only in traced or sampled batches
(`sentinel_batches`).

    >>> with Guard(model, mode="sentinel"):
    ...     for batch in loader:
    ...         model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()

How it works: docs/architecture.md, "Sentinel mode".
"""

from __future__ import annotations

import itertools
import math
import warnings
import weakref
from functools import partial
from typing import Dict, List, Optional

import torch
from torch import nn

from .. import _tree, numerics, rerun
from .._util import LiveHandles, WeakHook, compiled_original, qualified_name, register_tensor_hook
from .._schema import (
    BACKWARD, CAUSE_BACKWARD, FORWARD, GRAD_PARAM, LATEST, OUTPUT, PROBLEM_NEGINF, WRITTEN_IN_FORWARD,
)
from ..errors import NonFiniteError
from ..report import Report
from . import copies, detect, frames, sentinel_buffers
from .hooks import (
    forward_raised, inert_context, is_dynamo_compiling, own_call_frame_id, still_running,
)
from .passes import (
    ENTRY_INDEX, ENTRY_KIND, ENTRY_SHAPE, SLOT_ROLE, BackwardPasses, CallRecord, PassRecord, graph_task_id,
)
from .set_aside import CallWatch, Inner, SetAside
from .sentinel_buffers import Before, BufferSlots
from .sentinel_checks import (
    SURE_ANY, SURE_NAN, MasksForTheLoss, StepChecks, check_gradients_later, kept_gradient, stood_in,
)
from ..distributed.flags import RankFlags
from .rank_reports import received_report
from .sentinel_batches import SampledBatches
from .sentinel_calls import (GuardedParts, ThreadState, closes_top_level, entry_modules,
                             forget_submodules, modes_of, pass_through, registration_hooks)
from .sentinel_rerun import (forward_frame, gradient_frame, rerun_backward, rerun_forward,
                             rerun_step_together)

__all__ = ["Sentinel"]

_RAISED = object()  # the output an always-called forward hook gets after a forward that raised


MAX_OPEN_CALL_VALUES = 64  # calls' values left open for a backward (several ranks), at most


def _queue_callback(callback) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ---- the modules watched: models and their first callable submodules ---------------------------
class _Entry:
    """A module whose calls can be top-level: how reports name it, what it is hooked with."""

    __slots__ = ("module", "name", "cls", "root", "run_id", "hook_ids", "copy_inputs", "plans",
                 "inner", "buffers", "inf_accepted", "submodules")

    def __init__(self, module: nn.Module, name: str, root: bool):
        self.module = module
        self.name = name
        self.cls = type(compiled_original(module) or module).__name__
        self.root = root  # a model's own module: its calls may start batches
        self.run_id = id(rerun.run_alone(module))  # the module a re-run calls, as a full guard sees it
        self.submodules: Optional[list] = None  # module.modules(), until one is registered
        self.hook_ids: list = []
        self.copy_inputs = False  # a call of it was seen changing its inputs in place
        self.plans: dict = {}  # output layout -> which outputs nothing else in the output uses
        self.inner = Inner()  # (entry inside it, its two hook ids), set aside in its calls
        self.buffers: Optional[BufferSlots] = None  # where its floating buffers are (None: look up)
        self.inf_accepted = False  # a re-run of a call whose device flag read +inf found nothing


class _Call:
    """One top-level call, kept for a re-run until its backward pass has been checked."""

    __slots__ = ("entry", "args", "kwargs", "versions", "state", "batch_number", "call_index",
                 "output_ids", "top", "grads", "task", "top_seen", "inputs_changed", "order",
                 "held", "forward", "ranks_settled", "buffers", "training", "stage",
                 "forward_number")

    _made = itertools.count()  # calls in the order they were made (re-runs keep it)

    def __init__(self, entry: _Entry, args, kwargs, batch_number: int, call_index: int,
                 stage: str = ""):
        if entry.copy_inputs:  # seen changing its inputs in place: keep them as they are now
            args, kwargs = _tree.rebuild((args, kwargs), _copy, keep_unchanged=True)
        self.entry = entry
        self.args = args
        self.kwargs = kwargs
        self.versions = _versions((args, kwargs))
        self.state = rerun.take()
        # (its modules, each one's mode) where its check is read later
        self.training: Optional[tuple] = None
        self.batch_number = batch_number
        self.call_index = call_index  # calls of this module before it in the batch
        self.stage = stage  # what the loop ran besides training (Report.stage), said when read
        self.forward_number: Optional[int] = None  # its number among the steps' forwards
        self.output_ids: list = []  # ids of its output tensors (a later call may take them in)
        self.top: tuple = ()  # per output: nothing else in the output was computed from it
        self.grads: list = []  # per output: the gradient it got from outside the call
        self.task = None  # the autograd graph task its outputs last got gradients in
        self.top_seen = False  # a top output got its gradient in that task
        self.inputs_changed = False  # its inputs changed in place after it started
        self.order = next(self._made)
        self.held = None  # under DDP: its forward problem, raised once every rank knows (ranks)
        self.ranks_settled = False  # on a device: its step's reduction was acted on
        self.forward = rerun.redirected_forward(entry.module)
        # what its forward writes is checked too (copies, to run it again, in training calls)
        self.buffers = Before(entry, torch.is_grad_enabled() and entry.module.training)

    def inputs_now_changed(self) -> bool:
        return _versions((self.args, self.kwargs)) != self.versions


def _copy(t: torch.Tensor, path) -> torch.Tensor:
    with torch.no_grad():
        return t.clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t.clone()


def _versions(value) -> tuple:
    args, kwargs = value  # (tensors given as they are, the common call, without the walk)
    tensors = args if not kwargs and all(type(t) is torch.Tensor for t in args) else _tree.tensors(value)
    return tuple(-1 if t.is_inference() else t._version for t in tensors)


def _remove_all(handles: list) -> None:
    while handles:
        handles.pop().remove()


def _made_order(call: _Call) -> int:
    return call.order


class _OutputGradient:
    """The hook on one output tensor of a kept call: hands its gradient to the sentinel."""

    __slots__ = ("sentinel", "call", "position")

    def __init__(self, sentinel, call: _Call, position: int):
        self.sentinel = sentinel
        self.call = call
        self.position = position

    def __call__(self, grad):
        self.sentinel._on_output_gradient(self.call, self.position, grad)


class Sentinel:
    """The checks of `mode="sentinel"` for one Guard, its kept calls and its re-runs."""

    def __init__(self, guard):
        self.guard = guard
        self.attached = False
        self.paused = False  # True while a re-run runs the model again
        self.entries: Dict[int, _Entry] = {}
        self.tasks = BackwardPasses()  # autograd graph task -> the calls it goes through
        self._handles: list = []  # module hooks
        self.aside = SetAside()  # the inner entries' hooks while their model runs (reset: back)
        self._grad_handles = LiveHandles()  # hooks on output tensors (dead once their graph is freed)
        self._local = ThreadState()
        self._sign_hints: dict = {}  # (module id, role) -> one sign last time (stats.device_stats)
        self._accepted: set = set()  # (module id, role, kinds) the full guard's rules accept
        self._recent = frames.RecentPasses()  # the last outputs checked, for `report()`
        self._batch = -1  # the batch whose start was seen last
        self._call_counts: Dict[int, int] = {}  # module id -> top-level calls in the batch
        self._sampled = SampledBatches(guard)  # traced and sampled batches: the full hooks
        self.parts = GuardedParts(guard)  # the models' parameters and modules
        self._registration_handles: list = []  # torch's global hooks telling of new parameters
        weakref.finalize(self, _remove_all, self._registration_handles)
        self.checks = StepChecks(self._parameters)  # read later: CUDA's checks
        self.masks = MasksForTheLoss(
            self.checks, WeakHook(self, "_late_forward_problem", takes=2, raises=(NonFiniteError,)),
            WeakHook(self, "_share_forward_flag"))
        self.checks.forget_shared = partial(_forget_shared_flags, weakref.ref(self))
        self.ranks: Optional[RankFlags] = None  # a DDP model's: which rank made it
        self._held: Optional[_Call] = None  # its forward problem, held for the backward's end
        self.passes_checked = 0

    # ---- attach / detach ------------------------------------------------------------------
    def attach(self) -> bool:
        """Hook the models' top-level modules; returns True (detaches itself if it fails)."""
        try:
            watch = self.aside.watch = CallWatch(self)  # (inner hooks kept aside between calls)
            self._registration_handles.append(watch)  # (removed as they are, the sentinel gone)
            for prefix, root in self.guard.models.items():
                for name, module, outer in entry_modules(prefix, root):
                    if id(module) not in self.entries:
                        self._hook(module, name, module is root, len(outer) <= 1)
                        if outer:
                            watch.flag(module)
                    hook_ids = tuple(self.entries[id(module)].hook_ids)
                    for caller in outer:  # set aside in their calls
                        self.entries[id(caller)].inner.append((module, hook_ids))
            # optimizer steps: what wrote weights found non-finite
            self.guard.steps.start(self.guard.models, weights=True)
            self.checks.start()
            self.guard.outside.deferred = self.checks  # the loss code's values: read alike
            self.guard.outside.judge_loss = self.masks.judge_later
            self.masks.note = self.guard.outside.note_mask  # (a mask the loss showed harmless)
            self.ranks = RankFlags.attach_any(self.guard.models)
            self._registration_handles += registration_hooks(self)
        except BaseException:
            self.detach()
            raise
        self.attached = True
        return True

    def _hook(self, module: nn.Module, name: str, root: bool, said: bool) -> None:
        if said and getattr(module, "_compiled_call_impl", None) is not None:  # (not a region's)
            warnings.warn(f"numguard: {name or 'the model'} was compiled in place (module.compile()):"
                          " the sentinel's checks would run inside its compiled code, where they do "
                          "nothing; guard torch.compile(model) instead", stacklevel=5)
        entry = self.entries[id(module)] = _Entry(module, name, root)
        for handle in (module.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                       module.register_forward_hook(self._post_hook, with_kwargs=True,
                                                    always_call=True)):
            self._handles.append(handle)
            entry.hook_ids.append(handle.id)
        copies.install(module, entry.hook_ids)

    def detach(self) -> None:
        """Remove every hook (idempotent); what was reported stays. Checks still unread are
        read first (waiting): a detection is kept for `checks.raise_found`."""
        held, self._held = self._held, None
        if held is not None and self.attached:  # no backward came: raised on exit
            try:  # (this rank alone: no reduction came to tell the others)
                self._rerun_forward(held, *held.held)
            except NonFiniteError as error:
                self.checks.unraised = self.checks.unraised or error
        if self.attached:
            self.checks.stop()
            self.guard.outside.deferred = self.guard.outside.judge_loss = None
            self.masks.forget()
            if self.ranks is not None:
                self.ranks.detach()
                self.ranks = None
        self.attached = False
        self.aside.forget()
        self._grad_handles.remove_all()
        for handle in self._handles + self._registration_handles:
            handle.remove()
        for entry in self.entries.values():
            copies.uninstall(entry.module, entry.hook_ids)
        self._sampled.stop()
        self._handles.clear()
        self._registration_handles.clear()  # in place: the finalizer holds it
        self.parts.forget()
        self.checks.guarded_ids = None
        self.entries.clear()
        self.tasks.clear()
        self._sign_hints.clear()
        self._accepted.clear()
        self._call_counts.clear()
        self._local = ThreadState()
        self._batch = -1

    def report(self) -> Report:
        """The outputs of the last top-level calls checked, all finite (and the steps a loss
        scaler skipped, if any)."""
        options = self.guard.options
        note = (f'mode="sentinel": {self.passes_checked} passes checked (the outputs of the '
                "model's calls, and the gradients after each backward)")
        if self._sampled.batches_in_full:
            note += f"; {self._sampled.batches_in_full} batches watched with the full hooks"
        seen = self._recent.frames(options)
        full = self._sampled.latest_frames(options)
        if full and full[-1].batch_number >= self.guard.batch_number:
            seen = full  # the latest batch was a sampled one: its frames
        unwatched = frames.unwatched_note(seen)
        if unwatched:
            note = f"{note}; {unwatched}"
        return self.guard.outside.noted(self.guard.scaling.noted(frames.make_report(
            seen, None, LATEST, note, "", self.guard.batch_number, options)))

    # ---- forward ---------------------------------------------------------------------------
    def _pre_hook(self, module, args, kwargs):
        if is_dynamo_compiling() or self.paused:
            return
        local = self._local
        depth = local.depth
        if depth and not still_running(local.top_frame):
            depth = 0
        if not depth and pass_through(local, module, True):
            return
        local.depth = depth + 1
        if depth:
            return
        local.call = None
        local.top_frame, local.top_module = own_call_frame_id(), id(module)
        entry = self.entries.get(id(module))
        if entry is None:
            return  # a replica sharing this module's hook dicts (DataParallel's): not guarded
        if entry.inner:
            self.aside.take(entry.inner)  # their calls in this one need no hooks (set_aside)
        # Compiled, traced, exported or captured into a CUDA graph: no device work of ours (in a
        # capture an event recorded is the graph's, and asking it fails).
        inert = inert_context()
        if self.checks.pending and not inert:
            if not _backward_due(self):
                self.checks.seal()  # a call no backward followed
            self.checks.look()  # the steps before, if the device has their values by now
        # ...or recomputed in backward (activation checkpointing).
        if inert or graph_task_id() != -1:
            return
        guard = self.guard
        guard.outside.enter_model()  # the code before this call (a loss) is over: checked
        if entry.root and guard.batches.starts(id(module)):
            guard.batch_number = guard.batches.next(guard.options.abort_after_batch)
        guard.threads.state.batch_number = guard.batch_number  # what the outside watch reports
        if guard.batch_number != self._batch:
            self._batch = guard.batch_number
            self._call_counts.clear()
            self._sampled.start(guard.batch_number, module, args, kwargs)
        if self._sampled.running():
            return  # a traced or sampled batch: the full hooks watch it
        index = self._call_counts.get(id(module), 0)
        self._call_counts[id(module)] = index + 1
        local.call = _Call(entry, args, kwargs, guard.batch_number, index,
                           frames.stage_now(guard, module))

    opens = _pre_hook  # (a call of an inner entry whose hooks were kept aside: `CallWatch`)

    def _post_hook(self, module, args, kwargs, output=_RAISED):
        if is_dynamo_compiling() or self.paused:
            return
        local = self._local
        if pass_through(local, module, False) or not closes_top_level(local, module):
            return
        self.aside.end()  # (the inner entries' hooks, if this call set them aside: kept)
        call, local.call = local.call, None
        if call is None or output is _RAISED or call.entry.module is not module \
                or forward_raised():
            return
        if call.inputs_now_changed():  # the call itself changed them: copy from the next call on
            call.inputs_changed = call.entry.copy_inputs = True
        self._check_outputs(call, output)
        self.guard.outside.leave_model()  # watch the code that follows, up to its backward

    def _check_outputs(self, call: _Call, output) -> None:
        entry, options = call.entry, self.guard.options
        tensors = list(_tree.output_tensors(output))
        written = call.buffers.written()  # buffers the forward wrote: checked as outputs
        first = tensors[0] if tensors else written[0][1] if written else None
        if first is not None and numerics.deferred(first) and not self.guard.synchronous:
            # an asynchronous device: one value computed there, read when it is ready (its
            # re-run then, after the loop's model.train(), puts each module back in its mode)
            call.training = modes_of(entry)
            flags = numerics.output_flags((t for t in tensors if numerics.readable(t)),
                                          sentinel_buffers.produced(written, deferred=True))
            if flags is not None:  # read with the gradients of the backward that follows
                value, masks = flags
                inf_ok = entry.inf_accepted or options.stop_rules.inf_allowed(entry.name)
                self.checks.add(value, partial(self._late_forward_problem, call),
                                sure=SURE_NAN if inf_ok else SURE_ANY)
                if masks is not None and not inf_ok and torch.is_grad_enabled() and options.backward:
                    self.masks.add(call, masks)  # a -inf there: the loss judges it
                self._share_forward_flag(value)
        else:
            pass_, record = _outputs_read(call, output, sentinel_buffers.produced(written, False),
                                          options.limit_dtype is not None, self._sign_hints)
            # counted before a re-run (which then finds it counted), so that a step between
            # two calls of one batch is before this forward
            call.forward_number = self.guard.steps.forward_began(entry.run_id, call.batch_number)
            if detect.has_problem(pass_, options.stop_rules.limit_max):
                self._forward_problem(call, pass_, record)
            self._recent.remember(pass_, options.max_frames)
        self.passes_checked += 1
        if call.training is not None:  # (read later: counted now)
            call.forward_number = self.guard.steps.forward_began(entry.run_id, call.batch_number)
        if options.backward and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            self._keep_for_backward(call, tensors)

    def _share_forward_flag(self, value: torch.Tensor) -> None:
        if self.ranks is not None and torch.is_grad_enabled() and self.guard.options.backward:
            self.ranks.note_forward_flag(value)  # every rank learns of it, unread

    def _late_forward_problem(self, call: _Call, values: list) -> None:
        """A call's outputs held nan or +inf (read after the call): run it again, and raise. The
        flag stands for all its outputs: +inf the rules allowed in the model, or accepted in a
        re-run of it, is not run again at every call (nan always is)."""
        entry, inf = call.entry, values[0] == math.inf
        if inf and (entry.inf_accepted or self.guard.options.stop_rules.inf_allowed(entry.name)):
            return
        report = self._rerun(rerun_forward, self.guard, call, forward_frame(call))
        if report is not None:
            self._raise(report, call)
        call.buffers.keep_noting()  # accepted: what its buffers keep is not judged again
        entry.inf_accepted = entry.inf_accepted or inf

    def _forward_problem(self, call: _Call, pass_: PassRecord, record: CallRecord) -> bool:
        """Re-run the call if its outputs hold what the full guard's rules may stop on, and raise
        what it finds. Returns whether it re-ran the call (and found nothing to raise)."""
        options, module_id = self.guard.options, record.module_id
        rules = options.stop_rules  # without limit_dtype's predictions, unless stop_at_limit
        allowed = detect.INF_KINDS if rules.inf_allowed(call.entry.name) else frozenset()
        bad = {}
        for slot in record.slots:
            kinds = detect.value_kinds(pass_, slot, rules.limit_max) - allowed
            if kinds and (module_id, slot[SLOT_ROLE], kinds) not in self._accepted:
                bad[id(slot)] = (slot[SLOT_ROLE], kinds)
        if not bad:
            return False
        if all(kinds == {PROBLEM_NEGINF} for _, kinds in bad.values()) and self.guard.outside.hold(
                pass_, record, self, ("_rerun_forward", (call, pass_, record, bad))):
            return False  # a -inf mask in the model's output (illegal actions): the loss judges it
        if self.ranks is not None and torch.is_grad_enabled() and options.backward:
            call.held = (pass_, record, bad)  # raised at the backward's end, on every rank
            self.ranks.forward_problem, self._held = True, call
            return False
        return self._rerun_forward(call, pass_, record, bad)

    def _rerun_forward(self, call: _Call, pass_: PassRecord, record: CallRecord, bad: dict) -> bool:
        """Re-run the call under the full guard; raise what it finds (True: nothing found)."""
        options, module_id = self.guard.options, record.module_id
        seen = frames.build_frame(pass_, record, options, set(bad))
        report = self._rerun(rerun_forward, self.guard, call, seen)
        if report is not None:
            self._raise(report, call)
        # The same values again, which the full guard's rules accept.
        self._accepted.update((module_id, role, kinds) for role, kinds in bad.values())
        return True

    # ---- backward --------------------------------------------------------------------------
    def _keep_for_backward(self, call: _Call, tensors: list) -> None:
        """Hook the outputs that take gradients: the hooks hold the call."""
        call.output_ids = [id(t) for t in tensors]
        call.top = _top_outputs(call.entry, tensors)
        call.grads = [None] * len(tensors)
        hooked = _parameters_beside_computed(tensors)
        for position, t in enumerate(tensors):
            if t.requires_grad and id(t) not in hooked:
                hooked.add(id(t))
                self._grad_handles.add(register_tensor_hook(t, _OutputGradient(self, call, position)))

    def _on_output_gradient(self, call: _Call, position: int, grad) -> None:
        if self.paused or grad is None or not self.attached or is_dynamo_compiling():
            return
        task = graph_task_id()
        if call.task != task:  # the first gradient of this call in this backward pass
            call.task, call.top_seen = task, False
            call.grads = [None] * len(call.grads)
            _, calls, _ = self.tasks.open(list, partial(self._end_backward, first_round=True))
            calls.append(call)
        if call.top[position] or not call.top_seen:  # else: the pass started outside the call
            call.top_seen = call.top_seen or call.top[position]
            call.grads[position] = kept_gradient(grad, not self.guard.synchronous)

    def _end_backward(self, task, first_round: bool) -> None:
        if first_round:  # once more: after every callback queued meanwhile (DDP's all-reduce)
            _queue_callback(partial(self._end_backward, task, False))
            return
        done = sorted(self.tasks.pop(task, []), key=_made_order)  # backward met them reversed
        if not self.attached:
            return
        self._sampled.stop(paused_only=True)  # the traced batch is over
        self.masks.forget()  # no loss judged them (a backward through autograd.grad, say)
        try:
            self.passes_checked += 1
            parameters = self._parameters()
            grads = [g for p in parameters if (g := p.grad) is not None]
            if grads and numerics.deferred(grads[0]) and not self.guard.synchronous:
                done = check_gradients_later(self, done, parameters)
                return
            ranks = self.ranks.take_fresh() if self.ranks is not None else None
            held = self.ranks.take_held() if self.ranks is not None else None
            if held is not None:  # the loss code's, held until every rank knew (rank_reports)
                self._held = None  # (its own forward problem, if any, is a later one)
                raise _join_rerun_together(self, done, ranks, held)
            if ranks is not None and len(self.guard.models) == 1:
                # DDP's reduction carried every rank's own check: no second read of the grads
                if self.ranks.rank in ranks[0]:
                    self._backward_problem(done, parameters)
                elif ranks[0] or ranks[1]:  # (FSDP2: this rank's shard may have stayed finite)
                    self.across_ranks(done, None)
                return
            unread: list = []
            if grads and not numerics.all_finite(grads, unread):
                self._backward_problem(done, parameters)
            elif any(call.held is not None for call in done):
                self.across_ranks(done, None)  # held under no_sync: this rank alone knows
            if unread and done:
                self._note_unread(done[0], parameters, unread)
        finally:
            for call in done:
                call.grads = [None] * len(call.grads)

    def _note_unread(self, call: _Call, parameters: list, unread: list) -> None:
        """Keep the gradients that had no numbers to read (meta, fake) as rows of the report,
        as full mode keeps them: the report says they were not watched."""
        names, unread_ids = self.parameter_names(), {id(t) for t in unread}
        pass_, _ = _gradients_read(call, self._sign_hints, [
            (names.get(id(p), "?"), p.grad) for p in parameters
            if p.grad is not None and id(p.grad) in unread_ids])
        self._recent.remember(pass_, self.guard.options.max_frames)

    def _loss_scaling_excuses(self, call: _Call, bad: list) -> bool:
        """The one place loss scaling plugs in. With a GradScaler (the `scaler` option) inf/nan
        gradients are how the scaler learns its scale is too high: it skips that optimizer step,
        and the guard's rule (`scaler.LossScaling.excuses`, the guard's own, which keeps the
        skipped steps and counts them) lets it through, recorded in `guard.skipped_steps`.
        `bad`: the [(parameter name, gradient)] found non-finite."""
        options = self.guard.options
        if self.guard.scaling.scaler_of(options) is None:
            return False
        pass_, record = _gradients_read(call, self._sign_hints, bad)
        return self.guard.scaling.excuses(options, pass_, record, record.slots, CAUSE_BACKWARD)

    def _backward_problem(self, calls: List[_Call], parameters: list) -> None:
        """Re-run the calls of a backward pass whose gradients hold inf/nan; raise."""
        self.gradients_problem(calls, parameters, self._bad_gradients(parameters))

    def _bad_gradients(self, parameters: list) -> list:
        names = self.parameter_names()  # [(name, gradient)] that hold inf or nan, exactly
        return numerics.nonfinite_of((names.get(id(p), "?"), p.grad) for p in parameters
                                     if p.grad is not None)

    def gradients_problem(self, calls: List[_Call], parameters: list, bad: list,
                           flagged: bool = False) -> None:
        """Re-run the calls of a backward pass whose gradients `bad` [(name, grad)] hold inf/nan
        (`flagged`: some did, which ones is not known); raise."""
        if not bad and not flagged:
            return  # a norm overflowed on huge finite values
        first = calls[0]  # one at least: its output's gradient hook queued this check
        if bad and self._loss_scaling_excuses(first, bad):
            return
        seen = gradient_frame(first.entry.name, first.entry.cls, first.batch_number,
                              first.call_index, bad)
        if self.ranks is not None and self.across_ranks(calls, seen):
            return
        for call in calls:
            call.inputs_changed = call.inputs_changed or call.inputs_now_changed()
        report = self._rerun(rerun_backward, self.guard, calls, seen, parameters)
        if report is not None:
            report.reason += self.guard.scaling.refusal() + stood_in(calls)
            self._raise(report, first)

    def across_ranks(self, calls: List[_Call], seen, producers=None,
                      own_named_later: bool = False) -> bool:
        """Under DDP/FSDP2, what every rank learnt at the reduction: this rank's held forward
        problem, or one another rank made, raised; False: this rank's own gradients, or none
        (or, `own_named_later`, its own forward problem)."""
        if calls and calls[0].ranks_settled:
            return False  # its reduction's verdict was acted on already
        made, forward = producers or self.ranks.producers()
        if self.ranks.sharded and (made or forward):
            _rerun_together(self, calls, self.ranks.rank in made + forward, bool(made))
        held = next((call for call in calls if call.held is not None), None)
        if held is not None:
            self._held = None
            self.ranks.forget_step()
            self._rerun_forward(held, *held.held)
            return True
        source = min(set(made) | set(forward), default=None)
        if source is None or self.ranks.rank in made or (own_named_later
                                                          and self.ranks.rank in forward):
            return False
        first = calls[0]
        self.parts.forget()  # (FSDP2 swaps them, unseen)
        self._raise(received_report(seen or gradient_frame(
            first.entry.name, first.entry.cls, first.batch_number, first.call_index,
            self._bad_gradients(self._parameters())), source, source in forward,
            self.guard.options), first)

    def _parameters(self) -> list:
        """The guarded parameters (each once), as of the last parameter or submodule set."""
        return self.parts.parameters()

    def new_parameters(self, module, name, value) -> None:
        if self.parts.holds(module):  # (not a container a forward builds and drops)
            self.parts.forget()
            self.checks.guarded_ids = None
            forget_submodules(self.entries)

    def new_buffer(self, module, name, value) -> None:
        if self.parts.holds(module):
            sentinel_buffers.forget(self.entries.values(), module, name)

    def parameter_names(self) -> dict:
        return _parameter_names(self.guard.models)

    # ---- re-runs and reports ---------------------------------------------------------------
    def _rerun(self, rerun, *args):
        self.paused = True  # the re-run's calls and gradients are the full guard's alone
        try:
            return rerun(*args)
        finally:
            self.paused = False

    def _raise(self, report: Report, call: Optional[_Call] = None) -> None:
        """Raise a detection as full mode does: on_detect's exception, or NonFiniteError; in
        the stage `call` ran in (read later: the loop may be past it)."""
        report.stage = call.stage if call is not None else None
        if self.ranks is not None and report.source_rank is None and report.rank is not None:
            report.source_rank = self.ranks.rank  # this rank's own values made it
        raise frames.detection_error(self.guard, report)


def _backward_due(sentinel) -> bool:
    """Several ranks, a forward flag riding on the coming reduction: the calls before that
    backward stay open, to be sealed with it and acted on at the same point on every rank (a
    bound keeps calls that never get a backward from piling up)."""
    return (sentinel.ranks is not None and isinstance(sentinel.ranks.forward_problem, torch.Tensor)
            and sentinel.checks.open_values < MAX_OPEN_CALL_VALUES)


def _forget_shared_flags(sentinel_ref) -> None:
    """A step no reduction carried (a no_sync micro-step) raised: its flags do not ride on the
    next reduction."""
    sentinel = sentinel_ref()
    if sentinel is not None and sentinel.ranks is not None:
        sentinel.ranks.forget_step()


MAX_PLANS = 8  # output layouts remembered per module


def _top_outputs(entry: _Entry, tensors: list) -> tuple:
    """Per output: whether no other output was computed from it (the loss a model returns was
    computed from its logits: the logits' gradient then comes from the model itself). Found by
    walking the autograd graph once per output layout."""
    layout = tuple((t.requires_grad, t.grad_fn is not None, t.output_nr) for t in tensors)
    plan = entry.plans.get(layout)
    if plan is None:
        if len(entry.plans) >= MAX_PLANS:
            entry.plans.clear()
        plan = entry.plans[layout] = _top_of(tensors)
    return plan


def _parameter_names(models: dict) -> dict:
    """id(parameter) -> its name, as reports give it, for the guarded models' parameters."""
    return {id(p): rerun.original_name(qualified_name(prefix, name))
            for prefix, root in models.items() for name, p in root.named_parameters()}


def _parameters_beside_computed(tensors: list) -> set:
    """The ids of the parameters among a call's outputs (a policy's log_std) where another output
    is computed: those mark the backward, and a hook on a parameter would stay from call to call
    (its gradient is checked as a parameter's)."""
    if not any(t.requires_grad and not t.is_leaf for t in tensors):
        return set()
    return {id(t) for t in tensors if t.is_leaf}


def _outputs_read(call: _Call, output, written: list, nonzero_min: bool, sign_hints: dict) -> tuple:
    """(pass, record) of a call's outputs, and of the buffers [(name, tensor)] it wrote that hold
    nan or +inf, summarised and read (the forward's one synchronisation)."""
    site = id(call.entry.module)
    rows = [(role, OUTPUT, leaf, (site, role))
            for role, leaf in _tree.named_output_leaves(output) if isinstance(leaf, torch.Tensor)]
    rows += [(name + WRITTEN_IN_FORWARD, OUTPUT, t, (site, name + WRITTEN_IN_FORWARD))
             for name, t in written]
    return _read(call, FORWARD, rows, nonzero_min, sign_hints)


def _gradients_read(call: _Call, sign_hints: dict, named_grads: list) -> tuple:
    """(pass, record) of the gradients [(parameter name, grad)], summarised and read."""
    rows = [(f"{name}.grad", GRAD_PARAM, grad, None) for name, grad in named_grads]
    return _read(call, BACKWARD, rows, False, sign_hints)


def _read(call: _Call, phase: str, rows: list, nonzero_min: bool, sign_hints: dict) -> tuple:
    """(pass, record) of a call in `phase` whose rows [(role, category, tensor, site)] are
    summarised and read at once."""
    entry, pass_ = call.entry, PassRecord()
    record = CallRecord(id(entry.module), entry.name, entry.cls, phase, call.batch_number,
                        call.call_index, True)
    for role, category, t, site in rows:
        summary = pass_.summarise(t, site, nonzero_min, sign_hints)
        record.slots.append((role, category, summary[ENTRY_KIND], t.dtype, summary[ENTRY_SHAPE],
                             summary[ENTRY_INDEX], 0))
    pass_.calls.append(record)
    pass_.read_back()
    return pass_, record


def _join_rerun_together(sentinel: Sentinel, calls: List[_Call], ranks, held: BaseException):
    """FSDP2, this rank's loss code made the value: the other ranks learnt a rank made one and
    re-run the step together (`_rerun_together`), so this rank joins that re-run rather than
    leave them waiting in its collectives; returns its own error, the loss code's, to raise."""
    if ranks is not None and sentinel.ranks.sharded and (ranks[0] or ranks[1]):
        sentinel._rerun(rerun_step_together, sentinel.guard, calls, bool(ranks[0]), sentinel.ranks)
    return held


def _rerun_together(sentinel: Sentinel, calls: List[_Call], made_here: bool,
                    backward: bool) -> None:
    """FSDP2: every rank re-runs the step together (its all-gathers and reduce-scatters in step):
    the forward, and the backward where a rank's gradients held the value (`backward`); the rank
    that made it raises what its re-run found."""
    found = sentinel._rerun(rerun_step_together, sentinel.guard, calls, backward, sentinel.ranks)
    if found is not None and made_here:
        sentinel._held, found.source_rank = None, sentinel.ranks.rank
        sentinel._raise(found, calls[0])


def _top_of(tensors: list) -> tuple:
    """Per tensor: whether none of the others was computed from it (one walk of the graph)."""
    nodes: Dict[tuple, List[int]] = {}
    for position, t in enumerate(tensors):
        if t.grad_fn is not None:
            nodes.setdefault((t.grad_fn, t.output_nr), []).append(position)
    inner, seen = set(), set()
    stack = [fn for fn, _ in nodes]
    while stack:
        fn = stack.pop()
        for next_fn, output_nr in getattr(fn, "next_functions", ()):
            if next_fn is None:
                continue
            inner.update(nodes.get((next_fn, output_nr), ()))
            if next_fn not in seen:
                seen.add(next_fn)
                stack.append(next_fn)
    return tuple(position not in inner for position in range(len(tensors)))

