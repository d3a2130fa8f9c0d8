"""Where a pass's device rows are written: `RowSink`, blocks of rows per device and dtype that
the reductions write in place (a row at a time, `write`, or many with a few multi-tensor
reductions, `write_many`), read back by `stats.to_host` with one transfer per device. The
blocks go from pass to pass; `release_spare_blocks` frees those no pass holds."""

from __future__ import annotations

import bisect
import threading
from typing import Optional

import torch

_INF = float("inf")


class RowSink:
    """Where one pass writes its device rows: per device and dtype, blocks of rows that the
    reductions write in place (`out=`), so that no tensor is made per row. A row's handle is a
    plain int (the row's dtype block and place), which the garbage collector does not track: a
    pass of 0-d tensors was ~2,000 objects a step for it, and its full collections (0.15 s)
    came every 40 steps. `to_host` reads a pass's rows with one transfer per device; `release`
    hands the blocks on to the next pass.

    `abs_min`: each row also measures the smallest |t|, a second reduction. Without it a row is
    one reduction (min and max), and abs min is exact for a tensor of one sign, `UNMEASURED`
    for the rest."""

    __slots__ = ("_keys", "_rows", "_lock", "abs_min")

    def __init__(self, abs_min: bool = True):
        self._keys: list = []  # (device, dtype) by number
        self._rows: dict = {}  # (device, dtype) -> [its number, its blocks, rows written]
        self._lock = threading.Lock()  # (several autograd threads may write one pass)
        self.abs_min = abs_min

    def write(self, t: torch.Tensor) -> int:
        """Summarise `t` into the next row of its dtype; its handle."""
        key = (t.device, t.dtype)
        rows, row = self._reserve(key, 1)
        lowest, low, high = rows[1][row // ROWS_PER_BLOCK].views[row % ROWS_PER_BLOCK]
        autocast = _OUT_OVERLOADS_AUTOCAST and _autocast_enabled(key[0].type)
        if autocast:  # (as `_device_row`)
            torch.set_autocast_enabled(key[0].type, False)
        try:
            torch.aminmax(t, out=(low, high))
            if self.abs_min:
                torch.linalg.vector_norm(t, -_INF, out=lowest)
        except BaseException:
            for view in (lowest, low, high):  # no handle: a finite row, for a read of the range
                view.zero_()
            raise
        finally:
            if autocast:
                torch.set_autocast_enabled(key[0].type, True)
        return rows[0] << _ROW_BITS | row

    def write_many(self, tensors: list) -> list:
        """Summarise `tensors` (dense, non-empty, floating; any devices and dtypes) into the next
        rows, with a few multi-tensor reductions per device and dtype in place of a launch each
        (on a GPU each launch is ~15 us of host time); their handles. Lean rows only (no abs
        min): `_foreach_norm(inf)` gives the abs max A and `_foreach_max` the max M, nan
        propagating through both; the row's min is -A where A > M (exact) and otherwise
        max(-A, -tiny): not the min, but it keeps abs max, the signs of infinities and a known
        abs min as `aminmax` would give them (abs min is then known for a tensor <= 0 or all
        zeros, unmeasured for the rest; a tensor holding both +inf and -inf, and no nan, shows
        only its +inf)."""
        groups: dict = {}
        for position, t in enumerate(tensors):
            groups.setdefault((t.device, t.dtype), []).append(position)
        handles: list = [0] * len(tensors)
        for key, positions in groups.items():
            pairs = _max_rows([tensors[i] for i in positions], key)
            rows, first = self._reserve(key, len(positions))
            row, done = first, 0
            while done < len(positions):  # (rows may run on into the next block)
                start = row % ROWS_PER_BLOCK
                count = min(len(positions) - done, ROWS_PER_BLOCK - start)
                rows[1][row // ROWS_PER_BLOCK].tensor[start:start + count, 1:].copy_(
                    pairs[done:done + count])
                row, done = row + count, done + count
            for offset, position in enumerate(positions):
                handles[position] = rows[0] << _ROW_BITS | (first + offset)
        return handles

    def _reserve(self, key: tuple, count: int) -> tuple:
        """(the rows of `key`: [its number, its blocks, rows written], the first of `count` rows
        taken for the caller), blocks added as needed."""
        with self._lock:
            rows = self._rows.get(key)
            if rows is None:
                rows = self._rows[key] = [len(self._keys), [], 0]
                self._keys.append(key)
            first = rows[2]
            rows[2] = first + count
            while rows[2] > len(rows[1]) * ROWS_PER_BLOCK:
                rows[1].append(_take_block(key))
        return rows, first

    def device_of(self, handle: int) -> torch.device:
        return self._keys[handle >> _ROW_BITS][0]

    def only_device(self) -> Optional[torch.device]:
        """The device of every row written, or None (no rows, or rows of several devices)."""
        devices = {device for device, _ in self._keys}
        return devices.pop() if len(devices) == 1 else None

    def rows_of(self, handles: list) -> tuple:
        """(device rows as one matrix per dtype, in order, each handle's place among them)."""
        if not handles:
            return [], []
        numbers = {handle >> _ROW_BITS for handle in handles}
        ordered = sorted(handles) if len(numbers) > 1 else None
        matrices, bases, start = [], {}, 0
        for number in sorted(numbers):
            if ordered is None:
                low, high = min(handles), max(handles)
            else:  # the handles of this dtype lie between its number and the next
                first = number << _ROW_BITS
                low = ordered[bisect.bisect_left(ordered, first)]
                high = ordered[bisect.bisect_left(ordered, first + _ROW_MASK + 1) - 1]
            matrices.append(self._matrix(self._rows[self._keys[number]][1], low & _ROW_MASK,
                                         (high & _ROW_MASK) + 1))
            bases[number] = low - start  # a handle's place: itself less its dtype's base
            start += high - low + 1
        if len(bases) == 1:
            base = bases[number]
            return matrices, [handle - base for handle in handles]
        return matrices, [handle - bases[handle >> _ROW_BITS] for handle in handles]

    @staticmethod
    def _matrix(blocks: list, start: int, stop: int) -> torch.Tensor:
        first, last = start // ROWS_PER_BLOCK, (stop - 1) // ROWS_PER_BLOCK
        if first == last:
            return blocks[first].tensor[start % ROWS_PER_BLOCK: (stop - 1) % ROWS_PER_BLOCK + 1]
        whole = torch.cat([block.tensor for block in blocks[first:last + 1]])
        return whole[start - first * ROWS_PER_BLOCK: stop - first * ROWS_PER_BLOCK]

    def release(self) -> None:
        """Hand the blocks on (once the rows are read: a later pass writes over them)."""
        with self._lock:
            rows, self._rows, self._keys = self._rows, {}, []
        for key, (_, blocks, _) in rows.items():
            _give_back(key, blocks)


ROWS_PER_BLOCK = 256
_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1


def _max_rows(tensors: list, key: tuple) -> torch.Tensor:
    """(n, 2) rows (a min as `RowSink.write_many` says, max) of tensors of one device and dtype."""
    device_type = key[0].type
    autocast = _autocast_enabled(device_type)
    if autocast:
        torch.set_autocast_enabled(device_type, False)
    try:
        if key[0].type == "cpu":  # (a GPU's path run on the host: CPU's vector_norm is slow)
            abs_max = torch.stack(torch._foreach_max(torch._foreach_abs(tensors)))
        else:  # one multi-tensor kernel, no copy
            abs_max = torch.stack(torch._foreach_norm(tensors, _INF))
        high = torch.stack(torch._foreach_max(tensors))
    finally:
        if autocast:
            torch.set_autocast_enabled(device_type, True)
    low = abs_max.neg_()
    low = torch.where(high < -low, low, low.clamp(min=-torch.finfo(key[1]).tiny))
    return torch.stack((low, high), dim=1)


def _out_overloads_autocast() -> bool:
    """Whether autocast would cast the inputs of the `out=` reductions a sink writes with. It
    has no kernel for `out=` overloads (only the functional `linalg_vector_norm` is cast to
    float32), so the sink need not turn autocast off per row; a torch that adds one, or hides
    its dispatch table, gets the switch back."""
    try:
        tables = [torch._C._dispatch_dump(op) for op in ("aten::aminmax.out",
                                                         "aten::linalg_vector_norm.out")]
    except Exception:
        return True
    return any("Autocast" in table for table in tables)


_OUT_OVERLOADS_AUTOCAST = _out_overloads_autocast()


class _Block:
    """A block of `ROWS_PER_BLOCK` device rows of one dtype, (smallest |t|, min, max) each, with
    the 0-d views the reductions write into (made once: a view costs as much as a row)."""

    __slots__ = ("tensor", "views")

    def __init__(self, device: torch.device, dtype: torch.dtype):
        # Normal tensors even when made under inference_mode, so they can be written outside it.
        with torch.inference_mode(False):
            self.tensor = torch.empty((ROWS_PER_BLOCK, 3), dtype=dtype, device=device)
            self.views = [row.unbind() for row in self.tensor.unbind()]


_spare_blocks: dict = {}  # (device, dtype) -> blocks no pass holds
_spare_lock = threading.Lock()
_MAX_SPARE_BLOCKS = 16  # per dtype and device: 4,096 rows, a few passes of a large model


def _take_block(key: tuple) -> _Block:
    with _spare_lock:
        spare = _spare_blocks.get(key)
        if spare:
            return spare.pop()
    return _Block(*key)


def _give_back(key: tuple, blocks: list) -> None:
    with _spare_lock:
        spare = _spare_blocks.setdefault(key, [])
        spare.extend(blocks[:_MAX_SPARE_BLOCKS - len(spare)])


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device_type argument, and nothing to turn off per device
        return False
    except RuntimeError:  # a device type without autocast (meta)
        return False


def release_spare_blocks() -> None:
    with _spare_lock:
        _spare_blocks.clear()
