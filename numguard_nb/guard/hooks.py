"""Where the Guard's hooks go, and what it learns placing them; the checks its hooks make first.

Contract: `ModuleHooks.add(guard, models, watch_backward)` puts a forward pre-hook and one
always-called forward hook on every module and a `ParamHook` on every trainable parameter, and
learns each module's name in reports and the module whose forward calls it (`names`); `GradHooks`
holds the `GradHook`s on tensors of a graph and on leaf tensors fed to modules; `remove()` takes
them off. `inert_context()`: calls are being compiled, traced, exported or run under a dispatch
mode (the hooks do nothing). `running_calls()`, `still_running(own_call_frame_id())` and
`frame_local_of_call()` find calls an interrupt left open; `forward_raised()`: the call raised.

Limits: a TorchScript module is an opaque leaf (its weights are read as its caller's, their
gradients watched); a model compiled before attaching is hooked on its wrapper; a parameter
swapped in is hooked again at the next forward (`rehook_changed`) unless it brought hooks of its
own; one refusing hooks is warned of.

    hooks = ModuleHooks()
    hooks.add(guard, {"": model}, watch_backward=True)   # as Guard.attach does
    hooks.names[id(model.fc)]                            # ("fc", "Linear", id(model))
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import warnings
import weakref
from typing import Dict, List, Optional

import torch
from torch import nn

from .. import rerun, stats
from .._schema import BUFFER, FORWARD, PARAM
from .._util import LiveHandles, WeakHook, compiled_original, qualified_name
from . import copies
from .passes import CallRecord, Holding, PassRecord

__all__ = [
    "GradHook", "ParamHook", "ModuleHooks", "GradHooks", "inert_context", "running_calls",
    "frame_local_of_call", "own_call_frame_id", "still_running", "is_dynamo_compiling",
    "forward_raised",
]

# Constant True inside code Dynamo traces, so a hook's body drops out of compiled graphs; a plain
# function returning False when run, as cheap as a call can be (is_compiling() costs 3x more).
_is_compiling = getattr(torch.compiler, "is_compiling", None) or (lambda: False)
is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", None) or _is_compiling

_get_tracing_state = torch._C._get_tracing_state
_swap_on_conversion = getattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: False)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_FUNCTIONALIZE = torch._C.DispatchKey.Functionalize
_CALL_IMPL = nn.Module._call_impl.__code__
_UNIMPLEMENTED_FORWARD = nn.Module.forward  # containers (ModuleList, ModuleDict) are never called
_PLAIN_PARAMETERS = (nn.Parameter, torch.Tensor)


def inert_context() -> bool:
    """Whether module calls are being compiled or exported (`torch.compiler.is_compiling()`),
    traced by `torch.jit.trace`, functionalized, run under a dispatch mode that makes no real
    values (fake tensors, `make_fx`) or captured into a CUDA graph: the values are not real, or
    the guard's own ops would be recorded as the model's (in a CUDA graph, replayed later; and a
    read-back there would end the capture with an error). A mode that only looks on (a FLOP
    counter, a user's logging mode) runs real values: the guard's statistics are computed
    outside it (`stats.outside_tracing`)."""
    return (_is_compiling() or _get_tracing_state() is not None
            or (_dispatch_modes() > 0 and _unreal_modes())
            or torch._C._dispatch_tls_is_dispatch_key_included(_FUNCTIONALIZE)
            or stream_capturing())


# Where torch keeps the dispatch modes that make fake, proxy or functional values.
_UNREAL_MODE_MODULES = ("torch._subclasses", "torch.fx", "torch._functorch", "torch._dynamo",
                        "torch._export", "torch.export", "torch._inductor", "torch.distributed")


def _unreal_modes() -> bool:
    """Whether a dispatch mode on the stack is one of torch's that make no real values (or the
    stack cannot be read: assumed so)."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        modes = _get_current_dispatch_mode_stack()
    except Exception:
        return True
    if len(modes) < _dispatch_modes():
        return True
    return any(type(mode).__module__.startswith(_UNREAL_MODE_MODULES) for mode in modes)


