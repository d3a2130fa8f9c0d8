"""What names a function run outside the guarded modules: its ATen op and the user's line (its
name: `_util.function_name`).

- `user_where()` / `source_of(where)`: the user's line running now, kept cheaply, and later
  written as 'file.py:12: code' or, for a notebook cell, as IPython writes it:
  'Cell In[5], line 3: code';
- `aten_ops(func, args, kwargs, on_values)`: the ATen ops a function runs, found by running it
  again under a recording dispatch mode: on its values (grad off, random streams restored),
  which also says which op first made a non-finite value it was not given; or on meta tensors
  of its arguments' shapes (`Meta`), where the values are gone or were overwritten in place.
  `likeliest(ops, node)` picks among ops known only by name.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import warnings
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _tree, numerics
from .._schema import PROBLEM_NAN, PROBLEM_NEGINF, PROBLEM_POSINF
from .._util import code_where, function_name, is_internal_file, user_frame
from .passes import FINE

__all__ = ["user_where", "in_optimizer", "source_of", "scalar_kinds", "Meta", "input_role",
           "aten_ops", "likeliest", "fallback_op", "node_op"]

_NAN = frozenset((PROBLEM_NAN,))
_POSINF = frozenset((PROBLEM_POSINF,))
_NEGINF = frozenset((PROBLEM_NEGINF,))


# ---- where: the user's line -------------------------------------------------------------------
def user_where() -> Optional[tuple]:
    """(filename, line number) of the user's line running now, or None."""
    frame = user_frame()
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else None


def in_optimizer() -> bool:
    """Whether the function running now was called by torch.optim's code (an optimizer step, a
    learning-rate scheduler) rather than by the user's own."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_OPTIM_DIR):
            return True
        if not is_internal_file(filename):
            return False
        frame = frame.f_back
    return False


_OPTIM_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.optim.__file__)), "")


def source_of(where: Optional[tuple]) -> Optional[str]:
    """'file.py:12: code' or 'Cell In[5], line 3: code' of a `user_where` triple."""
    if where is None:
        return None
    filename, lineno = where
    label = code_where(filename, lineno)
    code = linecache.getline(filename, lineno).strip()
    return f"{label}: {code}" if code else label


# ---- the ATen op ------------------------------------------------------------------------------
# ATen ops (base names) that turn finite values into inf or nan, in the order a function that
# runs several is suspected of it when only their names are known.
_MAKERS = ("log", "log2", "log10", "log1p", "xlogy", "div", "reciprocal", "true_divide",
           "remainder", "fmod", "sqrt", "rsqrt", "pow", "exp", "exp2", "expm1",
           "nll_loss_forward", "nll_loss2d_forward", "mse_loss", "binary_cross_entropy",
           "mean", "sum", "mul", "addmm", "mm", "bmm")


def _kinds_of(value) -> frozenset:
    """The problem kinds held by the tensors and float scalars nested in `value` (host reads)."""
    kinds = set()
    for _, leaf in _tree.leaves(value):
        if isinstance(leaf, torch.Tensor):
            if leaf.is_floating_point() and leaf.numel() and not leaf.is_meta:
                nan, posinf, neginf = numerics.nonfinite_kinds(leaf)
                kinds.update(kind for kind, held in ((PROBLEM_NAN, nan), (PROBLEM_POSINF, posinf),
                                                     (PROBLEM_NEGINF, neginf)) if held)
        else:
            kinds |= scalar_kinds(leaf)
    return frozenset(kinds)


def scalar_kinds(value) -> frozenset:
    if type(value) is not float:
        return FINE
    if value != value:
        return _NAN
    if value == float("inf"):
        return _POSINF
    if value == float("-inf"):
        return _NEGINF
    return FINE


class _AtenOps(TorchDispatchMode):
    """Entered around one function: the ATen ops it runs (views left out) and, with `check`, the
    first whose outputs hold a problem kind its inputs did not."""

    def __init__(self, check: bool):
        super().__init__()
        self.check = check
        self.ops: list = []
        self.first_new: Optional[str] = None

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.__name__.startswith(("detach", "alias", "lift")):
            return out
        name = str(func)
        self.ops.append(name)
        if self.check and self.first_new is None and _kinds_of(out) - _kinds_of((args, kwargs)):
            self.first_new = name
        return out


def _base(op: str) -> str:
    """'aten.nll_loss_forward.default' -> 'nll_loss_forward', 'aten._log_softmax.default' ->
    'log_softmax', 'aten.log_.default' -> 'log'."""
    name = op.split(".")[1] if op.count(".") >= 2 else op
    name = name.lstrip("_")
    return name[:-1] if name.endswith("_") else name


def likeliest(ops: list, node: str = "") -> Optional[str]:
    """Of a function's ATen ops known only by name: the one behind `node` ('SqrtBackward0'),
    else the first that can make a non-finite value from finite ones, else the last."""
    if not ops:
        return None
    if node:
        wanted = _node_base(node)
        named = [op for op in ops if _base(op) == wanted]
        if named:
            return named[0]
    for maker in _MAKERS:
        for op in ops:
            if _base(op) == maker:
                return op
    return ops[-1]


def _node_base(node: str) -> str:
    """'SqrtBackward0' -> 'sqrt', 'LogSoftmaxBackward0' -> 'log_softmax'."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", re.sub(r"Backward\d*$", "", node)).lower()


