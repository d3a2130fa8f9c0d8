"""Re-run the failing step and name the ATen op and the source line that went bad.

The guard finds the culprit at module granularity. On a detection (with `ops=True`) it calls
`localise_forward` or `localise_backward`, which re-run the last top-level call of the model with
the same inputs, the same RNG state and autocast (`rerun.CallState`) and the same weights,
under a `mode.RerunMode` that protects every tensor the re-run writes and checks the culprit's
ops. For backward, the re-run's forward runs with grad enabled, then `torch.autograd.grad` runs
from the root's outputs (never `.backward()`, so no `.grad` field is touched).

The user's RNG stream, the modules' training flags, parameters, buffers and inputs are left as
they were; every failure here is caught and returned as an `OpLocation` note.
"""

from __future__ import annotations

import contextlib
import linecache
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _tree, rerun
from .._schema import BACKWARD
from .._util import code_where, error_line
from ..rerun import CallState
from .mode import RerunMode, kinds_phrase, nonfinite_kinds

__all__ = ["OpLocation", "localise_forward", "localise_backward"]


# ---- the result ----------------------------------------------------------------------------------
@dataclass
class OpLocation:
    """Where a re-run of the failing step first produced a non-finite value, at op level."""

    op: Optional[str] = None  # e.g. "aten.exp.default"
    node: Optional[str] = None  # backward only: the autograd node, e.g. "SqrtBackward0"
    # the Python line that called the op (backward: the forward line that created the node)
    filename: Optional[str] = None
    lineno: Optional[int] = None
    line: Optional[str] = None
    reproduced: bool = False  # the re-run reproduced the non-finite value in the culprit
    note: str = ""  # one sentence: what was found, or why it could not be localised
    made: tuple = ()  # what the op made: "nan", "inf" (a division by 0 makes inf, 0/0 nan)

    @property
    def source(self) -> Optional[str]:
        """"file:line: code" of the Python line, or None when unknown."""
        if self.filename is None:
            return None
        where = code_where(self.filename, self.lineno)
        return f"{where}: {self.line}" if self.line else where


# ---- small helpers -------------------------------------------------------------------------------
def _code_line(filename, lineno) -> Optional[str]:
    if filename is None or lineno is None:
        return None
    text = linecache.getline(filename, lineno).strip()
    return text or None


def _leafify(value):
    """Replace non-leaf tensors that require grad by detached leaves (same storage), so that the
    re-run's backward stops at the inputs instead of walking into the original graph."""
    return _tree.rebuild(value, _as_leaf, keep_unchanged=True)


def _as_leaf(t: torch.Tensor, path) -> torch.Tensor:
    if t.requires_grad and t.grad_fn is not None:
        return t.detach().requires_grad_(True)
    return t


# ---- the re-run ----------------------------------------------------------------------------------
def _problem(root, culprit, call_index, limit) -> Optional[str]:
    if not isinstance(root, torch.nn.Module):
        return f"the root is a {type(root).__name__}, not a torch.nn.Module"
    if not isinstance(culprit, torch.nn.Module):
        return f"the culprit is a {type(culprit).__name__}, not a torch.nn.Module"
    if isinstance(call_index, bool) or not isinstance(call_index, int) or call_index < 0:
        return f"call_index must be a call number >= 0, got {call_index!r}"
    if limit is not None and not isinstance(limit, (int, float)):
        return f"limit must be a number or None, got {limit!r}"
    return None


def _failure(note: str) -> OpLocation:
    return OpLocation(reproduced=False, note=note)


