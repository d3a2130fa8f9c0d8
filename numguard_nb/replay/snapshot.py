"""The weight snapshot: host copies of a guarded module's tensors, what they cost, and the replay
copy of the module rebuilt from them.

The snapshot is taken tensor by tensor straight to host memory (GPU memory is never doubled) when
the guard is attached. The replay copy is a deep copy of the live module whose tensors come from
the snapshot: the live model, its GPU memory and a possibly broken CUDA context are never read.
"""

from __future__ import annotations

import collections
import copy
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _util
from .._util import dtype_name, error_line, format_bytes
from ..errors import ReplayError

# A snapshot may take this share of the host memory available: the run, its data and a replay
# need the rest, and a kernel that runs out of memory dies with everything in it.
SNAPSHOT_MEMORY_SHARE = 0.5

LOW_PRECISION = (torch.float16, torch.bfloat16)
TORCH_LOSSES = "torch.nn.modules.loss"

# Module attributes holding hooks: copied shallowly into the replay model, numguard's removed.
_HOOK_DICTS = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
    "_backward_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def named_tensors(module: nn.Module):
    """(name, tensor, kind) for parameters, buffers and plain tensor attributes (shared ones too)."""
    for name, param in module.named_parameters(remove_duplicate=False):
        yield name, param, "param"
    for name, buf in module.named_buffers(remove_duplicate=False):
        yield name, buf, "buffer"
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield (f"{mod_name}.{attr}" if mod_name else attr), value, "attr"


def qualified_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---- what a snapshot costs --------------------------------------------------------------------
def snapshot_bytes(models) -> int:
    """Host memory a weight snapshot of `models` (a module or a dict of them) takes."""
    modules = [models] if isinstance(models, nn.Module) else list(models.values())
    seen, total = set(), 0
    for module in modules:
        for _, tensor, _ in named_tensors(module):
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


def snapshot_fits(models) -> Tuple[bool, str]:
    """Whether a weight snapshot of `models` fits in host memory, and if not, why (one line)."""
    needed, available = snapshot_bytes(models), _util.host_memory_available()
    if available is None or needed <= available * SNAPSHOT_MEMORY_SHARE:
        return True, ""
    return False, (
        f"the weights' host copy ({format_bytes(needed)}) would take more than half of the "
        f"{format_bytes(available)} of host memory available"
    )


# ---- the snapshot -----------------------------------------------------------------------------
def _version_sum(params) -> int:
    """Sum of the parameters' version counters: it grows when an optimizer step writes them."""
    total = 0
    for param in params:
        try:
            total += param._version
        except RuntimeError:  # inference tensors have no version counter
            pass
    return total


def _is_torch_loss_module(module: nn.Module) -> bool:
    """A torch.nn loss: rebuilt from its class and settings when a bundle is loaded."""
    return isinstance(module, nn.modules.loss._Loss) and type(module).__module__ == TORCH_LOSSES


class _Snapshot:
    """Host copies of one root module's tensors, by name (tied names share one copy)."""

    def __init__(self, tensors, kinds, requires_grad, class_name, devices, version, settings=None,
                 params=(), module=None):
        self.tensors: Dict[str, torch.Tensor] = tensors
        self.kinds: Dict[str, str] = kinds
        self.requires_grad: Dict[str, bool] = requires_grad
        self.class_name: str = class_name
        self.devices: List[str] = devices
        self.version: int = version
        self.settings: Dict[str, Any] = settings or {}  # plain attributes of torch.nn losses
        # The live module (weakly) and its parameters' ids, to tell cheaply whether they were
        # written or replaced since. Never a weak reference to a parameter: swap_tensors (and so
        # load_state_dict in swap mode) refuses a tensor that has one.
        self._module = weakref.ref(module) if module is not None else None
        self._param_ids = frozenset(id(p) for p in params)
        # Set when a torch.optim step updated them: fused optimizers (Adam(fused=True)) write
        # parameters without bumping their version counters.
        self.optimizer_stepped = False

    @classmethod
    def take(cls, module: nn.Module) -> "_Snapshot":
        tensors, kinds, requires_grad, devices, seen = {}, {}, {}, [], {}
        with torch.no_grad():
            for name, tensor, kind in named_tensors(module):
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
        if _is_torch_loss_module(module):
            settings = {k: v for k, v in vars(module).items()
                        if not k.startswith("_") and k != "training"
                        and (v is None or isinstance(v, (bool, int, float, str)))}
        params = list(module.parameters())
        return cls(tensors, kinds, requires_grad, qualified_name(type(module)), devices,
                   _version_sum(params), settings, params, module)

    @property
    def is_torch_loss(self) -> bool:
        """Taken from a torch.nn loss, which a bundle can rebuild without being given it."""
        return self.class_name.startswith(TORCH_LOSSES + ".")

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
        module = self._module() if self._module is not None else None
        if module is None:
            return self._module is not None  # the module is gone: its weights are not these
        params = list(module.parameters())
        if frozenset(id(p) for p in params) != self._param_ids:
            return True  # a parameter was replaced
        return _version_sum(params) != self.version

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


# ---- the replay copy of a module --------------------------------------------------------------
def _is_numguard_hook(hook) -> bool:
    func = getattr(hook, "__func__", None) or getattr(hook, "func", None) or hook
    func = getattr(func, "__func__", func)
    return str(getattr(func, "__module__", "") or "").startswith("numguard_nb")


def build_module(live: nn.Module, snapshot: _Snapshot, device, upcast: bool, notes: list,
                 label: str) -> nn.Module:
    """A copy of `live` on `device` whose tensors come from the snapshot.

    `copy.deepcopy` with a memo that maps every parameter, buffer and tensor attribute of the
    live module to its host copy: deepcopy never reads them (so a broken CUDA context or GPU
    memory is never touched), and hook dictionaries are copied without numguard's hooks.
    """
    memo: Dict[int, Any] = _tensor_memo(live, snapshot, device, upcast, notes, label)
    _add_hook_dicts_without_numguard(live, memo)
    try:
        return copy.deepcopy(live, memo)
    except ReplayError:
        raise
    except Exception as error:
        raise ReplayError(
            f"could not rebuild {label} ({type(live).__name__}) for the replay: "
            f"{error_line(error)}"
        ) from None


def _tensor_memo(live: nn.Module, snapshot: _Snapshot, device, upcast: bool, notes: list,
                 label: str) -> Dict[int, Any]:
    """id(live tensor) -> its replacement on `device`, made from the snapshot (ties kept)."""
    converted: Dict[int, torch.Tensor] = {}  # id(host copy) -> tensor on device (keeps ties)

    def convert(host: torch.Tensor) -> torch.Tensor:
        out = converted.get(id(host))
        if out is None:
            dtype = torch.float32 if upcast and host.dtype in LOW_PRECISION else None
            out = host.to(device=device, dtype=dtype, copy=True)
            converted[id(host)] = out
        return out

    memo: Dict[int, Any] = {}
    missing = []
    with torch.no_grad():
        for name, tensor, _kind in named_tensors(live):
            if id(tensor) in memo:
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
            memo[id(tensor)] = new
    if missing:
        notes.append(f"{label}: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                     "were not in the snapshot and were copied from the live model")
    return memo


def _add_hook_dicts_without_numguard(live: nn.Module, memo: Dict[int, Any]) -> None:
    """Hooks are copied shallowly (the same callables), without numguard's: the guard's hooks
    must not run on the replay copy. The id dictionaries that qualify hooks are filtered alike."""
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
