"""Models and training steps for tests/test_replay.py and notebooks: "the user's code".

Lines the tests look for carry a `# <- name` marker, so the tests compare the replay's location
with the real line without hard-coding numbers.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class Classifier(nn.Module):
    """A small classifier with a `n_classes`-logit head (2 in the course's example)."""

    def __init__(self, n_in: int = 8, n_classes: int = 2, dropout: float = 0.0, hidden: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Dropout(dropout))
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


class ClassifierWithLoss(nn.Module):
    """Hugging Face style: the forward computes the loss when `labels` are given."""

    def __init__(self, n_in: int = 8, n_classes: int = 2, dropout: float = 0.0):
        super().__init__()
        self.classifier = Classifier(n_in, n_classes, dropout)

    def forward(self, x, labels=None):
        logits = self.classifier(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits, labels)  # <- model loss line
        return {"loss": loss, "logits": logits}


class Prototypes(nn.Module):
    """Distances to learned prototypes with torch.cdist, which CPU lacks for float16."""

    def __init__(self, n_in: int = 8, n_protos: int = 3):
        super().__init__()
        self.protos = nn.Parameter(torch.randn(n_protos, n_in))

    def forward(self, x):
        return -torch.cdist(x, self.protos)


class WithOptions(nn.Module):
    """A forward taking a non-tensor object (it cannot go into a bundle)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x, options=None):
        return self.linear(x) * (options.scale if options is not None else 1.0)


class Options:
    scale = 2.0


def train_step(model, loss_fn, x, labels):
    logits = model(x)
    loss = loss_fn(logits, labels)  # <- loss call line
    loss.backward()
    return loss


def hf_step(model, x, labels):
    out = model(x, labels=labels)  # <- hf call line
    out["loss"].backward()
    return out["loss"]


# ---- a simulated GPU: cross_entropy's device-side assert, reported late -----------------------
_ASSERT = (
    "CUDA error: device-side assert triggered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)


class _Pending:
    error = None


@contextlib.contextmanager
def simulated_gpu():
    """Inside: cross_entropy with an out-of-range target does not raise (as on a GPU, where the
    kernel's assert is reported later); the next `sync` raises the CUDA error instead."""
    real = F.cross_entropy

    def cross_entropy(input, target, *args, **kwargs):
        classes = input.shape[1] if input.dim() > 1 else input.shape[0]
        if bool(((target < 0) | (target >= classes)).any()):
            _Pending.error = _ASSERT
            target = target.clamp(0, classes - 1)
        return real(input, target, *args, **kwargs)

    F.cross_entropy = cross_entropy
    try:
        yield
    finally:
        F.cross_entropy = real
        _Pending.error = None


def sync(loss):
    """`loss.item()` on the simulated GPU: where the asynchronous error shows up."""
    if _Pending.error is not None:
        message, _Pending.error = _Pending.error, None
        raise RuntimeError(message)  # <- sync line
    return loss.item()