def _localise(root, args, kwargs, rng, root_grad_outputs, culprit, call_index, limit,
              backward: bool, allow_inf: bool = False, buffers=None, handed: bool = False) -> OpLocation:
    problem = _problem(root, culprit, call_index, limit)
    if problem is not None:
        return _failure(f"could not localise the op: {problem}")
    if args is None:
        args = ()
    if not isinstance(args, tuple):
        args = tuple(args) if isinstance(args, list) else (args,)
    kwargs = dict(kwargs or {})
    limit = float(limit) if limit is not None else None
    if rng is not None and not isinstance(rng, CallState):
        return _failure(f"could not localise the op: rng is a {type(rng).__name__}, "
                        "not a snapshot taken with numguard_nb.ops.rng_state()")

    # the user's random state and training flags (parameters, buffers, inputs: the mode's)
    user_state = rerun.Kept((root, culprit), buffers=False)
    mode = RerunMode(culprit, call_index, limit, record_nodes=backward, has_rng=rng is not None,
                   allow_inf=bool(allow_inf))
    handles = []
    outcome: dict = {}
    try:
        for owner in (root, culprit):
            for name, p in owner.named_parameters():
                mode.protect("param", name, p)
            for name, b in owner.named_buffers():
                mode.protect("buffer", name, b)
        for role, t in list(_tree.named_leaves(args, "input")) + list(_tree.named_leaves(kwargs, "input")):
            if isinstance(t, torch.Tensor):
                mode.protect("input", role, t)
        for module, name, buffer, value in buffers or ():
            mode.start_from(module, name, buffer, value)
        handles.append(culprit.register_forward_pre_hook(mode.pre_hook, with_kwargs=True,
                                                         prepend=True))
        handles.append(culprit.register_forward_hook(mode.post_hook, with_kwargs=True,
                                                     always_call=True))
        if backward:
            args, kwargs = _leafify(args), _leafify(kwargs)
        with contextlib.ExitStack() as stack:
            rerun.entered(rng, stack, grad=backward)
            try:
                with mode:
                    output = root(*args, **kwargs)
            except Exception as error:
                outcome["raised"] = error_line(error)
                output = None
        # backward runs outside autocast, as the user's own backward does
        if backward and "raised" not in outcome:
            _run_backward(mode, output, root_grad_outputs, culprit, outcome)
        output = None
    finally:
        for handle in handles:
            handle.remove()
        failed = mode.restore()
        if failed:
            outcome["unrestored"] = failed
        user_state.restore()
    try:
        return _conclude(mode, outcome, culprit, call_index, limit, backward, handed)
    finally:
        mode.clear()


