"""What op localisation needs from a guarded run, kept by the Guard when `ops=True`.

For each top-level call: the module, its inputs, its call state (RNG streams, autocast, grad
mode, taken once by the Guard for everything that may re-run the call), copies of the buffers
its forward may update (`rerun.buffers_at_start`) and how often each module had been called
before it in the batch; and the gradients that arrive at the call's outputs, from
which a backward re-run starts. On a detection, `localise` re-runs the step (`rerun`).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Dict

from .. import _tree
from .._schema import CAUSE_FORWARD_INLINE, FORWARD_CAUSES
from ..rerun import (CallState, buffers_at_start, collective_in, forward_as, redirected_forward,
                     without_parallel_wrapper)
from .localise import OpLocation, localise_backward, localise_forward

__all__ = ["OpRecorder"]


def _store_grad(grads: list, position: int, grad) -> None:
    grads[position] = grad


def _store_leaf_grad(place: list, grad) -> None:
    place[0][place[1]] = grad  # (the latest call's gradients, its position there)


class OpRecorder:
    """The last top-level call of each guarded root, and the gradients at its outputs."""

    def __init__(self):
        # root id -> (root, args, kwargs, state, counts before, buffers at the start)
        self.calls: Dict[int, tuple] = {}
        self.written: set = set()  # (id of a module, buffer name) a forward was seen writing
        self.root_grads: Dict[int, list] = {}  # root id -> gradients of its outputs
        # id of a leaf output (a parameter a model returns) -> (it, weakly; [gradients, position])
        # where its one hook stores: hooked once while attached, not at every call
        self._leaf_places: Dict[int, tuple] = {}

    def remember_call(self, root, args, kwargs, state: CallState, call_counts: dict, batch: int) -> None:
        """Keep a top-level call of `batch` for a re-run. `call_counts` (module id -> calls so far
        in the batch): the culprit's call index within this call is its batch-wide index minus
        these."""
        self.calls[id(root)] = (root, args, kwargs, state, dict(call_counts),
                                buffers_at_start(root, self.written),
                                redirected_forward(without_parallel_wrapper(root)), batch)
        self.root_grads.pop(id(root), None)

    def note_written(self, module, names: list) -> None:
        """A forward call wrote these buffers of `module`: copied from the next call on."""
        self.written.update((id(module), name) for name in names)

    def keep_root_grads(self, root_id: int, output, handles: list) -> None:
        """Hold the gradients arriving at a root's outputs (hook handles go to `handles`).

        They are kept by position in `_tree.tensors(output)`; the backward re-run walks its own
        outputs the same way and pairs them by position, so both sides must use that walk."""
        tensors = _tree.tensors(output)
        grads: list = [None] * len(tensors)
        self.root_grads[root_id] = grads
        for position, tensor in enumerate(tensors):
            if not tensor.requires_grad:
                continue
            if tensor.is_leaf:
                kept = self._leaf_places.get(id(tensor))
                if kept is not None and kept[0]() is tensor:
                    kept[1][:] = [grads, position]
                    continue
                place = [grads, position]
                self._leaf_places[id(tensor)] = (weakref.ref(tensor), place)
                handles.append(tensor.register_hook(partial(_store_leaf_grad, place)))
            else:
                handles.append(tensor.register_hook(partial(_store_grad, grads, position)))

    def forget_grads(self) -> None:
        """A backward pass ended: its gradients are needed no longer."""
        self.root_grads.clear()

    def clear(self) -> None:
        self._leaf_places.clear()  # (their hooks go with the guard's handles)
        self.calls.clear()
        self.written.clear()
        self.root_grads.clear()

    def localise(self, root_id: int, culprit, module_id: int, call_index: int, batch: int,
                 cause: str, limit, allow_inf: bool) -> OpLocation:
        """Re-run the recorded call of root `root_id` and find the op that made the culprit's
        call (`call_index`-th call of `culprit` in `batch`) go non-finite, forward when `cause`
        is one of FORWARD_CAUSES, else backward. Never raises."""
        recorded = self.calls.get(root_id)
        if recorded is None or culprit is None:
            return OpLocation(note="op localisation needs the top-level call, which was not recorded")
        root, args, kwargs, state, counts_before, buffers, forward, recorded_batch = recorded
        if recorded_batch != batch or call_index < counts_before.get(module_id, 0):
            return OpLocation(note=(
                "op localisation re-runs the model's latest call, and the value was made in an "
                "earlier one (several forwards before one backward): a backward after each "
                "forward has the op named"))
        root = without_parallel_wrapper(root)  # its own forward would start collectives
        refused = collective_in(root)
        if refused:
            return OpLocation(note=f"the step was not re-run to name the op: {refused}")
        index = call_index - counts_before.get(module_id, 0)
        grads = self.root_grads.get(root_id)
        if cause not in FORWARD_CAUSES and grads is None:
            return OpLocation(note="op localisation needs the gradients of the model's outputs")
        with forward_as(root, forward):  # the forward it ran under (Lightning's redirection)
            if cause in FORWARD_CAUSES:
                return localise_forward(root, args, kwargs, state, culprit, index, limit,
                                        allow_inf=allow_inf, buffers=buffers,
                                        handed=cause == CAUSE_FORWARD_INLINE)
            return localise_backward(root, args, kwargs, state, grads, culprit, index, limit,
                                     allow_inf=allow_inf, buffers=buffers)
