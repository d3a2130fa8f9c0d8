"""Replay a captured call on CPU, where a CUDA error is raised at the line that caused it.

GPU work is asynchronous: a kernel that fails (a label past the number of classes in
`cross_entropy`, an embedding index past the vocabulary) is reported later, at `loss.backward()`
or the next synchronisation, as "CUDA error: device-side assert triggered", with a traceback that
points at the wrong line, and the CUDA context is unusable afterwards: nothing can be copied off
the GPU any more. The cure is to run the same batch on CPU, where the error is raised at once, at
the real line. So the data needed for that has to be on the host *before* the error:

- `Capture(models)` (what `Guard(..., capture=True)` builds on attach) takes a host snapshot of
  every guarded model's parameters, buffers and tensor attributes, tensor by tensor (so GPU memory
  is never doubled). A model already on CPU is copied too, since the run goes on to change its
  weights: that costs one more copy of the weights in host memory.
- `Capture.record` (called by the guard at the start of every top-level call of a guarded module)
  keeps the last two calls of each guarded module: host copies of their inputs (copied
  asynchronously into pinned memory for CUDA tensors: no synchronisation per step; CPU tensors
  are cloned), the CPU and CUDA RNG states, the grad and training modes, and the line that made
  the call.
- `CapturedCall.replay()` rebuilds the model on CPU from the snapshot (a deep copy of the live
  module in which every parameter and buffer is replaced by its host copy: the live model and
  its GPU memory are never touched, and the guard's hooks are left out), restores the RNG state
  and runs the call again. A loss module guarded alongside the model (`Guard({'model': m,
  'loss_fn': nn.CrossEntropyLoss()})`) is replayed after the model call that fed it, with the
  replayed model output in place of its inputs where they match it. The `ReplayResult` names the
  exception and the innermost line of the user's or the model's code (or, when the error is
  raised inside torch's own modules, the line that called the module).
- `CapturedCall.save(path)` writes a replay bundle that `load_capture(path, model)` replays in a
  fresh kernel; bundles are read with `torch.load(weights_only=True)` and never execute code.
- `replay_after_error(guard, exc)` does all of it for the notebook magic after a device error.

The snapshot holds the weights as they were when the guard was attached. If an optimizer step
changed them before the captured call, the replay says so (`CapturedCall.weights_changed`);
errors that come from the data (the usual device-side asserts) do not depend on the weights.
`Capture.snapshot()` takes a fresh snapshot when needed.
"""

from __future__ import annotations

import collections
import copy
import datetime
import html
import itertools
import linecache
import os
import pickle
import re
import sys
import tempfile
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from . import _util
from ._util import dtype_name, error_line, first_line, format_bytes, is_internal_file
from .errors import CaptureTooLarge, ReplayError

__all__ = [
    "Capture",
    "CaptureTooLarge",
    "CapturedCall",
    "Location",
    "ReplayError",
    "ReplayOutcome",
    "ReplayResult",
    "is_device_error",
    "load_capture",
    "replay_after_error",
    "snapshot_fits",
]

BUNDLE_FORMAT = "numguard_nb.replay"
BUNDLE_VERSION = 1

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MAX_DEPTH = 8  # nesting of containers walked in inputs and outputs

_DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "device-side assert",
    "cudaErrorAssert",
    "CUBLAS_STATUS",
    "an illegal memory access",
)
# Messages of CPU kernels that do not exist for half precision (the upcast is retried on these).
_MISSING_LOW_PRECISION = re.compile(
    r"not implemented for '(Half|BFloat16|ComplexHalf)'"
    r"|Low precision dtypes not supported"
    r"|Unsupported dtype (Half|BFloat16)"
    r"|doesn't support tensors of type: (Half|BFloat16)"
)
# Module attributes holding hooks: copied shallowly into the replay model, numguard's removed.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
    "_backward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def is_device_error(exc: BaseException) -> bool:
    """True for an error reported by the GPU itself (after which the CUDA context is unusable).

    `torch.AcceleratorError` (torch >= 2.8), or a RuntimeError whose message names a CUDA error:
    "CUDA error", "device-side assert", "cudaErrorAssert", "CUBLAS_STATUS", "an illegal memory
    access". An out-of-memory error is not one: the context survives it.
    """
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(marker in message for marker in _DEVICE_ERROR_MARKERS)
    return False


# ---- small helpers ------------------------------------------------------------------------
def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _path_str(path: tuple) -> str:
    """('args', 0) -> 'input[0]', ('kwargs', 'labels') -> 'input[labels]', ('output', 'logits')
    -> 'output[logits]': the guard's naming."""
    if not path:
        return "input"
    head, rest = path[0], path[1:]
    if head in ("args", "kwargs"):
        text, rest = f"input[{rest[0]}]", rest[1:]
    else:
        text = str(head)
    return text + "".join(f"[{key}]" for key in rest)


def _input_path_str(path: tuple) -> str:
    """A path into (args, kwargs) -> 'input[0]', 'input[labels]'."""
    return _path_str((("args", "kwargs")[path[0]],) + tuple(path[1:]))


def _describe(value) -> str:
    """A short description of a value (tensors by dtype and shape)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({dtype_name(value.dtype)}, shape {tuple(value.shape)})"
    if isinstance(value, dict):
        return f"{type(value).__name__}({', '.join(str(k) for k in value)})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def _leaves(value, path: tuple, depth: int = 0):
    """(path, tensor) for every tensor nested in tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif depth >= _MAX_DEPTH:
        return
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _leaves(item, path + (index,), depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, path + (key,), depth + 1)


def _map(value, path: tuple, on_tensor, on_other, depth: int = 0):
    """Rebuild `value` with `on_tensor(t, path)` for tensors and `on_other(v, path)` for leaves that
    are neither tensors nor containers; containers keep their type where it can be rebuilt."""
    if isinstance(value, torch.Tensor):
        return on_tensor(value, path)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if depth >= _MAX_DEPTH:
        return on_other(value, path)
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, tuple):
        items = [_map(v, path + (i,), on_tensor, on_other, depth + 1) for i, v in enumerate(value)]
        if type(value) is tuple:
            return tuple(items)
        if hasattr(type(value), "_fields"):  # namedtuple
            return type(value)(*items)
        try:
            return type(value)(items)
        except Exception:
            return tuple(items)
    if isinstance(value, list):
        items = [_map(v, path + (i,), on_tensor, on_other, depth + 1) for i, v in enumerate(value)]
        if type(value) is list:
            return items
        try:
            return type(value)(items)
        except Exception:
            return items
    if isinstance(value, dict):
        items = {k: _map(v, path + (k,), on_tensor, on_other, depth + 1) for k, v in value.items()}
        if type(value) in (dict, collections.OrderedDict):
            return type(value)(items)
        try:  # BatchEncoding, ModelOutput and other dict subclasses
            rebuilt = copy.copy(value)
            for key, item in items.items():
                rebuilt[key] = item
            return rebuilt
        except Exception:
            return items
    return on_other(value, path)


