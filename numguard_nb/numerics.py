"""Finite checks computed on the device, and the read-back of their flags without waiting.

A host read of a CUDA value (`.item()`, `bool(t)`, `.tolist()`) drains the device's queue: the
GPU then idles while Python launches the next kernels. The checks that run every step (the
sentinel's) therefore leave their results on the device as small flags, and `DeferredRead`
brings them to pinned host memory with a non-blocking copy and an event: `ready()` asks the event,
`values(wait=False)` reads them only once they are there. Only a caller that must know now (an
optimizer step about to write weights, a detach) waits, and each wait is counted in `READS` (the
statistics' read-back, `passes.PassRecord.read_back`, counts there too): tests assert a healthy
step waits for nothing.

Which devices are read later: those in `DEFERRED_DEVICE_TYPES` (CUDA). Host values are read at
once, as there is nothing to wait for; tests add "cpu" to run the deferred path on the host.

    >>> flags = [output_flag(outputs), grad_norms(grads)]
    >>> read = DeferredRead(flags)      # copies started, nothing waited for
    >>> read.values() if read.ready() else None   # [[amax], [norm, norm, ...]]
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
from typing import Dict, List, Optional, Tuple

import torch

from . import stats as _stats

__all__ = ["DEFERRED_DEVICE_TYPES", "READS", "DeferredRead", "all_finite", "count_read",
           "deferred", "fine", "nonfinite_kinds", "read", "grad_norms", "nonfinite_flag",
           "nonfinite_of", "output_flag", "output_flags", "readable", "stats_flag",
           "stored_values", "unseen"]

DEFERRED_DEVICE_TYPES = {"cuda"}
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_INF = math.inf
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SMALL = 16384  # numbers: a CPU tensor smaller than this is summed with the other small ones


class _Reads:
    """How many reads of device values waited for the device (or would have, on the host)."""

    __slots__ = ("waited",)

    def __init__(self):
        self.waited = 0


READS = _Reads()


def count_read() -> None:
    READS.waited += 1


_dispatch_modes = torch._C._len_torch_dispatch_stack
_NOTHING_TO_LEAVE = contextlib.nullcontext()


def unseen():
    """Where a user's dispatch mode is on (a FLOP counter, a logging mode), the guard's own ops
    run outside it, unseen and uncounted (`stats.outside_tracing`); elsewhere nothing to do."""
    return _stats.outside_tracing() if _dispatch_modes() else _NOTHING_TO_LEAVE


def _unseen(check):
    @functools.wraps(check)
    def run_unseen(*args, **kwargs):
        if not _dispatch_modes():
            return check(*args, **kwargs)
        with _stats.outside_tracing():
            return check(*args, **kwargs)
    return run_unseen


@_unseen
def read(t: torch.Tensor, counted: bool = True):
    """`t`'s values on the host now (a number for a 0-d tensor, else nested lists). The one
    blocking read of device values outside `DeferredRead`: the engine reads nothing else (see
    tests/test_architecture.py), and a read of a deferred device's values is counted (unless
    the caller knows `t` is a host tensor: tests count the host among the deferred devices)."""
    if counted and deferred(t):
        count_read()
    if type(t) not in _PLAIN and t.dim() <= 1:  # a subclass (DTensor) lists no values: each read
        return t.item() if not t.dim() else [x.item() for x in t]
    return t.tolist()


def nonfinite_kinds(t: torch.Tensor) -> Tuple[bool, bool, bool]:
    """Whether a floating-point tensor holds (nan, +inf, -inf), exactly: one read."""
    with torch.no_grad():
        flags = torch.stack([t.isnan().any(), (t == _INF).any(), (t == -_INF).any()])
    nan, posinf, neginf = read(flags)
    return nan, posinf, neginf


def deferred(t: torch.Tensor) -> bool:
    """Whether `t`'s checks are read later (its device runs asynchronously)."""
    return t.device.type in DEFERRED_DEVICE_TYPES


