"""The engine: hooks that find the module call where inf/nan is first produced.

Full mode:
- `options`: `GuardOptions`, the Guard's options checked into one immutable object;
- `guard`: `Guard`, attach/detach, the hooks, batches and the pass lifecycle;
- `passes`: what a pass records (call records, slots, cache entries), its one read-back, and
  each thread's place in its pass;
- `hooks`: where the hooks go (modules, parameters, tensors), and when they do nothing
  (compiling, tracing, exporting);
- `detect`: the producer-vs-carrier rules over recorded slots;
- `frames`: recorded slots turned into the report's frames, its reason sentence and the report;
- `copies`: copies of a guarded module (deepcopy, pickle, `torch.save`) come out unwatched.

Beside the model:
- `outside`, `outside_checks`, `outside_mode`, `outside_ops`: the loss watch (the code run
  between the model's calls and its backward: its mode, its records, its op names);
- `function_mode`: a torch function mode's place on a thread's stack;
- `steps`: the optimizer steps seen, and what wrote non-finite weights;
- `scaler`: the overflows a GradScaler skips, let through and recorded;
- `headroom`, `history`: what would not fit in `limit_dtype`; sampled ranges over a long run.

Sentinel mode and several processes:
- `sentinel`: the outputs and gradients checked each step, a failing step re-run;
- `sentinel_checks`: those checks on an asynchronous device, read when ready;
- `sentinel_batches`: the batches a sentinel runs with the full hooks;
- `sentinel_rerun`: the re-runs (alone, or on every rank together under FSDP2);
- `rank_reports`: a detection held until every rank knows, and what a rank that received a
  value reports (which rank made it is learnt by `distributed.flags`, at the gradient reduction).
"""

from ..errors import BatchLimitReached, NonFiniteError
from .guard import Guard
from .options import GuardOptions

__all__ = ["Guard", "GuardOptions", "NonFiniteError", "BatchLimitReached"]
