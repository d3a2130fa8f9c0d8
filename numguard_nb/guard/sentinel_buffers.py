"""The buffers a sentinel's top-level call writes (an EMA, a codebook's statistics), checked with
its outputs, and set back for its re-run.

A forward that writes inf or nan into a buffer can still return finite outputs: the buffer then
spoils later calls (the next batch, evaluation), far from where it went bad. So as a top-level
call starts, the floating buffers of its module are noted (each tensor and its version: nothing
is copied), and those its forward wrote in place or replaced are checked with its outputs
(`Before.written`). A re-run starts from what they held when the call began (`Before.set_back`):
a replaced buffer's old tensor is still there; one written in place is copied as a call starts:
the small ones in the first calls, then those a forward was seen writing, within
`rerun.BUFFER_COPY_BYTES` (past it, or for a large buffer not yet seen written, the re-run
starts from what the call wrote). As full mode, this tells a write by its version counter:
BatchNorm's kernel updating its running statistics, or a write through `.data`, moves none.

    before = Before(entry_buffers(entry))   # as the call starts
    ...                                     # the forward runs
    tensors = before.written()              # checked with the outputs
    before.set_back()                       # in a re-run, inside rerun.Kept
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from .. import numerics, rerun

# The first calls after the buffers are looked up copy every small one (`rerun.SMALL_BUFFER_BYTES`):
# a forward that writes inf or nan the first time it writes can be run again from what it found.
FRESH_CALLS = 2

__all__ = ["Before", "BufferSlots", "entry_buffers", "is_floating_buffer", "nonfinite", "set_back", "written_again"]


class BufferSlots:
    """Where a module's floating buffers live, each as (its module's buffer dict, its name):
    looked up by name at every call, so a buffer replaced or moved (`.to()`) is found as it is.
    Made again after a buffer of a new name or a submodule is registered."""

    __slots__ = ("pairs", "copied", "fresh")

    def __init__(self, module: nn.Module):
        self.pairs = [(m._buffers, name) for m in module.modules()
                      for name, b in m._buffers.items()
                      if b is not None and b.is_floating_point()]
        self.copied: set = set()  # positions of buffers a forward was seen writing in place
        self.fresh = FRESH_CALLS  # calls left that copy every small buffer

    def to_copy(self, tensors: list):
        """The positions of the buffers a call copies as it starts: in its first calls every
        small one (a forward's first write is not known until seen), then those seen written."""
        if not self.fresh:
            return self.copied
        self.fresh -= 1
        return self.copied | {i for i, t in enumerate(tensors) if t is not None
                              and t.numel() * t.element_size() <= rerun.SMALL_BUFFER_BYTES}


def entry_buffers(entry) -> BufferSlots:
    """The `BufferSlots` of a sentinel entry's module (kept on it until a registration drops it)."""
    slots = entry.buffers
    if slots is None:
        slots = entry.buffers = BufferSlots(entry.module)
    return slots


def is_floating_buffer(module: nn.Module, name: str) -> bool:
    """Whether `module` holds a floating buffer `name` (one being registered: a replacement, which
    the entries' `BufferSlots` find by name, not a new one)."""
    old = module._buffers.get(name)
    return old is not None and old.is_floating_point()


def _version(t) -> int:
    # (an inference tensor keeps no version: it cannot be written outside inference mode)
    return -1 if t is None or t.is_inference() else t._version


class Before:
    """A call's buffers as it started: the tensors, their versions, and copies of those a forward
    was seen writing in place."""

    __slots__ = ("slots", "tensors", "versions", "copies")

    def __init__(self, slots: BufferSlots):
        self.slots = slots
        self.tensors = [buffers.get(name) for buffers, name in slots.pairs]
        self.versions = [_version(t) for t in self.tensors]
        positions = slots.to_copy(self.tensors) if self.tensors else ()
        self.copies: Optional[dict] = _copies(self.tensors, positions) if positions else None

    def _changed(self) -> List[int]:
        tensors, versions = self.tensors, self.versions
        return [i for i, (buffers, name) in enumerate(self.slots.pairs)
                if buffers.get(name) is not tensors[i] or _version(tensors[i]) != versions[i]]

    def written(self) -> list:
        """The floating buffers the call wrote (in place, or replaced), as they are now; learns
        which to copy from the next call on."""
        if not self.tensors:
            return []
        written = []
        for i in self._changed():
            buffers, name = self.slots.pairs[i]
            now = buffers.get(name)
            if now is self.tensors[i]:
                self.slots.copied.add(i)
            if now is not None and now.is_floating_point() and now.numel():
                written.append(now)
        return written

    def set_back(self) -> None:
        """Put the buffers back as the call found them (for a re-run, inside `rerun.Kept`, which
        puts them back as they are now after it). One written in place that was not copied
        stays as written."""
        with torch.no_grad():
            for i in self._changed():
                buffers, name = self.slots.pairs[i]
                buffers[name] = self.tensors[i]
                copy = self.copies.get(i) if self.copies else None
                if copy is not None:
                    self.tensors[i].copy_(copy)


def _copies(tensors: list, positions: set) -> Optional[dict]:
    """Copies of the buffers at `positions` (written in place by an earlier call), all together
    within `rerun.BUFFER_COPY_BYTES`; None past it."""
    copies, size = {}, 0
    with torch.no_grad():
        for i in positions:
            t = tensors[i]
            if t is None or t.is_inference():
                continue
            size += t.numel() * t.element_size()
            if size > rerun.BUFFER_COPY_BYTES:
                return None
            copies[i] = t.clone()
    return copies


def nonfinite(written: list) -> bool:
    """Whether buffers a call wrote hold nan or +inf, read now (on the host, or for a guard that
    reads synchronously). -inf alone passes, as in outputs: a mask the forward caches."""
    value = numerics.output_flag(t for t in written if numerics.readable(t))
    return value is not None and not numerics.fine(numerics.read(value)[0])


def set_back(calls) -> None:
    """Put back the buffers as the first of `calls` found them (a re-run's start; calls without
    a record of them, a compiled full guard's, are left out)."""
    for call in reversed(calls):
        before = getattr(call, "buffers", None)
        if before is not None:
            before.set_back()


def written_again(call) -> list:
    """The buffers a re-run of `call` wrote (after `set_back`), as they are now."""
    before = getattr(call, "buffers", None)
    return before.written() if before is not None else []
