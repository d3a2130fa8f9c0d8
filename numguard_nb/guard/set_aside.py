"""The sentinel's hooks on a model's submodules, set aside while the model itself runs.

The sentinel hooks a model and its callable submodules at every depth, so that a submodule called
on its own (`model.encoder(x)`, a GAN's parts, a backbone's blocks from `forward_features`) is
checked too. Called from inside the model, those hooks
only count depth, yet any hook sends torch's `_call_impl` down its slow path. Where the host sets
a GPU step's pace that is measurable: on the 48 blocks of overhead.py's stack, with the blocks
unhooked, the sentinel's extra time on an H200 fell by 0.6-1.2 ms a step (of 21 ms). So while a
top-level call of the model runs, each submodule whose only forward hooks are the sentinel's has
them taken out of its hook dicts (torch's fast path), and they go back, first in their dicts as
they were, when the call ends.

What that misses: a submodule called on its own by another thread while the model runs in this
one; and, after an interrupt that skipped the model's closing hook, a submodule called on its own
before the model's next call ends (the session puts them back after a failed cell; detaching
drops them). A hook registered on such a submodule during the model's call with `prepend=True`
ends up after the sentinel's. Calls of the model in other threads are still checked: a call
inside whose opening hook did not run (the hooks were aside then) cannot end theirs
(`sentinel._closes_top_level`), and a copy made meanwhile gets hook dicts of its own (`copies`).
"""

from __future__ import annotations

import collections
import itertools
import operator
import threading
from typing import List, Optional

__all__ = ["SetAside", "Inner"]

_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")
_HOOKS = operator.attrgetter("_forward_hooks")
_POP = collections.OrderedDict.pop
_SET = operator.setitem  # (a hook dict of a subclass keeps its own __setitem__)
_MISSING = object()


class Inner:
    """The entries inside one, and their two hook ids, in columns: set aside with a few C-level
    passes (a model of hundreds of modules pays tens of microseconds a call, not hundreds)."""

    __slots__ = ("pairs", "modules", "pre_ids", "hook_ids")

    def __init__(self):
        self.pairs: list = []  # (module, (pre-hook id, hook id))
        self.modules: Optional[tuple] = None  # the columns, made at the first take after a change
        self.pre_ids: tuple = ()
        self.hook_ids: tuple = ()

    def append(self, pair: tuple) -> None:
        self.pairs.append(pair)
        self.modules = None

    def columns(self) -> "Inner":
        if self.modules is None:
            self.modules = tuple(m for m, _ in self.pairs)
            self.pre_ids = tuple(ids[0] for _, ids in self.pairs)
            self.hook_ids = tuple(ids[1] for _, ids in self.pairs)
        return self

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def __iter__(self):
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


class SetAside:
    """The sentinel's pre-hook and hook of some modules, out of their hook dicts for a while.
    Taking, putting back and forgetting hold one lock: a detach in one thread waits for a put-back
    under way in another, then removes what it put back (no hook is left behind)."""

    __slots__ = ("_taken", "_thread", "_lock")

    def __init__(self):
        self._taken: List[tuple] = []  # (module, pre-hook id, pre-hook, hook id, hook)
        self._thread: Optional[int] = None  # the thread that set them aside
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def take(self, modules: Inner) -> None:
        """Set aside the two hooks, `(module, (pre-hook id, hook id))`, of each module that has no
        other forward hook; nothing while some are aside (an outer call's, or another thread's)."""
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.get_ident()
            if self._take_all(modules):
                return
            for module, (pre_id, hook_id) in modules:
                pre_hooks, hooks = module._forward_pre_hooks, module._forward_hooks
                if len(pre_hooks) == 1 and len(hooks) == 1 and pre_id in pre_hooks and hook_id in hooks:
                    self._taken.append((module, pre_id, pre_hooks.pop(pre_id), hook_id,
                                        hooks.pop(hook_id)))

    def _take_all(self, inner: Inner) -> bool:
        """The common case at C speed: every module holds the sentinel's two hooks alone. False
        (nothing taken) where one does not."""
        inner = inner.columns()
        pres, hooks = list(map(_PRE_HOOKS, inner.modules)), list(map(_HOOKS, inner.modules))
        if not pres or max(map(len, pres)) != 1 or max(map(len, hooks)) != 1 \
                or min(map(len, pres)) != 1 or min(map(len, hooks)) != 1:
            return False
        pre_hooks = list(map(_POP, pres, inner.pre_ids, itertools.repeat(_MISSING)))
        post_hooks = list(map(_POP, hooks, inner.hook_ids, itertools.repeat(_MISSING)))
        if _MISSING in pre_hooks or _MISSING in post_hooks:  # (another hook in the place of ours)
            for dicts, ids, values in ((pres, inner.pre_ids, pre_hooks),
                                       (hooks, inner.hook_ids, post_hooks)):
                for hook_dict, key, value in zip(dicts, ids, values):
                    if value is not _MISSING:
                        hook_dict[key] = value
            return False
        self._taken = [(pres, inner.pre_ids, pre_hooks, hooks, inner.hook_ids, post_hooks)]
        return True

    def put_back(self, any_thread: bool = False) -> None:
        """Put them back, first in their dicts (where they were): by the thread that took them,
        or by any with `any_thread` (after an interrupt)."""
        if self._thread is None:
            return
        with self._lock:
            if self._thread is None or (not any_thread and self._thread != threading.get_ident()):
                return
            if len(self._taken) == 1 and len(self._taken[0]) == 6:  # taken at C speed
                pres, pre_ids, pre_hooks, hooks, hook_ids, post_hooks = self._taken[0]
                for dicts, ids, values in ((pres, pre_ids, pre_hooks), (hooks, hook_ids, post_hooks)):
                    collections.deque(map(_SET, dicts, ids, values), maxlen=0)
                    if max(map(len, dicts)) > 1:  # one registered meanwhile: ours came first
                        for hook_dict, key in zip(dicts, ids):
                            if len(hook_dict) > 1:
                                hook_dict.move_to_end(key, last=False)
                self._taken, self._thread = [], None
                return
            for module, pre_id, pre_hook, hook_id, hook in self._taken:
                for hooks, key, value in ((module._forward_pre_hooks, pre_id, pre_hook),
                                          (module._forward_hooks, hook_id, hook)):
                    hooks[key] = value
                    if len(hooks) > 1:  # one registered meanwhile: ours came first
                        hooks.move_to_end(key, last=False)
            self._taken, self._thread = [], None

    def forget(self) -> None:
        """Drop them (detaching: their handles' removal takes the rest of their entries)."""
        with self._lock:
            self._taken, self._thread = [], None
