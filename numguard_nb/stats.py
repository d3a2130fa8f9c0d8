"""Tensor summaries computed on the tensor's own device, with no host synchronisation.

`device_stats` returns a few 0-d tensors that stay on the device; the guard stacks those of a
whole pass and reads them with one transfer (`to_host`). `decode` turns one host row into the
fields of a `TensorRow`.

The row is (abs min, abs max, sum[, smallest non-zero abs]): nan propagates into abs max, an
infinity makes abs max inf, and when abs max is inf without a nan the sum tells the sign of the
infinities (+inf, -inf, or nan when both occur; finite values near the dtype's maximum can
overflow the sum and read as both). Three cheap reductions instead of the five passes and two
syncs of `abs().min()`, `abs().max()`, `isnan().any()`, `isinf().any()`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Iterator, Optional, Tuple

import torch

_INF = float("inf")
# On CPU, amin + amax are about 3x faster than aminmax per element for these (for half types, the
# reverse); below this size the cost is per op, and one aminmax beats two reductions.
_SEPARATE_MIN_MAX = (torch.float32, torch.float64)
_LARGE = 1 << 16  # elements

# Scratch memory for |t| on CPU. A fresh multi-MB buffer per tensor costs a page fault per 4 KiB
# page (6.5 ms for a 4 MiB activation, 50x the arithmetic); CUDA's caching allocator avoids that
# by itself. One buffer per thread and dtype, grown to the largest tensor, up to this many bytes.
_WORKSPACE_MAX_BYTES = 512 * 2**20
_workspace = threading.local()


def _abs_into_workspace(t: torch.Tensor) -> Optional[torch.Tensor]:
    """|t| written to a reused CPU buffer, or None where a buffer does not fit."""
    if t.device.type != "cpu" or t.is_complex() or not t.is_contiguous() or t.numel() < _LARGE \
            or t.numel() * t.element_size() > _WORKSPACE_MAX_BYTES:
        return None
    buffers = getattr(_workspace, "buffers", None)
    if buffers is None:
        buffers = _workspace.buffers = {}
    buffer = buffers.get(t.dtype)
    if buffer is None or buffer.numel() < t.numel():
        # A normal tensor even when made under inference_mode, so it can be written outside it.
        with torch.inference_mode(False):
            buffer = buffers[t.dtype] = torch.empty(t.numel(), dtype=t.dtype)
    return torch.abs(t, out=buffer[: t.numel()].view(t.shape))


def release_workspace() -> None:
    """Free this thread's scratch buffers (the guard calls it on detach)."""
    _workspace.buffers = {}


def _host_float(device: torch.device) -> torch.dtype:
    # float64 holds every float32/float16 statistic exactly; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def device_stats(t: torch.Tensor, nonzero_min: bool = False) -> Optional[tuple]:
    """Summary of `t` as a tuple of 0-d tensors on its device (call under no_grad), or None.

    The tuple is not stacked here: `to_host` stacks a whole pass at once, one op instead of one
    per tensor.

    Sparse and nested tensors are summarised over their stored values, float8 through float32.
    Never raises: what has no numbers to read (meta, functorch-wrapped, quantized) gets None and
    is reported without statistics.
    """
    try:
        t = _numbers_of(t)
        if t is None:
            return None
        if t.dtype is torch.bool:
            # bools: min and max as 0/1; they cannot be non-finite.
            lo, hi = t.all().to(_host_float(t.device)), t.any().to(_host_float(t.device))
            return (lo, hi, lo, hi) if nonzero_min else (lo, hi, lo)
        magnitude = _abs_into_workspace(t)
        if magnitude is None:
            magnitude = t.abs()
        if t.dtype in _SEPARATE_MIN_MAX and t.numel() >= _LARGE:
            lo, hi = magnitude.amin(), magnitude.amax()
        else:
            lo, hi = torch.aminmax(magnitude)
        if not (t.is_floating_point() or t.is_complex()):
            # integers: exact in float64, and never mixed into a float16 stack (65504 max).
            lo, hi = lo.to(_host_float(t.device)), hi.to(_host_float(t.device))
            return (lo, hi, lo, lo) if nonzero_min else (lo, hi, lo)
        total = t.sum() if t.is_floating_point() else hi
        if nonzero_min:
            return (lo, hi, total, magnitude.masked_fill_(magnitude == 0, _INF).amin())
        return (lo, hi, total)
    except Exception:  # a tensor type of someone else's: never break the user's forward
        return None


