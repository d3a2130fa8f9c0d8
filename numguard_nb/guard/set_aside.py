"""The sentinel's hooks on a model's submodules, set aside while the model itself runs.

The sentinel hooks a model and its callable submodules at every depth, so that a submodule called
on its own (`model.encoder(x)`, a GAN's parts, a backbone's blocks from `forward_features`) is
checked too. Called from inside the model, those hooks
only count depth, yet any hook sends torch's `_call_impl` down its slow path. Where the host sets
a GPU step's pace that is measurable: on the 48 blocks of overhead.py's stack, with the blocks
unhooked, the sentinel's extra time on an H200 fell by 0.6-1.2 ms a step (of 21 ms). So while a
top-level call of the model runs, each submodule whose only forward hooks are the sentinel's has
them taken out of its hook dicts (torch's fast path), and they go back, first in their dicts as
they were, when one of them is called on its own (below).

What that misses: a submodule called on its own by another thread while the model runs in this
one; and, after an interrupt that skipped the model's closing hook, a submodule called on its own
before the model's next call ends (the session puts them back after a failed cell; detaching
drops them). A hook registered on such a submodule with `prepend=True` while they are aside
ends up after the sentinel's. Calls of the model in other threads are still checked: a call
inside whose opening hook did not run (the hooks were aside then) cannot end theirs
(`sentinel._closes_top_level`), and a copy made meanwhile gets hook dicts of its own (`copies`).

Between the model's calls they stay aside (`SetAside.end` keeps them): setting them aside and
back cost ~3 us a module a call on a cache-cold host, half the sentinel's host time on overhead.py's
stack. Meanwhile one global forward pre-hook (`CallWatch`) sees every module call: one of them
called on its own puts them all back, and its call is checked as before. Other modules' calls take
torch's slow path while it watches: past half as many as the modules aside between two calls of
the model, they are put back; after `GAPS_TO_STOP` such gaps in a row (a teacher model called each
step, say), after each call, as before, for good.
"""

from __future__ import annotations

import collections
import itertools
import operator
import threading
import weakref
from typing import List, Optional

from torch.nn.modules import module as module_hooks

from . import copies
from .hooks import is_dynamo_compiling
from .passes import graph_task_id

__all__ = ["SetAside", "Inner", "CallWatch"]

GAPS_TO_STOP = 3  # gaps between a model's calls busy with other modules, in a row, to stop keeping

_PRE_HOOKS = operator.attrgetter("_forward_pre_hooks")
_HOOKS = operator.attrgetter("_forward_hooks")
_POP = collections.OrderedDict.pop
_SET = operator.setitem  # (a hook dict of a subclass keeps its own __setitem__)
_MISSING = object()


class Inner:
    """The entries inside one, and their two hook ids, in columns: set aside with a few C-level
    passes (a model of hundreds of modules pays tens of microseconds a call, not hundreds)."""

    __slots__ = ("pairs", "modules", "pre_ids", "hook_ids", "ids")

    def __init__(self):
        self.pairs: list = []  # (module, (pre-hook id, hook id))
        self.modules: Optional[tuple] = None  # the columns, made at the first take after a change
        self.pre_ids: tuple = ()
        self.hook_ids: tuple = ()
        self.ids: frozenset = frozenset()  # the modules' ids

    def append(self, pair: tuple) -> None:
        self.pairs.append(pair)
        self.modules = None

    def columns(self) -> "Inner":
        if self.modules is None:
            self.modules = tuple(m for m, _ in self.pairs)
            self.pre_ids = tuple(ids[0] for _, ids in self.pairs)
            self.hook_ids = tuple(ids[1] for _, ids in self.pairs)
            self.ids = frozenset(map(id, self.modules))
        return self

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def __iter__(self):
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


