"""Tensor summaries computed on the tensor's own device, with no host synchronisation.

On a GPU, `device_stats` writes the row into the pass's `RowSink` (blocks of rows per dtype that
the reductions fill in place) and returns its handle, or, without a sink, a `DeviceRow` of 0-d
tensors; the guard reads a whole pass with one transfer (`to_host`). On CPU, where there is
nothing to wait for, it returns the floats at once. `decode` turns one host row into the fields
of a `TensorRow`.

The host row is (abs min, abs max, signs[, smallest non-zero abs]). nan propagates into abs max
and an infinity makes it inf; then `signs` tells which infinities occur: +inf, -inf, or nan for
both. On CPU they are looked up exactly when abs max is inf, and beside a nan too, where `signs`
is then a bit mask (1: +inf, 2: -inf, 0: neither); |t| is written once to a reused buffer and
reduced by one integer aminmax over its bits. On a device the row is the signed min and max of
t itself (`aminmax`, one reduction, no temporary), whose signs tell the infinities exactly (beside
a nan both are nan: the infinities stay unknown there); `to_host` turns it into the host row. A
pass's rows in a `RowSink` made with `abs_min=True`, and rows made without a sink, add the
smallest |t| (`vector_norm(t, -inf)`), a second reduction: on a GPU each reduction is a launch of
~15 us of host time, so full mode measures the smallest |t| only where it is shown (see
`RowSink`). Without it, abs min is still exact for a tensor of one sign (its min, or -max) and
`UNMEASURED` for one of both signs. Both run outside autocast, which would first copy a float16
or bfloat16 tensor to float32 for a norm. `abs().min()`, `abs().max()`, `isnan().any()` and
`isinf().any()` take five passes and two syncs.

Some tensors hold no numbers: fake tensors (torch.export, FakeTensorMode), meta tensors,
functional and functorch-wrapped tensors (torch.func.vmap, grad, functionalize), wrapper
subclasses whose own storage is empty. They get no summary (None: "unsupported"), never a made-up
one. Tensors that do hold numbers are summarised outside whatever traces the call: the
statistics never enter a torch.jit trace, an export graph or a user's dispatch mode.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import struct
import threading
from typing import Optional, Tuple

import numpy as np
import torch

from .row_sink import RowSink, _autocast_enabled, release_spare_blocks

_INF = float("inf")

# |t| is reduced through an integer view of its bits: for non-negative floats the bit patterns
# sort like the values, nan's above inf's, and integer aminmax is one pass at 1.5-3x the speed of
# float amin + amax on CPU. The two results are viewed back as floats, bit for bit.
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64}
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# What makes a call unusual, each one C call: a dispatch mode (fake, proxy, functional, a
# user's), the torch.jit tracer, a torch.func transform. The common case has none of them.
_dispatch_modes = torch._C._len_torch_dispatch_stack
_tracing_state = torch._C._get_tracing_state
_set_tracing_state = torch._C._set_tracing_state
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_function_modes_enabled = torch._C._is_torch_function_mode_enabled


def _bits_reader(int_format: str, float_format: str, shift: int = 0):
    pack, unpack = struct.Struct(int_format).pack, struct.Struct(float_format).unpack
    if shift:
        return lambda value: unpack(pack((value & 0xFFFF) << shift))[0]
    return lambda value: unpack(pack(value))[0]


# Integer bits (from `.item()`) -> the float they encode; bfloat16 is float32's upper half.
_FLOAT_OF_BITS = {
    torch.float32: _bits_reader("<i", "<f"),
    torch.float16: _bits_reader("<h", "<e"),
    torch.bfloat16: _bits_reader("<I", "<f", shift=16),
    torch.float64: _bits_reader("<q", "<d"),
}

# Scratch memory for |t| on CPU. A fresh multi-MB buffer per tensor costs a page fault per 4 KiB
# page (6.5 ms for a 4 MiB activation, 50x the arithmetic); CUDA's caching allocator avoids that
# by itself. One buffer per thread and dtype, grown to the largest tensor, up to this many bytes,
# with its views cached per shape (making a view costs as much as summarising a small tensor).
_WORKSPACE_MAX_BYTES = 512 * 2**20
_WORKSPACE_MAX_VIEWS = 512
_workspace = threading.local()


def _abs_into_workspace(t: torch.Tensor, bits: torch.dtype) -> Optional[torch.Tensor]:
    """|t| written to a reused CPU buffer, returned as its integer view (`bits`), or None where a
    buffer does not fit."""
    views = getattr(_workspace, "views", None)
    if views is None:
        views = _workspace.views = {}
        _workspace.buffers = {}
    key = (t.dtype, t.shape)
    out = views.get(key)
    if out is None:
        if not t.is_cpu or t.numel() * t.element_size() > _WORKSPACE_MAX_BYTES:
            return None
        out = _workspace_view(views, t, bits)
    elif not t.is_cpu:
        return None
    torch.abs(t, out=out[0])  # any strides in, contiguous out
    return out[1]


def _workspace_view(views: dict, t: torch.Tensor, bits: torch.dtype) -> tuple:
    buffers = _workspace.buffers
    buffer = buffers.get(t.dtype)
    # Normal tensors even when made under inference_mode, so they can be written outside it.
    with torch.inference_mode(False):
        if buffer is None or buffer.numel() < t.numel():
            # on the CPU whatever the default device is (torch.set_default_device)
            buffer = buffers[t.dtype] = torch.empty(t.numel(), dtype=t.dtype, device="cpu")
            for key in [k for k in views if k[0] == t.dtype]:
                del views[key]  # views of the old, smaller buffer
        if len(views) >= _WORKSPACE_MAX_VIEWS:
            views.clear()
        view = buffer[: t.numel()].view(t.shape)
        views[(t.dtype, t.shape)] = pair = (view, view.view(bits))
    return pair


def release_workspace() -> None:
    """Free this thread's scratch buffers, and the sinks' spare blocks (the guard calls it on
    detach: a pass of a guard still attached makes its blocks again)."""
    _workspace.views = None
    _workspace.buffers = {}
    release_spare_blocks()


# CPU values are read at once (there is nothing to wait for). Tests set it False to run a GPU's
# path on the host: device rows, stacked and read once per pass.
CPU_READS_AT_ONCE = True


# The abs min of a host row whose tensor held both signs and whose smallest |t| was not measured
# (a `RowSink` without abs_min). No |t| is negative; `decode` gives None for it.
UNMEASURED = -1.0


class DeviceRow(tuple):
    """A device's row, its 0-d tensors not read: (abs min, min, max[, smallest non-zero abs])."""

    __slots__ = ()


