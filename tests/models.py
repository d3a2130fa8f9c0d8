"""The models and training steps the tests share, in one place ("the user's code").

Sections: the guard's small culprits, op localisation's models, and the replay's models and
steps. Some lines carry a marker at their end that the tests look up instead of hard-coding
line numbers: `# OP:<name>` on the line op localisation must name, `# <- <name>` on the user's
line a replay must point at. `line_of(name)` finds either.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def line_of(marker: str) -> int:
    """Line number of the one line of this file ending in `# OP:<marker>` or `# <- <marker>`."""
    endings = (f"# OP:{marker}", f"# <- {marker}")
    with open(__file__) as f:
        hits = [number for number, text in enumerate(f, 1) if text.rstrip().endswith(endings)]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} lines marked {marker!r} in {__file__}")
    return hits[0]


# ==== the guard's small culprits ==============================================================
class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class SqrtOfZero(nn.Module):
    """Finite forward (sqrt(0) = 0), nan backward: d sqrt(u)/du at 0 is inf, times du/dx = 0."""

    def forward(self, x):
        return torch.sqrt(x * 0)


# ==== op localisation: lines marked `# OP:<name>` are the ones it must name ====================
class Scale(nn.Module):
    """A learnable elementwise scale (starts at 1): keeps the values the tests feed in."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.weight


class NaiveSoftmax(nn.Module):
    def forward(self, x):
        e = torch.exp(x)  # OP:exp
        return e / e.sum(-1, keepdim=True)


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x) + 1.0  # OP:sqrt


class Normalise(nn.Module):
    def forward(self, x):
        x = x.abs()
        return x / x.sum(-1, keepdim=True)  # OP:div


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x.relu()) * 0.5  # OP:log


class Net(nn.Module):
    """scale -> block -> linear: the block is the culprit under test."""

    def __init__(self, block, n=8):
        super().__init__()
        self.pre = Scale(n)
        self.block = block
        self.post = nn.Linear(n, 4)

    def forward(self, x):
        return self.post(self.block(self.pre(x)))


# ---- backward-only non-finite values ---------------------------------------------------------
class LogNet(nn.Module):
    """Two layers with a log between them: nan once the first gives values below -10."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 1)

    def forward(self, x):
        return self.second(torch.log(self.first(x) + 10))  # nan for large inputs


class SqrtOfZeroPlusInput(nn.Module):
    """sqrt(0 * x) + x: a finite forward that keeps x, a nan gradient from sqrt's backward at 0."""

    def forward(self, x):
        h = x * 0.0
        return torch.sqrt(h) + x  # OP:sqrt_backward


class SqrtWeight(nn.Module):
    """x * sqrt(w): with w = 0 only the weight's own gradient is inf."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * torch.sqrt(self.w)


class PowHalf(nn.Module):
    def forward(self, x):
        return x.abs().pow(0.5)  # OP:pow_backward


class MaskedPow(nn.Module):
    """pow(0.5) at 0 has an inf gradient, which relu's backward masks: harmless."""

    def forward(self, x):
        return x.relu().pow(0.5)


class HiddenLog(nn.Module):
    def forward(self, x):
        return torch.where(x > 0, x.log(), x)  # OP:where_log


class DictNet(nn.Module):
    """Returns a dict: output tensors are walked in insertion order."""

    def __init__(self, block, n=8):
        super().__init__()
        self.pre = Scale(n)
        self.block = block
        self.norm = nn.BatchNorm1d(n)

    def forward(self, x):
        h = self.norm(self.pre(x))
        return {"aux": h.mean(), "count": 3, "out": self.block(h)}


# ---- dropout: only the mask the failing step drew gives inf ------------------------------------
class MaskMatch(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.register_buffer("target", torch.zeros(n))

    def forward(self, x):
        y = self.dropout(x)
        distance = (y - self.target).abs().sum()
        return y / distance  # OP:mask_div


class DropNet(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.pre = Scale(n)
        self.block = MaskMatch(n)

    def forward(self, x):
        return self.block(self.pre(x))


# ---- a module called twice -------------------------------------------------------------------
class Amplify(nn.Module):
    def forward(self, x):
        return torch.exp(x * 10.0)  # OP:shared_exp


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = Amplify()

    def forward(self, x):
        return self.shared(self.shared(x) * 0.1)


# ---- a limit on an fp32 model ----------------------------------------------------------------
class Widen(nn.Module):
    def forward(self, x):
        h = x * 1000.0  # OP:limit_mul
        return h - 1.0


# ---- not reproducible ------------------------------------------------------------------------
class FirstCallOnly(nn.Module):
    """Produces inf only on its first call ever: a re-run cannot reproduce it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            return x / torch.zeros_like(x)
        return x


class EatsInput(nn.Module):
    """Logs its input, then overwrites it in place."""

    def forward(self, x):
        out = torch.log(x)
        x.zero_()
        return out


class MaskedAttention(nn.Module):
    """A causal mask built with -inf on purpose, then a softmax over a fully masked row."""

    def forward(self, scores, kill_row):
        n = scores.shape[-1]
        mask = torch.full((n, n), float("-inf")).triu_(1)
        mask[kill_row] = float("-inf")
        return torch.softmax(scores + mask, dim=-1)  # OP:softmax


class LogMask(nn.Module):
    """An additive mask made with log(0) = -inf on purpose; a fully masked row gives nan."""

    def forward(self, scores, keep):
        bias = torch.log(keep)  # OP:log_mask
        return torch.softmax(scores + bias, dim=-1)  # OP:log_mask_softmax


# ==== replay: the user's models and steps; lines marked `# <- <name>` are where a replay points
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


class NanGradient(torch.autograd.Function):
    """The identity in forward; nan gradients in backward (a fault planted in backward)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")