def _cuda_stream_capturing() -> bool:
    # Nothing is captured before CUDA is initialised; asking first would fail on a CUDA build
    # without a usable GPU.
    return torch.cuda.is_initialized() and torch._C._cuda_isCurrentStreamCapturing()


def _never() -> bool:
    return False


# A build without CUDA has a stand-in that raises when called.
stream_capturing = _cuda_stream_capturing if torch.version.cuda or torch.version.hip else _never


def forward_raised() -> bool:
    """Whether the always-called forward hook asking runs on torch's error path: the module's
    forward, or a forward hook before this one (another guard's detection), raised, and
    `_call_impl` calls the hooks not yet called from its `except` block rather than from `inner`.
    Torch hands them the output it has (None, or the forward's output), which must not be checked
    as a call that returned: a detection raised there is only a warning torch prints ("...
    silenced as another error was raised in forward"), behind the error already raised."""
    caller = sys._getframe(2)  # 0: here, 1: the hook, 2: who called it
    return caller.f_code is _CALL_IMPL


# ---- calls an interrupt left open --------------------------------------------------------------
# An interrupt (Ctrl-C), or an error a forward catches from a submodule, skips the hooks that close
# calls. The guard and the sentinel find the calls that still run in one way: from the frames of
# torch's `_call_impl` up this thread's stack.
def _own_call_frame(frame, limit: Optional[int] = 8):
    """The `_call_impl` frame of the module call whose hook is running, looking up from `frame`
    past the guard's own frames (at most `limit`, None: the whole stack); None where none is."""
    while frame is not None and frame.f_code is not _CALL_IMPL:
        if limit is not None:
            if limit <= 0:
                return None
            limit -= 1
        frame = frame.f_back
    return frame


def own_call_frame_id() -> int:
    """Id of the frame of the module call whose hook asks (0 where there is none): held by a
    part of the guard that tracks calls by depth only, for `still_running`."""
    frame = _own_call_frame(sys._getframe(1))
    return id(frame) if frame is not None else 0


def still_running(frame_id: int) -> bool:
    """Whether the module call whose frame has id `frame_id` (from `own_call_frame_id`) is further
    up this thread's stack than the call whose hook asks."""
    own = _own_call_frame(sys._getframe(1))
    frame = own.f_back if own is not None else None
    for _ in range(256):
        if frame is None:
            return False
        if id(frame) == frame_id and frame.f_code is _CALL_IMPL:
            return True
        frame = frame.f_back
    return True  # deeper than looked: assume it runs


def frame_local_of_call():
    """An object living exactly as long as the frame of the module call whose hook asks (the
    `inner` closure torch's `_call_impl` makes per call), or None where there is none."""
    frame = _own_call_frame(sys._getframe(1))
    local = frame.f_locals.get("inner") if frame is not None else None
    return local if callable(local) else None


def running_calls() -> collections.Counter:
    """How many times each module (by id) is being called further up this thread's stack,
    leaving out the innermost call (the one whose hook asks)."""
    running: collections.Counter = collections.Counter()
    own = _own_call_frame(sys._getframe(1), limit=None)  # (a hook wrapped in frames of its own)
    frame = own.f_back if own is not None else None
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            running[id(frame.f_locals.get("self"))] += 1
        frame = frame.f_back
    return running


class GradHook:
    """The one hook a tensor gets: hands its gradient to the guard with the calls it belongs to.
    (One object, where a partial of a bound method is two for the garbage collector to track.)"""

    __slots__ = ("guard", "targets")

    def __init__(self, guard, targets: list):
        self.guard = guard
        self.targets = targets

    def __call__(self, grad):
        return self.guard._on_grad(self.targets, grad)