class SetAside:
    """The sentinel's pre-hook and hook of some modules (one `Inner` at a time), out of their hook
    dicts for a while: while a call of the module they are inside runs, and after it (kept) until
    one of them is called on its own (`CallWatch`) or another module's call takes its own. Taking,
    putting back and forgetting hold one lock: a detach in one thread waits for a put-back under
    way in another, then removes what it put back (no hook is left behind)."""

    __slots__ = ("_taken", "_thread", "_lock", "_group", "_kept", "watch")

    def __init__(self, watch: Optional["CallWatch"] = None):
        self._taken: List[tuple] = []  # (module, pre-hook id, pre-hook, hook id, hook)
        self._thread: Optional[int] = None  # the thread whose call runs with them aside
        self._lock = threading.Lock()
        self._group: Optional[Inner] = None  # whose hooks are aside
        self._kept = False  # aside with no call running: the watch looks out for their calls
        self.watch = watch  # (None: put back after each call)

    @property
    def active(self) -> bool:
        return self._thread is not None

    @property
    def kept(self) -> bool:
        return self._kept

    def take(self, modules: Inner) -> None:
        """Set aside the two hooks, `(module, (pre-hook id, hook id))`, of each module that has no
        other forward hook; nothing while some are aside for a call (an outer call's, or another
        thread's). Kept aside from the last call: nothing to do."""
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is not None:
                return
            if self._kept:
                self._unkeep()
                if self._group is modules:
                    self._thread = threading.get_ident()
                    return
                self._restore()  # another module's: back first
            self._thread = threading.get_ident()
            self._group = modules
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

    def end(self) -> None:
        """The call that set them aside has ended (in this thread): keep them aside, watched, where
        they were all taken at C speed; else put them back."""
        if self._thread is None:
            return
        with self._lock:
            if self._thread != threading.get_ident():
                return
            watch = self.watch
            if watch is not None and not watch.stopped and len(self._taken) == 1 \
                    and len(self._taken[0]) == 6:
                self._thread, self._kept = None, True
                watch.arm(self._group.ids, len(self._group))
                return
            self._restore()

    def put_back(self, any_thread: bool = False) -> bool:
        """Put them back, first in their dicts (where they were): kept ones by any thread; during
        a call, by the thread that took them, or by any with `any_thread` (after an interrupt).
        Whether any were put back."""
        if self._thread is None and not self._kept:
            return False
        with self._lock:
            if self._kept:
                self._unkeep()
            elif self._thread is None or (not any_thread and self._thread != threading.get_ident()):
                return False
            self._restore()
        return True

    def stop_keeping(self, for_good: bool) -> None:
        """Put them back now (other modules' calls cost more in the watch than keeping them aside
        saves), and `for_good` after each call from now on."""
        with self._lock:
            if self.watch is not None:
                self.watch.stopped = self.watch.stopped or for_good
            if self._kept:
                self._unkeep()
                self._restore()

    def _unkeep(self) -> None:
        self._kept = False
        if self.watch is not None:
            self.watch.disarm()

    def _restore(self) -> None:
        """(Under the lock) put what was taken back, first in its dicts."""
        if len(self._taken) == 1 and len(self._taken[0]) == 6:  # taken at C speed
            pres, pre_ids, pre_hooks, hooks, hook_ids, post_hooks = self._taken[0]
            for dicts, ids, values in ((pres, pre_ids, pre_hooks), (hooks, hook_ids, post_hooks)):
                collections.deque(map(_SET, dicts, ids, values), maxlen=0)
                if max(map(len, dicts)) > 1:  # one registered meanwhile: ours came first
                    for hook_dict, key in zip(dicts, ids):
                        if len(hook_dict) > 1:
                            hook_dict.move_to_end(key, last=False)
        else:
            for module, pre_id, pre_hook, hook_id, hook in self._taken:
                for hooks, key, value in ((module._forward_pre_hooks, pre_id, pre_hook),
                                          (module._forward_hooks, hook_id, hook)):
                    hooks[key] = value
                    if len(hooks) > 1:  # one registered meanwhile: ours came first
                        hooks.move_to_end(key, last=False)
        self._taken, self._thread, self._group = [], None, None

    def forget(self) -> None:
        """Drop them (detaching: their handles' removal takes the rest of their entries)."""
        with self._lock:
            self._unkeep()
            self._taken, self._thread, self._group = [], None, None
        if self.watch is not None:
            self.watch.remove()


class CallWatch:
    """A global forward pre-hook in torch's registry while hooks are kept aside between a model's
    calls: a module among them called on its own has them put back and its call opened by the
    sentinel's pre-hook (`Sentinel.opens`: they were not in the dicts torch read for this call). Its id
    is in each guarded module's `_forward_pre_hooks_with_kwargs` (`flag`), so torch hands it
    their keyword arguments; other modules' calls are counted, and past `limit` between two calls
    of the model, hooks are no longer kept aside (`SetAside.stop_keeping`)."""

    __slots__ = ("_sentinel", "_registry", "id", "ids", "limit", "others", "busy_gaps", "stopped",
                 "_flagged")

    def __init__(self, sentinel):
        self._sentinel = weakref.ref(sentinel)  # (torch's registry is global)
        handle = module_hooks.register_module_forward_pre_hook(self)
        self._registry = handle.hooks_dict_ref()
        self.id = handle.id
        self._registry.pop(self.id, None)  # armed only while hooks are kept aside
        self.ids: frozenset = frozenset()
        self.limit = 0
        self.others = 0
        self.busy_gaps = 0  # gaps in a row with more calls of other modules than `limit`
        self.stopped = False
        self._flagged: list = []  # (weakly) the modules whose kwargs flags hold its id

    def flag(self, module) -> None:
        """Have torch hand it `module`'s keyword arguments (copies of it leave the flag out)."""
        module._forward_pre_hooks_with_kwargs[self.id] = True
        copies.install(module, (self.id,))
        self._flagged.append(weakref.ref(module))

    def arm(self, ids: frozenset, count: int) -> None:
        if self.others <= self.limit:
            self.busy_gaps = 0
        self.ids, self.limit, self.others = ids, max(count // 2, 8), 0
        if self._registry is not None:
            self._registry[self.id] = self

    def disarm(self) -> None:
        if self._registry is not None:
            self._registry.pop(self.id, None)

    def remove(self) -> None:
        """Out of torch's registry and the modules' dicts for good (detach)."""
        self.disarm()
        self._registry = None
        for ref in self._flagged:
            module = ref()
            if module is not None:
                module._forward_pre_hooks_with_kwargs.pop(self.id, None)
                copies.uninstall(module, (self.id,))
        self._flagged.clear()

    def __call__(self, module, args, kwargs=None):
        if is_dynamo_compiling():
            return None  # traced into compiled code between the calls: nothing to do there
        sentinel = self._sentinel()
        if sentinel is None:
            return None
        if id(module) not in self.ids:
            self.others += 1
            if self.others == self.limit + 1:
                self.busy_gaps += 1
                sentinel.aside.stop_keeping(for_good=self.busy_gaps >= GAPS_TO_STOP)
            return None
        if sentinel.paused or graph_task_id() != -1:
            return None  # a re-run, or a recomputation in backward: inside a call checked
        if sentinel.aside.kept and sentinel.aside.put_back():
            sentinel.opens(module, args, {} if kwargs is None else kwargs)
        return None