def readable(t: torch.Tensor) -> bool:
    """Whether `t` holds numbers to read: not a meta or fake tensor, nor one wrapped by a
    torch.func transform. Full mode's statistics leave the same ones unread (`stats`)."""
    if type(t) in _PLAIN:
        return not t.is_meta and not _stats.is_functorch_wrapped(t)
    return not (t.is_meta or isinstance(t, _stats.STAND_INS) or _stats.is_functorch_wrapped(t))


@_unseen
def all_finite(tensors, unread: Optional[list] = None) -> bool:
    """Whether every tensor is finite, read back once per device. A sum (CPU) or a norm (other
    devices: one fused kernel) is inf or nan where a tensor holds inf or nan; it can overflow for
    huge finite values too, which `nonfinite_of` then rules out exactly. Tensors with no numbers
    to read are not watched: left out, and added to `unread`."""
    groups: Dict[tuple, list] = {}
    flags: Dict[torch.device, list] = {}
    for t in tensors:
        if not readable(t):
            if unread is not None:
                unread.append(t)
            continue
        if t.layout != torch.strided:
            t = t.coalesce().values() if t.is_sparse else t.to_dense()
        if t.numel() and (t.is_floating_point() or t.is_complex()):
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), group in groups.items():
        wide = torch.float32 if dtype in _LOW_PRECISION else None
        try:
            sums = _sums(group, wide) if device.type == "cpu" else torch._foreach_norm(group, 2, dtype=wide)
        except (RuntimeError, TypeError):  # a tensor subclass or dtype foreach cannot take
            sums = [t.sum(dtype=wide) for t in group]
        flags.setdefault(device, []).append(torch.stack(list(sums)).isfinite().all())
    count_read()
    return all(bool(torch.stack(device_flags).all()) for device_flags in flags.values())


def _sums(group: list, dtype) -> list:
    """One sum per large tensor, and one over all small ones put together: on CPU a reduction
    costs about as much to start as to run over a few thousand numbers."""
    small = [t.reshape(-1) for t in group if t.numel() < _SMALL]
    sums = [t.sum(dtype=dtype) for t in group if t.numel() >= _SMALL]
    if small:
        sums.append(torch.cat(small).sum(dtype=dtype))
    return sums


@_unseen
def nonfinite_of(named_tensors) -> list:
    """The (name, tensor) pairs whose tensor holds inf or nan, checked exactly (those with no
    numbers to read left out, as in `all_finite`)."""
    bad = []
    count_read()
    with torch.no_grad():
        for name, t in named_tensors:
            if not readable(t):
                continue
            values = t.coalesce().values() if t.is_sparse else t
            if values.numel() and not bool(torch.isfinite(values).all()):
                bad.append((name, t))
    return bad


def fine(value: float) -> bool:
    """Whether a checked value passes: not nan, not +inf (-inf is a mask's, or no value)."""
    return value < _INF


@_unseen
def output_flag(tensors, extra: Optional[list] = None) -> Optional[torch.Tensor]:
    """One float32 value on the device that is nan or +inf where an output holds nan or +inf
    (`fine` tells). -inf alone passes (an attention or action mask: the loss and the gradients
    judge whether it does harm). `amax` propagates nan and is +inf where +inf is: one reduction
    per tensor, no copy. `extra`: float32 0-d values to judge with them (written buffers'). On a
    GPU's device where the tensors are on several (a model split across devices)."""
    flags = _extreme_flags(tensors, extra, masks=False)
    return None if flags is None else flags[0]


@_unseen
def output_flags(tensors, extra: Optional[list] = None) -> Optional[tuple]:
    """`output_flag`, and beside it a second value that is +inf where an output holds -inf (nan
    beside a nan): a mask, or a -inf the loss must judge. One reduction per tensor (`aminmax`)."""
    return _extreme_flags(tensors, extra, masks=True)


