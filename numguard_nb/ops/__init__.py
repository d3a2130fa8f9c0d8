"""Op localisation: re-run the failing step and name the ATen op and the source line that went bad.

The guard finds the culprit at module granularity. With `Guard(..., ops=True)` it keeps what a
re-run needs (`recorder.OpRecorder`) and, on a detection, re-runs the last top-level call of the
model inside the culprit (`localise.localise_forward` / `localise.localise_backward`) under a
dispatch mode that checks every ATen op and protects the model's state (`mode.RerunMode`); what any
re-run shares (the call's state, putting back what it changes) is the package's `rerun`.

- `localise`: the re-run and its conclusion, an `OpLocation` (never raises);
- `mode`: the `TorchDispatchMode` of a re-run and the checks on values and ops;
- `recorder`: the Guard's side: the recorded calls and the gradients at their outputs.
"""

from ..rerun import CallState, take as rng_state
from .localise import OpLocation, localise_backward, localise_forward

__all__ = ["OpLocation", "CallState", "rng_state", "localise_forward", "localise_backward"]
