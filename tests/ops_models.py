"""Small models for tests/test_ops.py. Lines marked `# OP:<name>` are the ones the tests expect
op localisation to name; `line_of(name)` finds them."""

import torch
from torch import nn


def line_of(marker: str) -> int:
    with open(__file__) as f:
        for number, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# OP:{marker}"):
                return number
    raise LookupError(marker)


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
class SqrtOfZero(nn.Module):
    def forward(self, x):
        h = x * 0.0
        return torch.sqrt(h) + x  # OP:sqrt_backward


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