def _set_at(structure, path: tuple, new):
    """Replace the leaf at `path` in nested lists/dicts/tuples (tuples are rebuilt)."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(structure, tuple):
        items = list(structure)
        items[key] = _set_at(items[key], rest, new)
        if type(structure) is tuple:
            return tuple(items)
        if hasattr(type(structure), "_fields"):
            return type(structure)(*items)
        return type(structure)(items)
    structure[key] = _set_at(structure[key], rest, new)
    return structure


def _call_site() -> Optional[Tuple[str, int, str]]:
    """(filename, lineno, function) of the innermost frame outside torch and numguard_nb."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_internal_file(filename):
            return filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


def _version_sum(params) -> int:
    """Sum of the parameters' version counters: it grows when an optimizer step writes them."""
    total = 0
    for param in params:
        try:
            total += param._version
        except RuntimeError:  # inference tensors have no version counter
            pass
    return total


# ---- where an error is --------------------------------------------------------------------
@dataclass
class Location:
    """A line of Python: where an exception was raised, or the line that made the call."""

    filename: str
    lineno: int
    line: str = ""
    function: str = ""
    kind: str = "raised"  # "raised": a frame of the error; "call site": the line calling the module

    def __str__(self) -> str:
        where = f"{self.filename}:{self.lineno}" + (f" in {self.function}" if self.function else "")
        return f"{where}: {self.line}" if self.line else where

    @classmethod
    def of(cls, filename, lineno, function="", kind="raised", line=None) -> "Location":
        if line is None:
            line = linecache.getline(filename, lineno).strip()
        return cls(filename=filename, lineno=int(lineno), line=line, function=function, kind=kind)


def _error_location(exc: BaseException) -> Optional[Location]:
    """Innermost frame of the traceback in the user's or the model's code (not torch's)."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not is_internal_file(frame.filename):
            found = frame
    if found is None:
        return None
    return Location.of(found.filename, found.lineno, found.name, "raised", (found.line or "").strip())


def _format_traceback(exc: BaseException) -> str:
    """The exception's traceback without numguard's own replay frames at its top."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


# ---- the weights snapshot -----------------------------------------------------------------
def _named_tensors(module: nn.Module):
    """(name, tensor, kind) for parameters, buffers and plain tensor attributes (shared ones too)."""
    for name, param in module.named_parameters(remove_duplicate=False):
        yield name, param, "param"
    for name, buf in module.named_buffers(remove_duplicate=False):
        yield name, buf, "buffer"
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield (f"{mod_name}.{attr}" if mod_name else attr), value, "attr"


def snapshot_bytes(models) -> int:
    """Host memory a weight snapshot of `models` (a module or a dict of them) takes."""
    modules = [models] if isinstance(models, nn.Module) else list(models.values())
    seen, total = set(), 0
    for module in modules:
        for _, tensor, _ in _named_tensors(module):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += _stored_bytes(tensor)
    return total


def _stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a host copy of `tensor` takes: what it stores (a sparse tensor's values and
    indices, not its dense size; nothing for a meta tensor)."""
    if tensor.is_meta:
        return 0
    if tensor.layout == torch.sparse_coo:
        parts = (tensor._values(), tensor._indices())
    elif tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (tensor.values(), tensor.crow_indices(), tensor.col_indices())
    elif tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = (tensor.values(), tensor.ccol_indices(), tensor.row_indices())
    else:
        parts = (tensor,)
    return sum(part.numel() * part.element_size() for part in parts)


# A snapshot may take this share of the host memory available: the run, its data and a replay
# need the rest, and a kernel that runs out of memory dies with everything in it.
SNAPSHOT_MEMORY_SHARE = 0.5


def snapshot_fits(models) -> Tuple[bool, str]:
    """Whether a weight snapshot of `models` fits in host memory, and if not, why (one line)."""
    needed, available = snapshot_bytes(models), _util.host_memory_available()
    if available is None or needed <= available * SNAPSHOT_MEMORY_SHARE:
        return True, ""
    return False, (
        f"the weights' host copy ({format_bytes(needed)}) would take more than half of the "
        f"{format_bytes(available)} of host memory available"
    )


def _loss_class(module: nn.Module) -> bool:
    """A torch.nn loss: rebuilt from its class and settings when a bundle is loaded."""
    cls = type(module)
    return isinstance(module, nn.modules.loss._Loss) and cls.__module__ == "torch.nn.modules.loss"


def _qualified(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Snapshot:
    """Host copies of one root module's tensors, by name (tied names share one copy)."""

    def __init__(self, tensors, kinds, requires_grad, class_name, devices, version, settings=None,
                 params=()):
        self.tensors: Dict[str, torch.Tensor] = tensors
        self.kinds: Dict[str, str] = kinds
        self.requires_grad: Dict[str, bool] = requires_grad
        self.class_name: str = class_name
        self.devices: List[str] = devices
        self.version: int = version
        self.settings: Dict[str, Any] = settings or {}  # plain attributes of torch.nn losses
        # Weak references to the live parameters, to tell cheaply whether they were written since.
        self._params = [weakref.ref(p) for p in params]
        self._param_ids = frozenset(id(p) for p in params)
        # Set when a torch.optim step updated them: fused optimizers (Adam(fused=True)) write
        # parameters without bumping their version counters.
        self.optimizer_stepped = False

    def note_optimizer_step(self, optimizer) -> None:
        if self.optimizer_stepped:
            return
        for group in getattr(optimizer, "param_groups", ()):
            if any(id(p) in self._param_ids for p in group.get("params", ())):
                self.optimizer_stepped = True
                return

    def weights_changed(self) -> bool:
        """Whether the live parameters were written (or replaced) since the snapshot."""
        if self.optimizer_stepped:
            return True
        total = 0
        for ref in self._params:
            param = ref()
            if param is None:
                return True
            try:
                total += param._version
            except RuntimeError:  # inference tensors have no version counter
                pass
        return total != self.version

    @classmethod
    def take(cls, module: nn.Module) -> "_Snapshot":
        tensors, kinds, requires_grad, devices, seen = {}, {}, {}, [], {}
        with torch.no_grad():
            for name, tensor, kind in _named_tensors(module):
                if name in tensors:
                    continue
                host = seen.get(id(tensor))
                if host is None:
                    # One tensor at a time, straight to host memory (never a second GPU copy).
                    host = seen[id(tensor)] = tensor.detach().to("cpu", copy=True)
                    device = str(tensor.device)
                    if device not in devices:
                        devices.append(device)
                tensors[name], kinds[name] = host, kind
                requires_grad[name] = bool(tensor.requires_grad)
        settings = {}
        if _loss_class(module):
            settings = {k: v for k, v in vars(module).items()
                        if not k.startswith("_") and k != "training"
                        and (v is None or isinstance(v, (bool, int, float, str)))}
        params = list(module.parameters())
        return cls(tensors, kinds, requires_grad, _qualified(type(module)), devices,
                   _version_sum(params), settings, params)

    @property
    def cuda_device(self) -> Optional[int]:
        for device in self.devices:
            if device.startswith("cuda"):
                return torch.device(device).index or 0
        return None

    def dtypes(self) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for t in {id(t): t for t in self.tensors.values()}.values():
            counts[dtype_name(t.dtype)] = counts.get(dtype_name(t.dtype), 0) + 1
        return counts

    def to_bundle(self) -> dict:
        return {
            "class": self.class_name, "tensors": dict(self.tensors), "kinds": dict(self.kinds),
            "requires_grad": dict(self.requires_grad), "devices": list(self.devices),
            "dtypes": self.dtypes(),
            "settings": {str(k): _plain_scalar(v) for k, v in self.settings.items()},
        }

    @classmethod
    def from_bundle(cls, data: dict) -> "_Snapshot":
        return cls(dict(data["tensors"]), dict(data["kinds"]), dict(data["requires_grad"]),
                   str(data["class"]), list(data.get("devices", [])), 0,
                   dict(data.get("settings", {})))


