"""The dispatch mode of an op-localisation re-run, and the checks it makes on every ATen op.

`RerunMode` is entered around the re-run of a top-level call (see `rerun`). It:

- outside the culprit's call only watches writes, so that every parameter, buffer or input the
  re-run writes to is copied first and put back afterwards (values and version counters), and a
  re-run that cannot be exact (the model rewrites its inputs or weights in forward, or reads a
  buffer it also updates) is reported as not reproduced instead of guessed at;
- inside the culprit's call (the `call_index`-th, counted with temporary forward hooks) checks
  every ATen op and stops at the first whose outputs hold nan or inf (or, with `limit`, a
  magnitude beyond it) that its inputs, tensors and scalars, did not hold, noting the innermost
  Python frame outside torch/ and numguard_nb/;
- for backward, records the autograd nodes created inside the culprit's call with the line that
  created each, and in the backward stage checks only the ops executed by one of those nodes
  (`torch._C._current_autograd_node()`).
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import _tree, numerics
from .._schema import FORWARD, PROBLEM_NAN
from .._util import error_line, user_frame

__all__ = ["RerunMode", "nonfinite_kinds", "kinds_phrase"]

# What an op's values can hold that matters here: nan, and inf of either sign (or, with a limit,
# a magnitude beyond it). Coarser than the guard's problem kinds: an op is only asked whether it
# made something non-finite that it was not given.
_EMPTY = frozenset()
_NAN = PROBLEM_NAN
_INF = "inf"


# Ops whose outputs hold uninitialised memory: garbage in them is not a numerical problem.
_UNINITIALISED = frozenset((
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
    "resize_", "resize_as_", "set_", "_empty_affine_quantized",
    "_empty_per_channel_affine_quantized",
))
# Ops that update their running-statistics arguments without saying so in their schema
# (argument positions 3 and 4 when argument 5, `training`, is true).
_UNANNOTATED_STAT_WRITERS = frozenset((
    "aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm",
))


# ---- checks on values and ops ----------------------------------------------------------------
def _user_line():
    """(filename, lineno) of the user's line that is running, or (None, None)."""
    frame = user_frame()
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else (None, None)


def _scalar_kinds(value, limit) -> frozenset:
    if isinstance(value, bool) or not isinstance(value, (float, complex)):
        return _EMPTY
    if isinstance(value, complex):
        parts = (value.real, value.imag)
    else:
        parts = (value,)
    kinds = set()
    for part in parts:
        if math.isnan(part):
            kinds.add(_NAN)
        elif math.isinf(part) or (limit is not None and abs(part) > limit):
            kinds.add(_INF)
    return frozenset(kinds)


def nonfinite_kinds(values, limit=None) -> frozenset:
    """{'nan', 'inf'} subset held by tensors and float scalars in `values` (one sync per device).

    With `limit`, a magnitude above it counts as 'inf'. Call with autograd and the mode's checks off.
    """
    kinds = set()
    flags: dict = {}
    for value in values:
        if not isinstance(value, torch.Tensor):
            kinds |= _scalar_kinds(value, limit)
            continue
        try:
            if not (value.is_floating_point() or value.is_complex()) or value.numel() == 0:
                continue
            if value.layout != torch.strided or value.is_nested:
                value = numerics.stored_values(value)  # (sparse and nested: what they store)
                if value is None:
                    continue
            nan = value.isnan().any()
            inf = (value.abs() > limit).any() if limit is not None else value.isinf().any()
            flags.setdefault(value.device, []).extend((nan, inf))
        except Exception:  # meta, fake or exotic tensors: no numbers to read
            continue
    for pairs in flags.values():
        try:
            host = numerics.read(torch.stack(pairs))
        except Exception:
            continue
        if any(host[0::2]):
            kinds.add(_NAN)
        if any(host[1::2]):
            kinds.add(_INF)
    return frozenset(kinds)


def kinds_phrase(kinds) -> str:
    """'nan and inf', 'inf', ... for a sentence."""
    return " and ".join(k for k in (_NAN, _INF) if k in kinds) or "finite values"


def _storage_key(t: torch.Tensor):
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:
        return None
    if not ptr:
        return None
    return (t.device.type, t.device.index, ptr)


