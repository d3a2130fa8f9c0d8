"""A sentinel's second look: the failing call(s) run again, eagerly, under the full guard.

Contract: `rerun_forward(guard, call, seen)` runs a call the `Sentinel` kept again, with the same
inputs, random state and weights; `rerun_backward(guard, calls, seen, parameters)` runs the calls
of a failing backward pass forward again, then backward from the gradients their outputs got;
`rerun_step_together` re-runs a step on every rank at once (FSDP2); `rerun_compiled_call` serves
full mode's detections in a compiled model. They return the full guard's report, marked
`found_by="re-run"`; where a re-run comes out finite, a report that says so (`cause="transient"`
or `"compiled-code"`); None where it repeats values the full guard's rules accept. `full_guard`
makes that guard; `gradient_frame` is a frame of the non-finite gradients a sentinel found.

Limits: no `.grad` is changed, and buffers, random state and swapped submodules are put back;
a re-run that would start a collective on one rank alone is not made (its report says why).

    report = rerun_forward(guard, call, seen)         # seen: the outputs as the sentinel saw them
    if report is not None:
        raise frames.detection_error(guard, report)   # as the Sentinel raises it
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .. import _tree, numerics, rerun
from .._schema import (
    BACKWARD, CAUSE_COMPILED, CAUSE_DATA, CAUSE_STALE_GRADIENTS, CAUSE_TRANSIENT, CAUSE_UNATTRIBUTED,
    DETECTION, FORWARD, FOUND_BY_RERUN, GRAD_PARAM, MODE_FULL, OUTPUT, WRITTEN_IN_FORWARD,
)
from .._util import dtype_name, error_line
from ..errors import NonFiniteError
from ..report import Frame, Report, TensorRow
from . import frames, sentinel_buffers
from .passes import graph_task_id
from .sentinel_checks import GradStandIn

__all__ = ["full_guard", "rerun_forward", "rerun_step_together", "rerun_backward",
           "rerun_compiled_call", "forward_frame", "gradient_frame"]

_NOT_COMPILED_AGAIN = ("it was finite eagerly, and was not run compiled again: its "
                       "(Distributed)DataParallel wrapper would start collectives on this rank alone")


# ---- the full guard --------------------------------------------------------------------------
class _LentSteps:
    """The sentinel's `StepWatch` (the optimizer steps it saw), lent to a full guard: the full
    guard's forwards are counted in it and its weights' origins read from it; starting and
    stopping it (which forgets what it saw) stay the sentinel's."""

    def __init__(self, watch, forwards: Optional[dict] = None):
        self.watch = watch
        # root module id -> the number of the forward re-run (a check read later, a GPU's: the
        # latest forward of its batch may be a later call of it)
        self.forwards = forwards or {}

    def start(self, models: dict, weights: bool = False, gradients: bool = True) -> None:
        """Already watching, for the sentinel."""

    def stop(self) -> None:
        """The sentinel stops it, on its own detach."""

    def forward_began(self, root_id: int, batch: int) -> None:
        self.watch.forward_ran_again(root_id, batch)

    def weights_origin(self, root_id: int, params, batch: Optional[int] = None):
        return self.watch.weights_origin(root_id, params, batch, self.forwards.get(root_id))

    def buffers_origin(self, root_id: int, batch: Optional[int] = None):
        return self.watch.buffers_origin(root_id, batch, self.forwards.get(root_id))

    def __getattr__(self, name):
        return getattr(self.watch, name)


def full_guard(guard, models: Dict[str, nn.Module], batch: int, calls=(), **changes):
    """A full-mode guard of the sentinel's class and options on `models`, whose batches are
    counted by its caller, starting at `batch`, and which knows the optimizer steps the sentinel
    saw (its weights' origins are the sentinel's, for the forwards of `calls` it re-runs)."""
    options = guard.options.replace(mode=MODE_FULL, capture=False, abort_after_batch=None,
                                    full_every=None,
                                    **changes)
    full = guard.twin(models, options)
    full.outside.may_hold = False  # the code after the call is the sentinel's to judge
    forwards: dict = {}
    for call in calls:  # (the first of a module's calls: the first to see its weights)
        if getattr(call, "forward_number", None) is not None:
            forwards.setdefault(call.entry.run_id, call.forward_number)
    full.steps = _LentSteps(guard.steps, forwards)
    full.batches.started = batch  # numbered as the sentinel numbers its batches
    full.begin_batch()
    return full


