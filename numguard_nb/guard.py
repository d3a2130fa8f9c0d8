"""The Guard: hooks on every module call, forward and backward, that find where inf/nan is produced.

How it stays fast and harmless:
- statistics are small vectors computed on the tensor's device (`stats.device_stats`) and read
  with one transfer at the end of each top-level forward and each backward (`sync=False`); on
  CPU, where there is nothing to wait for, they are numbers from the start;
- backward is watched with tensor hooks (on outputs, inputs and parameters), never with
  `register_full_backward_hook`, which wraps tensors in views and breaks in-place modules;
- hooks keep only names and indices, never tensors; per-pass caches hold weak references;
- every module hook and parameter hook is removed on detach, which `with` guarantees.
"""

from __future__ import annotations

import collections
import fnmatch
import itertools
import math
import sys
import weakref
from functools import partial
from typing import Dict, Iterable, List, Optional, Union

import torch
from torch import nn

from . import _tree
from . import stats as _stats
from .report import (
    BACKWARD, BUFFER, DETECTION, FORWARD, GRAD_INPUT, GRAD_OUTPUT, GRAD_PARAM, INPUT, LATEST, OUTPUT,
    PARAM, TRACE, Frame, Report, TensorRow,
)
from ._util import dtype_name
from .errors import BatchLimitReached, NonFiniteError

__all__ = ["Guard", "NonFiniteError", "BatchLimitReached"]


_LIMIT_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


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


class _GradHook:
    """The one hook a tensor gets: hands its gradient to the guard with the calls it belongs to.
    (One object, where a partial of a bound method is two for the garbage collector to track.)"""

    __slots__ = ("guard", "targets")

    def __init__(self, guard: "Guard", targets: list):
        self.guard = guard
        self.targets = targets

    def __call__(self, grad):
        return self.guard._on_grad(self.targets, grad)


def _store_grad(grads: list, position: int, grad) -> None:
    grads[position] = grad


class _no_grad:
    """torch.no_grad without its Python-level overhead (it runs in every hook)."""

    __slots__ = ("prev",)

    def __enter__(self):
        self.prev = torch.is_grad_enabled()
        if self.prev:
            torch._C._set_grad_enabled(False)

    def __exit__(self, *exc):
        if self.prev:
            torch._C._set_grad_enabled(True)


_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: 0)


def _graph_task_id() -> int:
    """Id of the autograd graph task running this hook (-1 outside backward)."""
    return _current_graph_task_id()


# What can be wrong with a value. Kinds are compared between what a call received and what it
# gave out: a -inf mask passing through is no news, a +inf appearing next to it is.
_INPUT_ROLES = tuple(f"input[{i}]" for i in range(16))

_FINE = frozenset()
_NAN = frozenset(("nan",))
_OVERFLOW = frozenset(("overflow",))  # finite, but beyond limit_dtype's largest value
_INF_KINDS = frozenset(("+inf", "-inf", "overflow"))


# A slot is a row before the pass is read back: what the value was, and where its stats sit.
# A plain tuple of strings, numbers and a dtype, which the garbage collector stops tracking at its
# first look (objects would stay tracked, and thousands per step make full collections frequent):
# (role, category, kind, dtype, shape, index of the stats in the pass or None, arrival order).
_ROLE, _CATEGORY, _KIND, _DTYPE, _SHAPE, _INDEX, _SEQ = range(7)


class _Call:
    """One module call in one phase, as recorded during the pass (names and indices only)."""

    __slots__ = (
        "module_id", "module_name", "module_class", "phase", "batch_number", "call_index",
        "slots", "seq", "is_root", "raised", "backward", "parent", "child_kinds", "root_id",
        "forward", "__weakref__",
    )

    def __init__(self, module_id, name, cls, phase, batch_number, call_index, is_root):
        self.module_id = module_id
        self.module_name = name
        self.module_class = cls
        self.phase = phase
        self.batch_number = batch_number
        self.call_index = call_index
        self.slots: list = []
        self.seq = 0
        self.is_root = is_root
        self.raised = False
        self.backward: Optional[tuple] = None  # (backward pass, backward call) of a forward call
        self.parent: Optional[_Call] = None  # the enclosing call, in forward
        self.child_kinds = _FINE  # what its direct children's outputs held: it received them
        self.root_id = module_id  # the top-level module whose call this is part of
        self.forward: Optional[_Call] = None  # for a backward call: its forward call


