"""The buffers a sentinel's top-level call writes (an EMA, a codebook's statistics), checked with
its outputs, and set back for its re-run.

A forward that writes inf or nan into a buffer can still return finite outputs: the buffer then
spoils later calls (the next batch, evaluation), far from where it went bad. So as a top-level
call starts, the buffers of its module are noted (each tensor and its version: nothing is
copied), and those its forward wrote in place, replaced, or registered are checked with its
outputs (`Before.written`, `produced`): a problem where one holds nan or +inf it did not hold
when the call began, as told by the buffers' largest values (as full mode, which judges a
buffer's values against what it held). A re-run starts from what they held then
(`Before.set_back`): a replaced buffer's old tensor is still there; one written in place is
copied as a training call starts (every small one in the first training calls, since a first
write is not known until seen; then those a forward was seen writing, within
`rerun.BUFFER_COPY_BYTES`; otherwise the re-run starts from what the call wrote, and the check
from the buffer's largest value, taken as the call starts). As full mode, this tells a write by
its version counter: BatchNorm's kernel updating its running statistics, or a write through
`.data`, moves none.

    before = Before(entry, learning=True)    # as the call starts
    ...                                      # the forward runs
    written = before.written()               # [(name, tensor now, its largest value then)]
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
    registered inside the module (`forget`); made again then, keeping what it learnt."""

    __slots__ = ("module", "pairs", "names", "ids", "copied", "kept", "fresh", "stale")

    def __init__(self, module: nn.Module, prefix: str, earlier: Optional["BufferSlots"] = None):
        self.module = module
        self.pairs: list = []
        self.names: List[str] = []
        self.ids = set()
        for path, m in module.named_modules(prefix=prefix):
            self.ids.add(id(m))
            if isinstance(m, torch.jit.ScriptModule):
                continue  # its buffers are written in its scripted code, as full mode's unseen
            for name in m._buffers:
                self.pairs.append((m._buffers, name))
                self.names.append(rerun.original_name(qualified_name(path, name)))
        self.copied: set = set()  # positions of buffers a forward was seen writing in place
        self.kept: set = set()  # positions of buffers whose inf or nan a re-run accepted
        # calls left that note every small buffer: [other calls (their maxima), training calls
        # (copies)]
        self.fresh = [FRESH_CALLS, FRESH_CALLS]
        self.stale = False
        if earlier is not None:  # (a module registering something at each call: not every time)
            self.copied = self._same(earlier, earlier.copied)
            self.kept = self._same(earlier, earlier.kept)
            self.fresh = earlier.fresh

    def _same(self, earlier: "BufferSlots", positions: set) -> set:
        """The positions here of the buffers at `positions` in `earlier`."""
        wanted = {(id(earlier.pairs[i][0]), earlier.pairs[i][1]) for i in positions}
        return {i for i, (buffers, name) in enumerate(self.pairs) if (id(buffers), name) in wanted}

    def to_note(self, tensors: list, learning: bool) -> set:
        """The positions of the buffers a call notes as it starts (a training call copies them,
        another takes their largest values): in the first calls of each kind every small
        floating buffer, then those seen written in place."""
        if not self.fresh[learning]:
            return self.copied | self.kept
        self.fresh[learning] -= 1
        return self.copied | self.kept | {i for i, t in enumerate(tensors)
                                          if _checkable(t) and _small(t)}


def entry_buffers(entry) -> BufferSlots:
    """The `BufferSlots` of a sentinel entry's module (kept on it until it goes stale)."""
    slots = entry.buffers
    if slots is None or slots.stale:
        slots = entry.buffers = BufferSlots(entry.module, entry.name, slots)
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
        and t.layout == torch.strided and t.is_floating_point() and bool(t.numel())


