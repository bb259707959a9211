"""Two linear layers with a tanh between: the smallest model a capture test hooks."""

from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    """``b(tanh(a(x)))`` on 6 features, the weights fixed by seed 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))
