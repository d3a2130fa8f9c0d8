"""One captured call: host copies of a top-level call's inputs, with the state it ran in.

`CapturedCall` holds the data; replaying it (`run`), and writing it to a bundle (`bundle`), are
done by those modules. `host.HostCopies` makes the copies when the call is recorded.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch

from .._util import dtype_name
from ..rerun import CallState
from . import bundle, run
from .location import Location


class CapturedCall:
    """One top-level call of a guarded module, held on the host: replay it with `.replay()`.

    Attributes: `root_name` (the name the module was guarded under, "" for a single model),
    `module_class`, `index` (the call's number since the capture started), `args`/`kwargs` (host
    copies), `state` (the call's `CallState`: CPU RNG, autocast, grad mode), `cuda_device` and
    `cuda_rng_state` (the GPU the call used and its generator state: what a replay on a GPU
    restores, and the one CUDA stream a bundle keeps), `training`, `weights_changed` (an
    optimizer step wrote the weights after the snapshot), `call_site` (the line that made the
    call), `input_devices`, `source` (the `Capture`, or the loaded bundle, holding the models
    and their snapshots).
    """

    def __init__(self, source, root_name: str, module_class: str, index: int, args, kwargs, *,
                 state: CallState, cuda_device=None, cuda_rng_state=None, training=True,
                 weights_changed=False, call_site=None, input_devices=(), by_reference=(),
                 events=()):
        self.source = source
        self.root_name = root_name
        self.module_class = module_class
        self.index = index
        self.args = args
        self.kwargs = kwargs
        self.state = state
        self.cuda_device = cuda_device
        self.cuda_rng_state = cuda_rng_state
        self.training = training
        self.weights_changed = weights_changed
        self.call_site: Optional[Location] = call_site
        self.input_devices = list(input_devices)
        self.by_reference = list(by_reference)
        self._events = list(events)
        self.copy_note: Optional[str] = None  # set when the copies could not be confirmed
        self.extra_notes: List[str] = []  # e.g. a bundle saved with another torch version
        # The torch functions run after the call, outside the guarded modules, up to the next
        # top-level call (replay.outside): the loss code; and why the list stops early, if it does.
        self.outside: list = []
        self.outside_full = ""

    @property
    def name(self) -> str:
        return self.root_name or self.module_class

    @property
    def label(self) -> str:
        return f"{self.name} ({self.module_class})" if self.root_name else self.module_class

    # -- the call state, under the names CapturedCall has always had ---------------------------
    @property
    def cpu_rng_state(self):
        return self.state.cpu

    @property
    def grad_enabled(self) -> bool:
        return self.state.grad_enabled

    @property
    def autocast(self) -> dict:
        """{device type: (True, dtype name)} for each device type autocast was enabled for."""
        return {device: (True, dtype_name(dtype)) for device, dtype in self.state.autocast}

    def __repr__(self) -> str:
        from ..render.replay import value_outline

        inputs = [value_outline(a) for a in self.args] + \
            [f"{k}={value_outline(v)}" for k, v in self.kwargs.items()]
        where = f" at {self.call_site.where}" if self.call_site else ""
        return f"<numguard CapturedCall {self.index}: {self.label}({', '.join(inputs)}){where}>"

    def add_copy_events(self, events: list) -> None:
        """Events recorded after more host copies were queued (those of the code after it)."""
        self._events.extend(events)

    def wait_for_copies(self) -> None:
        """Wait until the asynchronous host copies of CUDA inputs are done (once)."""
        if not self._events:
            return
        events, self._events = self._events, []
        for event in events:
            try:
                event.synchronize()
            except Exception:
                self.copy_note = (
                    "the CUDA context reported an error while confirming that the input copies "
                    "finished; they were queued before the failing kernel ran, so they normally did"
                )
                return

    def chain(self) -> List["CapturedCall"]:
        """This call, after the calls of earlier-listed guarded modules that directly preceded it
        (the model call that fed a loss module)."""
        return run.chain_of(self)

    def replay(self, device: Union[str, torch.device] = "cpu") -> "run.ReplayResult":
        """Run the call again on `device` (CPU by default) from the host snapshot and copies.

        Returns a `ReplayResult`: the exception and the line where it was raised, or the output
        when the call runs clean. A float16/bfloat16 call that needs a kernel the CPU lacks is run
        again upcast to float32 (`result.upcast`).
        """
        return run.replay(self, device)

    def save(self, path) -> str:
        """Write a replay bundle (weights snapshot, inputs, RNG states, ...) for `load_capture`.

        Only tensors and plain values are stored, so `torch.load(weights_only=True)` reads it;
        an input that is neither (a cache object, a custom class) is refused with its name.
        """
        return bundle.save(self, path)