def _host_float(device: torch.device) -> torch.dtype:
    # float64 holds every float32/float16 statistic exactly; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def device_stats(t: torch.Tensor, nonzero_min: bool = False, sign_hints: Optional[dict] = None,
                 site=None, sink: Optional["RowSink"] = None):
    """Summary of `t`, or None: on CPU a tuple of floats, read at once (there is no device to
    wait for); elsewhere a tuple of 0-d tensors that stay on the device, for `to_host` to stack
    with the rest of the pass and read with one transfer. Call under no_grad.

    `sign_hints` (site -> whether the last tensor seen there had one sign throughout) lets CPU
    tensors that keep one sign, such as ReLU outputs, skip writing |t|: one pass instead of two.
    With a `sink`, a device's row is written into it and its handle (an int) returned instead.

    Sparse and nested tensors are summarised over their stored values, float8 through float32.
    Never raises: what has no numbers to read (fake, meta, functional, functorch-wrapped,
    quantized) gets None and is reported without statistics.
    """
    try:
        bits = _BITS.get(t.dtype)
        # The common case first, each test one attribute or C call: a plain strided float tensor
        # with nothing tracing, transforming or intercepting the call.
        if bits is None or type(t) not in _PLAIN or t.layout is not torch.strided or t.is_nested \
                or t.is_meta or _dispatch_modes() or _tracing_state() is not None \
                or _transforms_active():
            return _unusual_stats(t, nonzero_min)
        if not t.numel():
            return None
        if sink is not None and not nonzero_min and not (CPU_READS_AT_ONCE and t.is_cpu):
            try:
                return sink.write(t)  # a device's common case, straight to its row
            except Exception:  # a tensor the reductions cannot write: the plain ones then
                return _plain_stats(t, nonzero_min)
        return _summary(t, bits, nonzero_min, sign_hints, site, sink)
    except Exception:  # a tensor type of someone else's: never break the user's forward
        return None


