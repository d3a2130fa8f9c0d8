"""The buffers a sentinel's top-level call writes (an EMA, a codebook's statistics), checked with
its outputs, and set back for its re-run.

A forward that writes inf or nan into a buffer can still return finite outputs: the buffer then
spoils later calls (the next batch, evaluation), far from where it went bad. So as a top-level
call starts, the buffers of its module are noted (each tensor and its version: nothing is
copied), and those its forward wrote in place, replaced, or registered are checked with its
outputs (`Before.written`, `produced`): a problem where one holds nan or +inf now and held none
when the call began (as full mode, which judges a buffer's values against what it held). A
re-run starts from what they held when the call began (`Before.set_back`): a replaced buffer's
old tensor is still there; one written in place is copied as a training call starts (every small
one in the first training calls, since a first write is not known until seen; then those a
forward was seen writing, within `rerun.BUFFER_COPY_BYTES`; past it, the re-run starts from what
the call wrote). As full mode, this tells a write by its version counter: BatchNorm's kernel
updating its running statistics, or a write through `.data`, moves none.

    before = Before(entry, learning=True)    # as the call starts
    ...                                      # the forward runs
    written = before.written()               # [(name, tensor now, tensor at the start or None)]
    before.set_back()                        # in a re-run, inside rerun.Kept
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from .. import numerics, rerun
from .._util import qualified_name

# The first training calls after the buffers are looked up copy every small one
# (`rerun.SMALL_BUFFER_BYTES`): a forward that writes inf or nan the first time it writes can be
# run again from what it found.
FRESH_CALLS = 2

__all__ = ["FRESH_CALLS", "Before", "BufferSlots", "entry_buffers", "forget", "produced",
           "set_back", "written_again"]

_INF = math.inf


class BufferSlots:
    """Where a module's buffers live, each as (its module's buffer dict, its name) with the name
    reports give it: looked up by name at every call, so a buffer replaced, set to None and back,
    or moved (`.to()`) is found as it is. Stale once a buffer of a new name or a submodule is
    registered inside the module (`forget`)."""

    __slots__ = ("module", "pairs", "names", "ids", "copied", "fresh", "stale")

    def __init__(self, module: nn.Module, prefix: str):
        self.module = module
        self.pairs: list = []
        self.names: List[str] = []
        self.ids = set()
        for path, m in module.named_modules(prefix=prefix):
            self.ids.add(id(m))
            for name in m._buffers:
                self.pairs.append((m._buffers, name))
                self.names.append(qualified_name(path, name))
        self.copied: set = set()  # positions of buffers a forward was seen writing in place
        self.fresh = FRESH_CALLS  # training calls left that copy every small buffer
        self.stale = False

    def to_copy(self, tensors: list):
        """The positions of the buffers a training call copies as it starts: in the first ones
        every small floating buffer, then those seen written in place."""
        if not self.fresh:
            return self.copied
        self.fresh -= 1
        return self.copied | {i for i, t in enumerate(tensors) if _checkable(t)
                              and t.numel() * t.element_size() <= rerun.SMALL_BUFFER_BYTES}


def entry_buffers(entry) -> BufferSlots:
    """The `BufferSlots` of a sentinel entry's module (kept on it until it goes stale)."""
    slots = entry.buffers
    if slots is None or slots.stale:
        slots = entry.buffers = BufferSlots(entry.module, entry.name)
    return slots


def forget(entries, module: nn.Module, name: str) -> None:
    """A buffer or submodule `name` is being registered on `module` (torch's global hooks): the
    entries holding `module` look theirs up again, unless it replaces a buffer they know."""
    if name in module._buffers:
        return  # (found by name: a replacement needs no new look-up)
    for entry in entries:
        slots = entry.buffers
        if slots is not None and id(module) in slots.ids:
            slots.stale = True


def _checkable(t) -> bool:
    return t is not None and not isinstance(t, UninitializedTensorMixin) \
        and t.is_floating_point() and bool(t.numel())


def _version(t) -> int:
    # (an inference tensor keeps no version: it cannot be written outside inference mode; a lazy
    # module's buffer is not made yet)
    if t is None or isinstance(t, UninitializedTensorMixin) or t.is_inference():
        return -1
    return t._version


