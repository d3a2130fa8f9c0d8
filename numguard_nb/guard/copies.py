"""Copies of a guarded module come out unwatched: pickle, `copy.copy`, `copy.deepcopy` and
`torch.save` made while the guard is attached leave its hooks behind.

An EMA model, a DQN target network, a best-model snapshot or `AveragedModel(model)` is often
copied inside a guarded loop. Module hooks live in the module's hook dicts, which a copy
duplicates, and a deep copy of a bound-method hook deep-copies its Guard: the copy would stay
watched forever, and pickling would fail on the guard's weak references.

Both copy protocols look these methods up on the instance first, so while the guard is attached
each hooked module holds, as instance attributes, `__reduce_ex__` (pickle, `copy.copy`, and
`copy.deepcopy` of ordinary modules) and, where its class defines its own, `__deepcopy__`
(parametrized modules do). Each makes the copy the class would make, without the guard's hook
entries or these attributes; the module itself is never changed while it is copied.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from torch import nn

__all__ = ["CopyWithoutGuard", "install", "uninstall"]

_ATTRIBUTES = ("__reduce_ex__", "__deepcopy__")
# The hook dicts a forward hook or pre-hook has entries in (keyed by its handle's id).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
_HOOKS = ("_forward_pre_hooks", "_forward_hooks")  # those whose values are the hooks


class _Dropped:
    """What the guard's hooks and attributes become in a copy made by a class's own
    `__deepcopy__`, before they are taken out of it."""

    __slots__ = ()


_DROPPED = _Dropped()


class CopyWithoutGuard:
    """The copy methods one hooked module holds while the guard is attached."""

    __slots__ = ("module", "hook_ids")

    def __init__(self, module: nn.Module, hook_ids: Iterable[int]):
        self.module = module
        self.hook_ids = set(hook_ids)  # ids of the guard's hook handles on the module

    def reduce_ex(self, protocol):
        rv = type(self.module).__reduce_ex__(self.module, protocol)
        if isinstance(rv, tuple) and len(rv) > 2 and isinstance(rv[2], dict):
            rv = rv[:2] + (self._state_without_guard(rv[2]),) + rv[3:]
        return rv

    def deepcopy(self, memo):
        module = self.module
        # Whatever the class's own copy does, the guard's objects become _DROPPED, not copies.
        for name in _ATTRIBUTES:
            if name in module.__dict__:
                memo[id(module.__dict__[name])] = _DROPPED
        for name in _HOOKS:  # (the other dicts' values are flags, True: not to be dropped)
            for hook_id, hook in getattr(module, name).items():
                if hook_id in self.hook_ids:
                    memo[id(hook)] = _DROPPED
                    memo.setdefault(id(memo), []).append(hook)  # (its id stays its own)
        replica = type(module).__deepcopy__(module, memo)
        state = getattr(replica, "__dict__", None)
        if isinstance(state, dict):
            for name in _ATTRIBUTES:
                value = state.get(name)
                if value is _DROPPED or getattr(value, "__self__", None) is self:
                    del state[name]
            for name in _HOOK_DICTS:  # new dicts: the class's copy may share the module's
                hooks = state.get(name)
                if hooks is not None:
                    state[name] = OrderedDict((k, v) for k, v in hooks.items()
                                              if k not in self.hook_ids)
        return replica

    def _state_without_guard(self, state: dict) -> dict:
        state = dict(state)
        for name in _ATTRIBUTES:
            value = state.get(name)
            if getattr(value, "__self__", None) is self:
                del state[name]
        for name in _HOOK_DICTS:  # the copy's own dicts: never the module's, shared
            hooks = state.get(name)
            if hooks is not None:
                state[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in self.hook_ids)
        return state


def _copier_of(module: nn.Module):
    copier = getattr(module.__dict__.get("__reduce_ex__"), "__self__", None)
    return copier if isinstance(copier, CopyWithoutGuard) else None


def install(module: nn.Module, hook_ids: Iterable[int]) -> None:
    """Make copies of `module` leave out the hooks whose handle ids are `hook_ids` (one copier
    per module, shared by the guards attached to it)."""
    copier = _copier_of(module)
    if copier is None:
        copier = CopyWithoutGuard(module, ())
        module.__dict__["__reduce_ex__"] = copier.reduce_ex
        if getattr(type(module), "__deepcopy__", None) is not None:
            module.__dict__["__deepcopy__"] = copier.deepcopy
    copier.hook_ids.update(hook_ids)


def uninstall(module: nn.Module, hook_ids: Iterable[int]) -> None:
    """Undo `install`; the copy methods go with the last guard's hooks."""
    copier = _copier_of(module)
    if copier is None:
        return
    copier.hook_ids.difference_update(hook_ids)
    if not copier.hook_ids:
        for name in _ATTRIBUTES:
            if getattr(module.__dict__.get(name), "__self__", None) is copier:
                del module.__dict__[name]
