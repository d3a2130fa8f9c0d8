"""The capture: the guarded models' weight snapshot and their last calls, kept on the host.

`Guard(..., capture=True)` builds a `Capture` on attach and calls `record` at the start of every
top-level call of a guarded module. An optimizer step on the guarded weights is noted, so that a
replay on the snapshot says the weights have moved since.
"""

from __future__ import annotations

import collections
import itertools
import warnings
import weakref
from typing import Dict, List, Optional

from torch import nn

from .. import _tree, rerun
from .._util import WeakHook, error_line
from ..rerun import CallState
from ..errors import CaptureTooLarge, ReplayError
from .call import CapturedCall
from .host import HostCopies
from .location import call_site
from .outside import OutsideRecorder
from .snapshot import _Snapshot, snapshot_fits


class Capture:
    """Host snapshot of the guarded models and host copies of their last calls' inputs.

    `Guard(..., capture=True)` builds one on attach and calls `record` at the start of every
    top-level call of a guarded module; `guard.capture` is `capture.latest`.

    Args:
        models: a module, or a dict of name -> module (the guard's `models`, "" for one model).
        keep: calls kept per guarded module (2: the call that failed may be the one before the
            call during which the asynchronous error was reported).

    The snapshot is taken here, tensor by tensor to host memory: it costs one copy of the
    weights in host memory, also for a model already on CPU (whose weights the run goes on to
    change).
    """

    def __init__(self, models, keep: int = 2):
        if isinstance(models, nn.Module):
            models = {"": models}
        if not isinstance(models, dict) or not models or \
                not all(isinstance(m, nn.Module) for m in models.values()):
            raise TypeError("Capture needs a torch.nn.Module or a dict of name -> torch.nn.Module")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.models: Dict[str, nn.Module] = dict(models)
        self.keep = keep
        self.root_order: List[str] = list(self.models)
        self.snapshots: Dict[str, _Snapshot] = {}
        self._calls: collections.deque = collections.deque()
        self._count = itertools.count()
        self._warned = False
        self.snapshot()
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # The hook is torch's, global: it holds the capture weakly, and goes when the capture
        # does or the guard detaches, whichever comes first.
        self._optimizer_hook = register_optimizer_step_post_hook(
            WeakHook(self, "note_optimizer_step"))
        weakref.finalize(self, self._optimizer_hook.remove)

    def note_optimizer_step(self, optimizer) -> None:
        for snapshot in self.snapshots.values():
            snapshot.note_optimizer_step(optimizer)

    def stop_watching_optimizers(self) -> None:
        """Remove the optimizer-step hook (the guard calls it on detach; idempotent)."""
        self._optimizer_hook.remove()

    def snapshot(self) -> None:
        """(Re)take the host snapshot of every guarded model's weights, buffers and attributes.
        Raises CaptureTooLarge, before copying anything, where it would not fit in host memory."""
        fits, why = snapshot_fits(self.models)
        if not fits:
            raise CaptureTooLarge(
                f"capture refused: {why}: pass capture=False (no CPU replay after a CUDA error), "
                "or free host memory"
            )
        self.snapshots = {name: _Snapshot.take(module) for name, module in self.models.items()}
        # The code after a call finds the guarded weights it uses by name (a tied head, a
        # regularizer), not by a copy.
        params = {id(p): (weakref.ref(module), root, name) for root, module in self.models.items()
                  for name, p in module.named_parameters()}
        recorder = getattr(self, "recorder", None)
        self.recorder = OutsideRecorder(params)
        if recorder is not None:
            self.recorder.call = recorder.call

    @property
    def latest(self) -> Optional[CapturedCall]:
        """The latest captured call (None before the first)."""
        return self._calls[-1] if self._calls else None

    @property
    def calls(self) -> List[CapturedCall]:
        """The captured calls kept, oldest first."""
        return list(self._calls)

    def previous(self, call: CapturedCall) -> Optional[CapturedCall]:
        for other in self._calls:
            if other.index == call.index - 1:
                return other
        return None

    def replay(self, device="cpu"):
        """Replay the latest call (see `CapturedCall.replay`)."""
        if self.latest is None:
            raise ReplayError(
                "nothing was captured yet: run the model inside Guard(model, capture=True) "
                "first, then replay"
            )
        return self.latest.replay(device)

    def record(self, root_name: str, module: nn.Module, args, kwargs,
               state: Optional[CallState] = None) -> Optional[CapturedCall]:
        """Keep host copies of one top-level call's inputs, and the state it runs in (never raises).

        `state`: the call's `CallState`, when the caller took it for the call already (the guard
        takes it once per call, for op localisation too); else it is taken here.
        """
        try:
            if state is None:
                state = rerun.take()
            call = self._record(root_name, module, args, kwargs, state)
            self.recorder.start_call(call)
            return call
        except Exception as error:  # capturing must never break the run it watches
            self.recorder.start_call(None)  # what follows belongs to no call kept
            if not self._warned:
                self._warned = True
                warnings.warn(f"numguard: could not capture a call of {type(module).__name__} for "
                              f"replay: {error_line(error)}", RuntimeWarning, stacklevel=3)
            return None

    def note_output(self, output) -> None:
        """The output of the latest top-level call (the code after it reads it)."""
        try:
            self.recorder.note_output(self.recorder.call, output)
        except Exception:  # capturing must never break the run it watches
            pass

    def _root_for(self, root_name: str, module: nn.Module) -> str:
        for name, root in self.models.items():
            if root is module:
                return name
        if root_name in self.models and self.models[root_name] is module:
            return root_name
        # A module the guard treats as a root but that was not given here: snapshot it now.
        name = root_name if root_name not in self.models else f"{root_name}#{len(self.models)}"
        self.models[name] = module
        self.root_order.append(name)
        self.snapshots[name] = _Snapshot.take(module)
        return name

    def _record(self, root_name, module, args, kwargs, state: CallState) -> CapturedCall:
        root = self._root_for(root_name, module)
        snapshot = self.snapshots[root]
        copies = HostCopies()
        args_copy, kwargs_copy = copies.of_inputs(args, kwargs)
        events = copies.finished_events()
        cuda_device = min(copies.cuda_devices) if copies.cuda_devices else snapshot.cuda_device
        cuda_rng_state = None
        if cuda_device is not None and state.cuda is not None and cuda_device < len(state.cuda):
            cuda_rng_state = state.cuda[cuda_device]
        call = CapturedCall(
            self, root, type(module).__name__, next(self._count), args_copy, kwargs_copy,
            state=state, cuda_device=cuda_device, cuda_rng_state=cuda_rng_state,
            training=bool(module.training), weights_changed=snapshot.weights_changed(),
            call_site=call_site(),
            input_devices=sorted({str(t.device) for t in _tree.tensors((args, kwargs or {}))}),
            by_reference=copies.by_reference, events=events,
        )
        self._calls.append(call)
        same_root = [c for c in self._calls if c.root_name == root]
        for old in same_root[: max(0, len(same_root) - self.keep)]:
            self._calls.remove(old)
        return call

    def __repr__(self) -> str:
        names = ", ".join(n or type(m).__name__ for n, m in self.models.items())
        return f"<numguard Capture of {names}: {len(self._calls)} calls kept>"
