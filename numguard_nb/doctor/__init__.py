"""Check, step by step, that a training pipeline works before a long run.

``check_pipeline`` walks the steps a training step goes through -- the samples,
the batch, the forward pass, the loss, the gradients, the optimizer step, and
overfitting one batch -- and stops at the first one that is broken, with a
message that names the fix.  It runs on CPU, on a deep copy of the model, so
the user's weights, optimizer state and random number generator are untouched.

It works on a plain PyTorch model with a dataset, a DataLoader or a list of
samples, or on a ``transformers.Trainer``.  transformers is never imported
here: a Trainer is recognised by its class name and only its attributes and
methods are used.

The parts, in the order a check uses them: ``settings`` (what is checked, from the
arguments or a Trainer), ``run`` (``check_pipeline`` and the steps), ``samples`` (what the
data and the forward's signature say), ``labels`` (labels against the classifier's size),
``optimizers`` (the user's optimizer rebuilt over the copy), ``checklist`` (the result;
its text and HTML are in ``numguard_nb.render.checklist``).
"""

from __future__ import annotations

from .checklist import STEP_NAMES, PipelineReport, PipelineStep
from .run import check_pipeline

# Constants importable from numguard_nb.doctor before it became a package.
from .checklist import NAMES_SHOWN  # noqa: F401,E402
from .labels import IGNORED_LABEL, LABEL_ALIASES, LABEL_KEYS  # noqa: F401,E402
from .run import OVERFIT_STEPS, SAMPLES_TO_SCAN  # noqa: F401,E402
from .settings import DEFAULT_BATCH_SIZE, DEFAULT_SGD_LR  # noqa: F401,E402

__all__ = ["check_pipeline", "PipelineReport", "PipelineStep", "STEP_NAMES"]