def _small(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() <= rerun.SMALL_BUFFER_BYTES


def _version(t) -> int:
    # (an inference tensor keeps no version: it cannot be written outside inference mode; a lazy
    # module's buffer is not made yet)
    if t is None or isinstance(t, UninitializedTensorMixin) or t.is_inference():
        return -1
    return t._version


def _maximum(t: torch.Tensor) -> torch.Tensor:
    """`t`'s largest value as a float32 0-d tensor on its device (nan where it holds one)."""
    return numerics.output_flag([t])[0]


class Before:
    """A call's buffers as it started: the tensors, their versions, and for those it notes (every
    small one in the first calls, then those a forward was seen writing in place) a copy
    (training calls, within a budget) or else their largest value (outside training, only the
    small ones')."""

    __slots__ = ("entry", "slots", "tensors", "versions", "copies", "maxima")

    def __init__(self, entry, learning: bool):
        self.entry = entry
        slots = self.slots = entry_buffers(entry)
        tensors = self.tensors = [buffers.get(name) for buffers, name in slots.pairs]
        self.versions = [_version(t) for t in tensors]
        noted = slots.to_note(tensors, learning) if tensors else ()
        self.copies = _copies(tensors, noted) if learning and noted else {}
        with torch.no_grad():
            # (a large one outside training, a key/value cache, say: judged by what it holds)
            self.maxima = {i: _maximum(tensors[i]) for i in noted if i not in self.copies
                           and _checkable(tensors[i]) and (learning or _small(tensors[i])
                                                           or i in slots.kept)} if noted else {}

    def _changed(self) -> List[int]:
        tensors, versions = self.tensors, self.versions
        return [i for i, (buffers, name) in enumerate(self.slots.pairs)
                if buffers.get(name) is not tensors[i] or _version(tensors[i]) != versions[i]]

    def written(self) -> list:
        """(name, tensor now, its largest value at the call's start or None where unknown) of
        the floating buffers the call wrote in place, replaced, or registered; learns which to
        copy."""
        written = []
        if self.tensors:
            slots = self.slots
            with torch.no_grad():
                for i in self._changed():
                    buffers, name = slots.pairs[i]
                    now = buffers.get(name)
                    if not _checkable(now):
                        continue
                    if self._in_place(i):
                        slots.copied.add(i)
                    written.append((slots.names[i], now, self._start(i)))
        written += [(path, buffers[name], None) for buffers, name, path in self._registered()
                    if _checkable(buffers.get(name))]  # all it holds, the call made
        return written

    def _in_place(self, i: int) -> bool:
        """Whether the call wrote the tensor the buffer at `i` held as it began."""
        return self.tensors[i] is not None and _version(self.tensors[i]) != self.versions[i]

    def _start(self, i: int) -> Optional[torch.Tensor]:
        """The largest value the buffer at `i` held as the call began, or None where unknown."""
        start = self.copies.get(i) if self._in_place(i) else self.tensors[i]
        return _maximum(start) if _checkable(start) else self.maxima.get(i)

    def _registered(self) -> list:
        """(buffer dict, name, path) of the buffers registered inside the module since the call
        began (those of submodules made since among them)."""
        if not self.slots.stale:
            return []
        known = {(id(buffers), name) for buffers, name in self.slots.pairs}
        current = entry_buffers(self.entry)
        return [(buffers, name, path) for (buffers, name), path in zip(current.pairs, current.names)
                if (id(buffers), name) not in known]

    def keep_noting(self) -> None:
        """A re-run found what the call's buffers hold acceptable: those holding nan or inf are
        noted at every call from now on (their largest value as a call starts, whatever their
        size), so that what they keep is not judged again."""
        with torch.no_grad():
            for i in self._changed():
                now = self.slots.pairs[i][0].get(self.slots.pairs[i][1])
                if _checkable(now) and not numerics.read(now.isfinite().all()):
                    self.slots.kept.add(i)

    def set_back(self) -> None:
        """Put the buffers back as the call found them, for a re-run inside `rerun.Kept` (which
        puts them back as they are now after it): one written in place gets its copy's values
        (uncopied, it stays as written); one the call replaced gets its old tensor (or, written
        in place before, a copy: the old tensor is left as it is, the caller's graph may hold
        it); one the call registered is taken out where it went bad, for the re-run to make it
        again (a healthy one stays: Python state beside it, a flag, may say it is made)."""
        with torch.no_grad():
            for buffers, name, path in self._registered():
                if produced([(path, buffers[name], None)], False):
                    del buffers[name]
            for i in self._changed():
                buffers, name = self.slots.pairs[i]
                old, copy = self.tensors[i], self.copies.get(i)
                if buffers.get(name) is old:
                    if copy is not None:
                        old.data.copy_(copy)  # (.data: no version moved; rerun.Kept's)
                else:
                    buffers[name] = copy.clone() if copy is not None and self._in_place(i) \
                        else old


def _copies(tensors: list, positions) -> dict:
    """Copies of the buffers at `positions`, all together within `rerun.BUFFER_COPY_BYTES`."""
    copies, size = {}, 0
    with torch.no_grad():
        for i in sorted(positions):
            t = tensors[i]
            if not _checkable(t) or t.is_inference():
                continue
            nbytes = t.numel() * t.element_size()
            if size + nbytes <= rerun.BUFFER_COPY_BYTES:
                size += nbytes
                copies[i] = t.clone()
    return copies


def produced(written: list, deferred: bool):
    """What of the written buffers holds nan or +inf that it did not hold at the call's start,
    as told by their maxima (nan, else +inf, else a number): a buffer that kept +inf (a minimum
    not yet seen) passes, and so does one that held nan already; -inf alone passes, as in
    outputs (a mask the forward caches). `deferred`: one float32 0-d value per buffer on its
    device, for the call's flag (`numerics.fine` tells); else, read now (all at once),
    [(name, tensor)] of those that do."""
    values, named = [], []
    with torch.no_grad():
        for name, now, start in written:
            if not numerics.readable(now):
                continue
            value = _maximum(now)
            if start is not None and start.device == value.device:  # (nan == nan is false)
                value = torch.where(start.isnan() | (value == start), -_INF, value)
            values.append(value)
            named.append((name, now))
        if deferred or not values:
            return values if deferred else []
        read = numerics.read(torch.stack([v.to(values[0].device) for v in values]))
    return [pair for pair, value in zip(named, read) if not numerics.fine(value)]


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
