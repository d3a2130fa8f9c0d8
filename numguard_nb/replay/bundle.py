"""Replay bundles: a captured call written to a file, and read back in a fresh kernel.

A bundle is a dict of tensors and plain values that `torch.load(weights_only=True)` reads, so
loading one never executes code: the weight snapshot of every module in the call's chain, the
calls' host copies of their inputs, and their state (RNG, autocast, grad mode). The layout
(format BUNDLE_VERSION) is read by `load_capture` (replay.load).
"""

from __future__ import annotations

import datetime
import linecache
import os
import pickle
import re
from typing import Dict, List, Optional

import torch
from torch import nn

from .. import _tree
from .._util import dtype_name, error_line, first_line
from .._version import __version__
from ..rerun import CallState
from ..errors import ReplayError
from . import outside
from .location import CALL_SITE, Location, cell_named
from .snapshot import TORCH_LOSSES, _Snapshot, named_tensors, qualified_name

BUNDLE_FORMAT = "numguard_nb.replay"
BUNDLE_VERSION = 1

NOT_A_BUNDLE = "pass a file written by replay_after_error or CapturedCall.save"


# ---- writing ----------------------------------------------------------------------------------
def save(call, path) -> str:
    """Write `call` (after the calls that fed it) to `path`; refuse inputs a bundle cannot hold."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"numguard: {path} is a folder: give the bundle a file name, e.g. "
                         f"{os.path.join(path, 'numguard_replay.pt')}")
    chain = call.chain()
    for link in chain:
        link.wait_for_copies()
    calls = [_call_entry(link) for link in chain]
    roots = []
    for link in chain:
        if link.root_name not in roots:
            roots.append(link.root_name)
    contents = {
        "format": BUNDLE_FORMAT,
        "format_version": BUNDLE_VERSION,
        "torch_version": str(torch.__version__),
        "numguard_version": str(__version__),
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "roots": roots,
        "models": {root: _snapshot_entry(call.source.snapshots[root]) for root in roots},
        "calls": calls,
        "target": len(calls) - 1,
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    partial = f"{path}.part"
    try:  # never leave half a bundle behind (a full disk, an interrupt)
        torch.save(contents, partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def _snapshot_entry(snapshot: _Snapshot) -> dict:
    return {
        "class": snapshot.class_name, "tensors": dict(snapshot.tensors),
        "kinds": dict(snapshot.kinds), "requires_grad": dict(snapshot.requires_grad),
        "devices": list(snapshot.devices), "dtypes": snapshot.dtypes(),
        "settings": {str(k): _plain_scalar(v) for k, v in snapshot.settings.items()},
    }


def _call_entry(call) -> dict:
    rejected: List[str] = []
    args = _plain(tuple(call.args), (), rejected)
    kwargs = {k: _plain(v, (k,), rejected) for k, v in call.kwargs.items()}
    if rejected:
        raise ReplayError(
            f"cannot save the call of {call.label}: the bundle holds only tensors and plain "
            f"values, and {', '.join(rejected)} {'is' if len(rejected) == 1 else 'are'} not; "
            "pass tensors (or replay in this kernel with .replay())"
        )
    site = call.call_site
    recorded, cut_short = outside.encode(call.outside)
    return {
        "root": call.root_name, "module_class": call.module_class, "index": call.index,
        "args": args, "kwargs": kwargs,
        "cpu_rng_state": call.state.cpu, "cuda_rng_state": call.cuda_rng_state,
        "cuda_device": call.cuda_device, "grad_enabled": call.state.grad_enabled,
        "training": call.training,
        "autocast": {device: [True, dtype_name(dtype)] for device, dtype in call.state.autocast},
        "weights_changed": call.weights_changed,
        "outside": recorded, "outside_full": call.outside_full or cut_short,
        "input_devices": list(call.input_devices),
        "input_dtypes": sorted({dtype_name(t.dtype) for t in _tree.tensors((args, kwargs))}),
        "call_site": None if site is None else
        {"filename": str(site.filename), "lineno": int(site.lineno), "function": str(site.function),
         "line": site.line or linecache.getline(site.filename, site.lineno).strip(),
         "where": site.where},
    }


def _plain(value, path: tuple, rejected: List[str], depth: int = 0):
    """`value` in the containers weights_only loading reads (plain tuples, lists, and dicts with
    str or int keys), tensors as plain tensors and scalars as builtin types. Anything else
    (objects, namedtuples, dataclasses) is named in `rejected` and left out.

    This is a rule of its own rather than `_tree.rebuild`, which keeps each container's type:
    a namedtuple or a dict subclass would be written and then refused when the bundle is loaded."""
    if isinstance(value, torch.Tensor):
        return value if type(value) is torch.Tensor else value.as_subclass(torch.Tensor)
    if value is None or isinstance(value, (bool, int, float, str)):
        return _plain_scalar(value)
    if depth < _tree.MAX_DEPTH:
        if isinstance(value, (tuple, list)) and not hasattr(type(value), "_fields"):
            items = [_plain(v, path + (i,), rejected, depth + 1) for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        if isinstance(value, dict) and all(isinstance(k, (str, int)) for k in value):
            return {_plain_scalar(k): _plain(v, path + (k,), rejected, depth + 1)
                    for k, v in value.items()}
    rejected.append(f"{_tree.role_of('input', path)} ({type(value).__name__})")
    return None


def _plain_scalar(value):
    """bool/int/float/str subclasses (numpy floats, TorchVersion) as the builtin type, which
    weights_only loading accepts."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return value if type(value) is kind else kind(value)
    return value