class LeafTargets(dict):
    """The calls a leaf's gradient belongs to: a target list (as `GradHook.targets`) per thread
    that fed the leaf to a module, so that threads running their own passes on one model (a
    parameter fed to a submodule) each give their gradient to their own calls. Emptied when the
    backward pass that delivered it ends, or when its thread starts its next batch."""

    __slots__ = ()

    def of_this_thread(self) -> list:
        me = threading.get_ident()
        targets = self.get(me)
        if targets is None:
            targets = self[me] = []
        return targets

    def delivering(self) -> list:
        """The lists a gradient arriving now belongs to: this thread's (on CPU a backward runs in
        the thread that called it), else (a device's autograd thread) every thread's."""
        own = self.get(threading.get_ident())
        if own:
            return [own]
        return [targets for targets in list(self.values()) if targets]  # a snapshot: threads add

    def forget(self) -> None:
        for targets in list(self.values()):
            targets.clear()


class LeafHook:
    """The one hook a leaf tensor gets while it lives (a leaf outlives its graphs)."""

    __slots__ = ("guard", "targets")

    def __init__(self, guard):
        self.guard = guard
        self.targets = LeafTargets()

    def __call__(self, grad):
        return self.guard._on_leaf_grad(self.targets, grad)


class ParamHook:
    """The gradient hook of one parameter, what its gradient is reported as, and the calls that
    took the parameter itself as an input (`input_targets`, as `LeafHook.targets`)."""

    __slots__ = ("guard", "param", "module_id", "module_name", "module_class", "role", "handle",
                 "cdata", "input_targets")

    def __init__(self, guard, param, module_id: int, module_name: str, module_class: str, role: str):
        self.guard = guard
        self.param = param
        self.module_id = module_id
        self.module_name = module_name
        self.module_class = module_class
        self.role = role  # "weight.grad"
        self.input_targets = LeafTargets()
        self.cdata = param._cdata  # changes when the parameter is swapped
        self.handle = param.register_hook(self)

    def __call__(self, grad):
        return self.guard._on_param_grad(self, grad)

    def grad_as_is(self, guard, grad, pass_: PassRecord) -> Optional[torch.Tensor]:
        """The parameter, where the gradient its hook is given now becomes its `.grad` as it is
        and stays so until the backward ends: it has no gradient yet, no hook but this one, no
        call took it as an input, no process group reduces it (DDP writes `.grad` in place), and
        the guard does not read each gradient at once (sync). `pass_`: the backward running."""
        param = self.param
        if grad.is_cpu and stats.CPU_READS_AT_ONCE:
            return None  # (read at once)
        if param.grad is None and not self.input_targets and not guard.synchronous \
                and len(param._backward_hooks) == 1 \
                and not getattr(param, "_post_accumulate_grad_hooks", None):
            writes = pass_.writes_grads
            if writes is None:  # (asked once a backward: `backward()` or `autograd.grad()`)
                writes = pass_.writes_grads = not _distributed_initialised() and _accumulating()
            return param if writes else None
        return None

    def forward_call(self, state, guard) -> CallRecord:
        """The call the gradient is reported under: its module's first call in the batch of the
        thread running the backward (`state`, a PassState; on a device's autograd thread, which
        ran no forward, the latest batch of any thread) or, where its weights were used without
        calling it (F.linear(x, sub.weight), a compiled or scripted model), a call of its own,
        which still gives the gradient a frame."""
        if state.first_calls:
            first_calls, batch_number = state.first_calls, state.batch_number
        else:
            first_calls, batch_number = guard._first_calls, guard.batch_number
        call = first_calls.get(self.module_id)
        if call is None:
            call = first_calls[self.module_id] = CallRecord(
                self.module_id, self.module_name, self.module_class, FORWARD, batch_number, 0, False)
        return call

    def rehook(self) -> Optional[str]:
        """Move the hook to the tensor swapped in. Returns why it could not, or None: it cannot
        go without bringing back hooks of the user's, which the swap left with the old tensor."""
        param = self.param
        if self.handle is not None:
            self.handle.remove()  # from the hook dict the parameter kept: it no longer fires
        self.handle = None
        self.cdata = param._cdata
        if not param.requires_grad:
            return None
        if param._backward_hooks:
            return "swapped, with hooks of its own"
        try:
            param._backward_hooks = None  # a fresh dict, wired to the tensor it has now
            self.handle = param.register_hook(self)
        except Exception as error:  # a tensor subclass refusing hooks
            return f"swapped, {type(error).__name__}"
        return None


