"""The engine: hooks that find the module call where inf/nan is first produced.

- `options`: `GuardOptions`, the Guard's options checked into one immutable object;
- `passes`: what a pass records (call records, slots, cache entries), its one read-back, and
  each thread's place in its pass;
- `hooks`: where the hooks go (modules, parameters, tensors), and when they do nothing
  (compiling, tracing, exporting);
- `copies`: copies of a guarded module (deepcopy, pickle, `torch.save`) come out unwatched;
- `guard`: `Guard`, attach/detach, the hooks, batches and the pass lifecycle;
- `detect`: the producer-vs-carrier rules over recorded slots;
- `frames`: recorded slots turned into the report's frames, its reason sentence and the report.
"""

from ..errors import BatchLimitReached, NonFiniteError
from .guard import Guard
from .options import GuardOptions

__all__ = ["Guard", "GuardOptions", "NonFiniteError", "BatchLimitReached"]
