"""`load_capture`: a replay bundle read back into the `CapturedCall` to replay, in any kernel."""

from __future__ import annotations

import os

from .._util import error_line
from ..errors import ReplayError
from . import bundle, outside
from .call import CapturedCall


def load_capture(path, model) -> CapturedCall:
    """Load a replay bundle written by `CapturedCall.save` (or `replay_after_error`).

    Args:
        path: the bundle file.
        model: the same architecture built fresh (its weights do not matter: they come from the
            bundle), or a dict of name -> module as given to the Guard. A torch.nn loss guarded
            alongside the model (nn.CrossEntropyLoss, ...) is rebuilt from the bundle when not
            given.

    Returns the `CapturedCall` to `.replay()`. The file is read with
    `torch.load(weights_only=True)`: a bundle never executes code.
    """
    path = os.fspath(path)
    data = bundle.read(path)
    try:
        return _call_of(path, data, model)
    except (KeyError, IndexError, TypeError, AttributeError) as error:  # (a ReplayError passes)
        raise ReplayError(f"{path} is a damaged numguard bundle ({error_line(error)}): "
                          f"{bundle.NOT_A_BUNDLE}") from None


def _call_of(path: str, data: dict, model) -> CapturedCall:
    roots = list(data["roots"])
    snapshots = {root: bundle.snapshot_from_entry(data["models"][root]) for root in roots}
    models = bundle.modules_for(path, model, roots, snapshots)
    source = bundle.BundleSource(models, snapshots, roots)
    for entry in data["calls"]:
        call = CapturedCall(
            source, entry["root"], entry["module_class"], int(entry["index"]),
            tuple(entry["args"]), dict(entry["kwargs"]), **bundle.call_fields(entry))
        call.outside = outside.decode(entry.get("outside", []))  # the code run after it
        call.outside_full = str(entry.get("outside_full", ""))
        source.calls.append(call)
    target = source.calls[int(data.get("target", len(source.calls) - 1))]
    target.extra_notes.extend(bundle.version_notes(data, models, snapshots))
    return target