def _extreme_flags(tensors, extra: Optional[list], masks: bool) -> Optional[tuple]:
    maxima, negated_minima = [], []
    with torch.no_grad():
        for t in tensors:
            if t.layout != torch.strided or t.is_nested:
                t = stored_values(t)
            if t is None or not t.numel():
                continue
            if t.is_complex():  # by its parts, as the host's rows sign it: -inf + 0j passes
                t = torch.view_as_real(t.resolve_conj())
            elif not t.is_floating_point():
                continue
            elif t.element_size() == 1:  # float8: no max kernel of its own (on CPU at least)
                t = t.float()
            if masks:
                low, high = torch.aminmax(t)
                maxima.append(_as_flag(high))
                negated_minima.append(_as_flag(-low))
            else:
                maxima.append(_as_flag(t.amax()))
        maxima += extra or ()
        if not maxima:
            return None
        if not masks:
            return (_largest(maxima),)
        return _largest(maxima), (_largest(negated_minima) if negated_minima else None)


def _largest(values: list) -> torch.Tensor:
    """The largest of float32 0-d values, as a vector of one on one device (a GPU's where the
    values are on several)."""
    if len(values) == 1:
        return values[0].reshape(1)
    device = next((m.device for m in values if m.device.type == "cuda"), values[0].device)
    return torch.stack([m if m.device == device else m.to(device, non_blocking=True)
                        for m in values]).max().reshape(1)