def written_together(t) -> bool:
    """Whether `device_stats_many` writes `t`'s row: a plain dense float tensor, not empty, not
    an inference tensor, on a device (CPU values are read at once)."""
    return (t.dtype in _BITS and type(t) in _PLAIN and t.layout is torch.strided
            and not (t.is_nested or t.is_meta or t.is_inference() or (CPU_READS_AT_ONCE and t.is_cpu))
            and bool(t.numel()))


def device_stats_many(tensors: list, sink: "RowSink") -> list:
    """Rows of many tensors written into `sink` together (`RowSink.write_many`: a few launches
    per device and dtype, not one each): their handles, None for a tensor left to
    `device_stats` (off the common path, read at once on CPU, empty, an inference tensor), all
    None where the reductions refuse them. Lean rows only: a sink without abs min."""
    found: list = [None] * len(tensors)
    if sink.abs_min or _dispatch_modes() or _tracing_state() is not None or _transforms_active():
        return found
    take = [i for i, t in enumerate(tensors) if written_together(t)]
    if take:
        try:
            for i, handle in zip(take, sink.write_many([tensors[i] for i in take])):
                found[i] = handle
        except Exception:  # (a tensor the reductions refuse: each summarised on its own then)
            return [None] * len(tensors)
    return found


def _summary(t: torch.Tensor, bits: Optional[torch.dtype], nonzero_min: bool, sign_hints,
             site, sink=None):
    """The row of a dense tensor that holds numbers (`bits`: its integer view dtype, or None)."""
    if bits is not None:
        try:
            return _bit_stats(t, bits, nonzero_min, sign_hints, site,
                              read_now=t.is_cpu and CPU_READS_AT_ONCE, sink=sink)
        except Exception:  # a tensor the fast path cannot read: the plain reductions then
            pass
    row = _plain_stats(t, nonzero_min)
    return tuple(x.item() for x in row) if t.is_cpu and CPU_READS_AT_ONCE else row


def _unusual_stats(t: torch.Tensor, nonzero_min: bool) -> Optional[tuple]:
    """`device_stats` off the common path: another dtype, layout or tensor type, or a call made
    while something traces, transforms or intercepts torch ops. None for a tensor that holds no
    numbers; otherwise its row, computed where nothing records the work."""
    if not _intercepted():  # integers, masks, subclasses: nothing to set aside
        t = _numbers_of(t)
        return None if t is None else _summary(t, _BITS.get(t.dtype), nonzero_min, None, None)
    with outside_tracing():
        t = _numbers_of(t)
        row = None if t is None else _summary(t, _BITS.get(t.dtype), nonzero_min, None, None)
    if row is not None and t.is_cpu and CPU_READS_AT_ONCE and not all(type(x) is float for x in row):
        return None  # symbolic numbers (a fake tensor's, a trace's), not values
    return row


def _intercepted() -> bool:
    """Whether torch ops run now would be recorded by the jit tracer or seen by a dispatch mode.
    (torch.export's pre-dispatch modes come with a fake mode on the stack counted here.)"""
    return bool(_dispatch_modes() or _tracing_state() is not None)