def _is_numguard_hook(hook) -> bool:
    func = getattr(hook, "__func__", None) or getattr(hook, "func", None) or hook
    func = getattr(func, "__func__", func)
    return str(getattr(func, "__module__", "") or "").startswith("numguard_nb")


def _build_module(live: nn.Module, snapshot: _Snapshot, device, upcast: bool, notes: list,
                  label: str) -> nn.Module:
    """A copy of `live` on `device` whose tensors come from the snapshot.

    `copy.deepcopy` with a memo that maps every parameter, buffer and tensor attribute of the
    live module to its host copy: deepcopy never reads them (so a broken CUDA context or GPU
    memory is never touched), and hook dictionaries are copied without numguard's hooks.
    """
    converted: Dict[int, torch.Tensor] = {}  # id(host copy) -> tensor on device (keeps ties)

    def convert(host: torch.Tensor) -> torch.Tensor:
        out = converted.get(id(host))
        if out is None:
            dtype = torch.float32 if upcast and host.dtype in _LOW_PRECISION else None
            out = host.to(device=device, dtype=dtype, copy=True)
            converted[id(host)] = out
        return out

    memo: Dict[int, Any] = {}
    made: Dict[int, Any] = {}  # id(live tensor) -> replacement (a tensor shared by two names)
    missing = []
    with torch.no_grad():
        for name, tensor, _kind in _named_tensors(live):
            if id(tensor) in made:
                continue
            host = snapshot.tensors.get(name)
            if host is None:
                if tensor.device.type == "cpu":
                    continue  # created after the snapshot, on CPU: deepcopy copies it
                try:
                    host = tensor.detach().to("cpu")
                except Exception as error:
                    raise ReplayError(
                        f"{label}.{name} is a {tensor.device} tensor that was not in the snapshot "
                        f"and cannot be copied now ({error_line(error)}): attach the guard "
                        "after the model is built (or call Capture.snapshot()) and run again"
                    ) from None
                missing.append(name)
            new = convert(host)
            if isinstance(tensor, nn.Parameter):
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            made[id(tensor)] = memo[id(tensor)] = new
    if missing:
        notes.append(f"{label}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                     "were not in the snapshot and were copied from the live model")
    # Hooks: copied shallowly (the same callables), without numguard's (the guard's hooks must
    # not run on the replay copy); the id dictionaries that qualify hooks are filtered alike.
    numguard_ids = set()
    for module in live.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = module.__dict__.get(attr) or {}
            numguard_ids.update(key for key, hook in hooks.items() if _is_numguard_hook(hook))
    for module in live.modules():
        for attr in _HOOK_DICTS:
            hooks = module.__dict__.get(attr)
            if hooks is not None and id(hooks) not in memo:
                memo[id(hooks)] = collections.OrderedDict(
                    (key, value) for key, value in hooks.items()
                    if key not in numguard_ids and not (callable(value) and _is_numguard_hook(value))
                )
    try:
        return copy.deepcopy(live, memo)
    except ReplayError:
        raise
    except Exception as error:
        raise ReplayError(
            f"could not rebuild {label} ({type(live).__name__}) for the replay: "
            f"{error_line(error)}"
        ) from None


# ---- one captured call --------------------------------------------------------------------
class _CopyState:
    __slots__ = ("cuda_devices", "by_reference", "memo")

    def __init__(self):
        self.cuda_devices: set = set()
        self.by_reference: List[str] = []
        self.memo: Dict[int, torch.Tensor] = {}


def _host_copy(t: torch.Tensor, path, state: _CopyState) -> torch.Tensor:
    """A host copy of an input tensor: async into pinned memory for CUDA, a clone for CPU."""
    hit = state.memo.get(id(t))
    if hit is not None:
        return hit
    d = t.detach()
    if d.device.type == "cuda" and d.layout == torch.strided:
        out = torch.empty(d.shape, dtype=d.dtype, pin_memory=True)
        out.copy_(d, non_blocking=True)
        state.cuda_devices.add(d.device.index if d.device.index is not None else 0)
    elif d.device.type == "cpu":
        out = d.clone()
    else:
        out = d.to("cpu")
    if t.requires_grad and (out.is_floating_point() or out.is_complex()):
        out.requires_grad_(True)
    state.memo[id(t)] = out
    return out


class CapturedCall:
    """One top-level call of a guarded module, held on the host: replay it with `.replay()`.

    Attributes: `root_name` (the name the module was guarded under, "" for a single model),
    `module_class`, `index` (the call's number since the capture started), `args`/`kwargs` (host
    copies), `cpu_rng_state`, `cuda_rng_state`/`cuda_device` (when the call used a GPU),
    `grad_enabled`, `training`, `autocast`, `weights_changed` (an optimizer step wrote the weights
    after the snapshot), `call_site` (the line that made the call), `input_devices`.
    """

    def __init__(self, source, root_name: str, module_class: str, index: int, args, kwargs, *,
                 cpu_rng_state=None, cuda_rng_state=None, cuda_device=None, grad_enabled=True,
                 training=True, autocast=None, weights_changed=False, call_site=None,
                 input_devices=(), by_reference=(), events=()):
        self._source = source
        self.root_name = root_name
        self.module_class = module_class
        self.index = index
        self.args = args
        self.kwargs = kwargs
        self.cpu_rng_state = cpu_rng_state
        self.cuda_rng_state = cuda_rng_state
        self.cuda_device = cuda_device
        self.grad_enabled = grad_enabled
        self.training = training
        self.autocast = dict(autocast or {})
        self.weights_changed = weights_changed
        self.call_site: Optional[Location] = call_site
        self.input_devices = list(input_devices)
        self.by_reference = list(by_reference)
        self._events = list(events)
        self._copy_note: Optional[str] = None
        self.extra_notes: List[str] = []  # e.g. a bundle saved with another torch version

    @property
    def name(self) -> str:
        return self.root_name or self.module_class

    @property
    def label(self) -> str:
        return f"{self.name} ({self.module_class})" if self.root_name else self.module_class

    def __repr__(self) -> str:
        inputs = [_describe(a) for a in self.args] + [f"{k}={_describe(v)}" for k, v in self.kwargs.items()]
        where = f" at {self.call_site.filename}:{self.call_site.lineno}" if self.call_site else ""
        return f"<numguard CapturedCall {self.index}: {self.label}({', '.join(inputs)}){where}>"

    # -- host copies of CUDA inputs ---------------------------------------------------------
    def _wait_for_copies(self) -> None:
        if not self._events:
            return
        events, self._events = self._events, []
        for event in events:
            try:
                event.synchronize()
            except Exception:
                self._copy_note = (
                    "the CUDA context reported an error while confirming that the input copies "
                    "finished; they were queued before the failing kernel ran, so they normally did"
                )
                return

    # -- the calls replayed together --------------------------------------------------------
    def chain(self) -> List["CapturedCall"]:
        """This call, after the calls of earlier-listed guarded modules that directly preceded it
        (the model call that fed a loss module)."""
        calls = [self]
        order = self._source.root_order
        current = self
        while True:
            previous = self._source.previous(current)
            if previous is None or any(previous.root_name == c.root_name for c in calls):
                break
            if previous.root_name not in order or current.root_name not in order or \
                    order.index(previous.root_name) >= order.index(current.root_name):
                break
            calls.insert(0, previous)
            current = previous
        return calls

    # -- replay -----------------------------------------------------------------------------
    def replay(self, device: Union[str, torch.device] = "cpu") -> "ReplayResult":
        """Run the call again on `device` (CPU by default) from the host snapshot and copies.

        Returns a `ReplayResult`: the exception and the line where it was raised, or the output
        when the call runs clean. A float16/bfloat16 call that needs a kernel the CPU lacks is run
        again upcast to float32 (`result.upcast`).
        """
        device = torch.device(device)
        chain = self.chain()
        for call in chain:
            call._wait_for_copies()
        result = _run_chain(chain, device, upcast=False)
        low_precision = any(
            t.dtype in _LOW_PRECISION for c in chain
            for t in itertools.chain(self._source.snapshots[c.root_name].tensors.values(),
                                     (leaf for _, leaf in _leaves((c.args, c.kwargs), ())))
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

    # -- bundles ----------------------------------------------------------------------------
    def save(self, path) -> str:
        """Write a replay bundle (weights snapshot, inputs, RNG states, ...) for `load_capture`.

        Only tensors and plain values are stored, so `torch.load(weights_only=True)` reads it;
        an input that is neither (a cache object, a custom class) is refused with its name.
        """
        path = os.fspath(path)
        chain = self.chain()
        for call in chain:
            call._wait_for_copies()
        calls = [call._to_bundle() for call in chain]
        roots = []
        for call in chain:
            if call.root_name not in roots:
                roots.append(call.root_name)
        bundle = {
            "format": BUNDLE_FORMAT,
            "format_version": BUNDLE_VERSION,
            "torch_version": str(torch.__version__),
            "numguard_version": _numguard_version(),
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "roots": roots,
            "models": {root: self._source.snapshots[root].to_bundle() for root in roots},
            "calls": calls,
            "target": len(calls) - 1,
        }
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        partial = f"{path}.part"
        try:  # never leave half a bundle behind (a full disk, an interrupt)
            torch.save(bundle, partial)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return path

    def _to_bundle(self) -> dict:
        rejected: List[str] = []

        def on_tensor(t, path):
            return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)

        def on_other(value, path):
            rejected.append(f"{_path_str(path)} ({type(value).__name__})")
            return None

        def plain(value, path, depth=0):
            if isinstance(value, torch.Tensor):
                return on_tensor(value, path)
            if value is None or isinstance(value, (bool, int, float, str)):
                return _plain_scalar(value)
            if depth >= _MAX_DEPTH:
                return on_other(value, path)
            if isinstance(value, (tuple, list)) and not hasattr(type(value), "_fields"):
                items = [plain(v, path + (i,), depth + 1) for i, v in enumerate(value)]
                return tuple(items) if isinstance(value, tuple) else items
            if isinstance(value, dict):
                bad = [k for k in value if not isinstance(k, (str, int))]
                if bad:
                    return on_other(value, path)
                return {_plain_scalar(k): plain(v, path + (k,), depth + 1) for k, v in value.items()}
            return on_other(value, path)

        args = plain(tuple(self.args), ("args",))
        kwargs = {k: plain(v, ("kwargs", k)) for k, v in self.kwargs.items()}
        if rejected:
            raise ReplayError(
                f"cannot save the call of {self.label}: the bundle holds only tensors and plain "
                f"values, and {', '.join(rejected)} {'is' if len(rejected) == 1 else 'are'} not; "
                "pass tensors (or replay in this kernel with .replay())"
            )
        site = self.call_site
        return {
            "root": self.root_name, "module_class": self.module_class, "index": self.index,
            "args": args, "kwargs": kwargs,
            "cpu_rng_state": self.cpu_rng_state, "cuda_rng_state": self.cuda_rng_state,
            "cuda_device": self.cuda_device, "grad_enabled": self.grad_enabled,
            "training": self.training,
            "autocast": {k: [bool(v[0]), str(v[1])] for k, v in self.autocast.items()},
            "weights_changed": self.weights_changed,
            "input_devices": list(self.input_devices),
            "input_dtypes": sorted({dtype_name(t.dtype) for _, t in _leaves((args, kwargs), ())}),
            "call_site": None if site is None else
            {"filename": str(site.filename), "lineno": int(site.lineno), "function": str(site.function),
             "line": site.line or linecache.getline(site.filename, site.lineno).strip()},
        }


def _plain_scalar(value):
    """bool/int/float/str subclasses (numpy floats, TorchVersion) as the builtin type, which
    weights_only loading accepts."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return value if type(value) is kind else kind(value)
    return value


def _numguard_version() -> str:
    try:
        from . import __version__

        return str(__version__)
    except Exception:
        return "unknown"


# ---- running a chain of calls -------------------------------------------------------------
def _replay_inputs(call: CapturedCall, device: torch.device, upcast: bool):
    """Fresh device copies of the call's inputs (the host copies stay as they were)."""

    def on_tensor(t, path):
        dtype = torch.float32 if upcast and t.dtype in _LOW_PRECISION else None
        out = t.detach().to(device=device, dtype=dtype, copy=True)
        if t.requires_grad:
            out.requires_grad_(True)
        return out

    return _map((tuple(call.args), dict(call.kwargs)), (), on_tensor, lambda v, p: v)


def _match_outputs(inputs, produced, used: list):
    """Put replayed outputs of earlier calls in place of the inputs that hold the same values."""
    candidates = [(who, path, t) for who, output in produced for path, t in _leaves(output, ("output",))
                  if t.is_floating_point()]
    if not candidates:
        return inputs
    for path, x in list(_leaves(inputs, ())):
        if not x.is_floating_point():
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
            inputs = _set_at(inputs, path, new)
            used.append((_input_path_str(path), who, _path_str(out_path)))
            break
    return inputs


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

    def _pop(self):
        if self.stack:
            self.stack.pop()


def _run_chain(chain: List[CapturedCall], device: torch.device, upcast: bool) -> "ReplayResult":
    source = chain[-1]._source
    notes: List[str] = []
    modules: Dict[str, nn.Module] = {}
    produced: list = []  # (call name, output) of calls already replayed
    steps: List[str] = []
    tracker = _ModuleTracker()
    saved_cpu = torch.get_rng_state()
    saved_cuda = None
    exception = None
    failed: Optional[CapturedCall] = None
    output = None
    try:
        for position, call in enumerate(chain):
            module = modules.get(call.root_name)
            if module is None:
                live = source.models[call.root_name]
                module = _build_module(live, source.snapshots[call.root_name], device, upcast,
                                       notes, call.name)
                tracker.attach(module, call.root_name)
                modules[call.root_name] = module
            if module.training != call.training:
                module.train(call.training)
            args, kwargs = _replay_inputs(call, device, upcast)
            used: list = []
            if produced:
                args, kwargs = _match_outputs((args, kwargs), produced, used)
            step = f"{call.label} call {call.index}"
            if used:
                step += " with " + ", ".join(f"{inp} from the replayed {who} {out}" for inp, who, out in used)
                leftovers = [_input_path_str(p) for p, _ in _leaves((call.args, call.kwargs), ())]
                replaced = {u[0] for u in used}
                rest = [p for p in leftovers if p not in replaced]
                if rest:
                    step += f" and {', '.join(rest)} from its captured copy"
            elif produced:
                stale = [c.name for c in chain[:position] if c.weights_changed]
                why = (f"the weights of {', '.join(stale)} changed since the snapshot, so "
                       "its replayed output differs") if stale else \
                    "none matched the replayed outputs before it"
                step += f" with its captured inputs ({why})"
            else:
                step += " with its captured inputs"
            steps.append(step)
            if call.cpu_rng_state is not None:
                torch.set_rng_state(call.cpu_rng_state)
            if device.type == "cuda" and call.cuda_rng_state is not None:
                index = device.index if device.index is not None else 0
                if saved_cuda is None:
                    saved_cuda = (index, torch.cuda.get_rng_state(index))
                torch.cuda.set_rng_state(call.cuda_rng_state, index)
            autocast = call.autocast.get(device.type)
            context = (torch.autocast(device.type, dtype=getattr(torch, autocast[1].replace("torch.", "")))
                       if autocast and autocast[0] and not upcast else _null_context())
            for other, (enabled, dtype) in call.autocast.items():
                if enabled and other != device.type:
                    notes.append(f"the call ran under {other} autocast ({dtype_name(dtype)}); "
                                 f"the {device.type} replay runs without it")
            tracker.stack.clear()
            try:
                with torch.set_grad_enabled(call.grad_enabled), context:
                    result = module(*args, **kwargs)
            except Exception as error:  # the point of the replay: keep it, do not raise it
                exception, failed = error, call
                for later in chain[position + 1:]:
                    steps.append(f"{later.label} call {later.index} was not run")
                break
            produced.append((call.name, result))
            output = result
    finally:
        torch.set_rng_state(saved_cpu)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda[1], saved_cuda[0])

    target = chain[-1]
    for call in chain:
        if call.weights_changed:
            notes.append(f"the weights of {call.name} changed after the snapshot (taken when the "
                         "guard was attached) and before this call: the replay ran with the "
                         "snapshot's weights (errors from the data do not depend on them)")
        if call.by_reference:
            notes.append(f"{call.name}: {', '.join(call.by_reference)} were kept by reference, "
                         "not copied")
        if call._copy_note:
            notes.append(call._copy_note)
        notes.extend(call.extra_notes)
        replayed = modules.get(call.root_name)
        has_dropout = replayed is not None and any(
            isinstance(m, nn.modules.dropout._DropoutNd) for m in replayed.modules())
        if device.type != "cuda" and call.training and has_dropout and \
                any(d.startswith("cuda") for d in call.input_devices):
            notes.append(f"{call.name} ran on a GPU in training mode: dropout masks drawn on "
                         f"{device.type} differ from the GPU's")
    module_label = None
    location = None
    if exception is not None:
        if tracker.stack:
            name, cls = tracker.stack[-1]
            module_label = f"{name} ({cls})" if name != cls else cls
        location = _error_location(exception)
        if location is None:
            location = _fill_line(failed.call_site)
    return ReplayResult(
        call=failed or target, device=str(device), exception=exception,
        traceback=_format_traceback(exception) if exception is not None else "",
        location=location, module=module_label, output=output if exception is None else None,
        replayed="; then ".join(steps), notes=_unique(notes), upcast=False,
    )