class Before:
    """A call's buffers as it started: the tensors, their versions, and (in training calls)
    copies of those a forward was seen writing in place."""

    __slots__ = ("entry", "slots", "tensors", "versions", "copies")

    def __init__(self, entry, learning: bool):
        self.entry = entry
        slots = self.slots = entry_buffers(entry)
        self.tensors = [buffers.get(name) for buffers, name in slots.pairs]
        self.versions = [_version(t) for t in self.tensors]
        positions = slots.to_copy(self.tensors) if learning and self.tensors else ()
        self.copies: Optional[dict] = _copies(self.tensors, positions) if positions else None

    def _changed(self) -> List[int]:
        tensors, versions = self.tensors, self.versions
        return [i for i, (buffers, name) in enumerate(self.slots.pairs)
                if buffers.get(name) is not tensors[i] or _version(tensors[i]) != versions[i]]

    def written(self) -> list:
        """(name, tensor now, tensor at the call's start or None where unknown) of the floating
        buffers the call wrote in place, replaced, or registered; learns which to copy."""
        written = []
        if self.tensors:
            slots = self.slots
            for i in self._changed():
                buffers, name = slots.pairs[i]
                now, then = buffers.get(name), self.tensors[i]
                if not _checkable(now):
                    continue
                if now is then:
                    slots.copied.add(i)
                    then = self.copies.get(i) if self.copies else None
                written.append((slots.names[i], now, then if _checkable(then) else None))
        written += [(path, buffers[name], None) for buffers, name, path in self._registered()
                    if _checkable(buffers.get(name))]  # all it holds, the call made
        return written

    def _registered(self) -> list:
        """(buffer dict, name, path) of the buffers registered inside the module since the call
        began."""
        if not self.slots.stale:
            return []
        known = {(id(buffers), name) for buffers, name in self.slots.pairs}
        current = entry_buffers(self.entry)
        return [(buffers, name, path) for (buffers, name), path in zip(current.pairs, current.names)
                if (id(buffers), name) not in known]

    def set_back(self) -> None:
        """Put the buffers back as the call found them (for a re-run, inside `rerun.Kept`, which
        puts them back as they are now after it). One written in place that was not copied
        stays as written; one registered since is taken out, to be registered again."""
        for buffers, name, _ in self._registered():
            buffers.pop(name, None)
        with torch.no_grad():
            for i in self._changed():
                buffers, name = self.slots.pairs[i]
                buffers[name] = self.tensors[i]
                copy = self.copies.get(i) if self.copies else None
                if copy is not None:
                    self.tensors[i].copy_(copy)


def _copies(tensors: list, positions) -> Optional[dict]:
    """Copies of the buffers at `positions`, all together within `rerun.BUFFER_COPY_BYTES`;
    None past it."""
    copies, size = {}, 0
    with torch.no_grad():
        for i in positions:
            t = tensors[i]
            if not _checkable(t) or t.is_inference():
                continue
            size += t.numel() * t.element_size()
            if size > rerun.BUFFER_COPY_BYTES:
                return None
            copies[i] = t.clone()
    return copies


def produced(written: list, deferred: bool):
    """What of the written buffers holds nan or +inf that it did not hold at the call's start,
    as told by their maxima (nan, else +inf, else a number): a buffer that kept +inf (a minimum
    not yet seen) passes, and so does one that held nan already; -inf alone passes, as in
    outputs (a mask the forward caches). `deferred`: one float32 0-d value per buffer on its
    device, for the call's flag (`numerics.fine` tells); else, read now, [(name, tensor)] of
    those that do."""
    values, bad = [], []
    with torch.no_grad():
        for name, now, then in written:
            if not numerics.readable(now):
                continue
            value = numerics.output_flag([now])[0]
            start = numerics.output_flag([then])[0] if then is not None \
                and numerics.readable(then) else None
            if deferred:
                if start is not None:  # (nan == nan is false: a new nan stays)
                    value = torch.where(start.isnan() | (value == start), -_INF, value)
                values.append(value)
                continue
            now_max = numerics.read(value)
            start_max = numerics.read(start) if start is not None else -_INF
            if not numerics.fine(now_max) and not math.isnan(start_max) and now_max != start_max:
                bad.append((name, now))
    return values if deferred else bad


def set_back(calls) -> None:
    """Put back the buffers as the first of `calls` found them (a re-run's start; calls without
    a record of them, a compiled full guard's, are left out)."""
    for call in reversed(calls):
        before = getattr(call, "buffers", None)
        if before is not None:
            before.set_back()


def written_again(call) -> list:
    """The buffers a re-run of `call` wrote (after `set_back`) holding nan or +inf they did not
    hold when it began (`produced`), read now."""
    before = getattr(call, "buffers", None)
    return [now for _, now in produced(before.written(), False)] if before is not None else []
