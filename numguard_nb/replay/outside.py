"""The code run outside the guarded modules, recorded for the CPU replay: the loss, the label
lookup, `one_hot`, `gather` and the indexing between a captured call and `.backward()`.

After an asynchronous device error, that code is nearly always where the bad index was: a label
past the number of classes in `F.cross_entropy`, an index past a dimension in `gather`. The loss
watch (guard.outside) sees each torch function it calls; with capture on it hands each one to
`OutsideRecorder.before`/`after`, which keeps:

- the function, by its torch name ('torch.nn.functional.cross_entropy', 'Tensor.gather', or a
  tensor attribute such as 'Tensor.T'): the replay looks the name up in torch and runs nothing
  else, and a bundle holds the name, never code;
- its arguments, each tensor as a reference: to an output of the captured call or of an earlier
  recorded function, to a weight of a guarded model, or a host copy (labels, masks, class
  weights) made as the call's inputs are: queued asynchronously for a GPU tensor, no host
  synchronisation;
- the user's line that called it.

`replay_records` runs them after the replayed call, so that an error raised there is raised at its
real line. Memory stays bounded: at most MAX_RECORDS functions after one call, and host copies of
at most MAX_COPY_BYTES; what is past either is left out, and the replay says so.
"""

from __future__ import annotations

import linecache
import types
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from .. import _tree
from .._util import code_where, error_line, function_name, user_frame
from .location import cell_named
from .host import HostCopies

__all__ = ["OutsideRecord", "OutsideRecorder", "Ref", "replay_records", "encode", "decode",
           "MAX_RECORDS", "MAX_COPY_BYTES"]

MAX_RECORDS = 256  # functions recorded after one captured call
MAX_COPY_BYTES = 256 * 2**20  # host copies made for them

_ATTRIBUTE = types.MethodWrapperType  # a tensor attribute read (`t.T`, `t.grad`)
_CALL, _OP, _PARAM, _COPY, _DEVICE = "call", "op", "param", "copy", "device"


class Ref:
    """A tensor argument of a recorded function: `kind` and where to find it.

    call: output `path` of captured call `index`; op: output `path` of recorded function `number`
    after call `index`; param: weight `name` of guarded model `root`; copy: the host copy `tensor`;
    device: the device the replay runs on (a device the code named)."""

    __slots__ = ("kind", "index", "number", "path", "tensor")

    def __init__(self, kind: str, index=None, number=None, path=(), tensor=None):
        self.kind, self.index, self.number, self.path, self.tensor = kind, index, number, path, tensor

    def __repr__(self) -> str:
        return f"Ref({self.kind}, {self.index}, {self.number}, {self.path})"


class OutsideRecord:
    """One torch function run outside the guarded modules after captured call `index`."""

    __slots__ = ("name", "attribute", "args", "kwargs", "filename", "lineno", "line", "named")

    def __init__(self, name: str, attribute: bool, args, kwargs, filename=None, lineno=None,
                 line="", named: str = ""):
        self.name = name
        self.attribute = attribute
        self.args = args
        self.kwargs = kwargs
        self.filename = filename
        self.lineno = lineno
        self.line = line
        self.named = named  # as a bundle recorded it: a notebook cell's (`location.cell_named`)

    @property
    def where(self) -> str:
        """'Cell In[3], line 4' or 'train.py:12'."""
        if self.named:
            return self.named
        return code_where(self.filename, self.lineno) if self.filename else "an unknown line"

    @property
    def source_line(self) -> str:
        if not self.line and self.filename:
            self.line = linecache.getline(self.filename, self.lineno).strip()
        return self.line

    def __repr__(self) -> str:
        return f"<{self.name} at {self.where}>"