# ---- reading ----------------------------------------------------------------------------------
def read(path: str) -> dict:
    """The bundle's contents, checked to be a numguard bundle this version reads."""
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
        raise ReplayError(f"{path} cannot be read as a replay bundle ({error_line(error)}): it is "
                          f"another kind of file, or one cut short or damaged; {NOT_A_BUNDLE}") from None
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        what = f"a dict with keys {', '.join(map(str, list(data)[:5]))}" if isinstance(data, dict) \
            else f"a {type(data).__name__}"
        raise ReplayError(f"{path} is not a numguard replay bundle (it holds {what}): "
                          f"{NOT_A_BUNDLE}")
    if data.get("format_version") != BUNDLE_VERSION:
        raise ReplayError(f"{path} is a numguard bundle of format {data.get('format_version')}, this "
                          f"numguard reads format {BUNDLE_VERSION}: replay it with the numguard_nb "
                          f"version that wrote it ({data.get('numguard_version')})")
    return data


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(text)).split())  # (torch colours its messages)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def snapshot_from_entry(entry: dict) -> _Snapshot:
    return _Snapshot(dict(entry["tensors"]), dict(entry["kinds"]), dict(entry["requires_grad"]),
                     str(entry["class"]), list(entry.get("devices", [])), 0,
                     dict(entry.get("settings", {})))


def call_fields(entry: dict) -> dict:
    """The keyword arguments of `CapturedCall` (after source, root, class, index, args, kwargs)
    that a bundle's call entry holds."""
    site = entry.get("call_site")
    autocast = tuple((device, getattr(torch, str(setting[1]).replace("torch.", "")))
                     for device, setting in entry.get("autocast", {}).items() if setting[0])
    state = CallState(entry.get("cpu_rng_state"), None, None, autocast,
                      grad_enabled=bool(entry.get("grad_enabled", True)))
    return dict(
        state=state, cuda_device=entry.get("cuda_device"),
        cuda_rng_state=entry.get("cuda_rng_state"), training=bool(entry.get("training", True)),
        weights_changed=bool(entry.get("weights_changed", False)),
        call_site=None if site is None else _recorded_site(site),
        input_devices=entry.get("input_devices", []),
    )