class _OpInfo:
    __slots__ = ("name", "writes", "skip", "seeded", "stat_writer")

    def __init__(self, func):
        self.name = str(func)
        schema = func._schema
        self.writes = tuple(
            (index, arg.name, arg.kwarg_only)
            for index, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        base = schema.name.split("::")[-1]
        self.skip = base in _UNINITIALISED
        try:
            self.seeded = torch.Tag.nondeterministic_seeded in func.tags
        except Exception:
            self.seeded = False
        self.stat_writer = schema.name in _UNANNOTATED_STAT_WRITERS


_op_infos: dict = {}


def _op_info(func) -> _OpInfo:
    info = _op_infos.get(func)
    if info is None:
        info = _op_infos[func] = _OpInfo(func)
    return info


def _current_node():
    """The autograd node being executed on this thread, or None."""
    getter = getattr(torch._C, "_current_autograd_node", None)
    return getter() if getter is not None else None


# ---- the mode ----------------------------------------------------------------------------------

def _float_buffers(module) -> list:
    return [b for b in module._buffers.values() if b is not None and b.is_floating_point()]


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None

class RerunMode(TorchDispatchMode):
    """The dispatch mode of one re-run: protects state everywhere, checks ops in the culprit."""

    def __init__(self, culprit, call_index, limit, record_nodes, has_rng, allow_inf=False):
        super().__init__()
        self.culprit_class = type(culprit).__name__
        self.target = call_index
        self.limit = limit
        self.ignored = frozenset((_INF,)) if allow_inf else _EMPTY  # kinds that are no news
        self.record_nodes = record_nodes
        self.has_rng = has_rng
        self.stage = FORWARD
        self.tls = threading.local()
        self.lock = threading.Lock()
        # the culprit's calls
        self.calls = 0
        self.open_calls: list = []
        self.active = 0  # > 0 while the target call runs
        self.target_done = False
        self.in_kinds = _EMPTY  # what the target call received (inputs and own weights)
        self.out_kinds = _EMPTY  # what it returned
        self.made = 0  # ops that made inf or nan in the call (forward)
        self.roots: dict = {}  # storage key -> (the tensor, weakly; the op that made its inf/nan)
        self.output_root: Optional[dict] = None  # the op that made what the call returned
        self.grad_inputs: list = []  # its tensor inputs that require grad (backward)
        self.grad_out_kinds = _EMPTY  # what the gradients reaching its outputs held (backward)
        self.leaves: dict = {}  # id -> leaf requiring grad used by an op of the target call
        # the first bad op
        self.found: Optional[dict] = None
        # autograd nodes created by the target call: node -> (op, filename, lineno)
        self.pending: list = []
        self.nodes: dict = {}
        self.saved: dict = {}  # autograd node -> storage keys of what it saved in forward
        # state protection
        self.protected: dict = {}  # storage key -> [(kind, name, tensor)]
        self.buffer_keys: set = set()
        self.versions: dict = {}  # id(tensor) -> (tensor, version at start)
        self.snapshots: dict = {}  # id(tensor) -> (tensor, copy before the first write)
        self.written: dict = {}  # (kind, name) -> op that wrote
        self.buffer_reads: set = set()
        self.restarted: set = set()  # names of buffers set back to the failing call's start
        self.swapped: list = []  # (module, name, buffer it held) for buffers swapped for a re-run
        self.seeded_op: Optional[str] = None
        self.errors: list = []

    # ---- protection ----------------------------------------------------------------------
    def protect(self, kind: str, name: str, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None:
            return
        entries = self.protected.setdefault(key, [])
        if any(e[2] is t for e in entries):
            return
        entries.append((kind, name, t))
        if kind == "buffer":
            self.buffer_keys.add(key)
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter
            version = None
        self.versions.setdefault(id(t), (t, version))

    def start_from(self, module, name: str, buffer, value: torch.Tensor) -> None:
        """Set `module`'s buffer `name` back to `value`, what it held when the failing call began
        (`buffer()`, then; its forward updated it since, in place or by assigning a new tensor),
        keeping what it holds now for `restore`: a forward that reads what it updates then runs
        again as it ran."""
        current = module._buffers.get(name)
        entries = self.protected.get(_storage_key(current)) if current is not None else None
        if not entries or value.shape != current.shape:
            return
        if buffer() is current:
            if id(current) not in self.snapshots:
                self.snapshots[id(current)] = (current, current.detach().clone())
            with torch.no_grad():
                current.copy_(value)
        else:  # assigned anew by the call: the re-run gets the old one's values in its place
            self.swapped.append((module, name, current))
            module._buffers[name] = value.clone()
        self.restarted.update(entry_name for kind, entry_name, _ in entries if kind == "buffer")

    def _note_write(self, t: torch.Tensor, op: str) -> None:
        entries = self.protected.get(_storage_key(t))
        if not entries:
            return
        for kind, name, base in entries:
            if id(base) not in self.snapshots:
                self.snapshots[id(base)] = (base, base.detach().clone())
            self.written.setdefault((kind, name), op)

    def restore(self) -> list:
        """Put back every protected tensor the re-run wrote; returns names it could not."""
        failed = []
        setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
        for base, saved in self.snapshots.values():
            try:
                with (torch.inference_mode() if base.is_inference() else torch.no_grad()):
                    base.copy_(saved)
                version = self.versions.get(id(base), (None, None))[1]
                if setter is not None and version is not None:
                    setter((base,), (version,))
            except Exception:
                failed.append(type(base).__name__)
        self.snapshots.clear()
        for module, name, buffer in self.swapped:
            module._buffers[name] = buffer
        self.swapped.clear()
        return failed

    def inexact_reason(self) -> Optional[str]:
        """Why the re-run cannot have computed what the failing call computed, or None."""
        for (kind, name), op in self.written.items():
            if kind == "input":
                return (f"the model modifies its {name} in place ({op}), so the inputs kept "
                        "from the failing call no longer hold the values it saw")
            if kind == "param":
                return (f"the model modifies its weight {name} in place during forward ({op}), "
                        "so the weights are no longer those of the failing call")
        for (kind, name), op in self.written.items():
            if kind == "buffer" and name in self.buffer_reads and name not in self.restarted:
                return (f"the model reads buffer {name} that its forward also updates ({op}), "
                        "so the re-run started from a different state than the failing call")
        if self.seeded_op is not None and not self.has_rng:
            return (f"no RNG snapshot was given and the forward draws random numbers "
                    f"({self.seeded_op})")
        return None

    # ---- the culprit's calls (forward hooks) -----------------------------------------------
    @contextlib.contextmanager
    def internal(self):
        previous = getattr(self.tls, "internal", False)
        self.tls.internal = True
        try:
            with torch.no_grad():
                yield
        finally:
            self.tls.internal = previous

    def pre_hook(self, module, args, kwargs):
        index = self.calls
        self.calls += 1
        self.open_calls.append(index)
        if index != self.target:
            return None
        try:
            with self.internal():
                received = _tree.tensors((args, kwargs))
                weights = [p for p in module._parameters.values() if p is not None]
                buffers = _float_buffers(module)
                self.buffer_versions = [(name, b, _version(b)) for name, b in module._buffers.items()
                                        if b is not None and b.is_floating_point()]
                self.in_kinds = nonfinite_kinds(received + weights + buffers, self.limit)
                if self.stage == FORWARD and self.record_nodes:
                    self.grad_inputs = [t for t in received if t.requires_grad]
        except Exception as error:
            self.fail(error)
        self.active += 1
        return None

    def post_hook(self, module, args, kwargs, output):
        index = self.open_calls.pop() if self.open_calls else None
        if index != self.target:
            return None
        self.active -= 1
        self.target_done = True
        try:
            with self.internal():
                # what it returned, and the buffers it wrote (as the guard counts them)
                written = [b for name, old, version in self.buffer_versions
                           for b in (module._buffers.get(name),)
                           if b is not None and (b is not old or _version(b) != version)]
                self.out_kinds = nonfinite_kinds(_tree.tensors(output) + written, self.limit)
                if self.stage == FORWARD:
                    self.output_root = self._root_of(_tree.tensors(output) + written)
                    self.roots = {}
                if self.record_nodes:
                    self._resolve(final=True)
                    for t in _tree.tensors(output):
                        if t.requires_grad:
                            t.register_hook(self._grad_output_hook)
        except Exception as error:
            self.fail(error)
        return None

    buffer_versions: list = []  # the target call's floating buffers and their versions at its start

    def _grad_output_hook(self, grad):
        try:
            with self.internal():
                kinds = nonfinite_kinds([grad], self.limit)
            with self.lock:
                self.grad_out_kinds = self.grad_out_kinds | kinds
        except Exception as error:
            self.fail(error)
        return None

    def fail(self, error: BaseException) -> None:
        if len(self.errors) < 3:
            self.errors.append(error_line(error))

    # ---- node bookkeeping -----------------------------------------------------------------
    def _resolve(self, final: bool = False) -> None:
        """Map the grad_fn of the outputs of earlier ops of the target call to those ops."""
        keep = []
        for tensors, where, grad_off in self.pending:
            waiting = False
            for t in tensors:
                fn = t.grad_fn
                if fn is None:
                    # inside an autograd.Function's forward the node is attached on return
                    waiting = waiting or grad_off
                    continue
                self.nodes.setdefault(fn, where)
                if t._is_view():
                    base_fn = t._base.grad_fn
                    if base_fn is not None:
                        self.nodes.setdefault(base_fn, where)
            if waiting and not final:
                keep.append((tensors, where, grad_off))
        self.pending = keep

    # ---- the dispatch ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(self.tls, "internal", False):
            return func(*args, **kwargs)
        context = None
        try:
            context = self._before(func, args, kwargs)
        except Exception as error:
            self.fail(error)
        out = func(*args, **kwargs)
        if context is not None:
            try:
                self._after(func, args, kwargs, out, context)
            except Exception as error:
                self.fail(error)
        return out

    def _before(self, func, args, kwargs):
        info = _op_info(func)
        written = []
        if info.writes:
            for index, name, kwarg_only in info.writes:
                if name in kwargs:
                    value = kwargs[name]
                elif not kwarg_only and index < len(args):
                    value = args[index]
                else:
                    continue
                for t in (value if isinstance(value, (list, tuple)) else (value,)):
                    if isinstance(t, torch.Tensor):
                        written.append((t, kwarg_only))
        if info.stat_writer and len(args) > 5 and args[5] is True:
            written.extend((args[i], False) for i in (3, 4) if isinstance(args[i], torch.Tensor))

        if self.stage == FORWARD:
            if info.seeded and self.seeded_op is None:
                self.seeded_op = info.name
            if self.protected:
                written_ids = set()
                for t, _ in written:
                    written_ids.add(id(t))
                    self._note_write(t, info.name)
                if self.buffer_keys:
                    for t in tree_leaves((args, kwargs)):
                        if isinstance(t, torch.Tensor) and id(t) not in written_ids:
                            key = _storage_key(t)
                            if key in self.buffer_keys:
                                for kind, name, _ in self.protected[key]:
                                    if kind == "buffer":
                                        self.buffer_reads.add(name)
            if self.active <= 0:
                return None
            where = None
            if self.record_nodes:
                self._resolve()
                where = _user_line()
            # a backward re-run checks ops in backward only: its forward may hold hidden inf
            check = not info.skip and not self.record_nodes  # (on past the first: `roots`)
            if not (check or self.record_nodes):
                return None
            return (info, written, where, None, check, self._held(written) if check else _EMPTY)

        # backward: only ops executed by nodes the target call created
        if self.found is not None or info.skip or not self.nodes:
            return None
        node = _current_node()
        if node is None:
            return None
        where = self.nodes.get(node)
        if where is None:
            return None
        return (info, written, where, node, True, self._held(written))

    def _held(self, written) -> frozenset:
        """What the tensors an op is about to update in place hold before it runs (`out=`
        arguments excluded: their old values are overwritten, not used)."""
        updated = [t for t, kwarg_only in written if not kwarg_only]
        return nonfinite_kinds(updated, self.limit) if updated else _EMPTY

    def _after(self, func, args, kwargs, out, context):
        info, written, where, node, check, held = context
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if self.stage == FORWARD and self.record_nodes and outputs:
            self.pending.append((outputs, (info.name,) + tuple(where or (None, None)),
                                 not torch.is_grad_enabled()))
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf:
                    self.leaves.setdefault(id(t), t)
        if not check or (self.found is not None and self.stage != FORWARD):
            return
        with torch.no_grad():
            produced = nonfinite_kinds(outputs, self.limit)
            if not produced:
                return
            written_ids = {id(t) for t, _ in written}
            # tensors updated in place count with what they held before the op
            inputs = [v for v in tree_leaves((args, kwargs))
                      if not (isinstance(v, torch.Tensor) and id(v) in written_ids)]
            received = held | nonfinite_kinds(inputs, self.limit)
            if node is not None:
                # A value the node saved in forward is no gradient it received: a nan the forward
                # hid (nan_to_num, where) comes back through it, and the op that mixes it into
                # the gradient is named. An op on saved values alone that makes nothing new (a
                # mask from them) gives saved values too.
                saved = self._saved_keys(node)
                grads = [v for v in inputs if isinstance(v, torch.Tensor) and _storage_key(v) not in saved]
                if grads:
                    received = held | nonfinite_kinds(grads, self.limit)
                elif not produced - received - self.ignored:
                    self.saved[node] = saved | {_storage_key(t) for t in outputs}
                    return
        if self.stage == FORWARD and received:
            made_here = self._root_of(inputs + [t for t, _ in written])
            if made_here is not None:  # (nan from an inf an earlier op of the call made: that op)
                self._carry(made_here, outputs)
                return
        new = produced - received - self.ignored
        from_number = frozenset()
        if not new and self.stage == FORWARD:  # a Python number given nan (a scale; an inf one
            tensors = [v for v in inputs if isinstance(v, torch.Tensor)]  # may be a mask's fill)
            from_number = new = (produced - held - nonfinite_kinds(tensors, self.limit)
                                 - self.ignored) & {_NAN}
        if not new:
            return
        if self.stage == FORWARD:
            filename, lineno = _user_line()
            self.made += 1
            found = {"op": info.name, "node": None, "filename": filename, "lineno": lineno,
                     "kinds": new, "from_number": bool(from_number), "order": self.made}
            self._carry(found, outputs)
        else:
            _, filename, lineno = where
            found = {"op": info.name, "node": node.name(), "filename": filename,
                     "lineno": lineno, "kinds": new}
        with self.lock:
            if self.found is None:
                self.found = found

    # ---- which op made what the call returned --------------------------------------------------
    # The first op to make inf or nan may make one the call never returns (T5's log(0) of a
    # relative position, which `where` drops): each tensor holding inf or nan made in the call
    # keeps the op that first made its line of values, and the call's outputs name theirs.
    def _carry(self, root: Optional[dict], outputs: list) -> None:
        if root is None:
            return
        for t in outputs:
            key = _storage_key(t)
            if key is not None:
                self.roots[key] = (weakref.ref(t), root)

    def _root_of(self, values) -> Optional[dict]:
        """The earliest op that made the inf or nan of a live tensor among `values` (None: none)."""
        found = None
        for value in values:
            if not isinstance(value, torch.Tensor):
                continue
            entry = self.roots.get(_storage_key(value))
            if entry is not None and entry[0]() is not None and (
                    found is None or entry[1]["order"] < found["order"]):
                found = entry[1]
        return found

    def _saved_keys(self, node) -> frozenset:
        """Storage keys of the tensors an autograd node saved in forward (its `_saved_*`)."""
        keys = self.saved.get(node)
        if keys is None:
            found = set()
            for name in dir(node):
                if not name.startswith("_saved_"):
                    continue
                try:
                    value = getattr(node, name)
                except Exception:  # freed, or not a tensor attribute
                    continue
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        found.add(_storage_key(t))
            keys = self.saved[node] = frozenset(found)
        return keys

    def clear(self) -> None:
        self.saved = {}
        self.pending = []
        self.nodes = {}
        self.leaves = {}
        self.grad_inputs = []
        self.protected = {}
        self.versions = {}
        self.snapshots = {}