class OutsideRecorder:
    """What the capture knows of the tensors of the current steps, and the records it adds to
    the latest captured call (`call.outside`). Never raises into the user's code."""

    def __init__(self, params: Dict[int, tuple]):
        # id(parameter) -> (its root module, weakly; root name; parameter name): never a weak
        # reference to the parameter itself (swap_tensors refuses a tensor that has one)
        self._params = params
        self._known: Dict[int, tuple] = {}  # id(tensor) -> (weakref, Ref)
        self._pruned_at = 64
        self.call = None  # the captured call the functions run after
        self.copied = 0  # bytes of host copies made for the current call

    def start_call(self, call) -> None:
        """A captured call started: the functions from now on run after it."""
        self.call = call
        self.copied = 0

    def note_output(self, call, output) -> None:
        """The captured call's output: the functions after it find their inputs there."""
        if call is None:
            return
        for path, leaf in _tree.leaves(output):
            if isinstance(leaf, torch.Tensor):
                self._know(leaf, Ref(_CALL, call.index, path=path))

    def before(self, func, args, kwargs) -> Optional[OutsideRecord]:
        """Record one function about to run (None where nothing is recorded)."""
        call = self.call
        if call is None or call.outside_full:
            return None
        if len(call.outside) >= MAX_RECORDS:
            call.outside_full = f"only the first {MAX_RECORDS} functions after it were recorded"
            return None
        try:
            attribute = type(func) is _ATTRIBUTE
            if attribute:  # `t.T`: the getter of a tensor attribute
                name = f"Tensor.{getattr(getattr(func, '__self__', None), '__name__', '?')}"
            else:
                name = function_name(func)
            if not _resolvable(name):
                return None
            frame = user_frame()
            copies = _Copies(self)
            record = OutsideRecord(
                name, attribute, _tree.rebuild(tuple(args), copies.ref, copies.other),
                {k: _tree.rebuild(v, copies.ref, copies.other, (k,)) for k, v in (kwargs or {}).items()},
                frame.f_code.co_filename if frame is not None else None,
                frame.f_lineno if frame is not None else None)
            if copies.too_large:
                call.outside_full = (f"the inputs of {name} at {record.where} were past the "
                                     f"{MAX_COPY_BYTES >> 20} MiB kept for host copies")
                return None
            call.outside.append(record)
            call.add_copy_events(copies.events())
            return record
        except Exception as error:  # recording must never break the step it watches
            call.outside_full = f"recording stopped: {error_line(error)}"
            return None

    def after(self, record: Optional[OutsideRecord], out) -> None:
        """The recorded function's outputs: later functions find their inputs there."""
        call = self.call
        if record is None or call is None:
            return
        number = len(call.outside) - 1
        try:
            for path, leaf in _tree.leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._know(leaf, Ref(_OP, call.index, number, path))
        except Exception:
            pass

    def ref_of(self, t: torch.Tensor) -> Optional[Ref]:
        hit = self._known.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        param = self._params.get(id(t))
        if param is not None:
            module = param[0]()
            if module is not None and _parameter(module, param[2]) is t:
                return Ref(_PARAM, param[1], path=param[2])
        return None

    def _know(self, t: torch.Tensor, ref: Ref) -> None:
        self._known[id(t)] = (weakref.ref(t), ref)
        if len(self._known) > self._pruned_at:  # drop tensors gone since (amortised)
            self._known = {k: v for k, v in self._known.items() if v[0]() is not None}
            self._pruned_at = max(64, 2 * len(self._known))


def _parameter(module, name: str):
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


class _Copies:
    """The references and host copies of one recorded function's arguments."""

    def __init__(self, recorder: OutsideRecorder):
        self.recorder = recorder
        self.host = HostCopies()
        self.too_large = False

    def ref(self, t: torch.Tensor, path) -> Ref:
        known = self.recorder.ref_of(t)
        if known is not None:
            return known
        size = t.numel() * t.element_size()
        if self.recorder.copied + size > MAX_COPY_BYTES:
            self.too_large = True
            return Ref(_COPY)
        self.recorder.copied += size
        return Ref(_COPY, tensor=self.host.copy(t, path))

    def other(self, value, path):
        return Ref(_DEVICE) if isinstance(value, torch.device) else value

    def events(self) -> list:
        return self.host.finished_events() if self.host.cuda_devices else []


# ---- replaying ---------------------------------------------------------------------------------
def _resolvable(name: str) -> bool:
    return name.startswith("torch.") or name.startswith("Tensor.")


def resolve(name: str, attribute: bool = False):
    """The torch function a record names ('torch.nn.functional.cross_entropy', 'Tensor.gather');
    a tensor attribute's getter for an attribute. Only torch's own names are looked up."""
    if attribute:
        attr = name.split(".", 1)[1]
        return lambda t: getattr(t, attr)
    if not _resolvable(name):
        raise LookupError(f"{name} is not a torch function")
    parts = name.split(".")
    obj = torch.Tensor if parts[0] == "Tensor" else torch
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


class Unreplayable(Exception):
    """A recorded function's input cannot be had in this replay; the message says which."""