def _unique(items):
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


class _null_context:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- results ------------------------------------------------------------------------------
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

    call: CapturedCall
    device: str = "cpu"
    exception: Optional[BaseException] = None
    traceback: str = ""
    location: Optional[Location] = None
    module: Optional[str] = None
    output: Any = None
    replayed: str = ""
    notes: List[str] = field(default_factory=list)
    upcast: bool = False

    @property
    def ok(self) -> bool:
        """The call ran clean on the replay device."""
        return self.exception is None

    @property
    def call_site(self) -> Optional[Location]:
        """The line that made the replayed call (in the user's code)."""
        return _fill_line(self.call.call_site)

    def raise_(self):
        """Raise the replayed exception (its traceback points at the real line)."""
        if self.exception is not None:
            raise self.exception

    def _body(self) -> List[Tuple[str, str]]:
        """(style, text) lines after the headline: where, which module, what was replayed."""
        lines = []
        if self.exception is not None:
            lines.append(("error", error_line(self.exception)))
            location = self.location
            if location is not None:
                fn = f" in {location.function}" if location.function else ""
                if location.kind == "raised":
                    lines.append(("info", f"at {location.filename}:{location.lineno}{fn}"))
                else:
                    lines.append(("info", f"raised inside torch, in the call made at "
                                          f"{location.filename}:{location.lineno}{fn}"))
                if location.line:
                    lines.append(("code", location.line))
            if self.module:
                lines.append(("info", f"raised in module {self.module}"))
        else:
            lines.append(("info", f"it returned {_describe(self.output)}; the problem is elsewhere: an "
                                  "earlier call, or code outside the guarded modules"))
        if self.replayed:
            lines.append(("info", f"replayed: {self.replayed}"))
        for note in self.notes:
            lines.append(("note", f"note: {note}"))
        return lines

    def _lines(self) -> List[Tuple[str, str]]:
        """(style, text) lines shared by the text and HTML views."""
        if self.exception is not None:
            head = f"numguard replay on {self.device}: the call raised"
        else:
            head = f"numguard replay on {self.device}: the call ran clean"
        return [("head", head)] + self._body()

    def __repr__(self) -> str:
        return _text_block(self._lines())

    def _repr_html_(self) -> str:
        return _html_block(self._lines(), ok=self.exception is None)