def _is_uninitialised(param) -> bool:
    return isinstance(param, nn.parameter.UninitializedParameter)


class _WhenMaterialised:
    """A one-shot forward pre-hook on a lazy module, run after the one that makes its weights:
    hooks them and names the module by its new class (`LazyLinear` becomes `Linear`)."""

    def __init__(self, hooks: "ModuleHooks", guard, watch_backward: bool):
        self.hooks = hooks
        self.guard = guard
        self.watch_backward = watch_backward
        self.handle = None

    def __call__(self, module, args):
        if any(_is_uninitialised(p) for p in module._parameters.values()):
            return  # made later (a lazy module may wait for a later call)
        self.handle.remove()
        name, _, caller = self.hooks.names[id(module)]
        self.hooks.names[id(module)] = (name, type(module).__name__, caller)
        if self.watch_backward:
            self.hooks.hook_params(self.guard, module, id(module), name, type(module).__name__)


class _CompiledWeights:
    """A second forward pre-hook on a compiled model's wrapper, whose call is all the guard sees
    of the model: it gets the original model's weights and floating-point buffers, named as
    there, first among the call's rows; and the call is kept (`PassState.compiled_call`: its
    inputs and state, by reference) until the next, to re-run it eagerly on a detection.
    Without `keep_call`, on the caller of a TorchScript submodule: its weights, named from the
    caller (`prefix`), are the caller's rows."""

    def __init__(self, guard, original: nn.Module, prefix: str = "", keep_call: bool = True):
        self.guard = guard
        self.keep_call = keep_call
        self.weights = [(qualified_name(prefix, name), PARAM, p)
                        for name, p in original.named_parameters()] + [
            (qualified_name(prefix, name), BUFFER, b) for name, b in original.named_buffers()
            if b.is_floating_point()]

    def __call__(self, module, args, kwargs):
        guard = self.guard
        if is_dynamo_compiling() or guard.paused:
            return
        state = guard.threads.state
        if not state.stack or state.stack[-1].module_id != id(module):
            return  # not watched now (traced, exported)
        pass_, site = state.forward, id(module)
        state.stack[-1].slots[0:0] = [
            pass_.weight_slot(t, name, category, (site, name), guard._nonzero_min, guard._sign_hints)
            for name, category, t in self.weights]
        if len(state.stack) == 1 and self.keep_call:
            state.compiled_call = (module, args, kwargs, rerun.take())


def _accumulating() -> bool:
    """Whether the backward running a leaf's gradient hook writes the gradient into `.grad`
    (`backward()`), not `autograd.grad()`, which gives it back and leaves `.grad` as it was.
    (The node running is the leaf's AccumulateGrad either way; asked of a leaf's node under
    autograd.grad, torch raises.)"""
    try:
        return bool(torch._C._will_engine_execute_node(torch._C._current_autograd_node()))
    except Exception:
        return False


def _distributed_initialised() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _remove_handles(handles: list) -> None:
    while handles:
        handles.pop().remove()