def _rerun_guard(guard, models, batch: int, calls):
    # No scaler: the sentinel asked the loss scaling rule before re-running (see Sentinel).
    full = full_guard(guard, models, batch, calls, ops=True, sync=False, trace_batches=(),
                      on_trace=None, on_detect=None, history_every=None, scaler=None)
    # Started at a backward's end: its calls there are the step's, not a recomputation.
    full.rerun_task = graph_task_id()
    full.abs_min_everywhere = True  # a report of every row of one step: measure them all
    return full


# ---- running a kept call again -------------------------------------------------------------------
def _call_again(module: nn.Module, call, args, kwargs, grad: bool):
    """`module(*args, **kwargs)` from the call's random state, under its autocast, with grad mode
    `grad` (inference mode where the call ran in it)."""
    with contextlib.ExitStack() as stack:
        rerun.entered(call.state, stack, grad)
        if module is call.entry.module:  # (not a compiled one's)
            # the forward the call ran under (Lightning redirects it to training_step)
            stack.enter_context(rerun.forward_as(module, getattr(call, "forward", None)))
        return module(*args, **kwargs)


@contextlib.contextmanager
def _modes_as_called(calls):
    """Each module in the train/eval mode it was in when the calls ran (checks read later: an
    evaluation call is re-run after the loop went back to `model.train()`), for the whole re-run,
    its backward too (activation checkpointing recomputes there); set back after."""
    taken = [call.training for call in calls if getattr(call, "training", None) is not None]
    before = [(module, module.training) for modules, _ in taken for module in modules]
    for modules, modes in taken:
        for module, mode in zip(modules, modes):
            module.training = mode
    try:
        yield
    finally:
        for module, mode in before:
            module.training = mode


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A re-run's own leaf with `t`'s values: its backward stops there, and never reaches `t`."""
    return t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() \
        else t.detach()


def _forwards(calls, eager: Callable, grad: bool) -> Tuple[list, list]:
    """Run `calls` again in order; an input that was an earlier call's output is that call's new
    output (so the backward goes through both). Returns (outputs, leaf inputs)."""
    outputs, made, leaves = [], {}, []

    def feed(t: torch.Tensor, path) -> torch.Tensor:
        new = made.get(id(t))
        if new is not None and new.shape == t.shape and new.dtype == t.dtype:
            return new
        leaf = _leaf(t) if grad else t
        if leaf is not t and leaf.requires_grad:
            leaves.append(leaf)
        return leaf

    for call in calls:
        args = _tree.rebuild(call.args, feed, keep_unchanged=True)
        kwargs = _tree.rebuild(call.kwargs, feed, keep_unchanged=True)
        output = _call_again(eager(call.entry.module), call, args, kwargs, grad)
        outputs.append(output)
        for output_id, new in zip(call.output_ids, _tree.output_tensors(output)):
            made[output_id] = new
    return outputs, leaves


def _output_grads(calls, outputs) -> Tuple[list, list]:
    """(re-run outputs, the gradients the original outputs got) of the outputs that take one."""
    pairs = []
    for call, output in zip(calls, outputs):
        tensors = _tree.output_tensors(output)
        for position, grad in enumerate(call.grads or ()):
            if grad is not None and position < len(tensors) and tensors[position].requires_grad:
                if isinstance(grad, GradStandIn):
                    grad = grad.materialise()
                pairs.append((tensors[position], grad))
    return [o for o, _ in pairs], [g for _, g in pairs]


def _backward(calls, outputs, inputs: list) -> list:
    """Gradients of `inputs` from the re-run's outputs and the gradients the originals got."""
    outputs_, grads = _output_grads(calls, outputs)
    wanted = [t for t in inputs if t.requires_grad]
    if not outputs_ or not wanted:
        return []
    try:  # the graph kept: a reentrant checkpoint refuses only once the nodes after it ran
        return list(torch.autograd.grad(outputs_, wanted, grads, allow_unused=True,
                                        retain_graph=True))
    except RuntimeError as error:
        if "use_reentrant=True" not in str(error):
            raise
    return _backward_into_grad(outputs_, grads, wanted)