def _text_block(lines) -> str:
    indents = {"head": "", "section": "\n", "code": "      ", "error": "  "}
    return "\n".join(indents.get(style, "  ") + text for style, text in lines)


def _html_block(lines, ok: bool) -> str:
    colour = "#2e7d32" if ok else "#c62828"
    parts = [f'<div class="numguard-replay" style="font-family:monospace;border-left:4px solid {colour};'
             'padding:4px 8px">']
    for style, text in lines:
        text = html.escape(text)
        if style == "head":
            parts.append(f'<div style="font-weight:bold;color:{colour}">{text}</div>')
        elif style == "code":
            parts.append(f'<pre style="margin:2px 0 2px 2em">{text}</pre>')
        elif style == "section":
            parts.append(f'<div style="font-weight:bold;margin-top:6px">{text}</div>')
        elif style == "error":
            parts.append(f'<div style="margin-left:1em;font-weight:bold">{text}</div>')
        else:
            parts.append(f'<div style="margin-left:1em">{text}</div>')
    parts.append("</div>")
    return "".join(parts)


# ---- the capture --------------------------------------------------------------------------
class _OptimizerStepNote:
    """torch.optim's global step hook for one Capture, holding it weakly."""

    __slots__ = ("capture",)

    def __init__(self, capture: "Capture"):
        self.capture = weakref.ref(capture)

    def __call__(self, optimizer, args, kwargs) -> None:
        capture = self.capture()
        if capture is None:
            return
        try:
            capture.note_optimizer_step(optimizer)
        except Exception:  # never break the user's optimizer step
            pass