def _run_backward(mode: RerunMode, output, root_grad_outputs, culprit, outcome: dict) -> None:
    # Paired by position with the gradients kept at the failing call's outputs: both sides walk
    # the outputs with _tree.tensors (see OpRecorder.keep_root_grads).
    outputs = _tree.tensors(output)
    grads = list(root_grad_outputs) if root_grad_outputs is not None else []
    if len(grads) != len(outputs):
        outcome["backward"] = (f"root_grad_outputs holds {len(grads)} gradient(s) for the "
                               f"{len(outputs)} output tensor(s) of the re-run")
        return
    pairs = [(o, g) for o, g in zip(outputs, grads)
             if g is not None and isinstance(g, torch.Tensor) and o.requires_grad]
    if not pairs:
        outcome["backward"] = "no output of the re-run both requires grad and got a gradient"
        return
    if not mode.target_done:
        return  # _conclude says the call did not happen
    inputs, seen = [], set()
    candidates = list(mode.grad_inputs) + list(mode.leaves.values()) + [
        p for p in culprit.parameters() if p.requires_grad
    ]
    for t in candidates:
        if id(t) not in seen:
            seen.add(id(t))
            inputs.append(t)
    if not inputs:
        outcome["backward"] = "nothing the culprit's call used requires grad"
        return
    mode.stage = BACKWARD
    try:
        with mode:
            results = torch.autograd.grad(
                [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True,
            )
    except Exception as error:
        outcome["raised"] = f"{error_line(error)} (in backward)"
        return
    finally:
        pairs = outputs = None
    if all(r is None for r in results):
        outcome["backward"] = "no gradient from the root's outputs reached the culprit's call"
        return
    with mode.internal():
        outcome["grad_in_kinds"] = nonfinite_kinds([r for r in results if r is not None], mode.limit)


def _conclude(mode: RerunMode, outcome: dict, culprit, call_index, limit, backward,
              handed: bool = False) -> OpLocation:
    """`handed`: the value was one the call's own code handed a submodule, which it need not
    return (a product past limit_dtype's range that the next Linear brings back)."""
    name = mode.culprit_class
    call = f"call {call_index} of {name}"
    errors = f" (numguard's own checks failed: {mode.errors[0]})" if mode.errors else ""
    if "unrestored" in outcome:
        errors += f" (could not put back {', '.join(outcome['unrestored'])})"
    # (a forward that raises an error of its own after making the value, a distribution's
    # validation of a nan parameter, say: the op found before it)
    if "raised" in outcome and (backward or mode.found is None):
        return _failure(f"the re-run raised {outcome['raised']}, so the op could not be "
                        f"localised{errors}")
    if "raised" in outcome:
        errors += f" (then the call raised {outcome['raised']}, as it did)"
    if mode.calls <= call_index:
        return _failure(f"the re-run called {name} {mode.calls} time(s), so {call} never ran: "
                        f"the step cannot be reproduced{errors}")
    reason = mode.inexact_reason()
    if reason is not None:
        return _failure(f"the re-run cannot reproduce the failing step exactly: {reason}{errors}")
    # forward: the op that made what the call returned, before one that made a value it drops
    found = (mode.output_root or mode.found) if not backward else mode.found
    where = ""
    if found is not None:
        line = _code_line(found["filename"], found["lineno"])
        where = f" at {code_where(found['filename'], found['lineno'])}" if found["filename"] else ""
    bound = f" or values beyond {limit:g}" if limit is not None else ""

    if not backward:
        produced = mode.out_kinds - mode.in_kinds - mode.ignored
        if not produced and (handed or "raised" in outcome) and found is not None:
            produced = found["kinds"]
        if not produced:
            hint = (f" (an intermediate {found['op']}{where} did produce "
                    f"{kinds_phrase(found['kinds'])})" if found is not None else "")
            return _failure(f"the re-run of {call} returned only finite values{hint}: the failing "
                            f"step could not be reproduced{errors}")
        if found is None:
            return OpLocation(
                reproduced=True,
                note=(f"the re-run of {call} produced {kinds_phrase(produced)}{bound} again, but no "
                      f"single ATen op turned values free of them into them{errors}"),
            )
        given = (f"finite tensors and a number that holds {kinds_phrase(found['kinds'])} (a "
                 "Python number given to it: a scale or a temperature gone non-finite)"
                 if found.get("from_number") else "finite inputs")
        return OpLocation(
            op=found["op"], filename=found["filename"], lineno=found["lineno"], line=line,
            reproduced=True, made=tuple(sorted(found["kinds"])),
            note=(f"{found['op']} turned {given} into {kinds_phrase(found['kinds'])}{bound} "
                  f"in {call}{where}{errors}"),
        )

    if "backward" in outcome:
        return _failure(f"could not re-run backward: {outcome['backward']}{errors}")
    if found is not None:
        created = f", created{where}" if where else ""
        return OpLocation(
            op=found["op"], node=found["node"], filename=found["filename"],
            lineno=found["lineno"], line=line, reproduced=True, made=tuple(sorted(found["kinds"])),
            note=(f"{found['op']} in {found['node']}{created}, turned finite gradients into "
                  f"{kinds_phrase(found['kinds'])}{bound} in the backward of {call}{errors}"),
        )
    produced = outcome.get("grad_in_kinds", frozenset()) - mode.grad_out_kinds - mode.ignored
    if produced:
        return OpLocation(
            reproduced=True,
            note=(f"the re-run's backward of {call} produced {kinds_phrase(produced)}{bound} again, "
                  "but no single ATen op of its autograd nodes turned finite gradients into them "
                  f"(e.g. gradients summed where they meet){errors}"),
        )
    return _failure(f"the re-run's backward of {call} produced only finite gradients: the "
                    f"failing step could not be reproduced{errors}")


# ---- the API -------------------------------------------------------------------------------------
def localise_forward(root, args, kwargs, rng, culprit, call_index, limit=None, *,
                     allow_inf=False, buffers=None, handed=False) -> OpLocation:
    """Re-run `root(*args, **kwargs)` under no_grad with the RNG state `rng` (from `rng_state()`,
    taken before the failing call) and name the first ATen op inside call `call_index` of
    `culprit` that turned finite inputs into inf/nan (or, with `limit`, beyond it). With
    `allow_inf` (the culprit is allowed to produce inf), only nan counts. `buffers`: what the
    buffers held when the failing call began (`rerun.buffers_at_start`), set for the re-run.
    Never raises.
    """
    try:
        return _localise(root, args, kwargs, rng, None, culprit, call_index, limit, backward=False,
                         allow_inf=allow_inf, buffers=buffers, handed=handed)
    except Exception as error:
        return _failure(f"op localisation failed: {error_line(error)}")


def localise_backward(root, args, kwargs, rng, root_grad_outputs, culprit, call_index,
                      limit=None, *, allow_inf=False, buffers=None) -> OpLocation:
    """Re-run the forward with grad enabled, then backward from the root's output tensors (in
    `_tree.tensors` order) with `root_grad_outputs` (None entries: no gradient), and name the first
    ATen op run by an autograd node created in call `call_index` of `culprit` that turned finite
    gradients non-finite, with the forward line that created the node. `.grad` fields are not
    touched (`torch.autograd.grad`). With `allow_inf`, only nan counts. Never raises.
    """
    try:
        return _localise(root, args, kwargs, rng, root_grad_outputs, culprit, call_index, limit,
                         backward=True, allow_inf=allow_inf, buffers=buffers)
    except Exception as error:
        return _failure(f"op localisation failed: {error_line(error)}")
