"""After a device error, for the notebook magic: replay the captured calls on CPU, save a bundle,
and say what was found (`ReplayOutcome`).

After a device-side assert the CUDA context is unusable, so everything here works from what the
capture already holds on the host.
"""

from __future__ import annotations

import datetime
import itertools
import os
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .._util import error_line
from ..errors import ReplayError
from .call import CapturedCall
from .capture import Capture
from .location import Location
from .run import ReplayResult

_DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "device-side assert",
    "cudaErrorAssert",
    "CUBLAS_STATUS",
    "an illegal memory access",
)


def is_device_error(exc: BaseException) -> bool:
    """True for an error reported by the GPU itself (after which the CUDA context is unusable).

    `torch.AcceleratorError` (torch >= 2.8), or a RuntimeError whose message names a CUDA error:
    "CUDA error", "device-side assert", "cudaErrorAssert", "CUBLAS_STATUS", "an illegal memory
    access". An out-of-memory error is not one: the context survives it.
    """
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    if isinstance(exc, RuntimeError):
        message = str(exc)
        return any(marker in message for marker in _DEVICE_ERROR_MARKERS)
    return False


@dataclass
class ReplayOutcome:
    """What `replay_after_error` found: the CPU replay first, then the original error.

    `result` (a `ReplayResult`, None if the replay itself could not run: `replay_error` says
    why), `error` (the original exception), `path` (the bundle, None if it could not be written:
    `save_error` says why), `device_error` (the original error came from the GPU).
    """

    error: BaseException
    result: Optional[ReplayResult] = None
    path: Optional[str] = None
    device_error: bool = False
    save_error: Optional[str] = None
    replay_error: Optional[str] = None
    searched: List[str] = field(default_factory=list)

    @property
    def location(self) -> Optional[Location]:
        return self.result.location if self.result is not None else None

    def replay_commands(self) -> List[str]:
        """How to replay the bundle in a fresh kernel: the magic, and the Python call."""
        if self.path is None:
            return []
        call = self.result.call if self.result is not None else None
        arg = "model"
        if call is not None:
            snapshots = call.source.snapshots
            needed = [c.root_name for c in call.chain() if not snapshots[c.root_name].is_torch_loss]
            if len(needed) > 1:
                arg = "{" + ", ".join(f"{r!r}: {r or 'model'}" for r in needed) + "}"
        return [
            f"%numguard_replay {self.path}",
            f"from numguard_nb.replay import load_capture; load_capture({self.path!r}, {arg}).replay()",
        ]

    def __repr__(self) -> str:
        from ..render.replay import replay_outcome_text

        return replay_outcome_text(self)

    def _repr_html_(self) -> str:
        from ..render.replay import replay_outcome_html

        return replay_outcome_html(self)


def replay_after_error(guard, exc: BaseException, save_dir=None) -> ReplayOutcome:
    """Replay the guard's captured call on CPU after `exc`, save a bundle, and explain.

    Args:
        guard: a `Guard` built with `capture=True` (or a `Capture`, or a `CapturedCall`).
        exc: the error the step raised (usually `is_device_error(exc)`).
        save_dir: where to write the bundle `numguard_replay_<YYYYmmdd-HHMMSS>.pt`; default: the
            current directory when writable (next to the notebook), else the temp directory.

    The latest call is replayed first (after the model call that fed it, for a loss module);
    when it runs clean, the earlier captured calls are tried, newest first, since an asynchronous
    error may be reported one call late. Raises `ReplayError` when nothing was captured.
    """
    latest = _latest_call(guard)
    if latest is None:
        raise ReplayError(
            "nothing was captured to replay: run the step inside Guard(model, capture=True) "
            "(capture is off by default), then replay after the error"
        )
    outcome = ReplayOutcome(error=exc, device_error=is_device_error(exc))
    chosen = _replay_newest_first(latest, outcome)
    # Saved even when the replay here failed (a model that cannot be copied): a fresh kernel
    # builds the model itself and replays the bundle.
    _save_bundle(chosen if chosen is not None else latest, save_dir, outcome)
    return outcome


def _latest_call(guard) -> Optional[CapturedCall]:
    if isinstance(guard, CapturedCall):
        return guard
    capture = guard if isinstance(guard, Capture) else getattr(guard, "_capture", None)
    return capture.latest if capture is not None else getattr(guard, "capture", None)


def _replay_newest_first(latest: CapturedCall, outcome: ReplayOutcome) -> Optional[CapturedCall]:
    """Replay the latest call, then earlier ones until one raises; fill `outcome`. Returns the
    call whose result the outcome shows (None when the replay itself failed at once)."""
    tried: set = set()
    calls = getattr(latest.source, "calls", [])
    candidates = [latest] + [c for c in reversed(calls) if c.index < latest.index]
    chosen = None
    for call in candidates:
        if call.index in tried:
            continue
        tried.update(c.index for c in call.chain())
        try:
            result = call.replay("cpu")
        except ReplayError as error:
            outcome.replay_error = str(error)
            break
        except Exception as error:  # the outcome must be shown whatever happens
            outcome.replay_error = error_line(error)
            break
        if outcome.result is None:
            outcome.result, chosen = result, call
        if result.exception is not None:
            if call is not latest:
                outcome.searched.append(
                    f"the latest call ({latest.label} call {latest.index}) ran clean on CPU; an "
                    f"earlier one raised (the error was reported one call late)")
            outcome.result, chosen = result, call
            break
    return chosen


def _save_bundle(call: CapturedCall, save_dir, outcome: ReplayOutcome) -> None:
    path = _bundle_path(save_dir)
    try:
        outcome.path = call.save(path)
    except ReplayError as error:
        outcome.save_error = str(error)
    except Exception as error:
        outcome.save_error = error_line(error)
        try:
            if os.path.exists(path):
                os.remove(path)
        except OSError:
            pass


def _default_dir() -> str:
    """The current directory when writable (the bundle shows up next to the notebook), else the
    system temp directory."""
    cwd = os.getcwd()
    return cwd if os.access(cwd, os.W_OK) else tempfile.gettempdir()


def _bundle_path(save_dir) -> str:
    directory = os.fspath(save_dir) if save_dir is not None else _default_dir()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = os.path.join(directory, f"numguard_replay_{stamp}.pt")
    for n in itertools.count(1):
        if not os.path.exists(path):
            return path
        path = os.path.join(directory, f"numguard_replay_{stamp}-{n}.pt")
    return path  # pragma: no cover
