"""Replay a captured call on CPU, where a CUDA error is raised at the line that caused it.

Contract: `Capture(models)` (what `Guard(..., capture=True)` builds) keeps, before any error, a
host snapshot of the guarded weights and the last two calls of each guarded module (host copies
of the inputs, the `CallState` they ran in, the training mode, the calling line).
`CapturedCall.replay()` runs a call again on a CPU copy of the model and returns a `ReplayResult`
(the exception and its real line); `CapturedCall.save(path)` and `load_capture(path, model)`
replay it in a fresh kernel; `replay_after_error(guard, exc)` does it all for the magic.

Limits: the live model and its GPU memory are never touched; the snapshot holds the weights as
they were at attach (`CapturedCall.weights_changed` says when a step changed them before the
call, `Capture.snapshot()` takes a fresh one); bundles are read with `weights_only=True`.

    >>> result = guard.capture.replay(device="cpu")   # after the CUDA error
    >>> result.exception, result.location              # IndexError: ..., your file and line

How it works: docs/replay.md, "How it works".
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