_FLOAT8 = tuple(getattr(torch, name) for name in dir(torch) if name.startswith("float8_"))
_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _numbers_of(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The dense tensor whose values summarise `t`, or None when its values cannot be read."""
    if t.is_meta or t.is_quantized or _is_functorch_wrapped(t):
        return None
    if t.is_nested:
        t = t.values()
    elif type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        t = t.as_subclass(torch.Tensor)  # skip the subclass's __torch_function__
    if t.layout == torch.sparse_coo:
        t = t._values()
    elif t.layout in _COMPRESSED:
        t = t.values()
    if t.dtype in _FLOAT8:
        t = t.float()  # few kernels for float8; float32 holds every float8 value exactly
    return t if t.numel() else None


def _is_functorch_wrapped(t: torch.Tensor) -> bool:
    check = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return bool(check and check(t))


def _stack_to_host(vectors: list, device: torch.device) -> list:
    width = len(vectors[0])
    flat = torch.stack([x for vec in vectors for x in vec])  # promotes mixed float dtypes exactly
    return flat.to("cpu", _host_float(device)).view(-1, width).tolist()


def to_host(vectors: list) -> list:
    """Read many `device_stats` tuples with one transfer per device; returns lists of floats.

    A tuple that cannot be read back (a tensor type that refuses it) becomes a row of nan: the
    guard then looks at it rather than missing it."""
    if not vectors:
        return []
    try:
        return _to_host(vectors)
    except Exception:
        return [_one_to_host(vec) for vec in vectors]


def _one_to_host(vec) -> list:
    try:
        return _stack_to_host([vec], vec[0].device)[0]
    except Exception:
        return [math.nan] * len(vec)


def _to_host(vectors: list) -> list:
    device = vectors[0][0].device
    if all(vec[0].device == device for vec in vectors):
        return _stack_to_host(vectors, device)
    values: list = [None] * len(vectors)
    by_device: dict = {}
    for index, vec in enumerate(vectors):
        by_device.setdefault(vec[0].device, []).append(index)
    for dev, indices in by_device.items():
        host = _stack_to_host([vectors[i] for i in indices], dev)
        for i, row in zip(indices, host):
            values[i] = row
    return values


def decode(values) -> Tuple[float, float, bool, Optional[bool], Optional[bool], Optional[float]]:
    """(abs_min, abs_max, nan, posinf, neginf, nonzero_abs_min) from one host stats vector.

    posinf/neginf are None when a nan in the same tensor hides whether infinities occur.
    """
    abs_min, abs_max, total = values[0], values[1], values[2]
    nonzero = values[3] if len(values) > 3 else None
    if nonzero is not None and nonzero == _INF:
        nonzero = None  # all zeros
    if math.isnan(abs_max) or math.isnan(abs_min):
        return abs_min, abs_max, True, None, None, nonzero
    if abs_max == _INF:
        if math.isnan(total):
            return abs_min, abs_max, False, True, True, nonzero
        return abs_min, abs_max, False, total > 0, total < 0, nonzero
    return abs_min, abs_max, False, False, False, nonzero


_MAX_DEPTH = 8
_MANY = 16  # a longer container without a tensor in it is one row, not one row per item


def shape_of(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The shape as a tuple, or None where it has none (a jagged nested tensor)."""
    try:
        return tuple(t.shape)
    except Exception:
        return None


def walk(value, role: str, depth: int = 0) -> Iterator[Tuple[str, object]]:
    """(role, leaf) for every tensor or leaf value nested in tuples, lists, dicts, dataclasses.

    Roles follow Hugging Face's naming: output, output[0], output[0][1], plus output[logits] for
    dict keys (ModelOutput is a dict) and dataclass fields.
    """
    if isinstance(value, torch.Tensor) or value is None or depth >= _MAX_DEPTH:
        yield role, value
    elif isinstance(value, (tuple, list, dict)) and len(value) > _MANY and not any(
            isinstance(v, torch.Tensor) or isinstance(v, (tuple, list, dict))
            for v in (value.values() if isinstance(value, dict) else value)):
        yield role, value
    elif isinstance(value, (tuple, list)):
        if not value:
            yield role, value
        for index, item in enumerate(value):
            yield from walk(item, f"{role}[{index}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from walk(item, f"{role}[{key}]", depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from walk(getattr(value, f.name), f"{role}[{f.name}]", depth + 1)
    else:
        yield role, value