class ModuleHooks:
    """The hooks the guard puts on modules and parameters, and what it learns placing them; all
    removed and forgotten on detach."""

    def __init__(self):
        self.handles: list = []
        # id(module) -> (its name in reports, its class name, the id of the module whose forward
        # calls it or None for a model's root): a call made from anywhere else makes the guard
        # look whether its open calls still run.
        self.names: Dict[int, tuple] = {}
        self.modules: Dict[int, nn.Module] = {}  # id(module) -> module
        self.hook_ids: Dict[int, List[int]] = {}  # id(module) -> ids of the hooks on it
        self.compiled: set = set()  # ids of the modules of models that run compiled
        self.param_hooks: Dict[int, ParamHook] = {}  # id(parameter) -> its hook
        self.unwatched: List[str] = []  # parameters whose gradient could not be hooked
        self.subclass_params = False  # some parameter is a tensor subclass (torch swaps those)
        # id(parameter) -> (it, weakly; its module's id, name, class; its name) of the parameters
        # frozen when hooked: hooked once they train (gradual unfreezing)
        self.frozen: Dict[int, tuple] = {}
        # ids of parameters replaced (or of modules let go) while hooked: their gradients' hooks
        # go at the next pass, unless a module still holds them
        self.replaced: set = set()
        # While hooked: (the guard, weakly; watch_backward), for a submodule assigned to a hooked
        # module (a new head, a swapped activation): hooked as it is registered (a global hook).
        self._following: Optional[tuple] = None
        self._global: list = []  # that hook's handle (removed with this object too, if dropped)
        weakref.finalize(self, _remove_handles, self._global)
        # id of a module called top-level -> the hooked modules its call runs (`weights_under`);
        # forgotten whenever modules are hooked or let go
        self._modules_under: Dict[int, list] = {}
        self.holding = Holding()  # what the backwards learnt of gradients taken from `.grad`

    def weights_under(self, module_id: int) -> list:
        """The parameters and floating buffers of the hooked modules a top-level call of
        `module_id` runs (itself and its submodules), as they are now: for its pass to
        summarise together (`PassRecord.summarise_weights`). (Never kept: a weak reference
        would stop `torch.utils.swap_tensors`, a strong one keep a replaced buffer alive.)"""
        modules = self._modules_under.get(module_id)
        if modules is None:
            module = self.modules.get(module_id)
            if module is None:
                return []
            # (those holding none now are left out: one given a weight later has it summarised
            # at its own call, as a weight the pass's start missed always is)
            modules = self._modules_under[module_id] = [
                m for m in module.modules() if id(m) in self.modules and (m._parameters or m._buffers)]
        if stats.CPU_READS_AT_ONCE:  # a CPU model's values are read at once: nothing to gather
            first = next((t for m in modules for t in m._parameters.values() if t is not None), None)
            if first is not None and first.is_cpu:
                return []
        return [t for m in modules for t in itertools.chain(m._parameters.values(), m._buffers.values())
                if t is not None and t.is_floating_point()]

    def add(self, guard, models: Dict[str, nn.Module], watch_backward: bool) -> None:
        """Hook every module of `models` (once each, under its name with the model's prefix), and
        the submodules assigned to them from now on."""
        self._modules_under.clear()
        for prefix, root in models.items():
            self._add_tree(guard, root, prefix, None, watch_backward)
        for module_id, module in self.modules.items():
            copies.install(module, self.hook_ids[module_id])
        if self.unwatched:
            self._warn_unwatched()
        if self._following is None:
            self._following = (weakref.ref(guard), watch_backward)
            self._global.append(nn.modules.module.register_module_module_registration_hook(
                WeakHook(self, "follow", takes=3)))
            self._global.append(nn.modules.module.register_module_parameter_registration_hook(
                WeakHook(self, "new_parameter", takes=3)))

    def follow(self, parent: nn.Module, child_name: str, child) -> None:
        """A submodule registered on a module (torch's global hook): hooked where it joins a
        hooked one, under its name, as `add` would have."""
        known = self.names.get(id(parent))
        if known is None or self._following is None or not isinstance(child, nn.Module) \
                or id(child) in self.names:
            return
        name, _, caller = known
        guard, watch_backward = self._following[0](), self._following[1]
        if guard is None:
            return
        self._modules_under.clear()
        replaced = parent._modules.get(child_name)
        if replaced is not None and replaced is not child and id(replaced) in self.names:
            self._let_go(_reachable(guard.models, parent, child_name, child))  # (a new head)
        before = set(self.modules)
        self._add_tree(guard, child, qualified_name(name, child_name),
                       id(parent) if type(parent).forward is not _UNIMPLEMENTED_FORWARD else caller,
                       watch_backward)
        for module_id in set(self.modules) - before:
            copies.install(self.modules[module_id], self.hook_ids[module_id])

    def _let_go(self, reachable: set) -> None:
        """Unhook the modules no longer in the models (a submodule replaced while attached); the
        gradients of their parameters are let go at the next pass, as a replaced parameter's
        (`rehook_changed`), unless a module still holds them: nothing kept alive for them."""
        gone = {module_id for module_id in self.modules if module_id not in reachable}
        if not gone:
            return
        self._modules_under.clear()
        ids = set()
        for module_id in gone:
            hook_ids = self.hook_ids.pop(module_id, [])
            copies.uninstall(self.modules.pop(module_id), hook_ids)
            self.names.pop(module_id, None)
            self.compiled.discard(module_id)
            ids.update(hook_ids)
        for handle in [h for h in self.handles if h.id in ids]:
            handle.remove()
            self.handles.remove(handle)
        self.replaced.update(key for key, hook in self.param_hooks.items()
                             if hook.module_id in gone)

    def new_parameter(self, module: nn.Module, pname: str, param) -> None:
        """A parameter set on a hooked module (`layer.weight = nn.Parameter(...)`,
        `load_state_dict(assign=True)`; torch's global hook, before it is stored): its gradient
        hooked as `add` would have; the one it replaces is let go at the next pass
        (`rehook_changed`), unless a module still holds it."""
        known = self.names.get(id(module))
        if known is None or self._following is None or not self._following[1]:
            return
        guard = self._following[0]()
        old = module._parameters.get(pname)
        if old is not None and old is not param:
            self.replaced.add(id(old))
        if guard is not None and isinstance(param, torch.Tensor):
            self._hook_param(guard, param, id(module), known[0], known[1], pname)

    def _add_tree(self, guard, module: nn.Module, name: str, caller: Optional[int],
                  watch_backward: bool) -> None:
        if id(module) in self.names:
            return
        if isinstance(module, torch.jit.ScriptModule):
            if caller is None:
                warnings.warn(f"numguard: {name or 'the model'} is a TorchScript module: its calls "
                              "cannot be watched, only its weights' gradients (guard the eager "
                              "model it was scripted from; script it after the guard detaches)",
                              stacklevel=4)
            else:  # its weights are read as its caller's: a nan one is named, not the caller
                self._hook_opaque_weights(guard, caller, module, name)
            if watch_backward:
                cls = getattr(module, "original_name", type(module).__name__)
                self.hook_params(guard, module, id(module), name, cls, recurse=True)
            return
        original = compiled_original(module)
        if original is not None:
            self._add_compiled(guard, module, original, name, caller, watch_backward)
            return
        self._hook_module(guard, module, name, type(module).__name__, caller, watch_backward)
        self.compiled.discard(id(module))  # also run uncompiled, elsewhere in the model
        if watch_backward:
            self.hook_params(guard, module, id(module), name, type(module).__name__)
        if type(module).forward is not _UNIMPLEMENTED_FORWARD:
            caller = id(module)
        for child_name, child in module._modules.items():
            if child is not None:
                self._add_tree(guard, child, qualified_name(name, child_name), caller, watch_backward)

    def _hook_opaque_weights(self, guard, caller: int, module: nn.Module, name: str) -> None:
        """A pre-hook on the module that calls `module`, whose calls the guard cannot see (a
        TorchScript one): `module`'s weights become rows of each call of the caller."""
        caller_module, caller_name = self.modules[caller], self.names[caller][0]
        prefix = name[len(caller_name) + 1:] if caller_name else name
        handle = caller_module.register_forward_pre_hook(
            _CompiledWeights(guard, module, prefix, keep_call=False), with_kwargs=True)
        self.handles.append(handle)
        self.hook_ids[caller].append(handle.id)

    def _add_compiled(self, guard, wrapper: nn.Module, original: nn.Module, name: str,
                      caller: Optional[int], watch_backward: bool) -> None:
        # Hooks added to the original model now would be ignored by its compiled code (and
        # adding them would not recompile it): the wrapper's call is what the guard can see.
        self._hook_module(guard, wrapper, name, type(original).__name__, caller, watch_backward)
        weights = wrapper.register_forward_pre_hook(_CompiledWeights(guard, original), with_kwargs=True)
        self.handles.append(weights)
        self.hook_ids[id(wrapper)].append(weights.id)
        self.compiled.add(id(wrapper))
        for sub_name, sub in original.named_modules():
            if id(sub) not in self.names:
                self.compiled.add(id(sub))
            if watch_backward:
                self.hook_params(guard, sub, id(sub), qualified_name(name, sub_name), type(sub).__name__)

    def _hook_module(self, guard, module: nn.Module, name: str, cls: str, caller: Optional[int],
                     watch_backward: bool) -> None:
        module_id = id(module)
        self.names[module_id] = (name, cls, caller)
        self.modules[module_id] = module
        handles = []
        if any(_is_uninitialised(p) for p in module._parameters.values()):
            materialised = _WhenMaterialised(self, guard, watch_backward)
            materialised.handle = module.register_forward_pre_hook(materialised)
            handles.append(materialised.handle)
        handles.append(module.register_forward_pre_hook(guard.pre_hook, with_kwargs=True))
        # One hook after every call: called with the keyword inputs after a forward that
        # returned, and with (module, inputs, None) after one that raised an Exception.
        handles.append(module.register_forward_hook(guard.post_hook, with_kwargs=True,
                                                    always_call=True))
        self.handles += handles
        self.hook_ids[module_id] = [h.id for h in handles]

    def hook_params(self, guard, module: nn.Module, module_id: int, name: str, cls: str,
                    recurse: bool = False) -> None:
        """Hook the gradient of each trainable parameter of `module` (of its submodules too with
        `recurse`) not hooked yet; lazy ones wait for their module's first call."""
        for pname, param in module.named_parameters(recurse=recurse):
            self._hook_param(guard, param, module_id, name, cls, pname)

    def _hook_param(self, guard, param, module_id: int, name: str, cls: str, pname: str) -> None:
        if id(param) in self.param_hooks or _is_uninitialised(param):
            return
        if not param.requires_grad:
            self.frozen[id(param)] = (weakref.ref(param), module_id, name, cls, pname)
            return
        self.frozen.pop(id(param), None)
        self.subclass_params = self.subclass_params or type(param) not in _PLAIN_PARAMETERS
        try:
            self.param_hooks[id(param)] = ParamHook(guard, param, module_id, name, cls,
                                                    pname + ".grad")
        except Exception as error:  # a tensor subclass refusing hooks: watch the rest
            self.unwatched.append(f"{qualified_name(name, pname)} ({type(error).__name__})")

    def rehook_changed(self, guard) -> None:
        """Hook the parameters frozen until now that train (`requires_grad_(True)`), and the
        tensors swapped into parameters since the last pass. Swaps are looked for only where
        torch swaps (`module.to()`, `load_state_dict`): with the swap flag on, or with
        tensor-subclass parameters."""
        if self.replaced:  # (one look for all of a load_state_dict(assign=True))
            held = {id(p) for m in self.modules.values() for p in m._parameters.values()}
            for key in self.replaced - held:
                hook = self.param_hooks.pop(key, None)
                if hook is not None and hook.handle is not None:
                    hook.handle.remove()
            self.replaced.clear()
        for key, (ref, module_id, name, cls, pname) in list(self.frozen.items()):
            param = ref()
            if param is None or param.requires_grad:
                del self.frozen[key]
                if param is not None:
                    self._hook_param(guard, param, module_id, name, cls, pname)
        if not (self.subclass_params or _swap_on_conversion()):
            return
        for hook in list(self.param_hooks.values()):  # a lazy module's first call may add some
            if hook.param._cdata != hook.cdata:
                failed = hook.rehook()
                if failed:
                    self.unwatched.append(f"{qualified_name(hook.module_name, hook.role[:-5])} ({failed})")
        if self.unwatched:
            self._warn_unwatched()

    def _warn_unwatched(self) -> None:
        warnings.warn(f"numguard: the gradients of {', '.join(self.unwatched)} are not watched",
                      stacklevel=2)
        self.unwatched.clear()

    def remove(self) -> None:
        self._modules_under.clear()
        self.holding = Holding()
        self._following = None
        _remove_handles(self._global)
        for handle in self.handles:
            handle.remove()
        for module_id, module in self.modules.items():
            copies.uninstall(module, self.hook_ids[module_id])
        for hook in self.param_hooks.values():
            if hook.handle is not None:
                hook.handle.remove()
        self.handles.clear()
        self.names.clear()  # cleared, never replaced: the guard reads it as `_names`
        self.modules.clear()
        self.hook_ids.clear()
        self.compiled.clear()
        self.param_hooks.clear()
        self.frozen.clear()
        self.replaced.clear()
        self.unwatched.clear()
        self.subclass_params = False


