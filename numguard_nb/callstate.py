"""The state a top-level call ran in: RNG streams, autocast, grad and inference mode.

Taken once, just before a call, by whoever needs to run that call again: op localisation
re-runs it inside the culprit, the CPU replay re-runs it from a host copy. Both restore the
same things the same way from here.
"""

from __future__ import annotations

import contextlib
import random
from typing import Optional

import torch

__all__ = ["CallState", "take", "autocast_dtype", "enter_autocast"]

AUTOCAST_DEVICES = ("cpu", "cuda")


class CallState:
    """What a top-level call's randomness and precision depended on, taken just before it.

    Holds the CPU generator state, the CUDA generator states when CUDA is initialised, Python's
    `random` state, the autocast settings in force (a forward run under `torch.autocast` is
    re-run under it, even when the re-run happens later, in backward), whether gradients were
    recorded and whether inference mode was on (a forward re-run then runs under it, instead of
    no_grad).
    """

    __slots__ = ("cpu", "cuda", "python", "autocast", "inference", "grad_enabled")

    def __init__(self, cpu, cuda, python, autocast, inference=False, grad_enabled=True):
        self.cpu = cpu
        self.cuda = cuda  # one state per CUDA device, or None
        self.python = python
        self.autocast = autocast  # ((device_type, dtype), ...) for each enabled device type
        self.inference = inference  # the call ran under torch.inference_mode()
        self.grad_enabled = grad_enabled

    def restore(self) -> None:
        """Set the RNG streams back to this state (autocast is entered separately)."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(self.cuda)
        if self.python is not None:
            random.setstate(self.python)

    def __repr__(self) -> str:
        cuda = f", {len(self.cuda)} CUDA generator(s)" if self.cuda is not None else ""
        autocast = f", autocast {self.autocast}" if self.autocast else ""
        return f"<numguard CallState: CPU generator{cuda}{autocast}>"


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype if autocast is enabled for `device_type`, else None (never raises)."""
    try:
        try:
            if torch.is_autocast_enabled(device_type):
                return torch.get_autocast_dtype(device_type)
            return None
        except (TypeError, AttributeError):  # torch < 2.4: no device_type argument
            if device_type == "cpu":
                return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    except Exception:
        return None


def take() -> CallState:
    """The state now: CPU (and, if initialised, CUDA) RNG states, autocast, grad and inference
    mode; about 25 us."""
    cuda = None
    if torch.cuda.is_initialized():
        try:
            cuda = torch.cuda.get_rng_state_all()
        except Exception:  # e.g. during CUDA graph capture
            cuda = None
    autocast = tuple(
        (device, dtype) for device in AUTOCAST_DEVICES
        for dtype in (autocast_dtype(device),) if dtype is not None
    )
    return CallState(torch.get_rng_state(), cuda, random.getstate(), autocast,
                     torch.is_inference_mode_enabled(), torch.is_grad_enabled())


def enter_autocast(state: Optional[CallState], stack: contextlib.ExitStack) -> None:
    """Enter the autocast settings of `state` (when given) on `stack`."""
    if state is None:
        return
    wanted = dict(state.autocast)
    for device in set(AUTOCAST_DEVICES) | set(wanted):
        dtype = wanted.get(device)
        current = autocast_dtype(device)
        if dtype is not None and current != dtype:
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
        elif dtype is None and current is not None:
            stack.enter_context(torch.autocast(device_type=device, enabled=False))