def replay_records(call, records: List[OutsideRecord], device: torch.device, upcast: bool,
                   outputs: Dict[int, object], modules: dict, snapshots: dict):
    """Run `records` (recorded after captured call `call.index`) on `device`. `outputs` maps each
    replayed call's index to its output; the records' outputs are added under (index, number).
    Returns (the record that raised, its exception), or (None, None)."""
    low = (torch.float16, torch.bfloat16)

    def value(ref):
        if not isinstance(ref, Ref):
            return ref
        if ref.kind == _DEVICE:
            return device
        if ref.kind == _COPY:
            if ref.tensor is None:
                raise Unreplayable("an input too large to copy")
            t = ref.tensor
            dtype = torch.float32 if upcast and t.dtype in low else None
            out = t.detach().to(device=device, dtype=dtype, copy=True)
            return out.requires_grad_(True) if t.requires_grad and out.is_floating_point() else out
        if ref.kind == _PARAM:
            module = modules.get(ref.index)
            if module is not None:
                return module.get_parameter(ref.path)
            if ref.index in snapshots and ref.path in snapshots[ref.index].tensors:
                return snapshots[ref.index].tensors[ref.path].to(device)
            raise Unreplayable(f"the weight {ref.path} of {ref.index or 'the model'}, not replayed")
        key = ref.index if ref.kind == _CALL else (ref.index, ref.number)
        if key not in outputs:
            what = f"call {ref.index}" if ref.kind == _CALL else f"function {ref.number} after call {ref.index}"
            raise Unreplayable(f"an output of {what}, which this replay did not run")
        return _at(outputs[key], ref.path)

    for number, record in enumerate(records):
        try:
            func = resolve(record.name, record.attribute)
        except (AttributeError, LookupError):
            raise Unreplayable(f"{record.name} at {record.where}, which this torch does not have") from None
        if record.name == "Tensor.cuda":  # the replay's device instead
            func = lambda t, *a, **k: t.to(device)  # noqa: E731
        args = tuple(_on_device(a, device) for a in
                     _tree.rebuild(tuple(record.args), lambda t, p: t, lambda v, p: value(v)))
        kwargs = {k: _on_device(_tree.rebuild(v, lambda t, p: t, lambda x, p: value(x)), device)
                  for k, v in record.kwargs.items()}
        try:
            out = func(*args, **kwargs)
        except Exception as error:  # the point of the replay: keep it
            return record, error
        outputs[(call.index, number)] = out
    return None, None


def _on_device(value, device: torch.device):
    """A device the code named by its string ('cuda', 'cuda:0'): the replay's device instead."""
    return device if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")) else value


def _at(value, path: tuple):
    for key in path:
        value = value[key] if isinstance(value, (tuple, list, dict)) else getattr(value, key)
    return value


# ---- bundles -------------------------------------------------------------------------------------
# weights_only loading reads dicts, lists, tuples, str, int, float, bool, None and tensors: what a
# record holds besides is written as a tagged dict.
_TAG = "__numguard__"


def encode(records: List[OutsideRecord]) -> Tuple[list, str]:
    """The records as plain values (a bundle), and "" or why the list stops early: a value a
    bundle cannot hold stops it there (a replay of the rest would run without it)."""
    out = []
    for record in records:
        try:
            entry = {"name": record.name, "attribute": record.attribute,
                     "args": _encode(tuple(record.args)), "kwargs": _encode(dict(record.kwargs)),
                     "filename": record.filename, "lineno": record.lineno,
                     "line": record.source_line, "where": record.where}
        except TypeError as error:
            return out, (f"the bundle holds the functions before {record.name} at {record.where}, "
                         f"one of whose arguments is a {error}, which a bundle cannot hold")
        out.append(entry)
    return out, ""


_NUMPY_SCALARS = {"b": bool, "i": int, "u": int, "f": float}  # numpy's dtype kinds


def _encode(value):
    if isinstance(value, Ref):
        path = value.path if isinstance(value.path, str) else list(value.path)  # a weight's name
        return {_TAG: "ref", "kind": value.kind, "index": value.index, "number": value.number,
                "path": path, "tensor": value.tensor}
    if isinstance(value, torch.Tensor):
        return value
    if value is None or type(value) in (bool, int, float, str):
        return value
    plain = _NUMPY_SCALARS.get(getattr(getattr(value, "dtype", None), "kind", None))
    if plain is not None and type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return plain(value)  # a numpy scalar or 0-d array (a temperature from a config), as torch reads it
    for plain in (bool, int, float, str):  # a subclass (an IntEnum) as torch reads it
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, slice):
        return {_TAG: "slice", "args": [_encode(value.start), _encode(value.stop), _encode(value.step)]}
    if value is Ellipsis:
        return {_TAG: "ellipsis"}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "name": str(value).replace("torch.", "")}
    if isinstance(value, (torch.memory_format, torch.layout)):
        return {_TAG: "torch", "name": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {_TAG: "device", "name": str(value)}
    if isinstance(value, (tuple, list)) and not hasattr(type(value), "_fields"):
        items = [_encode(v) for v in value]
        return {_TAG: "tuple", "items": items} if isinstance(value, tuple) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _encode(v) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def decode(entries: list) -> List[OutsideRecord]:
    return [OutsideRecord(str(e["name"]), bool(e["attribute"]), _decode(e["args"]), _decode(e["kwargs"]),
                          e.get("filename"), e.get("lineno"), e.get("line", ""),
                          cell_named(e.get("where", "")))
            for e in entries]


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        tag = value.get(_TAG)
        if tag == "ref":
            path = value["path"] if isinstance(value["path"], str) else tuple(value["path"])
            return Ref(value["kind"], value["index"], value["number"], path, value["tensor"])
        if tag == "slice":
            return slice(*(_decode(v) for v in value["args"]))
        if tag == "ellipsis":
            return Ellipsis
        if tag in ("dtype", "torch"):  # torch's dtypes; its memory formats and layouts
            return getattr(torch, value["name"])
        if tag == "device":
            return torch.device(value["name"])
        if tag == "tuple":
            return tuple(_decode(v) for v in value["items"])
        return {k: _decode(v) for k, v in value.items()}
    return value