class Capture:
    """Host snapshot of the guarded models and host copies of their last calls' inputs.

    `Guard(..., capture=True)` builds one on attach and calls `record` at the start of every
    top-level call of a guarded module; `guard.capture` is `capture.latest`.

    Args:
        models: a module, or a dict of name -> module (the guard's `models`, "" for one model).
        keep: calls kept per guarded module (2: the call that failed may be the one before the
            call during which the asynchronous error was reported).

    The snapshot is taken here, tensor by tensor to host memory: it costs one copy of the
    weights in host memory, also for a model already on CPU (whose weights the run goes on to
    change).
    """

    def __init__(self, models, keep: int = 2):
        if isinstance(models, nn.Module):
            models = {"": models}
        if not isinstance(models, dict) or not models or \
                not all(isinstance(m, nn.Module) for m in models.values()):
            raise TypeError("Capture needs a torch.nn.Module or a dict of name -> torch.nn.Module")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.models: Dict[str, nn.Module] = dict(models)
        self.keep = keep
        self.root_order: List[str] = list(self.models)
        self.snapshots: Dict[str, _Snapshot] = {}
        self._calls: collections.deque = collections.deque()
        self._count = itertools.count()
        self._warned = False
        self.snapshot()
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # The hook is torch's, global: it holds the capture weakly, and goes when the capture
        # does or the guard detaches, whichever comes first.
        self._optimizer_hook = register_optimizer_step_post_hook(_OptimizerStepNote(self))
        weakref.finalize(self, self._optimizer_hook.remove)

    def note_optimizer_step(self, optimizer) -> None:
        for snapshot in self.snapshots.values():
            snapshot.note_optimizer_step(optimizer)

    def stop_watching_optimizers(self) -> None:
        """Remove the optimizer-step hook (the guard calls it on detach; idempotent)."""
        self._optimizer_hook.remove()

    def snapshot(self) -> None:
        """(Re)take the host snapshot of every guarded model's weights, buffers and attributes.
        Raises CaptureTooLarge, before copying anything, where it would not fit in host memory."""
        fits, why = snapshot_fits(self.models)
        if not fits:
            raise CaptureTooLarge(
                f"capture refused: {why}: pass capture=False (no CPU replay after a CUDA error), "
                "or free host memory"
            )
        self.snapshots = {name: _Snapshot.take(module) for name, module in self.models.items()}

    @property
    def latest(self) -> Optional[CapturedCall]:
        """The latest captured call (None before the first)."""
        return self._calls[-1] if self._calls else None

    @property
    def calls(self) -> List[CapturedCall]:
        """The captured calls kept, oldest first."""
        return list(self._calls)

    def previous(self, call: CapturedCall) -> Optional[CapturedCall]:
        for other in self._calls:
            if other.index == call.index - 1:
                return other
        return None

    def replay(self, device="cpu") -> ReplayResult:
        """Replay the latest call (see `CapturedCall.replay`)."""
        if self.latest is None:
            raise ReplayError(
                "nothing was captured yet: run the model inside Guard(model, capture=True) "
                "first, then replay"
            )
        return self.latest.replay(device)

    def record(self, root_name: str, module: nn.Module, args, kwargs) -> Optional[CapturedCall]:
        """Keep host copies of one top-level call's inputs and RNG state (never raises)."""
        try:
            return self._record(root_name, module, args, kwargs)
        except Exception as error:  # capturing must never break the run it watches
            if not self._warned:
                self._warned = True
                warnings.warn(f"numguard: could not capture a call of {type(module).__name__} for "
                              f"replay: {error_line(error)}", RuntimeWarning, stacklevel=3)
            return None

    def _root_for(self, root_name: str, module: nn.Module) -> str:
        for name, root in self.models.items():
            if root is module:
                return name
        if root_name in self.models and self.models[root_name] is module:
            return root_name
        # A module the guard treats as a root but that was not given here: snapshot it now.
        name = root_name if root_name not in self.models else f"{root_name}#{len(self.models)}"
        self.models[name] = module
        self.root_order.append(name)
        self.snapshots[name] = _Snapshot.take(module)
        return name

    def _record(self, root_name, module, args, kwargs) -> CapturedCall:
        root = self._root_for(root_name, module)
        snapshot = self.snapshots[root]
        state = _CopyState()

        def on_other(value, path):
            state.by_reference.append(f"{_path_str(path)} ({type(value).__name__})")
            return value

        args_copy = _map(tuple(args), ("args",), lambda t, p: _host_copy(t, p, state), on_other)
        kwargs_copy = {k: _map(v, ("kwargs", k), lambda t, p: _host_copy(t, p, state), on_other)
                       for k, v in (kwargs or {}).items()}
        events = []
        for index in sorted(state.cuda_devices):
            with torch.cuda.device(index):
                event = torch.cuda.Event()
                event.record()
                events.append(event)
        cuda_device = min(state.cuda_devices) if state.cuda_devices else snapshot.cuda_device
        cuda_rng = None
        if cuda_device is not None and torch.cuda.is_available():
            cuda_rng = torch.cuda.get_rng_state(cuda_device)
        autocast = {}
        for device_type in ("cpu", "cuda"):
            try:
                if torch.is_autocast_enabled(device_type):
                    autocast[device_type] = (True, dtype_name(torch.get_autocast_dtype(device_type)))
            except (TypeError, AttributeError, RuntimeError):
                pass
        site = _call_site()
        devices = sorted({str(t.device) for _, t in _leaves((args, kwargs or {}), ())})
        call = CapturedCall(
            self, root, type(module).__name__, next(self._count), args_copy, kwargs_copy,
            cpu_rng_state=torch.get_rng_state(), cuda_rng_state=cuda_rng, cuda_device=cuda_device,
            grad_enabled=torch.is_grad_enabled(), training=bool(module.training),
            autocast=autocast, weights_changed=snapshot.weights_changed(),
            call_site=Location.of(site[0], site[1], site[2], "call site", line="") if site else None,
            input_devices=devices, by_reference=state.by_reference, events=events,
        )
        self._calls.append(call)
        same_root = [c for c in self._calls if c.root_name == root]
        for old in same_root[: max(0, len(same_root) - self.keep)]:
            self._calls.remove(old)
        return call

    def __repr__(self) -> str:
        names = ", ".join(n or type(m).__name__ for n, m in self.models.items())
        return f"<numguard Capture of {names}: {len(self._calls)} calls kept>"


