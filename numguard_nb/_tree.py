"""The one walker over nested values: tuples, lists, dicts and dataclasses holding tensors.

Every part of numguard_nb that looks inside a module's inputs or outputs goes through here, so
they all agree on what a container is, on the order of the leaves and on how deep to look:
- `named_leaves` names each leaf the way reports do (`output[0][logits]`),
- `leaves` gives each leaf's path (a tuple of keys), `tensors` just the tensors, in that order,
- `rebuild` maps the tensors (and other leaves) into a copy of the structure, `set_at` replaces
  one leaf.

Containers: tuple and list (namedtuples and subclasses too), dict (subclasses such as
`ModelOutput` and `BatchEncoding` too) and dataclass instances. `torch.Size` is a value, not a
container. Dicts are visited before dataclasses (a `ModelOutput` is both).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Callable, Iterator, List, Tuple

import torch

__all__ = ["MAX_DEPTH", "named_leaves", "leaves", "tensors", "named_output_leaves", "output_tensors",
           "rebuild", "set_at", "role_of"]

MAX_DEPTH = 8  # deeper than this, a value is a leaf
_MANY = 16  # a longer container without a tensor or container in it is one leaf (compact walks)
_PRIMITIVES = (bool, int, float, complex, str, bytes)


def _is_dataclass_instance(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _items(value):
    """(key, item) pairs of a container, or None for a leaf."""
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return enumerate(value)
    if isinstance(value, dict):
        return value.items()
    if _is_dataclass_instance(value):
        return ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    return None


def _is_long_and_flat(value) -> bool:
    """A long container with no tensor or container in it (a list of token ids, say)."""
    if not isinstance(value, (tuple, list, dict)) or len(value) <= _MANY:
        return False
    items = value.values() if isinstance(value, dict) else value
    return not any(isinstance(v, (torch.Tensor, tuple, list, dict)) for v in items)


def role_of(prefix: str, path: tuple) -> str:
    """'output' + (0, 'logits') -> 'output[0][logits]': the reports' naming."""
    return prefix + "".join(f"[{key}]" for key in path)


def named_leaves(value, role: str, depth: int = 0) -> Iterator[Tuple[str, object]]:
    """(role, leaf) for every leaf, tensor or not, named like `output[0][logits]`.

    None, an empty tuple or list, a long flat container and anything deeper than MAX_DEPTH are
    leaves of their own, so that a report has a row for each."""
    if isinstance(value, torch.Tensor) or value is None or depth >= MAX_DEPTH \
            or _is_long_and_flat(value):
        yield role, value
        return
    items = _items(value)
    if items is None:
        yield role, value
        return
    if isinstance(value, (tuple, list)) and not value:
        yield role, value
    for key, item in items:
        yield from named_leaves(item, f"{role}[{key}]", depth + 1)


def leaves(value, path: tuple = (), depth: int = 0) -> Iterator[Tuple[tuple, object]]:
    """(path, leaf) for every leaf that is not a container, in the same order as `named_leaves`."""
    items = None if isinstance(value, torch.Tensor) or depth >= MAX_DEPTH else _items(value)
    if items is None:
        yield path, value
        return
    for key, item in items:
        yield from leaves(item, path + (key,), depth + 1)


def tensors(value) -> List[torch.Tensor]:
    """The tensors nested in `value`, in walking order. Code that pairs tensors across two walks
    (the gradients kept at a model's outputs, a backward re-run from them) relies on this order."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [leaf for _, leaf in leaves(value) if isinstance(leaf, torch.Tensor)]


def named_output_leaves(value, role: str = "output") -> Iterator[Tuple[str, object]]:
    """`named_leaves` of a module's output; an object that holds no tensor that way (a
    torch.distributions object, a result class of one's own) gives its attributes' instead,
    named `output.logits`. The same value always gives them in the same order."""
    found = list(named_leaves(value, role))
    if any(isinstance(leaf, torch.Tensor) for _, leaf in found) or not _plain_object(value):
        return iter(found)
    return (leaf for key, item in sorted(vars(value).items()) if not key.startswith("_")
            for leaf in named_leaves(item, f"{role}.{key}"))


def output_tensors(value) -> List[torch.Tensor]:
    """The tensors among `named_output_leaves(value)`, in its order (the plain walk where it
    finds any: no names are built)."""
    found = tensors(value)
    if found or not _plain_object(value):
        return found
    return [leaf for _, leaf in named_output_leaves(value) if isinstance(leaf, torch.Tensor)]


def _plain_object(value) -> bool:
    """An instance of a class of its own (not a container, a number, a module or a type)."""
    return (value is not None and hasattr(value, "__dict__") and _items(value) is None
            and not isinstance(value, (type, torch.nn.Module, torch.Tensor)))


def _rebuilt_like(value, items: dict):
    """A container of `value`'s type holding `items` (key -> new item)."""
    if isinstance(value, tuple):
        values = list(items.values())
        if type(value) is tuple:
            return tuple(values)
        if hasattr(type(value), "_fields"):  # namedtuple
            return type(value)(*values)
        try:
            return type(value)(values)
        except Exception:
            return tuple(values)
    if isinstance(value, list):
        values = list(items.values())
        if type(value) is list:
            return values
        try:
            return type(value)(values)
        except Exception:
            return values
    if isinstance(value, dict):
        if type(value) in (dict, collections.OrderedDict):
            return type(value)(items)
        try:  # BatchEncoding, ModelOutput and other dict subclasses
            rebuilt = copy.copy(value)
            for key, item in items.items():
                rebuilt[key] = item
            return rebuilt
        except Exception:
            return dict(items)
    rebuilt = copy.copy(value)  # a dataclass instance (frozen ones too)
    for key, item in items.items():
        object.__setattr__(rebuilt, key, item)
    return rebuilt


def rebuild(value, on_tensor: Callable, on_other: Callable = None, path: tuple = (),
            depth: int = 0, keep_unchanged: bool = False):
    """`value` with every tensor replaced by `on_tensor(t, path)` and every other leaf by
    `on_other(v, path)` (kept as it is when None). None, numbers and strings are kept as they are.
    Containers keep their type where it can be rebuilt. With `keep_unchanged`, a container none
    of whose items changed is returned itself rather than copied."""
    if isinstance(value, torch.Tensor):
        return on_tensor(value, path)
    if value is None or isinstance(value, _PRIMITIVES):
        return value
    items = None if depth >= MAX_DEPTH else _items(value)
    if items is None:
        return value if on_other is None else on_other(value, path)
    new = {key: rebuild(item, on_tensor, on_other, path + (key,), depth + 1, keep_unchanged)
           for key, item in items}
    if keep_unchanged and all(new[key] is item for key, item in _items(value)):
        return value
    return _rebuilt_like(value, new)


def set_at(structure, path: tuple, new):
    """`structure` with the leaf at `path` replaced by `new` (tuples are rebuilt, lists and dicts
    changed in place)."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(structure, tuple):
        items = dict(enumerate(structure))
        items[key] = set_at(items[key], rest, new)
        return _rebuilt_like(structure, items)
    if isinstance(structure, (list, dict)):
        structure[key] = set_at(structure[key], rest, new)
        return structure
    items = dict(_items(structure))
    items[key] = set_at(items[key], rest, new)
    return _rebuilt_like(structure, items)
