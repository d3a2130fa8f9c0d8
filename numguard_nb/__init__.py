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
from .guard import BatchLimitReached, Guard, NonFiniteError
from .replay import is_device_error, load_capture, replay_after_error
from .report import Frame, Report, TensorRow


__all__ = [
    "Guard",
    "NonFiniteError",
    "BatchLimitReached",
    "Report",
    "Frame",
    "TensorRow",
    "DebugUnderflowOverflow",
    "detect_overflow",
    "load_capture",
    "replay_after_error",
    "is_device_error",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython):
    """`%load_ext numguard_nb`: register the magics (IPython is imported only here)."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython):
    """`%unload_ext numguard_nb`: remove every hook and event handler the magics added."""
    from .magics import unload

    unload(ipython)
