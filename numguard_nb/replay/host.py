"""Host copies of tensors a replay needs, made without a host synchronisation: copied
asynchronously into pinned memory for CUDA tensors, cloned for CPU tensors."""

from __future__ import annotations

from typing import Dict, List

import torch

from .. import _tree


class HostCopies:
    """Host copies of one call's input tensors: copied asynchronously into pinned memory for CUDA
    tensors (no synchronisation per step), cloned for CPU tensors. A tensor passed twice is
    copied once. Other values that are not plain data are kept by reference and named."""

    __slots__ = ("cuda_devices", "by_reference", "_memo")

    def __init__(self):
        self.cuda_devices: set = set()
        self.by_reference: List[str] = []
        self._memo: Dict[int, torch.Tensor] = {}

    def of_inputs(self, args, kwargs):
        """(args, kwargs) with every tensor replaced by its host copy."""
        args_copy = _tree.rebuild(tuple(args), self.copy, self._keep)
        kwargs_copy = {key: _tree.rebuild(value, self.copy, self._keep, (key,))
                       for key, value in (kwargs or {}).items()}
        return args_copy, kwargs_copy

    def finished_events(self) -> list:
        """One CUDA event per device copied from, recorded after the copies were queued: waiting
        on them says the copies are done."""
        events = []
        for index in sorted(self.cuda_devices):
            with torch.cuda.device(index):
                event = torch.cuda.Event()
                event.record()
                events.append(event)
        return events

    def copy(self, t: torch.Tensor, path) -> torch.Tensor:
        hit = self._memo.get(id(t))
        if hit is not None:
            return hit
        d = t.detach()
        if d.device.type == "cuda" and d.layout == torch.strided:
            out = torch.empty(d.shape, dtype=d.dtype, pin_memory=True)
            out.copy_(d, non_blocking=True)
            self.cuda_devices.add(d.device.index if d.device.index is not None else 0)
        elif d.device.type == "cpu":
            out = d.clone()
        else:
            out = d.to("cpu")
        if t.requires_grad and (out.is_floating_point() or out.is_complex()):
            out.requires_grad_(True)
        self._memo[id(t)] = out
        return out

    def _keep(self, value, path):
        if not isinstance(value, torch.Size):  # a size is a value, not an object to share
            self.by_reference.append(f"{_tree.role_of('input', path)} ({type(value).__name__})")
        return value