def _backward_into_grad(outputs, grads, wanted: list) -> list:
    """The gradients of `wanted` by `.backward()`, which torch.utils.checkpoint(use_reentrant=True)
    needs (it refuses autograd.grad): the `.grad` of every leaf it reaches is set aside, read
    after, and put back."""
    touched = list(wanted) + [leaf for leaf in _graph_leaves(outputs)
                              if not any(leaf is t for t in wanted)]
    kept = [t.grad for t in touched]
    try:
        for t in touched:
            t.grad = None
        torch.autograd.backward(outputs, grads)
        return [t.grad for t in wanted]
    finally:
        for t, grad in zip(touched, kept):
            t.grad = grad


def _graph_leaves(outputs) -> list:
    """The leaf tensors whose `.grad` a backward from `outputs` accumulates into."""
    leaves, seen, todo = [], set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad's leaf
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        todo.extend(fn for fn, _ in node.next_functions)
    return leaves


def _has_problem(tensors, allow_inf: bool, limit: Optional[float]) -> bool:
    """Whether any floating tensor holds nan (inf too, unless `allow_inf`; beyond `limit` too)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.numel():
            continue
        with torch.no_grad():
            nan, posinf, neginf = numerics.nonfinite_kinds(t)
            if nan or (not allow_inf and (posinf or neginf)):
                return True
            if limit is not None and not allow_inf and numerics.read(t.abs().max()) > limit:
                return True
    return False


# ---- the re-runs -------------------------------------------------------------------------------
def _eager_models(models: Dict[str, nn.Module]) -> Dict[str, nn.Module]:
    return {prefix: rerun.eager(root) for prefix, root in models.items()}


def _all_parts(models: Dict[str, nn.Module]) -> list:
    return [part for root in models.values() for part in rerun.compiled_parts(root)]


def _collective(models: Dict[str, nn.Module]) -> Optional[str]:
    return next(filter(None, (rerun.collective_in(rerun.run_alone(root))
                              for root in models.values())), None)


def _not_rerun(seen: Frame, call, options, why: str) -> Report:
    """A detection the re-run cannot place: re-running would start collectives on one rank."""
    report = _seen_report(seen, options, CAUSE_UNATTRIBUTED, (
        f"inf/nan in {_where(seen, call)}; not run again to name the module that made it: {why}"),
        "Run this rank's step again in full mode (Guard(model), every module hooked) to name "
        "the module, or reproduce it on one process.")
    report.found_by = ""  # nothing was re-run
    return report


# A first call that rewrote its inputs in place had them not copied: its re-run read what it left.
_INPUTS_REWRITTEN = ("; but the call changed its inputs in place (x.sub_(mean).div_(std)), so its "
                     "re-run read them as it left them: the model's own in-place code may have made "
                     "the values (inputs are copied before each call from now on, so a later batch "
                     "is told apart)")


def rerun_forward(guard, call, seen: Frame) -> Optional[Report]:
    """Run the call again under the full guard; see the module docstring. `seen`: the frame of
    the call's outputs as the sentinel saw them, the problems flagged."""
    models, options = guard.models, guard.options
    refused = _collective(models)
    if refused:
        return _not_rerun(seen, call, options, refused)
    allow_inf = options.inf_allowed(call.entry.name)
    with rerun.Kept(models.values()), _modes_as_called([call]):
        sentinel_buffers.set_back([call])  # what the call's forward found
        rerun.finite_running_statistics(models.values())
        parts = _all_parts(models)
        with rerun.swapped(parts, rerun.eager), rerun.eager_stance():
            full = _rerun_guard(guard, _eager_models(models), call.batch_number, [call])
            try:
                with full:
                    output = _call_again(rerun.run_alone(call.entry.module), call, call.args,
                                         call.kwargs, call.state.grad_enabled)
            except NonFiniteError as error:
                if error.report.cause == CAUSE_DATA and call.inputs_changed:
                    error.report.reason += _INPUTS_REWRITTEN
                return _found(error.report)
            except Exception as error:  # (Python state the re-run cannot set back)
                return _failed(seen, call, options, error)
            if _has_problem(_tree.output_tensors(output) + sentinel_buffers.written_again(call), allow_inf,
                            options.stop_rules.limit_max):
                return None  # the same values again, and the full guard's rules accept them
            output = None
        if not rerun.involves_compiled(call.entry.module):
            return _transient(seen, call, options, "the re-run's outputs were finite")
        if rerun.run_alone(call.entry.module) is not rerun.eager(call.entry.module):
            return _transient(seen, call, options, _NOT_COMPILED_AGAIN)
        again = _call_again(call.entry.module, call, call.args, call.kwargs, False)
        if not _has_problem(_tree.output_tensors(again), allow_inf, options.stop_rules.limit_max):
            return _transient(seen, call, options, "run again, eagerly and compiled, its outputs "
                              "were finite")
        with rerun.swapped(parts, rerun.aot_eager):
            aot = _call_again(rerun.aot_eager(call.entry.module), call, call.args, call.kwargs, False)
        captured = _has_problem(_tree.output_tensors(aot), allow_inf, options.stop_rules.limit_max)
        return _compiled(seen, call, options, captured)


