"""Running captured calls again: the chain of calls replayed together, each call's inputs (with
the replayed outputs of earlier calls in place of the inputs they match), and the result.

A loss module guarded alongside the model (`Guard({'model': m, 'loss_fn': nn.CrossEntropyLoss()})`)
is replayed after the model call that fed it. The caller's RNG state is restored afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .. import _tree
from .._util import dtype_name, error_line
from ..rerun import CallerRandomState
from .location import CALL_SITE, Location, error_location, format_traceback, with_source_line
from .outside import Unreplayable, replay_records
from .snapshot import LOW_PRECISION, build_module

# Messages of CPU kernels that do not exist for half precision (the upcast is retried on these).
_MISSING_LOW_PRECISION = re.compile(
    r"not implemented for '(Half|BFloat16|ComplexHalf)'"
    r"|Low precision dtypes not supported"
    r"|Unsupported dtype (Half|BFloat16)"
    r"|doesn't support tensors of type: (Half|BFloat16)"
)


@dataclass
class ReplayResult:
    """What a replay found.

    `exception` is None when the call ran clean (then the problem is elsewhere: an earlier call,
    or code outside the guarded modules) and `output` holds what the call returned. Otherwise
    `traceback` is the formatted traceback, `location` the innermost line of the user's or the
    model's code (when the error is raised inside torch's own modules: the line that called the
    module, `location.kind == "call site"`), and `module` the innermost module that was running.
    `replayed` says which calls were run and where their inputs came from; `upcast` is True when
    the call was run again in float32 because the device lacked a half-precision kernel.
    """

    call: Any  # the CapturedCall replayed (the one that raised, when one did)
    device: str = "cpu"
    exception: Optional[BaseException] = None
    traceback: str = ""
    location: Optional[Location] = None
    module: Optional[str] = None
    output: Any = None
    replayed: str = ""
    notes: List[str] = field(default_factory=list)
    upcast: bool = False
    # The torch function run outside the guarded modules that raised (replay.outside), if one did.
    function: Any = None

    @property
    def ok(self) -> bool:
        """The call ran clean on the replay device."""
        return self.exception is None

    @property
    def call_site(self) -> Optional[Location]:
        """The line that made the replayed call (in the user's code)."""
        return with_source_line(self.call.call_site)

    def raise_(self):
        """Raise the replayed exception (its traceback points at the real line)."""
        if self.exception is not None:
            raise self.exception

    def __repr__(self) -> str:
        from ..render.replay import replay_result_text

        return replay_result_text(self)

    def _repr_html_(self) -> str:
        from ..render.replay import replay_result_html

        return replay_result_html(self)


# ---- which calls run together -----------------------------------------------------------------
def chain_of(call) -> list:
    """`call`, after the calls of earlier-listed guarded modules that directly preceded it (the
    model call that fed a loss module)."""
    source = call.source
    order = source.root_order
    calls = [call]
    current = call
    while True:
        previous = source.previous(current)
        if previous is None or any(previous.root_name == c.root_name for c in calls):
            break
        if previous.root_name not in order or current.root_name not in order or \
                order.index(previous.root_name) >= order.index(current.root_name):
            break
        calls.insert(0, previous)
        current = previous
    return calls


def replay(call, device: Union[str, torch.device] = "cpu") -> ReplayResult:
    """Run `call` (after the calls that fed it) again on `device`; run it again upcast to float32
    when a half-precision kernel it needs is missing there."""
    device = torch.device(device)
    chain = chain_of(call)
    for link in chain:
        link.wait_for_copies()
    result = _run_chain(chain, device, upcast=False)
    low_precision = any(
        t.dtype in LOW_PRECISION for c in chain
        for t in itertools.chain(call.source.snapshots[c.root_name].tensors.values(),
                                 _tree.tensors((c.args, c.kwargs)))
    )
    missing = _MISSING_LOW_PRECISION.search(str(result.exception)) \
        if result.exception is not None and low_precision else None
    if missing is not None:
        first = error_line(result.exception)
        dtype = "bfloat16" if "BFloat16" in missing.group(0) else "float16"
        result = _run_chain(chain, device, upcast=True)
        result.upcast = True
        result.notes.insert(0, f"replayed upcast to float32: {device.type} lacks a {dtype} "
                               f"kernel the call needs ({first})")
    return result


# ---- the inputs of one call -------------------------------------------------------------------
def _input_role(path: tuple) -> str:
    """A path into (args, kwargs) -> 'input[0]', 'input[labels]'."""
    return _tree.role_of("input", path[1:])


def _replay_inputs(call, device: torch.device, upcast: bool):
    """Fresh device copies of the call's inputs (the host copies stay as they were)."""

    def on_tensor(t, path):
        dtype = torch.float32 if upcast and t.dtype in LOW_PRECISION else None
        out = t.detach().to(device=device, dtype=dtype, copy=True)
        if t.requires_grad:
            out.requires_grad_(True)
        return out

    return _tree.rebuild((tuple(call.args), dict(call.kwargs)), on_tensor)


def _match_outputs(inputs, produced, used: list):
    """Put replayed outputs of earlier calls in place of the inputs that hold the same values."""
    candidates = [(who, path, t) for who, output in produced for path, t in _tree.leaves(output)
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not candidates:
        return inputs
    for path, x in list(_tree.leaves(inputs)):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            continue
        for who, out_path, o in candidates:
            if o.numel() != x.numel() or o.numel() == 0:
                continue
            with torch.no_grad():
                same = torch.allclose(o.detach().float().reshape(-1), x.detach().float().reshape(-1),
                                      rtol=1e-2, atol=1e-4, equal_nan=True)
            if not same:
                continue
            new = o if o.shape == x.shape else o.reshape(x.shape)
            if new.dtype != x.dtype:
                new = new.to(x.dtype)
            inputs = _tree.set_at(inputs, path, new)
            used.append((_input_role(path), who, _tree.role_of("output", out_path)))
            break
    return inputs


def _step_text(call, chain: list, position: int, used: list, fed: bool) -> str:
    """'loss_fn (CrossEntropyLoss) call 3 with input[0] from the replayed model output ...'."""
    step = f"{call.label} call {call.index}"
    if used:
        step += " with " + ", ".join(f"{inp} from the replayed {who} {out}" for inp, who, out in used)
        replaced = {u[0] for u in used}
        rest = [_input_role(path) for path, leaf in _tree.leaves((call.args, call.kwargs))
                if isinstance(leaf, torch.Tensor) and _input_role(path) not in replaced]
        if rest:
            step += f" and {', '.join(rest)} from its captured copy"
    elif fed:
        stale = [c.name for c in chain[:position] if c.weights_changed]
        why = (f"the weights of {', '.join(stale)} changed since the snapshot, so "
               "its replayed output differs") if stale else \
            "none matched the replayed outputs before it"
        step += f" with its captured inputs ({why})"
    else:
        step += " with its captured inputs"
    return step


# ---- running the chain ------------------------------------------------------------------------
class _ModuleTracker:
    """Hooks on the replay copy (never on the live model): which module was running on error."""

    def __init__(self):
        self.stack: List[Tuple[str, str]] = []

    def attach(self, module: nn.Module, prefix: str) -> None:
        for name, sub in module.named_modules():
            full = ".".join(p for p in (prefix, name) if p)
            label = (full or type(sub).__name__, type(sub).__name__)
            sub.register_forward_pre_hook(lambda m, a, _l=label: self.stack.append(_l))
            sub.register_forward_hook(lambda m, a, o: self._pop())

    def innermost(self) -> Optional[str]:
        """'body.0 (Linear)': the module running when the error was raised."""
        if not self.stack:
            return None
        name, cls = self.stack[-1]
        return f"{name} ({cls})" if name != cls else cls

    def _pop(self):
        if self.stack:
            self.stack.pop()


def _autocast_context(call, device: torch.device, upcast: bool, notes: list):
    """The call's autocast on the replay device (none when upcast); a note for other devices'."""
    autocast = dict(call.state.autocast)
    for other, dtype in autocast.items():
        if other != device.type:
            notes.append(f"the call ran under {other} autocast ({dtype_name(dtype)}); "
                         f"the {device.type} replay runs without it")
    dtype = autocast.get(device.type)
    if dtype is None or upcast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _run_chain(chain: list, device: torch.device, upcast: bool) -> ReplayResult:
    source = chain[-1].source
    notes: List[str] = []
    modules: Dict[str, nn.Module] = {}
    produced: list = []  # (call name, output) of calls already replayed
    outputs: dict = {}  # call index, or (call index, function number) -> output
    steps: List[str] = []
    tracker = _ModuleTracker()
    caller_rng = CallerRandomState()
    exception = None
    failed = None
    function = None
    output = None
    try:
        for position, call in enumerate(chain):
            module = modules.get(call.root_name)
            if module is None:
                module = build_module(source.models[call.root_name], source.snapshots[call.root_name],
                                      device, upcast, notes, call.name)
                tracker.attach(module, call.root_name)
                modules[call.root_name] = module
            if module.training != call.training:
                module.train(call.training)
            args, kwargs = _replay_inputs(call, device, upcast)
            used: list = []
            if produced:
                args, kwargs = _match_outputs((args, kwargs), produced, used)
            steps.append(_step_text(call, chain, position, used, bool(produced)))
            caller_rng.set_for(call.state.cpu, call.cuda_rng_state, device)
            context = _autocast_context(call, device, upcast, notes)
            tracker.stack.clear()
            try:
                with torch.set_grad_enabled(call.state.grad_enabled), context:
                    result = module(*args, **kwargs)
                    outputs[call.index] = result
                    function, exception = _run_outside(call, device, upcast, outputs, modules,
                                                       source, steps, notes)
            except Exception as error:  # the point of the replay: keep it, do not raise it
                exception = error
            if exception is not None:
                failed = call
                steps.extend(f"{later.label} call {later.index} was not run"
                             for later in chain[position + 1:])
                break
            produced.append((call.name, result))
            produced.extend((f"{call.name}'s code", out) for key, out in outputs.items()
                            if isinstance(key, tuple) and key[0] == call.index)
            output = result
    finally:
        caller_rng.restore()

    notes.extend(_chain_notes(chain, modules, device))
    location = None
    if function is not None:  # a torch function: the line that called it is the real one
        location = Location.of(function.filename, function.lineno, "", CALL_SITE,
                               line=function.source_line)
        location.named = function.named
    elif exception is not None:
        location = error_location(exception) or with_source_line(failed.call_site)
    return ReplayResult(
        call=failed or chain[-1], device=str(device), exception=exception,
        traceback=format_traceback(exception) if exception is not None else "",
        location=location,
        module=tracker.innermost() if exception is not None and function is None else None,
        output=output if exception is None else None,
        replayed="; then ".join(steps), notes=_unique(notes), upcast=False, function=function,
    )


def _run_outside(call, device, upcast, outputs, modules, source, steps: list, notes: list):
    """Run the code recorded after `call` (replay.outside): (the function that raised, its
    exception), or (None, None). Says what ran in `steps`, and where the record stops in `notes`."""
    records = call.outside
    if not records:
        return None, None
    try:
        function, error = replay_records(call, records, device, upcast, outputs, modules,
                                         source.snapshots)
    except Unreplayable as why:
        notes.append(f"the code after {call.label} call {call.index} was not replayed: it reads "
                     f"{why}")
        return None, None
    if function is not None:
        done = records.index(function)
        steps.append(f"the code after it, {done + 1} of {len(records)} recorded torch functions, "
                     f"up to {function.name} at {function.where}")
        return function, error
    last = records[-1]
    steps.append(f"the code after it: {len(records)} recorded torch functions, the last {last.name} "
                 f"at {last.where}")
    if call.outside_full:
        notes.append(f"the code after {call.label} call {call.index} was recorded in part: "
                     f"{call.outside_full}")
    return None, None


def _chain_notes(chain: list, modules: Dict[str, nn.Module], device: torch.device) -> List[str]:
    """What may make the replay differ from the original calls."""
    notes = []
    for call in chain:
        if call.weights_changed:
            notes.append(f"the weights of {call.name} changed after the snapshot (taken when the "
                         "guard was attached) and before this call: the replay ran with the "
                         "snapshot's weights (errors from the data do not depend on them)")
        if call.by_reference:
            notes.append(f"{call.name}: {', '.join(call.by_reference)} were kept by reference, "
                         "not copied")
        if call.copy_note:
            notes.append(call.copy_note)
        notes.extend(call.extra_notes)
        replayed = modules.get(call.root_name)
        has_dropout = replayed is not None and any(
            isinstance(m, nn.modules.dropout._DropoutNd) for m in replayed.modules())
        if device.type != "cuda" and call.training and has_dropout and \
                any(d.startswith("cuda") for d in call.input_devices):
            notes.append(f"{call.name} ran on a GPU in training mode: dropout masks drawn on "
                         f"{device.type} differ from the GPU's")
    return notes


def _unique(items):
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