def _aten_name(name: str) -> Optional[str]:
    """'aten.log.default', 'aten.div.Tensor' (the overload a Python number takes too), or
    'aten.pow' where the overload is not known; None for a name that is no ATen op."""
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    try:
        overloads = packet.overloads() if packet is not None else []
    except Exception:
        overloads = []
    if not overloads:
        return None
    for overload in ("default", "Tensor"):
        if overload in overloads:
            return f"aten.{name}.{overload}"
    return f"aten.{name}"


def fallback_op(func) -> str:
    """The ATen op of the function's name ('aten.log.default'), where no replay could run;
    else the function's own name."""
    name = getattr(func, "__name__", "") or ""
    return _aten_name(name.rstrip("_")) or function_name(func)


def node_op(node: str, func) -> str:
    """The forward ATen op behind an autograd node that `func` made ('SqrtBackward0',
    `Tensor.sqrt` -> 'aten.sqrt.default'), from their names."""
    op = fallback_op(func)
    wanted = _node_base(node)
    if _base(op) == wanted:
        return op
    return _aten_name(wanted) or _aten_name("_" + wanted) or op  # ToCopyBackward0: _to_copy


class Meta:
    """A tensor argument kept by shape and dtype only, to run the function again on meta."""

    __slots__ = ("shape", "stride", "dtype")

    def __init__(self, t: torch.Tensor):
        self.shape = tuple(t.shape)
        self.stride = t.stride() if t.layout is torch.strided else None
        self.dtype = t.dtype

    def tensor(self) -> torch.Tensor:
        if self.stride is None:
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")


def _as_meta(value):
    """`value` with its tensors as meta tensors (from tensors or kept `Meta`s)."""
    return _tree.rebuild(value, lambda t, _: Meta(t).tensor(),
                         lambda v, _: v.tensor() if isinstance(v, Meta) else v)


def aten_ops(func, args, kwargs, on_values: bool):
    """(ops run, the first that made a new problem kind or None) by running `func` again: on its
    values with `on_values` (grad off, random streams restored), else on meta tensors."""
    namer = _AtenOps(check=on_values)
    try:  # (its warnings were given once, by the call itself)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if on_values:
                devices = sorted({t.device.index or 0 for t in _tree.tensors((args, kwargs))
                                  if t.is_cuda})
                with torch.random.fork_rng(devices=devices), namer:
                    func(*args, **kwargs)
            else:
                meta_args, meta_kwargs = _as_meta((args, kwargs))
                with namer:
                    func(*meta_args, **meta_kwargs)
    except Exception:  # a function that cannot run again (data-dependent shapes on meta, ...)
        pass
    return namer.ops, namer.first_new


def input_role(role: str) -> str:
    """'input[1]' for args[1] ('input[0]' is the args tuple) and 'input[name]' for a keyword."""
    for prefix in ("input[0]", "input[1]"):
        if role.startswith(prefix):
            return "input" + role[len(prefix):]
    return role