def _reachable(models: dict, parent: nn.Module, child_name: str, child) -> set:
    """The ids of the modules of `models` once `child` is set as `parent`'s `child_name`."""
    seen, stack = set(), list(models.values())
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, sub in module._modules.items():
            sub = child if module is parent and name == child_name else sub
            if isinstance(sub, nn.Module):
                stack.append(sub)
    return seen


class GradHooks:
    """The gradient hooks the guard puts on tensors, and their handles (removed on detach).

    A tensor seen in forward gets one hook per pass (and version), fanned out to every call that
    saw it; its handle is dead once the tensor's graph is freed. A leaf tensor fed to a module
    gets one hook while it lives (a hook per forward would pile up on it: a leaf outlives its
    graphs); a guarded parameter fed to a module reports through its own gradient hook. The calls
    a leaf's gradient belongs to (`LeafTargets`) are kept until the backward pass that delivers it
    ends, or the thread that added them starts its next batch (`PassState.note_leaf_targets`)."""

    def __init__(self, guard, param_hooks: Dict[int, ParamHook]):
        self.guard = guard
        self.param_hooks = param_hooks
        self.handles = LiveHandles()  # hooks on tensors of a graph
        self.leaf_targets: Dict[int, tuple] = {}  # id(leaf) -> (handle, LeafTargets)
        self._kept_leaves = 0  # live leaves after the last pruning

    def leaf_targets_of(self, leaf: torch.Tensor) -> LeafTargets:
        """The targets of the one hook delivering `leaf`'s gradient, hooking it the first time."""
        hook = self.param_hooks.get(id(leaf))
        if hook is not None and hook.param is leaf and hook.handle is not None:
            return hook.input_targets
        known = self.leaf_targets.get(id(leaf))
        if known is not None:
            hooks = known[0].hooks_dict_ref()
            if hooks is not None and hooks is leaf._backward_hooks:
                return known[1]
        hook = LeafHook(self.guard)
        self.leaf_targets[id(leaf)] = (leaf.register_hook(hook), hook.targets)
        if len(self.leaf_targets) > 2 * self._kept_leaves + 8:
            self._drop_dead_leaves()
        return hook.targets

    def forget_targets(self) -> None:
        """Forget every call the leaves' gradients belong to, in every thread (`Guard.reset`)."""
        for _, targets in list(self.leaf_targets.values()):
            targets.forget()
        for hook in list(self.param_hooks.values()):
            hook.input_targets.forget()

    def drop_dead(self, force: bool = False) -> None:
        """Forget the handles of hooks on freed graphs and tensors, which need no removal; unless
        `force`d, only once they have doubled since the last time (bounded, amortised)."""
        if force or len(self.handles) > 2 * self.handles.kept + self.handles.slack:
            self.handles.prune()

    def _drop_dead_leaves(self) -> None:
        for key, known in list(self.leaf_targets.items()):  # a snapshot: threads add theirs
            if known[0].hooks_dict_ref() is None:
                self.leaf_targets.pop(key, None)
        self._kept_leaves = len(self.leaf_targets)

    def remove(self) -> None:
        self.handles.remove_all()
        for handle, _ in self.leaf_targets.values():
            handle.remove()
        self.leaf_targets.clear()
        self._kept_leaves = 0
