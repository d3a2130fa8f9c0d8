"""numguard_nb: find where a PyTorch training run goes numerically wrong, and see it in the notebook.

    %load_ext numguard_nb
    %%numguard
    loss = model(**batch).loss
    loss.backward()

or, from Python:

    import numguard_nb as ng
    with ng.Guard(model):
        ...
"""

from ._version import __version__
from .compat import DebugUnderflowOverflow, detect_overflow
from .errors import BatchLimitReached, CaptureTooLarge, NonFiniteError, ReplayError
from .guard import Guard, GuardOptions
from .replay import is_device_error, load_capture, replay_after_error
from .report import Frame, Report, TensorRow

__all__ = [
    "Guard",
    "GuardOptions",
    "NonFiniteError",
    "BatchLimitReached",
    "ReplayError",
    "CaptureTooLarge",
    "Report",
    "Frame",
    "TensorRow",
    "DebugUnderflowOverflow",
    "detect_overflow",
    "load_capture",
    "replay_after_error",
    "is_device_error",
    "check_pipeline",
    "NumguardCallback",
    "NumguardLightningCallback",
    "load_ipython_extension",
    "unload_ipython_extension",
]

# Imported on first use: the doctor and the callbacks pull in data loading and trainer code.
_LAZY = {
    "check_pipeline": ("doctor", "check_pipeline"),
    "NumguardCallback": ("integrations", "NumguardCallback"),
    "NumguardLightningCallback": ("integrations", "NumguardLightningCallback"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'numguard_nb' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(f".{module}", __name__), attribute)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def load_ipython_extension(ipython):
    """`%load_ext numguard_nb`: register the magics (IPython is imported only here)."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython):
    """`%unload_ext numguard_nb`: remove every hook and event handler the magics added."""
    from .magics import unload

    unload(ipython)