def _fill_line(location: Optional[Location]) -> Optional[Location]:
    if location is not None and not location.line:
        location.line = linecache.getline(location.filename, location.lineno).strip()
    return location


# ---- bundles ------------------------------------------------------------------------------
class _Bundle:
    """The source of calls loaded from a bundle: given modules, snapshot from the file."""

    def __init__(self, models, snapshots, root_order):
        self.models = models
        self.snapshots = snapshots
        self.root_order = root_order
        self.calls: List[CapturedCall] = []

    def previous(self, call):
        position = self.calls.index(call)
        return self.calls[position - 1] if position > 0 else None


def _rebuild_loss(class_name: str, settings: dict, snapshot: _Snapshot) -> Optional[nn.Module]:
    module_name, _, cls_name = class_name.rpartition(".")
    if module_name != "torch.nn.modules.loss":
        return None
    cls = getattr(nn.modules.loss, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.modules.loss._Loss)):
        return None
    try:
        module = cls()
    except Exception:
        return None
    for key, value in settings.items():
        if key in vars(module):
            setattr(module, key, value)
    for name, kind in snapshot.kinds.items():
        if kind == "buffer" and "." not in name and module._buffers.get(name) is None:
            module._buffers[name] = snapshot.tensors[name].clone()
    return module


def _check_state(label: str, module: nn.Module, snapshot: _Snapshot) -> None:
    ours = {n: t for n, t, k in _named_tensors(module) if k != "attr"}
    theirs = {n: t for n, t in snapshot.tensors.items() if snapshot.kinds.get(n) != "attr"}
    missing = sorted(set(theirs) - set(ours))
    unexpected = sorted(set(ours) - set(theirs))
    shapes = [f"{n} {tuple(ours[n].shape)} vs {tuple(theirs[n].shape)} in the bundle"
              for n in sorted(set(ours) & set(theirs)) if tuple(ours[n].shape) != tuple(theirs[n].shape)]
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
    if shapes:
        problems.append(f"shape of {'; '.join(shapes[:3])}{' ...' if len(shapes) > 3 else ''}")
    if problems:
        raise ReplayError(
            f"{label} does not match the bundle ({'; '.join(problems)}): "
            f"build the same architecture as when the bundle was saved ({snapshot.class_name}) "
            "with the same configuration"
        )