class _KeptCall:
    """A compiled model's top-level call kept by a full-mode guard (`hooks._CompiledWeights`),
    shaped as the sentinel's calls for `rerun_forward`."""

    def __init__(self, entry, args, kwargs, state, batch_number: int, call_index: int):
        self.entry, self.args, self.kwargs, self.state = entry, args, kwargs, state
        self.batch_number, self.call_index, self.inputs_changed = batch_number, call_index, False


class _KeptEntry:
    def __init__(self, module: nn.Module, name: str):
        self.module, self.name = module, name


def rerun_compiled_call(guard, kept: tuple, seen: Frame) -> Optional[Report]:
    """Full mode's detection in a compiled model's call (`kept`: its module, inputs and call
    state): the call run again eagerly under a full guard, as `rerun_forward`."""
    module, args, kwargs, state = kept
    name = guard.module_hooks.names.get(id(module), ("",))[0]
    return rerun_forward(guard, _KeptCall(_KeptEntry(module, name), args, kwargs, state,
                                          seen.batch_number, seen.call_index), seen)


def rerun_backward(guard, calls, seen: Frame, parameters: list) -> Optional[Report]:
    """Run the calls of a backward pass again, forward then backward, under the full guard.
    `parameters`: the guarded parameters, whose gradients the re-run computes (not in `.grad`)."""
    models, options = guard.models, guard.options
    refused = _collective(models)
    if refused:
        return _not_rerun(seen, calls[0], options, refused)
    batch = calls[0].batch_number
    with rerun.Kept(models.values()), _modes_as_called(calls):
        sentinel_buffers.set_back(calls)
        parts = _all_parts(models)
        with rerun.swapped(parts, rerun.eager), rerun.eager_stance():
            full = _rerun_guard(guard, _eager_models(models), batch, calls)
            full.outside.masks_judged = True  # (the step's loss judged them, and went on)
            try:
                with full:
                    outputs, leaves = _forwards(calls, rerun.run_alone, True)
                    grads = _backward(calls, outputs, parameters + leaves)
            except NonFiniteError as error:
                return _found(error.report)
            except Exception as error:  # (Python state the re-run cannot set back)
                return _failed(seen, calls[0], options, error)
            if not grads:
                return _transient(seen, calls[0], options, "nothing of the re-run's outputs took "
                                  "a gradient, so its backward could not be run again")
            if _has_problem(grads, False, None):
                return None  # the same gradients again, and the full guard's rules accept them
            outputs = grads = None
        finite = ("the gradients of a re-run through the model's calls were finite (or the "
                  "inf/nan came from code outside them that uses the weights directly)")
        if guard.steps.gradients_were_not_finite():
            return _stale_gradients(seen, calls[0], options)
        if not any(rerun.involves_compiled(call.entry.module) for call in calls):
            return _transient(seen, calls[0], options, finite)
        if any(rerun.run_alone(call.entry.module) is not rerun.eager(call.entry.module)
               for call in calls):
            return _transient(seen, calls[0], options, f"{finite}; {_NOT_COMPILED_AGAIN}")
        outputs, _ = _forwards(calls, lambda m: m, True)
        if not _has_problem(_backward(calls, outputs, list(parameters)), False, None):
            return _transient(seen, calls[0], options, finite + ", run compiled again too")
        with rerun.swapped(parts, rerun.aot_eager):
            outputs, _ = _forwards(calls, rerun.aot_eager, True)
            captured = _has_problem(_backward(calls, outputs, list(parameters)), False, None)
        return _compiled(seen, calls[0], options, captured)


