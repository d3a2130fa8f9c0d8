"""Replay a captured call on CPU, where a CUDA error is raised at the line that caused it.

GPU work is asynchronous: a kernel that fails (a label past the number of classes in
`cross_entropy`, an embedding index past the vocabulary) is reported later, at `loss.backward()`
or the next synchronisation, as "CUDA error: device-side assert triggered", with a traceback that
points at the wrong line, and the CUDA context is unusable afterwards: nothing can be copied off
the GPU any more. The cure is to run the same batch on CPU, where the error is raised at once, at
the real line. So the data needed for that has to be on the host *before* the error:

- `Capture(models)` (what `Guard(..., capture=True)` builds on attach) takes a host snapshot of
  every guarded model's parameters, buffers and tensor attributes, tensor by tensor (so GPU memory
  is never doubled). A model already on CPU is copied too, since the run goes on to change its
  weights: that costs one more copy of the weights in host memory.
- `Capture.record` (called by the guard at the start of every top-level call of a guarded module)
  keeps the last two calls of each guarded module: host copies of their inputs (copied
  asynchronously into pinned memory for CUDA tensors: no synchronisation per step; CPU tensors
  are cloned), the state the call ran in (a `CallState`: CPU and CUDA RNG, autocast, grad mode;
  the guard takes it once per call and passes it), the training mode, and the line that made
  the call.
- `CapturedCall.replay()` rebuilds the model on CPU from the snapshot (a deep copy of the live
  module in which every parameter and buffer is replaced by its host copy: the live model and
  its GPU memory are never touched, and the guard's hooks are left out), restores the RNG state
  and runs the call again. A loss module guarded alongside the model (`Guard({'model': m,
  'loss_fn': nn.CrossEntropyLoss()})`) is replayed after the model call that fed it, with the
  replayed model output in place of its inputs where they match it. The `ReplayResult` names the
  exception and the innermost line of the user's or the model's code (or, when the error is
  raised inside torch's own modules, the line that called the module).
- `CapturedCall.save(path)` writes a replay bundle that `load_capture(path, model)` replays in a
  fresh kernel; bundles are read with `torch.load(weights_only=True)` and never execute code.
- `replay_after_error(guard, exc)` does all of it for the notebook magic after a device error.

The snapshot holds the weights as they were when the guard was attached. If an optimizer step
changed them before the captured call, the replay says so (`CapturedCall.weights_changed`);
errors that come from the data (the usual device-side asserts) do not depend on the weights.
`Capture.snapshot()` takes a fresh snapshot when needed.

Where each part lives: `snapshot` (the weight snapshot and what it costs), `call` (one captured
call and its host copies), `run` (replaying a chain of calls), `capture` (`Capture`), `bundle`
and `load` (writing and reading bundles), `after_error` (`replay_after_error`, `ReplayOutcome`).
Their views are in numguard_nb.render.replay.
"""

from __future__ import annotations

from ..errors import CaptureTooLarge, ReplayError
from .after_error import ReplayOutcome, is_device_error, replay_after_error
from .bundle import BUNDLE_FORMAT, BUNDLE_VERSION  # noqa: F401 (importable here, as before)
from .call import CapturedCall
from .capture import Capture
from .load import load_capture
from .location import Location
from .run import ReplayResult
from .snapshot import SNAPSHOT_MEMORY_SHARE, snapshot_bytes, snapshot_fits  # noqa: F401 (as before)

__all__ = [
    "Capture",
    "CaptureTooLarge",
    "CapturedCall",
    "Location",
    "ReplayError",
    "ReplayOutcome",
    "ReplayResult",
    "is_device_error",
    "load_capture",
    "replay_after_error",
    "snapshot_fits",
]