@contextlib.contextmanager
def outside_tracing():
    """Run torch ops for real and unseen: the torch.jit tracer paused, dispatch modes (fake,
    proxy, functional, a user's) and torch function modes set aside. The statistics are then
    neither recorded into a trace or graph nor counted by a user's mode. (Under a torch.func
    transform, ops on tensors it has not wrapped run as they are: nothing records them.)"""
    state = _tracing_state()
    if state is not None:
        _set_tracing_state(None)
    try:
        with contextlib.ExitStack() as stack:
            if _dispatch_modes() or _pre_dispatch_modes():
                from torch.utils._python_dispatch import _disable_current_modes

                stack.enter_context(_disable_current_modes())
            if _function_modes_enabled():
                stack.enter_context(torch._C.DisableTorchFunction())
            yield
    finally:
        if state is not None:
            _set_tracing_state(state)


def _pre_dispatch_modes() -> int:
    """Modes of torch.export's pre-dispatch tracing, which the stack above does not count."""
    count = getattr(torch._ops, "_len_torch_dispatch_stack_pre_dispatch", None)
    return count() if count is not None else 0


def _bit_stats(t: torch.Tensor, bits: torch.dtype, nonzero_min: bool, sign_hints, site,
               read_now: bool, sink=None):
    """`device_stats` of a float tensor: floats when `read_now` (on CPU: |t| through its integer
    bits), else a row left on the device: written into `sink` (its handle), or a `DeviceRow`."""
    if read_now and sign_hints is not None and not nonzero_min and sign_hints.get(site, True):
        row = _one_signed_row(t, bits)
        sign_hints[site] = row is not None
        if row is not None:
            return row
    if not read_now:
        if sink is not None and not nonzero_min:
            return sink.write(t)
        return _device_row(t, bits, nonzero_min)
    lo, hi, smallest = _magnitudes(t, bits, nonzero_min)
    as_float = _FLOAT_OF_BITS[t.dtype]
    abs_max = as_float(hi.item())
    # The signs of infinities matter only when there may be some: look for them then.
    row = (as_float(lo.item()), abs_max, 0.0 if abs_max < _INF else _exact_signs(t, abs_max))
    return row if smallest is None else row + (smallest.item(),)


def _device_row(t: torch.Tensor, bits: torch.dtype, nonzero_min: bool) -> DeviceRow:
    """Two reductions of t in its own dtype, no temporary, out of autocast (its float32 copy for
    a norm is a pass and a write of 2-4 bytes per value). The smallest non-zero |t| writes |t|."""
    device_type = t.device.type
    autocast = _autocast_enabled(device_type)
    if autocast:
        torch.set_autocast_enabled(device_type, False)
    try:
        low, high = torch.aminmax(t)
        row = (torch.linalg.vector_norm(t, -_INF), low, high)
        if nonzero_min:
            pieces = t.numel() * t.element_size() > DEVICE_PIECE_BYTES
            row += ((_magnitudes_in_pieces if pieces else _magnitudes)(t, bits, True)[2],)
    finally:
        if autocast:
            torch.set_autocast_enabled(device_type, True)
    return DeviceRow(row)


def smallest_magnitudes(tensors: list) -> list:
    """(smallest |t|, largest |t|) of each tensor as floats (None where it cannot be had), with
    one read per device: the abs min a `RowSink` without abs_min left unmeasured, for a report,
    and the abs max to tell that the tensor still holds the values its row summarised."""
    found: list = [None] * len(tensors)
    by_device: dict = {}
    for index, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(index)
    for device, indices in by_device.items():
        autocast = _autocast_enabled(device.type)
        if autocast:  # (as `_device_row`)
            torch.set_autocast_enabled(device.type, False)
        try:
            host_float = _host_float(device)
            norms = torch.stack([torch.linalg.vector_norm(tensors[i], ord).to(host_float)
                                 for i in indices for ord in (-_INF, _INF)])
            values = norms.cpu().tolist()
            for position, index in enumerate(indices):
                found[index] = (values[2 * position], values[2 * position + 1])
        except Exception:  # a tensor the norm refuses: its abs min stays unmeasured
            pass
        finally:
            if autocast:
                torch.set_autocast_enabled(device.type, True)
    return found


