"""Which calls of a guarded model the sentinel checks: its entries (the model and its callable
submodules at every depth, each hooked, those inside a call set aside while it runs) and, per
thread, the top-level call under way.

Contract: `entry_modules` lists the modules to hook; a thread's `ThreadState` says how deep it is
in calls of them; `closes_top_level` tells the closing hook of the top-level call from one
inside it; `pass_through` marks calls that are no top-level ones (Lightning's evaluation step
called through the DDP or FSDP wrapper); `GuardedParts` which parameters and modules are the
models'.
"""

from __future__ import annotations

import operator
import threading

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from .._util import WeakHook, compiled_original, qualified_name

from .hooks import own_call_frame_id, still_running

__all__ = ["GuardedParts", "ThreadState", "closes_top_level", "entry_modules", "forget_submodules",
           "modes_of", "pass_through", "registration_hooks"]

_UNIMPLEMENTED_FORWARD = nn.Module.forward  # containers (ModuleList, ModuleDict) are never called
_TRAINING = operator.attrgetter("training")


def entry_modules(prefix: str, root: nn.Module):
    """(name, module, the entries it is inside) of the modules whose calls can be top-level:
    `root`, then (unless it runs compiled) every callable submodule at any depth (a training
    step may call `model.transformer` or `backbone.forward_features`, whose blocks it calls),
    looking through containers; not into compiled or TorchScript code."""
    if isinstance(root, torch.jit.ScriptModule):
        raise TypeError(f"numguard: {prefix or 'the model'} is a TorchScript module, whose calls "
                        "the sentinel cannot watch: guard the eager model it was scripted from "
                        "(script it after the guard detaches), or guard a module that calls it")
    yield prefix, root, ()
    if compiled_original(root) is not None:
        return  # hooks inside compiled code would be traced into it
    seen = {id(root)}
    stack = [(qualified_name(prefix, key), child, (root,))
             for key, child in reversed(root._modules.items()) if child is not None]
    while stack:
        name, module, outer = stack.pop()
        if id(module) in seen or isinstance(module, torch.jit.ScriptModule):
            continue  # (a scripted one takes no hooks: its caller's checks see its output)
        seen.add(id(module))
        inside = outer
        if type(module).forward is not _UNIMPLEMENTED_FORWARD or compiled_original(module) is not None:
            yield name, module, outer
            if compiled_original(module) is not None:
                continue
            inside = outer + (module,)
        stack.extend((qualified_name(name, key), child, inside)
                     for key, child in reversed(module._modules.items()) if child is not None)


class ThreadState(threading.local):
    """One thread's place: how deep in top-level calls, the top call's frame, the call kept."""

    def __init__(self):
        self.depth = 0
        self.top_frame = 0  # id of the top-level call's `_call_impl` frame
        self.top_module = 0  # id of its module
        self.call = None
        self.passed_through: list = []  # ids of calls that are no top-level ones (`_pass_through`)


# The steps Lightning's strategies call through the DDP or FSDP wrapper, whose forward they patch
# to the step (`_ForwardRedirection`): an evaluation step's own calls of submodules are the
# top-level calls, as in one process (it returns no output to check: a loss it logs, say).
_STEPS_PASSED_THROUGH = ("validation_step", "test_step", "predict_step")


def pass_through(local: ThreadState, module, opening: bool) -> bool:
    """Whether this call of `module` is no top-level call (Lightning's redirected evaluation
    step), noted as it opens and forgotten as it closes."""
    if not opening:
        if local.passed_through and local.passed_through[-1] == id(module):
            local.passed_through.pop()
            return True
        return False
    forward = module.__dict__.get("forward") if not local.depth else None
    if forward is None or not getattr(forward, "__qualname__", "").startswith("_ForwardRedirection."):
        return False
    try:
        cells = dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__)))
    except Exception:  # another version's redirection
        return False
    if cells.get("method_name") not in _STEPS_PASSED_THROUGH:
        return False
    local.passed_through.append(id(module))
    return True


def closes_top_level(local: ThreadState, module) -> bool:
    """Whether `module`'s closing hook ends this thread's top-level call (then depth 0), not a
    call inside it. By the module and its call's frame, not by the count alone: a call inside
    whose opening hook did not run (another thread put the set-aside hooks back while it ran)
    throws the count off, and must neither end the top-level call (nor let a recursive call of
    the same model end it) nor let the next call inside pass for top-level."""
    depth = local.depth - 1
    if id(module) != local.top_module or own_call_frame_id() != local.top_frame:
        if depth <= 0 and still_running(local.top_frame):
            depth = 1
        local.depth = max(depth, 0)
        return False
    local.depth = 0
    return True


class GuardedParts:
    """The guarded models' parameters (each once) and modules, looked up again only after torch's
    global hooks tell of a parameter or submodule registered on one of those modules: a forward
    that builds a container each call (Hugging Face's Llama slices its ModuleList of layers, a
    dozen registrations a step) changes nothing of theirs."""

    __slots__ = ("_guard", "_parameters", "_module_ids")

    def __init__(self, guard):
        self._guard = guard  # (its models: the ones it is pointed at now)
        self._parameters = None
        self._module_ids = None

    def parameters(self) -> list:
        if self._parameters is None:  # (those models share, once)
            self._parameters = list({id(p): p for root in self._guard.models.values()
                                     for p in root.parameters()}.values())
        if self._module_ids is None:  # (looked up here, a backward's end: the models are whole)
            self._module_ids = {id(m) for root in self._guard.models.values() for m in root.modules()}
        return self._parameters

    def holds(self, module: nn.Module) -> bool:
        """Whether `module` is one of the models' (True while that is not known: a submodule
        being registered joins them only after the hook that tells of it)."""
        return self._module_ids is None or id(module) in self._module_ids

    def forget(self) -> None:
        self._parameters = self._module_ids = None


def modes_of(entry) -> tuple:
    """(an entry's modules, each one's train/eval mode now), to put back for its re-run."""
    if entry.submodules is None:
        entry.submodules = list(entry.module.modules())
    return entry.submodules, tuple(map(_TRAINING, entry.submodules))


def forget_submodules(entries: dict) -> None:
    """A module joined the models: each entry looks its submodules up again."""
    for entry in entries.values():
        entry.submodules = None


def registration_hooks(sentinel) -> list:
    """torch's global hooks telling `sentinel` of a parameter, submodule or buffer registered on
    a module (`new_parameters`, `new_buffer`): the parameters are looked up again only after one
    is set or a submodule replaced. They hold it weakly: a sentinel dropped while attached goes."""
    changed, buffers = (WeakHook(sentinel, "new_parameters", takes=3),
                        WeakHook(sentinel, "new_buffer", takes=3))  # (a module: both)
    return [module_hooks.register_module_parameter_registration_hook(changed),
            module_hooks.register_module_module_registration_hook(changed),
            module_hooks.register_module_module_registration_hook(buffers),
            module_hooks.register_module_buffer_registration_hook(buffers)]
