"""The floor of a leaner full mode: what hooks that keep only a compact log of a pass would cost.

Full mode's host time is mostly its per-call records (docs/overhead.md, "Full mode's host
time"), not its statistics. `LeanFloor` measures what would be left with a leaner record: per
module call, the module's id in a log and a row for each floating input not seen in the pass and
for each output, a gradient hook on each output that writes its gradient's row; the weights' rows
written together at the forward's start and the parameters' gradients' at the backward's end
(`RowSink.write_many`), as full mode writes them on a GPU; each pass read once and scanned for a
non-finite value. It builds no calls, no slots and no report: `benchmarks/attribute.py`'s variant
`full-lean-floor` times it against full mode, to tell whether reworking full mode's records
could reach its goals (GPT-2 124M and the Llama-style model <= 1.3x, the stack <= 2x).

    floor = LeanFloor(model)   # hooked; floor.detach() takes every hook off
"""

from __future__ import annotations

import itertools
import math
import weakref

import torch

from numguard_nb import stats
from numguard_nb._tree import output_tensors
from numguard_nb._util import register_tensor_hook
from numguard_nb.row_sink import RowSink

_set_grad_enabled = torch._C._set_grad_enabled


class LeanFloor:
    """Compact-log hooks on every module of `model` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.weights = [t for t in itertools.chain(model.parameters(), model.buffers())
                        if t.is_floating_point()]
        self.sink = RowSink(abs_min=False)
        self.log: list = []  # module ids (a call opening), -1 (one closing), row handles
        self.rows: list = []  # the pass's row handles, to read
        self.seen: dict = {}  # id(tensor) -> (its weak reference, version, row handle)
        self.grad_hooks: list = []  # the pass's gradient hooks' handles (dead once its graph is)
        self.depth = 0
        self.backward_open = False
        self.passes_read = 0
        self.nonfinite_passes = 0
        self.module_hooks = []
        for module in model.modules():
            self.module_hooks.append(module.register_forward_pre_hook(self.pre_hook, with_kwargs=True))
            self.module_hooks.append(module.register_forward_hook(self.post_hook, with_kwargs=True,
                                                                  always_call=True))

    def detach(self) -> None:
        for handle in self.module_hooks + self.grad_hooks:
            handle.remove()
        self.module_hooks, self.grad_hooks = [], []

    def _row(self, t: torch.Tensor) -> int:
        known = self.seen.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            return known[2]
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            _set_grad_enabled(False)  # (the reductions write with out=)
        try:
            handle = self.sink.write(t)
        finally:
            if grad_enabled:
                _set_grad_enabled(True)
        self.seen[id(t)] = (weakref.ref(t), t._version, handle)
        self.rows.append(handle)
        return handle

    def _rows_together(self, tensors: list) -> None:
        with torch.no_grad():
            self.rows += self.sink.write_many([t for t in tensors if t.numel()])

    def pre_hook(self, module, args, kwargs):
        if self.depth == 0:
            self._rows_together(self.weights)
        self.depth += 1
        log = self.log
        log.append(id(module))
        for value in itertools.chain(args, kwargs.values()):
            if type(value) is torch.Tensor and value.is_floating_point() and value.numel():
                log.append(self._row(value))

    def post_hook(self, module, args, kwargs, output=None):
        self.depth -= 1
        log = self.log
        log.append(-1)
        for value in ((output,) if type(output) is torch.Tensor else output_tensors(output)):
            if value.is_floating_point() and value.numel():
                log.append(self._row(value))
                if value.requires_grad:
                    self.grad_hooks.append(register_tensor_hook(value, self.grad_hook))
        if self.depth == 0:
            self._read()

    def grad_hook(self, grad):
        if not self.backward_open:
            self.backward_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.log.append(self._row(grad))

    def _end_backward(self) -> None:
        self.backward_open = False
        self._rows_together([p.grad for p in self.parameters if p.grad is not None])
        self._read()
        self.grad_hooks = []

    def _read(self) -> None:
        """The pass's one read, and a scan for a non-finite value (a detection's first look)."""
        values = stats.to_host(self.rows, self.sink)
        self.passes_read += 1
        if not all(row is not None and math.isfinite(row[1]) for row in values):
            self.nonfinite_passes += 1
        self.sink.release()
        self.rows, self.log, self.seen = [], [], {}