class _Pass:
    """State of one forward or backward pass: its calls and its pending device statistics."""

    __slots__ = ("calls", "vectors", "values", "cache", "seq", "received", "received_by_module")

    # cache entry: see Guard._summarise

    def __init__(self):
        self.calls: list = []
        self.vectors: list = []  # stats vectors still on the device
        self.values: list = []  # stats read back to the host, same indexing
        self.cache: dict = {}  # id(tensor) -> cache entry: one summary (and hook) per tensor
        self.seq = itertools.count()
        # backward: what each forward call's backward has received so far (its output gradients
        # and its direct children's input gradients), by id of the forward call and by module.
        self.received: Dict[int, set] = {}
        self.received_by_module: Dict[int, set] = {}

    def read_back(self) -> None:
        """Move every pending statistic to the host: the pass's one synchronisation."""
        if len(self.values) < len(self.vectors):
            self.values.extend(_stats.to_host(self.vectors[len(self.values):]))


def _normalise_models(model_or_models) -> Dict[str, nn.Module]:
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
    """

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
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
            raise ValueError(f"max_frames must be a positive integer, got {max_frames!r}")
        try:
            batches = list(trace_batches)
        except TypeError:
            batches = [None]
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in batches):
            raise ValueError(f"trace_batches must be batch numbers like [1, 3], got {trace_batches!r}")
        self.trace_batches = frozenset(batches)
        if any(b < 0 for b in self.trace_batches):
            raise ValueError(f"trace_batches are 0-indexed batch numbers, got {sorted(self.trace_batches)}")
        if abort_after_batch is not None and (
            isinstance(abort_after_batch, bool) or not isinstance(abort_after_batch, int)
            or abort_after_batch < 0
        ):
            raise ValueError(
                f"abort_after_batch must be None or a batch number >= 0, got {abort_after_batch!r}"
            )
        self.max_frames = max_frames
        self.abort_after_batch = abort_after_batch
        self.backward = bool(backward)
        self.sync = bool(sync)
        self.allow_inf = self._parse_allow_inf(allow_inf)
        self.limit_dtype = self._parse_limit_dtype(limit_dtype)
        self._limit_max = float(torch.finfo(self.limit_dtype).max) if self.limit_dtype else None
        # Smallest positive value the limit dtype holds (subnormal): below it, a value flushes to 0.
        self._limit_tiny = (
            float(torch.finfo(self.limit_dtype).smallest_normal) * float(torch.finfo(self.limit_dtype).eps)
            if self.limit_dtype else None
        )
        for name, callback in (("on_trace", on_trace), ("on_detect", on_detect)):
            if callback is not None and not callable(callback):
                raise TypeError(f"{name} must be a function taking a Report, got {callback!r}")
        self.on_trace = on_trace
        self.on_detect = on_detect
        self.ops = bool(ops)
        # Whether attach takes a capture (settable between attaches: the magics turn it off when
        # the weights' host copy stops fitting in memory).
        self.capture_enabled = bool(capture)
        self._capture = None  # replay.Capture, made on attach

        self.detection: Optional[Report] = None  # set when a non-finite value was found
        self.traces: Dict[int, Report] = {}
        self.batch_number = 0  # the batch being run (or last run)
        self._batches_started = 0
        self._handles: list = []
        self._paused = False  # True while the guard re-runs a step itself (op localisation)
        self._batches_counted_by_caller = False  # begin_batch() was called
        self._leaf_targets: Dict[int, list] = {}  # id(leaf tensor) -> [weakref, targets]
        self._modules: Dict[int, nn.Module] = {}
        self._ops_calls: Dict[int, tuple] = {}  # root id -> (root, args, kwargs, rng, counts)
        self._root_grads: Dict[int, list] = {}  # root id -> gradients of its outputs
        self._tensor_handles: list = []
        self._attached = False
        self._names: Dict[int, str] = {}
        self._roots: Dict[int, nn.Module] = {}
        self._primary_root_id: Optional[int] = None
        self._param_owner: Dict[int, tuple] = {}
        # One weak reference per parameter and buffer for the guard's lifetime: CPython hands it
        # out again for every weakref.ref(param) of a pass, where a first one costs microseconds.
        self._lasting_refs: list = []
        self._sign_hints: dict = {}  # (module id, role) -> one sign last time (stats.device_stats)
        # The last passes, kept as (pass, its last calls) and turned into frames only when a
        # report needs them as context: most passes are clean and never shown.
        self._recent: collections.deque = collections.deque()
        self._reset_pass_state()

    # ---- options --------------------------------------------------------------------------
    @staticmethod
    def _parse_allow_inf(allow_inf):
        if allow_inf is True or allow_inf is False:
            return allow_inf
        if isinstance(allow_inf, str):
            return (allow_inf,)
        try:
            globs = tuple(allow_inf)
        except TypeError:
            raise ValueError(
                f"allow_inf must be True/False or module-name globs like ['*.attn*'], got {allow_inf!r}"
            ) from None
        if not all(isinstance(g, str) for g in globs):
            raise ValueError(f"allow_inf globs must be strings, got {allow_inf!r}")
        return globs

    @staticmethod
    def _parse_limit_dtype(limit_dtype):
        if limit_dtype is None:
            return None
        if isinstance(limit_dtype, str):
            key = limit_dtype.replace("torch.", "").lower()
            if key not in _LIMIT_DTYPES:
                raise ValueError(
                    f"limit_dtype {limit_dtype!r} is not a float dtype: use float16, bfloat16, float32 or float64"
                )
            return _LIMIT_DTYPES[key]
        if isinstance(limit_dtype, torch.dtype) and limit_dtype.is_floating_point:
            return limit_dtype
        raise ValueError(
            f"limit_dtype must be a floating torch dtype such as torch.float16, got {limit_dtype!r}"
        )

    def _inf_allowed(self, module_name: str) -> bool:
        if self.allow_inf is True or self.allow_inf is False:
            return self.allow_inf
        return any(fnmatch.fnmatchcase(module_name, g) for g in self.allow_inf)

    # ---- attach / detach ------------------------------------------------------------------
    def attach(self) -> "Guard":
        """Register the hooks (idempotent). Prefer `with Guard(...)`, which always detaches."""
        if self._attached:
            return self
        self._reset_pass_state()
        try:
            for prefix, root in self.models.items():
                self._roots[id(root)] = root
                if self._primary_root_id is None:
                    self._primary_root_id = id(root)
                for name, module in root.named_modules():
                    if id(module) in self._names:
                        continue
                    full = name if not prefix else (f"{prefix}.{name}" if name else prefix)
                    self._names[id(module)] = full
                    self._modules[id(module)] = module
                    self._lasting_refs.extend(
                        weakref.ref(t) for t in itertools.chain(
                            module._parameters.values(), module._buffers.values())
                        if t is not None)
                    self._handles.append(
                        module.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
                    )
                    self._handles.append(
                        module.register_forward_hook(self._post_hook, with_kwargs=True)
                    )
                    # Runs only when forward raised: closes the call the normal hook never saw.
                    self._handles.append(
                        module.register_forward_hook(self._post_hook_on_error, always_call=True)
                    )
                    if self.backward:
                        for pname, param in module.named_parameters(recurse=False):
                            if param.requires_grad and id(param) not in self._param_owner:
                                self._param_owner[id(param)] = (module, pname)
                                self._handles.append(
                                    param.register_hook(partial(self._on_param_grad, module, pname))
                                )
            if self.capture_enabled:
                from .replay import Capture

                self._capture = None  # never an earlier attach's capture, should this one fail
                self._capture = Capture(self.models)
        except BaseException:
            self.detach()
            raise
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove every hook this guard registered (idempotent)."""
        for handle in itertools.chain(self._handles, self._tensor_handles):
            handle.remove()
        self._handles.clear()
        self._tensor_handles.clear()
        if self._capture is not None:
            self._capture.stop_watching_optimizers()  # the capture itself stays, for replay
        self._names.clear()
        self._leaf_targets.clear()
        self._modules.clear()
        self._ops_calls.clear()
        self._root_grads.clear()
        self._roots.clear()
        self._param_owner.clear()
        self._lasting_refs.clear()
        self._sign_hints.clear()
        self._primary_root_id = None
        self._attached = False
        self._reset_pass_state()
        _stats.release_workspace()

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
        self._stack: List[_Call] = []
        self._closed_normally: Optional[_Call] = None
        self._forward: Optional[_Pass] = None
        self._backward_passes: Dict[int, _Pass] = {}  # autograd graph task id -> its pass
        self._call_counts: Dict[int, int] = {}
        self._first_calls: Dict[int, _Call] = {}
        self._tracing = False

    @property
    def capture(self):
        """The latest captured call (replayable on CPU), or None without capture=True."""
        return self._capture.latest if self._capture is not None else None

    # ---- the latest report ----------------------------------------------------------------
    @property
    def report(self) -> Report:
        """The detection report if there was one, else a report of the last frames seen."""
        if self.detection is not None:
            return self.detection
        return self._make_report(self._recent_frames(), None, LATEST, "", "")

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
                if self._capture is not None:
                    self._capture.record(self._names[module_id], module, args, kwargs)
                if self.ops:
                    self._remember_call_for_ops(module, args, kwargs)
        index = self._call_counts.get(module_id, 0)
        self._call_counts[module_id] = index + 1
        # A call with nothing around it is top-level, whether or not it is a guarded root (a
        # LightningModule's training_step calls its submodules directly).
        call = _Call(
            module_id, self._names.get(module_id, "?"), type(module).__name__, FORWARD,
            self.batch_number, index, not stack,
        )
        if index == 0:
            self._first_calls[module_id] = call
        if stack:
            call.parent = stack[-1]
            call.root_id = stack[0].module_id
        pass_ = self._forward
        watch_grads = self.backward and torch.is_grad_enabled()
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
        pass_ = self._forward
        watch_grads = self.backward and torch.is_grad_enabled()
        self._add_nested(pass_, call, "output", OUTPUT, output, watch_grads)
        if self.ops and watch_grads and not self._stack:
            self._keep_root_grads(call.module_id, output)
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

    def _pop_call(self, module_id) -> Optional[_Call]:
        stack = self._stack
        while stack:
            call = stack.pop()
            if call.module_id == module_id:
                return call
        return None  # hooks attached mid-call, or state reset: nothing to close

    def _finish_call(self, call: _Call, raising: bool = False) -> None:
        pass_ = self._forward
        call.seq = next(pass_.seq)
        pass_.calls.append(call)
        if self.sync and not raising and not self._tracing:
            pass_.read_back()
            culprit = self._forward_culprit(pass_, [call])
            if culprit is not None:
                self._detect(pass_, FORWARD, *culprit)
        if not self._stack:
            self._end_forward(raising)

    def begin_batch(self) -> None:
        """Start the next batch now. For loops that never call the guarded model itself (a
        LightningModule's training_step calls its submodules): once called, only these calls
        count batches."""
        self._batches_counted_by_caller = True
        self._start_batch()

    def _start_batch(self) -> None:
        batch = self._batches_started
        if self.abort_after_batch is not None and batch > self.abort_after_batch:
            raise BatchLimitReached(
                f"numguard: stopped before batch {batch} because abort_after_batch="
                f"{self.abort_after_batch} (batches 0..{self.abort_after_batch} ran)"
            )
        self._batches_started += 1
        self.batch_number = batch
        self._call_counts.clear()
        self._first_calls.clear()
        self._tracing = batch in self.trace_batches

    def _begin_forward(self, module_id, recomputing: bool) -> None:
        if self._backward_passes and not recomputing:
            self._backward_passes.clear()  # backward passes that raised before their end
        if module_id == self._primary_root_id and not recomputing \
                and not self._batches_counted_by_caller:
            self._start_batch()
        self._forward = _Pass()
        if len(self._tensor_handles) > 4096:
            # Handles on freed graphs are dead; keep the list bounded over long runs.
            self._tensor_handles = [h for h in self._tensor_handles if h.hooks_dict_ref() is not None]

    def _end_forward(self, raising: bool) -> None:
        pass_ = self._forward
        self._forward = None
        pass_.read_back()
        if self._tracing:
            self._record_trace(pass_)
            return
        culprit = None
        if not raising and self._has_problem(pass_):
            culprit = self._forward_culprit(pass_, pass_.calls) or self._first_nan(pass_, pass_.calls)
        if culprit is not None:
            self._detect(pass_, FORWARD, *culprit)
        self._remember(pass_)

    # ---- values ---------------------------------------------------------------------------
    def _add_nested(self, pass_: _Pass, call: _Call, role, category, value, watch_grads) -> None:
        if isinstance(value, torch.Tensor):  # the common case, without walking
            self._add(pass_, call, role, category, value, watch_grads)
            return
        for leaf_role, leaf in _tree.named_leaves(value, role):
            self._add(pass_, call, leaf_role, category, leaf, watch_grads)

    def _add(self, pass_: _Pass, call: _Call, role, category, value, watch_grads) -> None:
        """Summarise one value of a call; for gradients-to-be, hook the tensor."""
        if not isinstance(value, torch.Tensor):
            kind = "none" if value is None else "not a tensor"
            call.slots.append((role, category, kind, None, None, None, 0))
            return
        entry = self._summarise(pass_, value, (call.module_id, role))
        call.slots.append((role, category, entry[5], value.dtype, entry[4], entry[2], 0))
        if watch_grads and value.requires_grad and category != PARAM:
            # Targets lie flat, (call, role, category) after one another: no tuple per target.
            if value.is_leaf:
                targets = self._leaf_hook(value)
            elif entry[3] is None:
                # One hook per tensor (and version), fanned out to every call that saw it.
                targets = entry[3] = []
                self._tensor_handles.append(value.register_hook(_GradHook(self, targets)))
            else:
                targets = entry[3]
            targets += (call, "grad_" + role, GRAD_OUTPUT if category == OUTPUT else GRAD_INPUT)

    def _leaf_hook(self, leaf: torch.Tensor) -> list:
        """The targets of the one hook a leaf tensor (a parameter used as an input, say) gets for
        the guard's lifetime: a hook per forward would pile up on it, since leaves never die."""
        known = self._leaf_targets.get(id(leaf))
        if known is not None and known[0]() is leaf:
            return known[1]
        targets: list = []
        self._leaf_targets[id(leaf)] = [weakref.ref(leaf), targets]
        self._handles.append(leaf.register_hook(_GradHook(self, targets)))
        return targets

    def _summarise(self, pass_: _Pass, t: torch.Tensor, site) -> list:
        """The cache entry of `t` in this pass, computing its statistics the first time: [weak
        reference, version, stats index or None, gradient targets or None, shape, kind]. `site`
        (module id, role) says where it was seen, for `stats.device_stats`' sign hints."""
        inference = t.is_inference()  # inference tensors have no version counter to cache on
        if not inference:
            key = id(t)
            entry = pass_.cache.get(key)
            version = t._version
            if entry is not None and entry[0]() is t and entry[1] == version:
                return entry
        vec = None
        numel = t.numel()
        if numel:
            with _no_grad():
                vec = _stats.device_stats(t, self.limit_dtype is not None, self._sign_hints, site)
        index = None
        if vec is not None:
            index = len(pass_.vectors)
            pass_.vectors.append(vec)
        kind = "tensor" if index is not None else ("empty" if numel == 0 else "unsupported")
        if inference:
            return [None, None, index, None, _stats.shape_of(t), kind]
        entry = pass_.cache[key] = [weakref.ref(t), version, index, None, _stats.shape_of(t), kind]
        return entry

    # ---- backward -------------------------------------------------------------------------
    def _backward_state(self) -> _Pass:
        task = _graph_task_id()
        pass_ = self._backward_passes.get(task)
        if pass_ is None:
            pass_ = self._backward_passes[task] = _Pass()
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
            forward_call = self._first_calls[id(module)] = _Call(
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
        _, _, index, _, shape, kind = self._summarise(pass_, grad, site)
        # Targets were registered in forward order; backward reaches them in reverse (a tensor
        # that is A's output and B's input is B's input gradient before it is A's output's).
        for position in range(len(targets) - 3, -1, -3):
            forward_call, role, category = targets[position:position + 3]
            call = self._backward_call(pass_, forward_call)
            slot = (role, category, kind, grad.dtype, shape, index, next(pass_.seq))
            call.slots.append(slot)
            if self.sync and not self._tracing:
                pass_.read_back()
                culprit = self._backward_culprit(pass_, [slot], {id(slot): call})
                if culprit is not None:
                    self._detect(pass_, BACKWARD, *culprit)

    @staticmethod
    def _backward_call(pass_: _Pass, forward_call: _Call) -> _Call:
        """The backward counterpart of a forward call in this backward pass (made on first use:
        a graph can be backpropagated more than once)."""
        known = forward_call.backward
        if known is not None and known[0] is pass_:
            return known[1]
        call = _Call(
            forward_call.module_id, forward_call.module_name, forward_call.module_class,
            BACKWARD, forward_call.batch_number, forward_call.call_index, forward_call.is_root,
        )
        call.root_id = forward_call.root_id
        call.forward = forward_call
        forward_call.backward = (pass_, call)
        call.seq = next(pass_.seq)
        pass_.calls.append(call)
        return call

    def _end_backward(self, task) -> None:
        pass_ = self._backward_passes.pop(task, None)
        if pass_ is None or not self._attached:
            return
        try:
            self._finish_backward(pass_)
        finally:
            self._root_grads.clear()  # held for a backward re-run only until this pass ends
            for _, targets in self._leaf_targets.values():
                targets.clear()  # the calls that used the leaves are done with

    def _finish_backward(self, pass_: _Pass) -> None:
        # The graph this pass ran on has been consumed: its tensor hooks need no removal.
        self._tensor_handles = [h for h in self._tensor_handles if h.hooks_dict_ref() is not None]
        pass_.read_back()
        if self._tracing:
            self._record_trace(pass_)
            return
        if not self._has_problem(pass_):
            self._remember(pass_)
            return
        slots = sorted(
            (slot for call in pass_.calls for slot in call.slots), key=lambda s: s[_SEQ]
        )
        owner = {id(slot): call for call in pass_.calls for slot in call.slots}
        culprit = self._backward_culprit(pass_, slots, owner) or self._first_nan(
            pass_, sorted(pass_.calls, key=lambda c: min((s[_SEQ] for s in c.slots), default=c.seq)))
        if culprit is not None:
            self._detect(pass_, BACKWARD, *culprit)
        self._remember(pass_)

    # ---- detection ------------------------------------------------------------------------
    def _has_problem(self, pass_: _Pass) -> bool:
        """Quick scan of a pass: any nan/inf (or, with limit_dtype, any value beyond it)?"""
        limit = self._limit_max if self._limit_max is not None else sys.float_info.max
        for values in pass_.values:
            # `not x <= limit` is true for nan, inf and overflow alike.
            if not values[1] <= limit or values[0] != values[0]:
                return True
        return False

    def _kinds(self, pass_: _Pass, slot: tuple) -> frozenset:
        """What is wrong with one value: a subset of {'nan', '+inf', '-inf', 'overflow'}."""
        if slot[_INDEX] is None:
            return _FINE
        values = pass_.values[slot[_INDEX]]
        abs_min, abs_max = values[0], values[1]
        if math.isnan(abs_max) or math.isnan(abs_min):
            return _NAN
        if abs_max == math.inf:
            _, _, _, posinf, neginf, _ = _stats.decode(values)
            return frozenset(k for k, present in (("+inf", posinf), ("-inf", neginf)) if present)
        if self._limit_max is not None and abs_max > self._limit_max and slot[_DTYPE] is not None \
                and slot[_DTYPE].is_floating_point:
            return _OVERFLOW
        return _FINE

    def _forward_culprit(self, pass_: _Pass, calls):
        """(call, bad slots, cause) of the first call that produced a non-finite value."""
        for call in calls:
            received = set(call.child_kinds)
            from_parent = set()  # what came in through the call's inputs
            bad_params, bad_inputs, produced = [], [], []
            for slot in call.slots:
                kinds = self._kinds(pass_, slot)
                if not kinds:
                    continue
                if slot[_CATEGORY] == PARAM or (slot[_CATEGORY] == BUFFER and "nan" in kinds):
                    bad_params.append(slot)
                    received |= kinds
                elif slot[_CATEGORY] == BUFFER:  # a stored -inf mask is something it received
                    received |= kinds
                elif slot[_CATEGORY] == INPUT:
                    received |= kinds
                    from_parent |= kinds
                    if call.is_root and "nan" in kinds:
                        bad_inputs.append(slot)
            if bad_params:
                return call, bad_params, "weights"
            if bad_inputs:
                return call, bad_inputs, "data"
            allowed = self._inf_allowed(call.module_name)
            given = set()
            for slot in call.slots:
                if slot[_CATEGORY] != OUTPUT:
                    continue
                kinds = self._kinds(pass_, slot)
                given |= kinds
                new = kinds - received
                if allowed:
                    new = new - _INF_KINDS
                if new:
                    produced.append(slot)
            if produced:
                return call, produced, "forward"
            if call.parent is not None:
                # What the child gave out beyond what the parent handed it (an allowed inf, a
                # stored mask) is news the parent received; what it only passed on came from the
                # parent, who may have made it.
                call.parent.child_kinds |= given - from_parent
        return None

    def _backward_culprit(self, pass_: _Pass, slots, owner):
        """The first gradient (in arrival order) made non-finite by a call: a call's input or
        parameter gradient holding what its output gradients (and its children's input gradients)
        did not, or an output gradient its parent's own code made between its submodules.
        Slots must come in arrival order, across calls of this method too (sync mode)."""
        received, by_module = pass_.received, pass_.received_by_module
        for slot in slots:
            kinds = self._kinds(pass_, slot)
            call = owner[id(slot)]
            forward = call.forward
            parent = forward.parent if forward is not None else None
            if slot[_CATEGORY] == GRAD_OUTPUT:
                if kinds:
                    if parent is None:
                        return call, [slot], "loss-gradient"
                    if kinds - received.get(id(parent), _FINE):
                        return self._backward_call(pass_, parent), [slot], "backward-inline"
                self._note_received(pass_, forward, kinds)
                continue
            if kinds:
                if slot[_CATEGORY] == GRAD_PARAM:  # summed over every call of the module
                    got = by_module.get(call.module_id, _FINE)
                else:
                    got = received.get(id(forward), _FINE)
                new = kinds - got
                if self._inf_allowed(call.module_name):
                    new = new - _INF_KINDS
                if new:
                    return call, [slot], "backward"
            if slot[_CATEGORY] == GRAD_INPUT and parent is not None:
                self._note_received(pass_, parent, kinds)
        return None

    def _first_nan(self, pass_: _Pass, calls):
        """A nan the producer rules could not attribute (never let one pass in silence): the
        first call holding one."""
        for call in calls:
            bad = [slot for slot in call.slots if "nan" in self._kinds(pass_, slot)]
            if bad:
                return call, bad, "unattributed"
        return None

    @staticmethod
    def _note_received(pass_: _Pass, forward_call: Optional[_Call], kinds) -> None:
        if forward_call is None or not kinds:
            return
        pass_.received.setdefault(id(forward_call), set()).update(kinds)
        pass_.received_by_module.setdefault(forward_call.module_id, set()).update(kinds)

    def _detect(self, pass_: _Pass, phase, call: _Call, bad_slots, cause) -> None:
        """Build the report for a detection and raise it."""
        flagged = {id(s) for s in bad_slots}
        culprit_frame = self._frame(pass_, call, flagged)
        if self.ops and cause in ("forward", "backward", "backward-inline"):
            self._localise(culprit_frame, call, "forward" if cause == "forward" else "backward")
        if phase == FORWARD:
            led_up = [c for c in pass_.calls if c.seq < call.seq]
        else:
            limit = min(s[_SEQ] for s in bad_slots)
            led_up = [c for c in pass_.calls if c is not call and c.seq <= limit]
        led_up_frames = [self._frame(pass_, c, flagged) for c in led_up[-self.max_frames:]]
        frames = (self._recent_frames() + led_up_frames + [culprit_frame])[-self.max_frames:]
        # A gradient made in a module's own code shows in the submodule that received it.
        evidence = next((f for f in led_up_frames if f.flagged_rows), None)
        reason = self._reason(cause, culprit_frame, evidence)
        self.detection = self._make_report(frames, culprit_frame, DETECTION, reason, cause)
        self._reset_pass_state()
        error = self.on_detect(self.detection) if self.on_detect is not None else None
        raise error if isinstance(error, BaseException) else NonFiniteError(self.detection)

    # ---- op localisation (ops=True) ----------------------------------------------------------
    def _remember_call_for_ops(self, root, args, kwargs) -> None:
        from .callstate import take as rng_state

        # Counts so far in this batch: the culprit's call index within this top-level call is
        # its batch-wide index minus these.
        self._ops_calls[id(root)] = (root, args, kwargs, rng_state(), dict(self._call_counts))
        self._root_grads.pop(id(root), None)

    def _keep_root_grads(self, root_id, output) -> None:
        """Hold the gradients arriving at a root's outputs: a backward re-run starts from them."""
        tensors = _tree.tensors(output)
        grads: list = [None] * len(tensors)
        self._root_grads[root_id] = grads
        for position, tensor in enumerate(tensors):
            if tensor.requires_grad:
                self._tensor_handles.append(
                    tensor.register_hook(partial(_store_grad, grads, position))
                )

    def _localise(self, frame: Frame, call: _Call, cause: str) -> None:
        from . import ops

        recorded = self._ops_calls.get(call.root_id)
        culprit = self._modules.get(call.module_id)
        if recorded is None or culprit is None:
            frame.op_note = "op localisation needs the top-level call, which was not recorded"
            return
        root, args, kwargs, rng, counts_before = recorded
        index = call.call_index - counts_before.get(call.module_id, 0)
        options = dict(limit=self._limit_max, allow_inf=self._inf_allowed(call.module_name))
        self._paused = True
        try:
            if cause == "forward":
                where = ops.localise_forward(root, args, kwargs, rng, culprit, index, **options)
            else:
                grads = self._root_grads.get(call.root_id)
                if grads is None:
                    frame.op_note = "op localisation needs the gradients of the model's outputs"
                    return
                where = ops.localise_backward(root, args, kwargs, rng, grads, culprit, index, **options)
        finally:
            self._paused = False
        frame.op_note = where.note
        if where.reproduced:
            frame.op = f"{where.node}: {where.op}" if where.node else where.op
            frame.source = where.source

    def _reason(self, cause: str, frame: Frame, evidence: Optional[Frame] = None) -> str:
        rows = frame.flagged_rows
        what = "; ".join(f"{row.role} holds {row.problems}" for row in rows)
        where = f"{frame.label} ({frame.module_class})"
        call = f"call {frame.call_index} of batch {frame.batch_number}"
        predicted = any(row.predicted_overflow for row in rows)
        limit = (
            f" (beyond {dtype_name(self.limit_dtype)}'s largest value {self._limit_max:.5g}: "
            "predicted overflow)" if predicted else ""
        )
        if cause == "weights" and predicted:
            return (f"the weights of {where} in batch {frame.batch_number} exceed "
                    f"{dtype_name(self.limit_dtype)}'s largest value {self._limit_max:.5g} ({what})")
        if cause == "weights" and all(row.category == BUFFER for row in rows):
            return (f"the buffers of {where} are non-finite in batch {frame.batch_number} ({what}): "
                    "running statistics went bad in an earlier batch")
        if cause == "weights":
            return (f"the weights of {where} are non-finite in batch {frame.batch_number} ({what}): "
                    "an earlier optimizer step wrote them")
        if cause == "data":
            return f"the data fed to {where} in batch {frame.batch_number} holds nan ({what})"
        if cause == "loss-gradient":
            return (f"the gradient entering {where} in backward of batch {frame.batch_number} is "
                    f"already non-finite ({what}): the loss or code outside the guarded modules "
                    "produced it")
        if cause == "unattributed":
            return (f"{where} holds nan in {frame.phase} ({call}): {what}; numguard could not tell "
                    "which module produced it (its frames below show where it first appears)")
        if cause == "backward-inline" and evidence is not None:
            what = "; ".join(f"{row.role} of {evidence.label} holds {row.problems}"
                             for row in evidence.flagged_rows)
            return (f"{where} produced a non-finite gradient in backward ({call}), in its own code "
                    f"between its submodules: {what}, while the gradients {frame.label} received "
                    f"were finite{limit}")
        if cause in ("backward", "backward-inline"):
            return (f"{where} produced a non-finite gradient in backward ({call}): {what}, "
                    f"while the gradient it received was finite{limit}")
        return (f"{where} produced a non-finite value in forward ({call}): {what}, "
                f"which its inputs and weights did not hold{limit}")

    # ---- frames and reports ---------------------------------------------------------------
    def _frame(self, pass_: _Pass, call: _Call, flagged=frozenset()) -> Frame:
        rows = []
        for slot in call.slots:
            row = TensorRow(
                role=slot[_ROLE], category=slot[_CATEGORY], kind=slot[_KIND],
                dtype=dtype_name(slot[_DTYPE]) if slot[_DTYPE] is not None else None,
                shape=slot[_SHAPE],
                flagged=id(slot) in flagged,
            )
            if slot[_INDEX] is not None:
                (row.abs_min, row.abs_max, row.nan, row.posinf, row.neginf,
                 row.nonzero_abs_min) = _stats.decode(pass_.values[slot[_INDEX]])
                self._mark_limits(row, slot)
            rows.append(row)
        return Frame(
            module_name=call.module_name, module_class=call.module_class, phase=call.phase,
            batch_number=call.batch_number, call_index=call.call_index, rows=rows,
            raised=call.raised,
        )

    def _mark_limits(self, row: TensorRow, slot: tuple) -> None:
        if self._limit_max is None or not slot[_DTYPE].is_floating_point:
            return
        if row.abs_max is not None and not row.nonfinite and row.abs_max > self._limit_max:
            row.predicted_overflow = True
        if row.nonzero_abs_min is not None and row.nonzero_abs_min < self._limit_tiny:
            row.predicted_underflow = True
        if row.abs_max is not None and not row.nan:
            row.limit_share = row.abs_max / self._limit_max

    def _make_report(self, frames, culprit, kind, reason, cause) -> Report:
        rank = world = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return Report(
            frames=frames, first_nonfinite=culprit, batch_number=self.batch_number, kind=kind,
            reason=reason, cause=cause, rank=rank, world_size=world,
            limit_dtype=dtype_name(self.limit_dtype) if self.limit_dtype else None,
        )

    def _remember(self, pass_: _Pass) -> None:
        """Keep the pass's last calls as context for a detection in a later pass."""
        pass_.vectors = []  # read back already: free the device memory
        pass_.cache = {}
        calls = sorted(pass_.calls, key=lambda c: c.seq)[-self.max_frames:]
        self._recent.append((pass_, calls))
        # Keep just enough passes to fill max_frames frames of context.
        while len(self._recent) > 1 and sum(len(c) for _, c in list(self._recent)[1:]) >= self.max_frames:
            self._recent.popleft()

    def _recent_frames(self) -> list:
        frames = [self._frame(p, c) for p, calls in self._recent for c in calls]
        return frames[-self.max_frames:]

    def _record_trace(self, pass_: _Pass) -> None:
        # A trace notes where a non-finite value would have been caught, without stopping.
        backward = any(c.phase == BACKWARD for c in pass_.calls)
        if backward:
            slots = sorted((s for c in pass_.calls for s in c.slots), key=lambda s: s[_SEQ])
            culprit = self._backward_culprit(
                pass_, slots, {id(s): c for c in pass_.calls for s in c.slots})
        else:
            culprit = self._forward_culprit(pass_, pass_.calls)
        flagged = {id(s) for s in culprit[1]} if culprit is not None else set()
        calls = sorted(pass_.calls, key=lambda c: c.seq)  # after the search: it may add a call
        frames = [self._frame(pass_, c, flagged) for c in calls]
        report = self.traces.get(self.batch_number)
        if report is None:
            report = self.traces[self.batch_number] = self._make_report([], None, TRACE, "", "")
        report.frames.extend(frames)
        if culprit is not None and report.first_nonfinite is None:
            call, _, cause = culprit
            frame = frames[calls.index(call)]
            evidence = next((f for f in frames if f.flagged_rows and f is not frame), None)
            report.first_nonfinite = frame
            report.cause = cause
            report.reason = self._reason(cause, frame, evidence)
        if self.on_trace is not None:
            self.on_trace(report)

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        names = ", ".join(type(m).__name__ for m in self.models.values())
        return f"<numguard Guard on {names}: {state}, batch {self.batch_number}>"