def stored_values(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The values a sparse or nested tensor stores, as one strided tensor (None: another kind)."""
    try:
        if t.is_sparse:
            return t._values()  # (uncoalesced is fine for a check)
        if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
            return t.values()
        if t.is_nested:
            if t.layout == torch.jagged:
                return t.values()
            parts = t.unbind()
            return torch.cat([part.reshape(-1) for part in parts]) if parts else None
    except (RuntimeError, NotImplementedError, TypeError):
        pass
    return None


def _as_flag(maximum: torch.Tensor) -> torch.Tensor:
    """A maximum as float32: a float64 number beyond float32's range becomes -inf (fine), not
    +inf; nan and +inf stay."""
    if maximum.dtype == torch.float64:
        maximum = maximum.masked_fill(maximum.isfinite(), -_INF)
    return maximum.float()


@_unseen
def stats_flag(vectors: list, sink: Optional["_stats.RowSink"] = None) -> Optional[torch.Tensor]:
    """One float32 value on the device that is nan or inf where any of the `stats.device_stats`
    rows (or rows in `sink`, by handle) summarised a tensor holding inf or nan (from their
    extremes); None where a row is on the host or none has one. A few launches per dtype, not one
    per value."""
    by_dtype: dict = {}
    handles = []
    for vec in vectors:
        if vec is None:
            continue
        if type(vec) is int:
            handles.append(vec)
            continue
        # a device's row holds the signed min and max (1, 2); another, abs max (1)
        extremes = vec[1:3] if type(vec) is _stats.DeviceRow else vec[1:2]
        if any(not isinstance(x, torch.Tensor) or x.device.type not in DEFERRED_DEVICE_TYPES
               for x in extremes):
            return None
        by_dtype.setdefault(extremes[0].dtype, []).extend(extremes)
    with torch.no_grad():
        maxima = [torch.stack(group).abs().amax().float() for group in by_dtype.values()]
        if handles:
            matrices, _ = sink.rows_of(handles)
            if any(m.device.type not in DEFERRED_DEVICE_TYPES for m in matrices):
                return None
            maxima += [m[:, 1:3].abs().amax().float() for m in matrices]
        if not maxima:
            return None
        return (maxima[0] if len(maxima) == 1 else torch.stack(maxima).amax()).reshape(1)


@_unseen
def grad_norms(tensors: list) -> Optional[torch.Tensor]:
    """Per tensor its norm, as one float32 vector on the device (the tensors' order; all on one
    device): inf or nan where the tensor holds inf or nan (`fine` tells), overflowing only for
    values beyond float32's range. One fused kernel per dtype (`torch._foreach_norm`)."""
    if not tensors:
        return None
    tensors = [_local(t) for t in tensors]
    dtypes = {t.dtype for t in tensors}
    with torch.no_grad():
        if len(dtypes) == 1:  # the common case: one launch, one stack
            return _norms(tensors, dtypes.pop())
        positions: dict = {}
        for position, t in enumerate(tensors):
            positions.setdefault(t.dtype, []).append(position)
        order = [p for group in positions.values() for p in group]
        norms = torch.cat([_norms([tensors[p] for p in group], dtype)
                           for dtype, group in positions.items()])
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return norms[inverse.to(norms.device)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own values of a DTensor (an FSDP2 gradient's shard): a check on the DTensor
    itself would be a collective of DTensor's making, every step. Other tensors as they are."""
    to_local = getattr(t, "to_local", None) if type(t) not in _PLAIN else None
    return to_local() if to_local is not None else t


_ONES: Dict[torch.device, torch.Tensor] = {}  # device -> float32 1.0: a scale that changes nothing


@_unseen
def nonfinite_flag(groups: list) -> Optional[torch.Tensor]:
    """One float32 value on the tensors' device (all on one): +inf where any holds inf or nan,
    else -1 (`fine` tells). `groups`: the tensors in lists of one dtype each. GradScaler's fused
    check, one launch per dtype and no tensor made per input: far less host time than
    `grad_norms` on a model of many parameters, but it does not say which tensor. Its kernel
    writes each value back times 1.0 (the same bits). None where it cannot take them: tensors
    that take gradients themselves (a double backward's: the write would count as an in-place
    change) or a kind it has no kernel for."""
    if any(map(_REQUIRES_GRAD, itertools.chain.from_iterable(groups))):  # (C speed: a model's
        return None                                                     # gradients, each step)
    groups = [group if set(map(type, group)) <= _PLAIN_TYPES else [_local(t) for t in group]
              for group in groups if group]
    if not groups:
        return None
    device = groups[0][0].device
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    found = torch.zeros(1, dtype=torch.float32, device=device)
    try:
        with torch.no_grad():
            for group in groups:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, one)
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return found.sub_(1).reciprocal_()  # 0 -> -1, 1 -> +inf


def _norms(group: list, dtype: torch.dtype) -> torch.Tensor:
    wide = torch.float32 if dtype in _LOW_PRECISION else None
    try:
        values = torch._foreach_norm(group, 2, dtype=wide)
    except (RuntimeError, TypeError):  # a tensor subclass or dtype foreach cannot take
        values = [t.float().norm() for t in group]
    return torch.stack(values).float()


class DeferredRead:
    """Float32 vectors on the device, copied to pinned host memory as soon as they are computed,
    read once there. Vectors on the host need no copy and are ready at once."""

    __slots__ = ("_host", "_event", "_sizes", "_values", "on_device")

    def __init__(self, vectors: list):
        self._sizes = [int(v.numel()) for v in vectors]
        self._values: Optional[list] = None
        self._event = None
        self.on_device: Optional[torch.Tensor] = None  # the vectors joined, until read
        if not vectors:
            self._host = None
            self._values = []
            return
        # A model across devices (layers on two GPUs, or some on the CPU) has a flag per device:
        # joined on a GPU's, where a copy waits for nothing.
        device = next((v.device for v in vectors if v.device.type == "cuda"), vectors[0].device)
        flat = torch.cat([v.reshape(-1) if v.device == device
                          else v.reshape(-1).to(device, non_blocking=True) for v in vectors])
        if flat.device.type in DEFERRED_DEVICE_TYPES:
            self.on_device = flat
        if flat.device.type == "cuda":
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flat.device))  # where the copy runs
        else:
            self._host = flat

    def ready(self) -> bool:
        """Whether the flags are on the host (never waits)."""
        return self._values is not None or self._event is None or self._event.query()

    def values(self, wait: bool = False, counted: bool = True) -> Optional[List[list]]:
        """The vectors as lists of floats, or None while not ready (unless `wait`: then the wait
        is counted in `READS`, unless a wait for later work on the device covered it)."""
        if self._values is None:
            if not self.ready():
                if not wait:
                    return None
                if counted:
                    count_read()
                if self._event is not None:
                    self._event.synchronize()
            flat = self._host.tolist()
            self._values, start = [], 0
            for size in self._sizes:
                self._values.append(flat[start:start + size])
                start += size
            self._host = self._event = self.on_device = None
        return self._values