def rerun_step_together(guard, calls, backward: bool, ranks) -> Optional[Report]:
    """Every rank runs the step's calls again under a full guard that traces (it never stops
    part-way), so that the collectives a sharded model makes (FSDP2's all-gathers, and with
    `backward` its reduce-scatters) stay in step on every rank: forward only and without grad,
    or forward and backward from the gradients the outputs got. The re-run's gradients never
    reach `.grad` (each is set aside, then put back) and its reductions carry no flags (`ranks`,
    every rank alike). Returns what this rank's trace found, or None."""
    models, batch = guard.models, calls[0].batch_number
    parameters = [p for model in models.values() for p in model.parameters()] if backward else []
    kept_grads, flagging = [p.grad for p in parameters], ranks.active
    with rerun.Kept(models.values()), _modes_as_called(calls):
        sentinel_buffers.set_back(calls)
        full = full_guard(guard, models, batch, calls, ops=False, sync=False,
                          trace_batches=(batch,), on_trace=None, on_detect=None,
                          history_every=None, scaler=None)
        full.rerun_task = graph_task_id()
        try:
            ranks.active = False
            for p in parameters:
                p.grad = None
            with full:
                full.batches.started = batch  # (attaching forgot the batch full_guard began)
                full.begin_batch()
                outputs = [_call_again(call.entry.module, call, call.args, call.kwargs, backward)
                           for call in calls]
                if backward:
                    _backward_together(calls, outputs)
        finally:
            ranks.active = flagging
            for p, grad in zip(parameters, kept_grads):
                p.grad = grad
    report = full.traces.get(batch)
    if report is None or report.first_nonfinite is None:
        return None
    report.kind = DETECTION
    return _found(report)


def _backward_together(calls, outputs) -> None:
    """The backward of a joint re-run, from the gradients the original outputs got (every rank
    has some: the reduce-scatters need every rank)."""
    outputs_, grads = _output_grads(calls, outputs)
    if outputs_:
        torch.autograd.backward(outputs_, grads)


# ---- reports ---------------------------------------------------------------------------------
def _found(report: Report) -> Report:
    report.found_by = FOUND_BY_RERUN
    return report


_LISTED = 3  # the values an error's first line names; the report's rows hold them all


def _holds(frame: Frame) -> str:
    rows = frame.flagged_rows
    listed = "; ".join(f"{row.role} holds {row.nonfinite_words or 'values beyond the limit'}"
                       for row in rows[:_LISTED])
    more = f"; and {len(rows) - _LISTED} more (the report's rows)" if len(rows) > _LISTED else ""
    return listed + more or (
        "inf or nan, found by one check on the device that does not say which tensor")


def _where(seen: Frame, call) -> str:
    changed = (" (its inputs had been changed in place since: the re-run used them as they were "
               "then)" if call.inputs_changed else "")
    return (f"{seen.words} in {seen.phase} of batch {seen.batch_number} "
            f"({_holds(seen)}){changed}")


def _seen_report(seen: Frame, options, cause: str, reason: str, hint: str) -> Report:
    """A report of what the sentinel saw, and of what its re-run found (or why there was none)."""
    report = frames.make_report([seen], seen, DETECTION, reason, cause, seen.batch_number, options)
    report.hint = hint
    return _found(report)