def load_capture(path, model) -> CapturedCall:
    """Load a replay bundle written by `CapturedCall.save` (or `replay_after_error`).

    Args:
        path: the bundle file.
        model: the same architecture built fresh (its weights do not matter: they come from the
            bundle), or a dict of name -> module as given to the Guard. A torch.nn loss guarded
            alongside the model (nn.CrossEntropyLoss, ...) is rebuilt from the bundle when not
            given.

    Returns the `CapturedCall` to `.replay()`. The file is read with
    `torch.load(weights_only=True)`: a bundle never executes code.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ReplayError(f"no replay bundle at {path}: pass the path of a numguard_replay_*.pt file "
                          "written by replay_after_error or CapturedCall.save")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ReplayError(
            f"{path} holds Python objects that weights_only loading refuses to run "
            f"({_one_line(first_line(str(error)), 160)}): a numguard bundle holds only tensors and "
            "plain values, so this file was not written by numguard; do not load it"
        ) from None
    except Exception as error:
        raise ReplayError(f"{path} is not a numguard replay bundle ({error_line(error)}): "
                          "pass a file written by replay_after_error or CapturedCall.save") from None
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        what = f"a dict with keys {', '.join(map(str, list(data)[:5]))}" if isinstance(data, dict) \
            else f"a {type(data).__name__}"
        raise ReplayError(f"{path} is not a numguard replay bundle (it holds {what}): pass a file "
                          "written by replay_after_error or CapturedCall.save")
    if data.get("format_version") != BUNDLE_VERSION:
        raise ReplayError(f"{path} is a numguard bundle of format {data.get('format_version')}, this "
                          f"numguard reads format {BUNDLE_VERSION}: replay it with the numguard_nb "
                          f"version that wrote it ({data.get('numguard_version')})")
    roots = list(data["roots"])
    snapshots = {root: _Snapshot.from_bundle(data["models"][root]) for root in roots}
    models = _assign_models(path, model, roots, snapshots)
    for root in roots:
        _check_state(f"the module given for {root!r}" if root else "the model given", models[root],
                     snapshots[root])
    source = _Bundle(models, snapshots, roots)
    notes = []
    if str(data.get("torch_version")) != torch.__version__:
        notes.append(f"the bundle was saved with torch {data.get('torch_version')}, "
                     f"this is torch {torch.__version__}")
    for root in roots:
        given = _qualified(type(models[root]))
        if given != snapshots[root].class_name:
            notes.append(f"{root or 'the model'} is a {given}, the bundle's a {snapshots[root].class_name}")
    for entry in data["calls"]:
        site = entry.get("call_site")
        call = CapturedCall(
            source, entry["root"], entry["module_class"], int(entry["index"]),
            tuple(entry["args"]), dict(entry["kwargs"]),
            cpu_rng_state=entry.get("cpu_rng_state"), cuda_rng_state=entry.get("cuda_rng_state"),
            cuda_device=entry.get("cuda_device"), grad_enabled=bool(entry.get("grad_enabled", True)),
            training=bool(entry.get("training", True)),
            autocast={k: (bool(v[0]), str(v[1])) for k, v in entry.get("autocast", {}).items()},
            weights_changed=bool(entry.get("weights_changed", False)),
            call_site=None if site is None else Location.of(
                site["filename"], site["lineno"], site.get("function", ""), "call site",
                line=site.get("line", "")),
            input_devices=entry.get("input_devices", []),
        )
        source.calls.append(call)
    target = source.calls[int(data.get("target", len(source.calls) - 1))]
    target.extra_notes.extend(notes)
    return target


def _assign_models(path, model, roots, snapshots) -> Dict[str, nn.Module]:
    rebuildable = {r for r in roots if snapshots[r].class_name.startswith("torch.nn.modules.loss.")}
    models: Dict[str, nn.Module] = {}
    if isinstance(model, nn.Module):
        needed = [r for r in roots if r not in rebuildable] or roots[:1]
        if len(needed) != 1:
            names = ", ".join(repr(r) for r in needed)
            raise ReplayError(f"{path} replays several modules ({names}): pass a dict like "
                              f"{{{', '.join(f'{r!r}: ...' for r in needed)}}}")
        models[needed[0]] = model
    elif isinstance(model, dict) and all(isinstance(m, nn.Module) for m in model.values()):
        models.update({k: v for k, v in model.items() if k in roots})
        if len(model) == 1 and not models:
            only = next(iter(model.values()))
            needed = [r for r in roots if r not in rebuildable]
            if len(needed) == 1:
                models[needed[0]] = only
    else:
        raise ReplayError(f"load_capture needs the model (a torch.nn.Module built fresh, or a dict "
                          f"of name -> module), got {type(model).__name__}")
    for root in roots:
        if root in models:
            continue
        rebuilt = _rebuild_loss(snapshots[root].class_name, snapshots[root].settings, snapshots[root]) \
            if root in rebuildable else None
        if rebuilt is None:
            raise ReplayError(f"{path} replays {root!r} ({snapshots[root].class_name}) too: pass "
                              f"load_capture(path, {{{', '.join(f'{r!r}: ...' for r in roots)}}})")
        models[root] = rebuilt
    return models


# ---- after a device error, for the notebook magic -----------------------------------------
@dataclass
class ReplayOutcome:
    """What `replay_after_error` found: the CPU replay first, then the original error.

    `result` (a `ReplayResult`, None if the replay itself could not run: `replay_error` says
    why), `error` (the original exception), `path` (the bundle, None if it could not be written:
    `save_error` says why), `device_error` (the original error came from the GPU).
    """

    error: BaseException
    result: Optional[ReplayResult] = None
    path: Optional[str] = None
    device_error: bool = False
    save_error: Optional[str] = None
    replay_error: Optional[str] = None
    searched: List[str] = field(default_factory=list)

    @property
    def location(self) -> Optional[Location]:
        return self.result.location if self.result is not None else None

    def _hint(self) -> List[str]:
        if self.path is None:
            return []
        call = self.result.call if self.result is not None else None
        arg = "model"
        if call is not None:
            source = call._source
            roots = [c.root_name for c in call.chain()]
            needed = [r for r in roots if not source.snapshots[r].class_name.startswith("torch.nn.modules.loss.")]
            if len(needed) > 1:
                arg = "{" + ", ".join(f"{r!r}: {r or 'model'}" for r in needed) + "}"
        return [
            f"%numguard_replay {self.path}",
            f"from numguard_nb.replay import load_capture; load_capture({self.path!r}, {arg}).replay()",
        ]

    def _lines(self) -> List[Tuple[str, str]]:
        lines: List[Tuple[str, str]] = []
        result = self.result
        if result is None:
            lines.append(("head", f"numguard: the captured call could not be replayed: {self.replay_error}"))
        elif result.exception is not None:
            lines.append(("head", f"numguard: replayed on {result.device}, the error is raised at the real line:"))
            lines.extend(result._body())
        else:
            lines.append(("head", f"numguard: replayed on {result.device}, the captured call ran clean"))
            lines.extend(result._body())
        for text in self.searched:
            lines.append(("note", f"note: {text}"))
        lines.append(("section", "The original error (reported late, so its traceback points at the wrong line):"))
        lines.append(("code", error_line(self.error)))
        if self.device_error:
            lines.append(("section", "The CUDA context is unusable after a device error: restart the "
                                     "kernel before using the GPU again."))
        if self.path is not None:
            lines.append(("section", f"Replay bundle: {self.path}"))
            lines.append(("info", "in a fresh kernel, build the model (any weights) and run:"))
            for hint in self._hint():
                lines.append(("code", hint))
        elif self.save_error is not None:
            lines.append(("note", f"note: no replay bundle was written: {self.save_error}"))
        return lines

    def __repr__(self) -> str:
        return _text_block(self._lines())

    def _repr_html_(self) -> str:
        ok = self.result is not None and self.result.exception is None
        return _html_block(self._lines(), ok=ok)


def _default_dir() -> str:
    """The current directory when writable (the bundle shows up next to the notebook), else the
    system temp directory."""
    cwd = os.getcwd()
    return cwd if os.access(cwd, os.W_OK) else tempfile.gettempdir()


def _bundle_path(save_dir) -> str:
    directory = os.fspath(save_dir) if save_dir is not None else _default_dir()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(directory, f"numguard_replay_{stamp}.pt")
    for n in itertools.count(1):
        if not os.path.exists(path):
            return path
        path = os.path.join(directory, f"numguard_replay_{stamp}-{n}.pt")
    return path  # pragma: no cover


def replay_after_error(guard, exc: BaseException, save_dir=None) -> ReplayOutcome:
    """Replay the guard's captured call on CPU after `exc`, save a bundle, and explain.

    Args:
        guard: a `Guard` built with `capture=True` (or a `Capture`, or a `CapturedCall`).
        exc: the error the step raised (usually `is_device_error(exc)`).
        save_dir: where to write the bundle `numguard_replay_<YYYYmmdd-HHMMSS>.pt`; default: the
            current directory when writable (next to the notebook), else the temp directory.

    The latest call is replayed first (after the model call that fed it, for a loss module);
    when it runs clean, the earlier captured calls are tried, newest first, since an asynchronous
    error may be reported one call late. Raises `ReplayError` when nothing was captured.
    """
    if isinstance(guard, CapturedCall):
        latest, source = guard, guard._source
    else:
        capture = guard if isinstance(guard, Capture) else getattr(guard, "_capture", None)
        latest = capture.latest if capture is not None else getattr(guard, "capture", None)
        source = latest._source if latest is not None else None
    if latest is None:
        raise ReplayError(
            "nothing was captured to replay: run the step inside Guard(model, capture=True) "
            "(capture is off by default), then replay after the error"
        )
    outcome = ReplayOutcome(error=exc, device_error=is_device_error(exc))
    tried: set = set()
    candidates = [latest] + [c for c in reversed(getattr(source, "calls", [])) if c.index < latest.index]
    chosen = None
    for call in candidates:
        if call.index in tried:
            continue
        chain = call.chain()
        tried.update(c.index for c in chain)
        try:
            result = call.replay("cpu")
        except ReplayError as error:
            outcome.replay_error = str(error)
            break
        except Exception as error:  # the outcome must be shown whatever happens
            outcome.replay_error = error_line(error)
            break
        if outcome.result is None:
            outcome.result, chosen = result, call
        if result.exception is not None:
            if call is not latest:
                outcome.searched.append(
                    f"the latest call ({latest.label} call {latest.index}) ran clean on CPU; an "
                    f"earlier one raised (the error was reported one call late)")
            outcome.result, chosen = result, call
            break
    if chosen is not None:
        path = _bundle_path(save_dir)
        try:
            outcome.path = chosen.save(path)
        except ReplayError as error:
            outcome.save_error = str(error)
        except Exception as error:
            outcome.save_error = error_line(error)
            try:
                if os.path.exists(path):
                    os.remove(path)
            except OSError:
                pass
    return outcome