# |t| is written out for the smallest non-zero |t| (`nonzero_min`): on a device, a tensor larger
# than this (a language model's float32 logits: 1.5 GiB) is reduced in pieces of this size, so
# the peak memory grows by no more.
DEVICE_PIECE_BYTES = 64 * 2**20


def _magnitudes(t: torch.Tensor, bits: torch.dtype, nonzero_min: bool) -> tuple:
    """(smallest |t| bits, largest |t| bits, smallest nonzero |t| or None), 0-d tensors."""
    magnitude_bits = _abs_into_workspace(t, bits)
    if magnitude_bits is None:
        magnitude_bits = t.abs().view(bits)
    lo, hi = torch.aminmax(magnitude_bits)
    smallest = None
    if nonzero_min:
        magnitude = magnitude_bits.view(t.dtype)
        smallest = magnitude.masked_fill_(magnitude == 0, _INF).amin()
    return lo, hi, smallest


def _magnitudes_in_pieces(t: torch.Tensor, bits: torch.dtype, nonzero_min: bool) -> tuple:
    """`_magnitudes` of a large device tensor, |t| written a piece at a time."""
    per_piece = max(1, DEVICE_PIECE_BYTES // t.element_size())
    if t.is_contiguous():
        pieces = t.reshape(-1).split(per_piece)
    else:  # along its longest dimension (no contiguous copy of the whole)
        dim = max(range(t.dim()), key=lambda d: t.shape[d])
        pieces = t.split(max(1, per_piece * t.shape[dim] // t.numel()), dim=dim)
    rows = [_magnitudes(piece, bits, nonzero_min) for piece in pieces]
    lo = torch.stack([row[0] for row in rows]).amin()
    hi = torch.stack([row[1] for row in rows]).amax()
    smallest = torch.stack([row[2] for row in rows]).amin() if nonzero_min else None
    return lo, hi, smallest


_MAGNITUDE_MASK = {torch.int16: 0x7FFF, torch.int32: 0x7FFFFFFF, torch.int64: 0x7FFFFFFFFFFFFFFF}


def _one_signed_row(t: torch.Tensor, bits: torch.dtype) -> Optional[tuple]:
    """The row of a CPU tensor whose values all have one sign bit, from one pass over its bits;
    None when both signs occur (then |t| is needed), or when t's bits cannot be viewed (a
    negative-bit view)."""
    try:
        raw_bits = t.view(bits)
    except RuntimeError:
        return None
    lo, hi = torch.aminmax(raw_bits)
    lo, hi = lo.item(), hi.item()
    as_float = _FLOAT_OF_BITS[t.dtype]
    if lo >= 0:  # no sign bit set: the bits of t are those of |t|
        abs_min, abs_max = as_float(lo), as_float(hi)
        return abs_min, abs_max, 0.0 if abs_max < _INF else (
            _INF if abs_max == _INF else _exact_signs(t, abs_max))
    if hi < 0:  # every sign bit set: below it, the bits sort by magnitude
        mask = _MAGNITUDE_MASK[bits]
        abs_min, abs_max = as_float(lo & mask), as_float(hi & mask)
        return abs_min, abs_max, 0.0 if abs_max < _INF else (
            -_INF if abs_max == _INF else _exact_signs(t, abs_max))
    return None


# Beside a nan, the third field of a CPU row is a bit mask of the infinities found.
_POSINF_BIT, _NEGINF_BIT = 1, 2


def _exact_signs(t: torch.Tensor, abs_max: float) -> float:
    """The third field of a CPU row whose abs max is inf or nan, exactly. inf: +inf, -inf, or nan
    for both. nan: the bit mask of the infinities beside it (0.0 for none)."""
    positive, negative = bool((t == _INF).any()), bool((t == -_INF).any())
    if abs_max == _INF:
        if positive and negative:
            return math.nan
        return _INF if positive else -_INF
    return float((_POSINF_BIT if positive else 0) | (_NEGINF_BIT if negative else 0))


def _plain_stats(t: torch.Tensor, nonzero_min: bool) -> tuple:
    """The row as 0-d tensors from plain reductions over |t|: booleans, integers, complex numbers,
    and float tensors the bit-level path cannot read (a backend without integer aminmax, say)."""
    if t.dtype is torch.bool:
        # bools: min and max as 0/1; they cannot be non-finite.
        lo, hi = t.all().to(_host_float(t.device)), t.any().to(_host_float(t.device))
        return (lo, hi, lo, hi) if nonzero_min else (lo, hi, lo)
    if not (t.is_floating_point() or t.is_complex()):
        lo, hi = _integer_magnitudes(t)
        return (lo, hi, lo, lo) if nonzero_min else (lo, hi, lo)
    magnitude = t.abs()
    lo, hi = torch.aminmax(magnitude)
    # (a complex value's infinities signed by its parts: log(0j) is -inf + 0j, a real -inf's kin)
    signs = t.sum() if t.is_floating_point() else torch.view_as_real(t.resolve_conj()).sum()
    if nonzero_min:
        return (lo, hi, signs, magnitude.masked_fill_(magnitude == 0, _INF).amin())
    return (lo, hi, signs)


def _integer_magnitudes(t: torch.Tensor) -> tuple:
    """(smallest |t|, largest |t|) of an integer tensor as 0-d floats: exact in float64, and
    never mixed into a float16 stack (65504 max). Not through `t.abs()`, which wraps at the
    dtype's minimum (int8's -128 stays -128)."""
    host_float = _host_float(t.device)
    low, high = (x.to(host_float) for x in torch.aminmax(t))
    if not t.dtype.is_signed:
        return low, high
    # |x| - 1, which cannot wrap: x - 1 above zero, ~x (= -x - 1) below it; zero gives -1.
    smallest = torch.where(t < 0, ~t, t - 1).amin().to(host_float) + 1
    return smallest, torch.maximum(low.abs(), high.abs())


_FLOAT8 = tuple(getattr(torch, name) for name in dir(torch) if name.startswith("float8_"))
_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _numbers_of(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The dense tensor whose values summarise `t`, or None when it holds none to read: a meta
    or fake tensor, one wrapped by a torch.func transform (vmap, grad, functionalize), a wrapper
    subclass whose own storage is empty, a quantized tensor."""
    if t.is_meta or t.is_quantized or _is_functorch_wrapped(t):
        return None
    if t.is_nested:
        t = t.values()
    elif type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        if isinstance(t, _STAND_INS):
            return None  # a trace's fake or functional tensor: no values at all
        t = t.as_subclass(torch.Tensor)  # skip the subclass's __torch_function__
        if t.layout is torch.strided and not t.data_ptr():
            return None  # a wrapper subclass (DTensor, ...): its values live in inner tensors
    if t.layout == torch.sparse_coo:
        t = t._values()
    elif t.layout in _COMPRESSED:
        t = t.values()
    if t.dtype in _FLOAT8:
        t = t.float()  # few kernels for float8; float32 holds every float8 value exactly
    return t if t.numel() else None


def _stand_in_types() -> tuple:
    """The tensor types of tracing that stand in for values they do not hold."""
    types = []
    for module, name in (("torch._subclasses.fake_tensor", "FakeTensor"),
                         ("torch._subclasses.functional_tensor", "FunctionalTensor")):
        try:
            types.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # an older torch without it
            pass
    return tuple(types)


_STAND_INS = STAND_INS = _stand_in_types()

_functorch_check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def _is_functorch_wrapped(t: torch.Tensor) -> bool:
    return bool(_functorch_check is not None and _functorch_check(t))


is_functorch_wrapped = _is_functorch_wrapped


def _all_ints(vectors: list) -> bool:
    """Whether every row is a sink's handle (at C speed: a pass has hundreds)."""
    return set(map(type, vectors)) == {int}


def _stack_to_host(vectors: list, device: torch.device, sink: Optional[RowSink] = None) -> list:
    """The rows of one device as host lists, with one transfer. Rows are stacked per dtype: a
    stack of mixed dtypes (bfloat16 activations beside float32 weights under autocast) is a
    copy per value (cat's fallback: a kernel launch each on a GPU), one of a single dtype is one
    batched copy. A sink's rows come as matrices already. Device rows become host rows on the
    host, after the transfer (`_host_rows`: a dozen array operations, not a dozen launches)."""
    host_float = _host_float(device)
    if type(vectors[0]) is int and _all_ints(vectors):
        # A sink's rows only (the device path's common case): in order with one comprehension.
        matrices, places = sink.rows_of(vectors)
        raw = _joined([matrix.to(host_float) for matrix in matrices]).cpu().numpy()
        rows = list(map(tuple, _host_rows(raw, sink.abs_min).tolist()))
        return [rows[place] for place in places]
    width = len(vectors[0]) if type(vectors[0]) is not int else 3
    groups: dict = {}
    handles: list = []
    for index, vec in enumerate(vectors):
        if type(vec) is int:
            handles.append(index)
        else:
            groups.setdefault((type(vec) is DeviceRow, vec[0].dtype), []).append(index)
    order, blocks, sink_rows = [], [], 0
    if handles:
        matrices, places = sink.rows_of([vectors[i] for i in handles])
        blocks = [matrix.to(host_float) for matrix in matrices]
        sink_rows = sum(len(matrix) for matrix in matrices)
        order = [None] * sink_rows
        for index, place in zip(handles, places):
            order[place] = index  # (rows no handle here asked for stay None: not read out)
    device_rows = sink_rows
    for device_kind in (True, False):  # device rows first, to turn into host rows together
        for (kind, _), indices in groups.items():
            if kind is device_kind:
                # (a row of mixed dtypes is promoted exactly, as the rows of mixed groups are)
                block = torch.stack([x for i in indices for x in vectors[i]]).to(host_float)
                blocks.append(block.view(-1, width))
                order += indices
                device_rows += len(indices) if device_kind else 0
    raw = _joined(blocks).cpu().numpy()
    if device_rows:
        made = _abs_min_column(raw[:sink_rows], sink.abs_min) if sink_rows else raw[:0]
        raw = np.concatenate([_host_rows(np.concatenate([made, raw[sink_rows:device_rows]])),
                              raw[device_rows:]])
    # tuples of floats, which the garbage collector stops tracking (lists it tracks for good)
    rows = list(map(tuple, raw.tolist()))
    if not handles and len(groups) == 1:
        return rows
    values: list = [None] * len(vectors)
    for position, index in enumerate(order):
        if index is not None:
            values[index] = rows[position]
    return values


def _joined(blocks: list) -> torch.Tensor:
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _abs_min_column(rows: np.ndarray, measured: bool) -> np.ndarray:
    """`rows` (abs min, min, max, ...) whose abs min column was not written unless `measured`,
    with one: exact for a tensor of one sign, `UNMEASURED` for one of both."""
    if measured:
        return rows
    low, high = rows[:, 1], rows[:, 2]
    derived = np.where(low >= 0, low, np.where(high <= 0, -high, UNMEASURED)) + 0.0  # (-0.0 made 0.0)
    return np.concatenate([derived[:, None], rows[:, 1:]], axis=1)


def _host_rows(rows: np.ndarray, abs_min_measured: bool = True) -> np.ndarray:
    """A matrix of `DeviceRow` values, (abs min, min, max, ...), as host rows, (abs min, abs max,
    signs, ...). Beside a nan, the infinities are unknown (signs nan). Rows whose abs min was not
    `abs_min_measured` get one (`_abs_min_column`). (A new array: `rows` may share a sink's
    block, which later passes write over.)"""
    rows = _abs_min_column(rows, abs_min_measured)
    low, high = rows[:, 1], rows[:, 2]
    abs_max = np.maximum(-low, high) + 0.0  # nan where either is; -0.0 made 0.0
    positive, negative = high == _INF, low == -_INF
    signs = np.where(positive & negative, math.nan,
                     np.where(positive, _INF, np.where(negative, -_INF, 0.0)))
    unknown = np.isnan(abs_max)
    columns = [np.where(unknown, math.nan, rows[:, 0]), abs_max, np.where(unknown, math.nan, signs)]
    return np.stack(columns + [rows[:, i] for i in range(3, rows.shape[1])], axis=1).astype(rows.dtype, copy=False)


def to_host(vectors: list, sink: Optional[RowSink] = None) -> list:
    """Read many `device_stats` rows (and handles of rows in `sink`) with one transfer per
    device; returns lists of floats.

    A row that cannot be read back (a tensor type that refuses it) becomes None: a value
    without statistics, never a row of made-up numbers (nan would read as a detection)."""
    if not vectors:
        return []
    if _intercepted():
        with outside_tracing():
            return _all_to_host(vectors, sink)
    return _all_to_host(vectors, sink)


def _all_to_host(vectors: list, sink) -> list:
    try:
        return _to_host(vectors, sink)
    except Exception:
        return [_one_to_host(vec, sink) for vec in vectors]


def _one_to_host(vec, sink) -> Optional[list]:
    if type(vec) is not int and type(vec[0]) is float:
        return vec
    try:
        device = sink.device_of(vec) if type(vec) is int else vec[0].device
        return _stack_to_host([vec], device, sink)[0]
    except Exception:
        return None


def _to_host(vectors: list, sink) -> list:
    device = sink.only_device() if sink is not None else None  # (of every row in the sink)
    if device is not None and type(vectors[0]) is int and _all_ints(vectors):
        return _stack_to_host(vectors, device, sink)
    values: list = [None] * len(vectors)
    by_device: dict = {}
    for index, vec in enumerate(vectors):
        if type(vec) is int:  # a row in the sink
            by_device.setdefault(device or sink.device_of(vec), []).append(index)
        elif vec is None:  # a value gone before its row was written (`PassRecord.read_back`)
            pass
        elif type(vec[0]) is float:  # read on the host already
            values[index] = vec
        else:
            by_device.setdefault(vec[0].device, []).append(index)
    for dev, indices in by_device.items():
        host = _stack_to_host([vectors[i] for i in indices], dev, sink)
        for i, row in zip(indices, host):
            values[i] = row
    return values


def decode(values) -> Tuple[float, float, bool, Optional[bool], Optional[bool], Optional[float]]:
    """(abs_min, abs_max, nan, posinf, neginf, nonzero_abs_min) from one host stats vector.

    posinf/neginf are None when a nan in the same tensor hides whether infinities occur (a
    device row, whose `signs` is then nan). abs_min is None where it was not measured.
    """
    abs_min, abs_max, signs = values[0], values[1], values[2]
    nonzero = values[3] if len(values) > 3 else None
    if nonzero is not None and nonzero == _INF:
        nonzero = None  # all zeros
    if math.isnan(abs_max) or math.isnan(abs_min):
        # abs min and max as min() and max() of it would say
        if math.isnan(signs):
            return math.nan, math.nan, True, None, None, nonzero
        mask = int(signs)
        return (math.nan, math.nan, True, bool(mask & _POSINF_BIT), bool(mask & _NEGINF_BIT),
                nonzero)
    if abs_min == UNMEASURED:
        abs_min = None
    if abs_max == _INF:
        if math.isnan(signs):
            return abs_min, abs_max, False, True, True, nonzero
        return abs_min, abs_max, False, signs > 0, signs < 0, nonzero
    return abs_min, abs_max, False, False, False, nonzero


def shape_of(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The shape as a plain tuple (which the garbage collector stops tracking, unlike a
    torch.Size), or None where it has none (a strided nested tensor)."""
    try:
        return tuple(t.shape)
    except Exception:
        return None