class BundleSource:
    """Where the calls loaded from a bundle come from: the modules given, the snapshot read."""

    def __init__(self, models: Dict[str, nn.Module], snapshots: Dict[str, _Snapshot],
                 root_order: List[str]):
        self.models = models
        self.snapshots = snapshots
        self.root_order = root_order
        self.calls: list = []

    def previous(self, call):
        position = self.calls.index(call)
        return self.calls[position - 1] if position > 0 else None


def modules_for(path: str, model, roots: List[str], snapshots: Dict[str, _Snapshot]) -> Dict[str, nn.Module]:
    """The module replaying each root: given (a module, or a dict of name -> module), or a
    torch.nn loss rebuilt from the bundle; checked against the bundle's snapshot."""
    rebuildable = {r for r in roots if snapshots[r].is_torch_loss}
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
        spare = [m for k, m in model.items() if k not in roots]
        for root in (r for r in roots if r not in models):
            # A namespace's models by other names (`model`, `loss_fn`): the one of the root's
            # class, else the only one given for the only root that needs one.
            same = [m for m in spare if qualified_name(type(m)) == snapshots[root].class_name]
            needed = [r for r in roots if r not in rebuildable]
            if len(same) == 1:
                models[root] = same[0]
                spare.remove(same[0])  # (one module for one root: a GAN's G and D are two)
            elif len(model) == 1 and spare and needed == [root]:
                models[root] = spare[0]
    else:
        raise ReplayError(f"load_capture needs the model (a torch.nn.Module built fresh, or a dict "
                          f"of name -> module), got {type(model).__name__}")
    for root in roots:
        if root in models:
            continue
        rebuilt = _rebuild_loss(snapshots[root]) if root in rebuildable else None
        if rebuilt is None:
            raise ReplayError(f"{path} replays {root!r} ({snapshots[root].class_name}) too: pass "
                              f"load_capture(path, {{{', '.join(f'{r!r}: ...' for r in roots)}}})")
        models[root] = rebuilt
    for root in roots:
        _check_state(f"the module given for {root!r}" if root else "the model given", models[root],
                     snapshots[root])
    return {root: models[root] for root in roots}


def _rebuild_loss(snapshot: _Snapshot) -> Optional[nn.Module]:
    module_name, _, cls_name = snapshot.class_name.rpartition(".")
    if module_name != TORCH_LOSSES:
        return None
    cls = getattr(nn.modules.loss, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.modules.loss._Loss)):
        return None
    try:
        module = cls()
    except Exception:
        return None
    for key, value in snapshot.settings.items():
        if key in vars(module):
            setattr(module, key, value)
    for name, kind in snapshot.kinds.items():
        if kind == "buffer" and "." not in name and module._buffers.get(name) is None:
            module._buffers[name] = snapshot.tensors[name].clone()
    return module


def _check_state(label: str, module: nn.Module, snapshot: _Snapshot) -> None:
    ours = {n: t for n, t, k in named_tensors(module) if k != "attr"}
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


def version_notes(data: dict, models: Dict[str, nn.Module], snapshots: Dict[str, _Snapshot]) -> List[str]:
    """Differences between where the bundle was saved and here that may change the replay."""
    notes = []
    if str(data.get("torch_version")) != torch.__version__:
        notes.append(f"the bundle was saved with torch {data.get('torch_version')}, "
                     f"this is torch {torch.__version__}")
    for root, model in models.items():
        given = qualified_name(type(model))
        if given != snapshots[root].class_name:
            notes.append(f"{root or 'the model'} is a {given}, the bundle's a {snapshots[root].class_name}")
    return notes


def _recorded_site(site: dict) -> Location:
    """The call site a bundle recorded, named as it was where it was recorded."""
    location = Location.of(site["filename"], site["lineno"], site.get("function", ""), CALL_SITE,
                           line=site.get("line", ""))
    location.named = cell_named(site.get("where", ""))
    return location
