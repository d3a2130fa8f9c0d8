"""Small helpers shared by the engine, the report, its views and the tools: one home each."""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import types
import weakref
from typing import Optional

import torch
from torch.utils.hooks import RemovableHandle as _HANDLE_IDS  # (one counter of hook keys)

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_internal_files: dict = {}


def first_line(text) -> str:
    """The first non-blank line of `text`, stripped ('' if there is none)."""
    for line in str(text).splitlines():
        line = line.strip()
        if line:
            return line
    return ""


def message_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return first_line(error) or type(error).__name__


def error_line(error: BaseException, limit: Optional[int] = None) -> str:
    """`Type: first line of the message`, cut to `limit` characters of message."""
    text = first_line(error)
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def dtype_name(dtype) -> str:
    """'float16' for torch.float16."""
    return str(dtype).replace("torch.", "")


# Largest finite value of the floating dtypes people train in, by dtype name.
_FLOAT_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
}


# Smallest positive normal value: below it a value is subnormal (losing precision on its way to 0).
_FLOAT_SMALLEST_NORMAL = {
    "float16": 6.103515625e-05,
    "bfloat16": 1.1754943508222875e-38,
    "float32": 1.1754943508222875e-38,
    "float64": 2.2250738585072014e-308,
}


def _finfo_value(dtype_name: Optional[str], known: dict, attribute: str) -> Optional[float]:
    if dtype_name is None:
        return None
    if dtype_name in known:
        return known[dtype_name]
    dtype = getattr(torch, dtype_name, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return float(getattr(torch.finfo(dtype), attribute))
    return None


def dtype_smallest_normal(dtype_name: Optional[str]) -> Optional[float]:
    """Smallest positive normal value of a floating dtype given by name, or None."""
    return _finfo_value(dtype_name, _FLOAT_SMALLEST_NORMAL, "smallest_normal")


def dtype_max(dtype_name: Optional[str]) -> Optional[float]:
    """Largest finite value of a floating dtype given by name, or None for other dtypes."""
    return _finfo_value(dtype_name, _FLOAT_MAX, "max")


def is_internal_file(filename: Optional[str]) -> bool:
    """Frames in torch itself or in numguard_nb are not where a user's code went wrong."""
    if not filename:
        return False
    hit = _internal_files.get(filename)
    if hit is None:
        path = filename if filename.startswith("<") else os.path.abspath(filename)
        hit = _internal_files[filename] = path.startswith(_TORCH_DIR) or path.startswith(_PACKAGE_DIR)
    return hit


def user_frame():
    """The innermost Python frame outside torch and numguard_nb (the user's line that is running),
    or None. Uses the live stack: call it from inside the code whose caller is wanted."""
    frame = sys._getframe(1)
    while frame is not None:
        if not is_internal_file(frame.f_code.co_filename):
            return frame
        frame = frame.f_back
    return None


def caller_at_user_line():
    """A function `call(func, args, kwargs)` whose frame stands at the user's line that is
    running (in its file, with its globals). The warnings torch raises inside a call made through
    it (a C++ `TORCH_WARN`, or `warnings.warn(..., stacklevel=2)` in `torch.nn.functional`) then
    name the user's line, and are shown once per that line, as without the guard, not the line of
    the guard's watch that made the call; a traceback through it shows the user's line (IPython
    and pytest leave it out). Where no user frame is found, a plain caller."""
    frame = user_frame()
    if frame is None:
        return _PLAIN_CALLER
    key = (frame.f_code.co_filename, frame.f_lineno, id(frame.f_globals))
    caller = _CALLERS.get(key)
    if caller is None:
        if len(_CALLERS) >= _MAX_CALLERS:
            _CALLERS.clear()
        caller = _CALLERS[key] = _caller_at(frame)
    return caller


def _without_columns(code):
    """`code` with its lines but no columns (Python 3.11's location table, each entry "no
    column"): a traceback then marks no part of the user's line, whose columns are not its own."""
    if not hasattr(code, "co_positions"):
        return code  # (before 3.11: lines only)
    try:
        table, left = bytearray(), len(code.co_code) // 2
        while left:
            units = min(8, left)
            table += bytes((0x80 | 13 << 3 | units - 1, 0))  # code 13: no column, line + 0
            left -= units
        moved = code.replace(co_linetable=bytes(table))
        lines = {line for line, *_ in moved.co_positions()}
        return moved if lines == {code.co_firstlineno} else code
    except Exception:  # (a table format this code does not know: columns are only cosmetic)
        return code


# A one-line function whose lines move to the user's (`co_firstlineno`); IPython and pytest
# leave its frame out of tracebacks.
_CALLER_CODE = _without_columns(compile(
    "def call(func, args, kwargs): __tracebackhide__ = True; return func(*args, **kwargs)",
    "<numguard>", "exec").co_consts[0])
_PLAIN_CALLER = types.FunctionType(_CALLER_CODE, {})
_CALLERS: dict = {}  # (file, line, id(globals)) -> a caller standing there
_MAX_CALLERS = 256


def forget_callers() -> None:
    """Let go of the callers made so far (a watch stopping: each holds its code's globals)."""
    _CALLERS.clear()


def _caller_at(frame):
    """A function whose one line is `frame`'s line, in its file, run with its globals (which it
    holds: their id, in `_CALLERS`' key, cannot be reused while it is kept)."""
    code = frame.f_code
    names = {"co_name": code.co_name}
    if hasattr(code, "co_qualname"):  # (Python 3.11 and later)
        names["co_qualname"] = code.co_qualname
    moved = _CALLER_CODE.replace(co_filename=code.co_filename, co_firstlineno=frame.f_lineno or 1,
                                 **names)
    return types.FunctionType(moved, frame.f_globals)


def cell_name(filename: Optional[str]) -> Optional[str]:
    """'Cell In[5]' where `filename` is the file IPython compiled a notebook cell (or a terminal
    input) under, as its tracebacks name it; None for any other file. IPython is never imported
    here: a shell is asked only where one is running in this process already."""
    ipython = sys.modules.get("IPython")
    if not filename or ipython is None:
        return None
    try:
        compiler = ipython.get_ipython().compile
        format_code_name = getattr(compiler, "format_code_name", None)  # IPython 8 and later
        if format_code_name is not None:
            found = format_code_name(filename)
            return " ".join(found) if found else None
        number = getattr(compiler, "_filename_map", {}).get(filename)
    except Exception:  # no shell running, or one without a compiler that names cells
        return None
    return f"Cell In[{number}]" if number is not None else None


def code_where(filename: Optional[str], lineno) -> str:
    """'Cell In[5], line 3' for a line of a notebook cell, else 'path/file.py:3'."""
    cell = cell_name(filename)
    return f"{cell}, line {lineno}" if cell else f"{filename}:{lineno}"


class WeakHook:
    """A hook for one of torch's global registries that calls `owner.<method>(...)` with the
    first `takes` arguments it is given, holding the owner weakly (the registry is global: a hook
    must not keep a guard and its models alive). The one form of a global hook here: torch.optim's
    step hooks (`takes=1`: the optimizer) and the module registration hooks (`takes=3`). It runs
    as it is inside compiled code (traced, what it reads would recompile each time), and its own
    failure never breaks the user's code: `on_error(owner)` is called instead. Errors of the
    `raises` types (a detection that must stop the step) go through."""

    __slots__ = ("owner", "method", "on_error", "raises", "takes", "returns")

    def __init__(self, owner, method: str, on_error=None, raises: tuple = (), takes: int = 1,
                 returns: bool = False):
        import weakref

        self.owner = weakref.ref(owner)
        self.method = method
        self.on_error = on_error
        self.raises = raises
        self.takes = takes
        # Whether the method's result goes back to torch (a step pre-hook's new arguments); else
        # None, which every registry reads as "nothing changed".
        self.returns = returns

    @torch.compiler.disable
    def __call__(self, *args):
        owner = self.owner()
        if owner is None:
            return None
        try:
            result = getattr(owner, self.method)(*args[:self.takes])
        except self.raises:
            raise
        except Exception:
            if self.on_error is not None:
                self.on_error(owner)
            return None
        return result if self.returns else None

    def __repr__(self) -> str:
        return f"<numguard WeakHook {self.method}>"


class PicklesWithoutLock:
    """A collection kept by the user (`guard.history`, `guard.headroom`) that holds a `_lock`:
    pickled and copied without it, a new one made as it is loaded."""

    def __init__(self):
        self._lock = threading.Lock()  # (its values are added from the threads that run passes)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class LiveHandles(list):
    """Handles of hooks on tensors and graph nodes. Those whose tensor or graph is gone need no
    removal and are dropped (`prune`), once the list has doubled since the last time: bounded
    over a long run, at an amortised cost. `remove_all` removes the rest."""

    __slots__ = ("kept", "slack")

    def __init__(self, slack: int = 64):
        super().__init__()
        self.kept = 0  # live handles after the last pruning
        self.slack = slack

    def add(self, handle) -> None:
        self.append(handle)
        if len(self) > 2 * self.kept + self.slack:
            self.prune()

    def prune(self) -> None:
        self[:] = [h for h in self if h.hooks_dict_ref() is not None]  # in place: other threads
        self.kept = len(self)

    def remove_all(self) -> None:
        for handle in self:
            handle.remove()
        self.clear()
        self.kept = 0


class TensorHookHandle:
    """A hook on a tensor, as `register_tensor_hook` registers it: `remove()`, and the weak
    reference to its hook dict that `LiveHandles` prunes on (a `RemovableHandle`'s two)."""

    __slots__ = ("hooks_dict_ref", "id")

    def __init__(self, hooks: dict, key: int):
        self.hooks_dict_ref = weakref.ref(hooks)
        self.id = key

    def remove(self) -> None:
        hooks = self.hooks_dict_ref()
        if hooks is not None:
            hooks.pop(self.id, None)


def register_tensor_hook(t: torch.Tensor, hook) -> "TensorHookHandle":
    """`t.register_hook(hook)` at a fifth of its host time (1 against 4-9 us, a hook per module
    output a step in full mode): the same dict on the tensor and on its graph node, without the
    import and `RemovableHandle` torch makes per call. A tensor subclass, or one under a torch
    function mode, goes through `register_hook` (its override or the mode sees it)."""
    if type(t) is not torch.Tensor or torch._C._has_torch_function_unary(t):
        return t.register_hook(hook)
    hooks = t._backward_hooks
    if hooks is None:
        if not t.requires_grad:  # (torch's own error)
            return t.register_hook(hook)
        hooks = t._backward_hooks = collections.OrderedDict()
        grad_fn = t.grad_fn
        if grad_fn is not None:
            grad_fn._register_hook_dict(t)
    key = _HANDLE_IDS.next_id
    _HANDLE_IDS.next_id = key + 1
    hooks[key] = hook
    return TensorHookHandle(hooks, key)


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning its caller gives point at the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and is_internal_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def host_memory_available() -> Optional[int]:
    """Bytes of host memory this process can still get without swapping or being killed: Linux's
    MemAvailable, or less where a container's memory limit (cgroup v2 or v1) leaves less. None
    where that is not known."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for directory, limit_name, usage_name, cache_name in (
        ("/sys/fs/cgroup/", "memory.max", "memory.current", "inactive_file"),
        ("/sys/fs/cgroup/memory/", "memory.limit_in_bytes", "memory.usage_in_bytes",
         "total_inactive_file"),
    ):
        try:
            with open(directory + limit_name) as f:
                limit = f.read().strip()
            with open(directory + usage_name) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max", or v1's "no limit" sentinel
            # Page cache the kernel can drop counts as usage there; the working set does not.
            usage -= _cgroup_stat(directory + "memory.stat", cache_name)
            headroom = max(0, int(limit) - usage)
            available = headroom if available is None else min(available, headroom)
        break
    return available


def _cgroup_stat(path: str, key: str) -> int:
    try:
        with open(path) as stat:
            for line in stat:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def format_bytes(count: int) -> str:
    """'1.5 GB', '320 MB', '12 kB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count} B"


def format_abs_max(value: Optional[float]) -> str:
    """An abs max as a comparison shows it: '1.2e+03', 'inf', 'nan', '-' when missing."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    return f"{value:.3g}"


def format_ratio(ratio: Optional[float]) -> str:
    """'12.5x', or what an infinite ratio means."""
    if ratio is None:
        return "-"
    if math.isinf(ratio):
        return "finite vs inf/nan or 0"
    return f"{ratio:.3g}x"


def trainer_model(obj):
    """The model a trainer-like object stands for, or None: an object whose class has a `train`
    method and whose `.model` is a torch.nn.Module (Hugging Face's Trainer and its subclasses,
    and look-alikes). Only the class is searched for `train`, so no instance `__getattr__` of an
    arbitrary object runs."""
    from torch import nn

    if isinstance(obj, (type, nn.Module)) or not callable(getattr(type(obj), "train", None)):
        return None
    try:
        model = getattr(obj, "model", None)
    except Exception:
        return None
    return model if isinstance(model, nn.Module) else None


def is_hf_trainer(obj) -> bool:
    """A Hugging Face `Trainer` (any subclass: Seq2SeqTrainer, ...), matched by class name so that
    transformers need not be imported: a trainer-like object (`trainer_model`) with a training
    set attribute."""
    return (trainer_model(obj) is not None and hasattr(obj, "train_dataset")
            and any(klass.__name__ == "Trainer" for klass in type(obj).__mro__))


def qualified_name(prefix: str, name: str) -> str:
    """`prefix.name` as `named_modules()` joins names ("" stands for the model itself)."""
    return name if not prefix else (f"{prefix}.{name}" if name else prefix)


def module_words(module_name: str, module_class: str) -> str:
    """How a sentence names a module: 'encoder.block.0 (T5Block)'; a model, whose name is empty,
    by its class alone."""
    return f"{module_name} ({module_class})" if module_name else module_class


def compiled_original(module) -> Optional[torch.nn.Module]:
    """The original model of a `torch.compile` wrapper, else None (without importing Dynamo: no
    wrapper exists before it is imported)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return None


def function_name(func) -> str:
    """'torch.log', 'Tensor.div', 'torch.nn.functional.cross_entropy'."""
    known = _names.get(func)
    if known is None:
        known = _names[func] = _name_of(func)
    return known


_names: dict = {}  # function -> its name: looked up once


def _name_of(func) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    name = name.replace("_VariableFunctionsClass.", "torch.").replace("TensorBase.", "Tensor.")
    module = getattr(func, "__module__", None)
    if "." not in name and module:
        name = f"{module}.{name}"
    return name
