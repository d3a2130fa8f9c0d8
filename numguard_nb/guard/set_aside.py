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

import threading
from typing import List, Optional

__all__ = ["SetAside"]


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

    def take(self, modules: list) -> None:
        """Set aside the two hooks, `(module, (pre-hook id, hook id))`, of each module that has no
        other forward hook; nothing while some are aside (an outer call's, or another thread's)."""
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.get_ident()
            for module, (pre_id, hook_id) in modules:
                pre_hooks, hooks = module._forward_pre_hooks, module._forward_hooks
                if len(pre_hooks) == 1 and len(hooks) == 1 and pre_id in pre_hooks and hook_id in hooks:
                    self._taken.append((module, pre_id, pre_hooks.pop(pre_id), hook_id,
                                        hooks.pop(hook_id)))

    def put_back(self, any_thread: bool = False) -> None:
        """Put them back, first in their dicts (where they were): by the thread that took them,
        or by any with `any_thread` (after an interrupt)."""
        if self._thread is None:
            return
        with self._lock:
            if self._thread is None or (not any_thread and self._thread != threading.get_ident()):
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