def _failed(seen: Frame, call, options, error: Exception) -> Report:
    """A detection whose re-run raised: state kept outside the model's tensors (a flag, a
    cache's length) did not let the call run again as it ran."""
    report = _seen_report(seen, options, CAUSE_UNATTRIBUTED, (
        f"inf/nan in {_where(seen, call)}; running the call again to name the module that made it "
        f"failed ({error_line(error)}): the model keeps state outside its tensors that the re-run "
        "could not set back"),
        "Run the step in full mode (Guard(model), every module hooked): it names the module as "
        "the values are made, without running the call again.")
    report.found_by = ""  # nothing could be re-run
    return report


def _transient(seen: Frame, call, options, differed: str) -> Report:
    return _seen_report(seen, options, CAUSE_TRANSIENT, (
        f"inf/nan in {_where(seen, call)}, but a re-run of the same call with the same inputs, "
        f"weights and random state did not repeat it: {differed}"),
        "A fault that does not repeat: a hardware error (check `nvidia-smi -q` for ECC errors), "
        "a communication fault, a race, or state kept outside the model's tensors that changed "
        "between the two runs. Keep the sentinel on to see whether it comes back, and on which "
        "rank.")


def _stale_gradients(seen: Frame, call, options) -> Report:
    return _seen_report(seen, options, CAUSE_STALE_GRADIENTS, (
        f"inf/nan in {_where(seen, call)}, which a re-run of the step did not make: the .grad "
        "already held inf/nan when the guard attached, and this backward added to it"),
        "A .grad an earlier backward left, never zeroed (a step stopped before "
        "`optimizer.zero_grad()`). Zero the gradients and reload the weights and the optimizer's "
        "state (a checkpoint) before training again.")


def _compiled(seen: Frame, call, options, captured: bool) -> Report:
    which = ("non-finite too: graph capture (Dynamo's graph, AOTAutograd's decompositions) makes "
             "it" if captured else "finite: the backend's generated kernels make it")
    return _seen_report(seen, options, CAUSE_COMPILED, (
        f"inf/nan in {_where(seen, call)} when run compiled, again when re-run compiled, but not "
        f'when re-run eagerly: the compiled code makes it; compiled with backend="aot_eager" it is '
        f"{which}"),
        "Run the part eagerly (torch.compiler.disable), or compile it with another backend, and "
        "report it to PyTorch with a minimal repro (TORCHDYNAMO_REPRO_AFTER=\"aot\" writes one).")


def gradient_frame(name: str, cls: str, batch: int, call_index: int, grads) -> Frame:
    """A frame of the non-finite gradients a sentinel found: `grads` is [(parameter name, grad)]."""
    return _flagged_frame(name, cls, BACKWARD, batch, call_index,
                          [(f"{role}.grad", GRAD_PARAM, grad) for role, grad in grads])


def forward_frame(call) -> Frame:
    """A frame of a sentinel's call whose one device flag said nan or +inf: the buffers it wrote
    that hold them (read now) as its rows, none where its outputs did."""
    written = sentinel_buffers.produced(call.buffers.written(), False) if call.buffers else []
    return _flagged_frame(call.entry.name, call.entry.cls, FORWARD, call.batch_number,
                          call.call_index, [(name + WRITTEN_IN_FORWARD, OUTPUT, t)
                                            for name, t in written])


def _flagged_frame(name: str, cls: str, phase: str, batch: int, call_index: int, tensors) -> Frame:
    """A frame whose rows are the flagged tensors [(role, category, tensor)], read now."""
    rows = []
    with torch.no_grad():
        for role, category, t in tensors:
            values = t.coalesce().values() if t.is_sparse else t
            abs_max = float(numerics.read(values.abs().max())) if values.numel() else None
            nan, posinf, neginf = numerics.nonfinite_kinds(values)
            rows.append(TensorRow(
                role=role, category=category, dtype=dtype_name(t.dtype), shape=tuple(t.shape),
                abs_max=abs_max, nan=nan, posinf=posinf, neginf=neginf, flagged=True))
    return Frame(module_name=name, module_class=cls, phase=phase, batch_number=batch,
                 call_index=call_index, rows=rows)

