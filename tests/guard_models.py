"""Small modules shared by the guard's test files."""

import torch
from torch import nn


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class SqrtOfZero(nn.Module):
    """Finite forward (sqrt(0) = 0), nan backward: d sqrt(u)/du at 0 is inf, times du/dx = 0."""

    def forward(self, x):
        return torch.sqrt(x * 0)
