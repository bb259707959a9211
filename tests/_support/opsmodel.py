"""A small model with planted, layout-dependent rounding inside custom operators.

Every aten op of ``Net`` is exact or correctly rounded element by element (mul, add,
sub, relu), so its result for a row does not depend on the other rows of the batch, on
any CPU. The planted differences live in custom operators (``torch.library``) that take
another path when the batch holds more than one request:

``dmtest::batch_round``
    ``x * 3`` in float32 (one correctly rounded multiply); with more than one batch row,
    ``x`` is first rounded to float16.
``dmtest::rowsum``
    Sum over the last axis in float32, left to right; with more than one batch row the
    running sum is kept in float16 (float16 accumulation).

Names are unlike ``data/``: a ``model.`` prefix, a pooled head, a positional bias whose
leading dim equals the alone layout's row count.
"""

from __future__ import annotations

import torch
from torch import nn

F = 8
S = 12  # positions of the studied request (and the packed layout's padded length)
LENGTHS = {"p0": 7, "q": S, "p2": 10}  # packed layout: q is batch row 1


@torch.library.custom_op("dmtest::batch_round", mutates_args=())
def batch_round(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > 1:
        return x.to(torch.float16).to(x.dtype) * 3.0
    return x * 3.0


@batch_round.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("dmtest::rowsum", mutates_args=())
def rowsum(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[0] > 1
    acc = torch.zeros(x.shape[:-1], dtype=torch.float16 if half else x.dtype)
    for i in range(x.shape[-1]):
        acc = acc + x[..., i].to(acc.dtype)
    return acc.to(x.dtype)


@rowsum.register_fake
def _(x):
    return x.new_empty(x.shape[:-1])


def ref_batch_round(x):
    return x * 3.0


def ref_rowsum(x):
    return x.sum(-1)


class Scale(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.rand(F, generator=g) + 0.5)
        self.bias = nn.Parameter(torch.rand(F, generator=g) - 0.5)

    def forward(self, x):
        return x * self.weight + self.bias


class Quirk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.active = True

    def forward(self, x):
        return torch.ops.dmtest.batch_round(x) if self.active else x * 3.0


class Mixer(nn.Module):
    """Adds each row's float16-prone sum back to it: a second custom op, downstream."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def forward(self, x):
        s = torch.ops.dmtest.rowsum(x) if self.active else x.sum(-1) * 0.0
        return x + s[..., None] * 0.125


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos_bias = nn.Parameter(torch.linspace(-1, 1, S * F).reshape(S, F))
        self.stage1 = Scale(1)
        self.quirk = Quirk()
        self.stage2 = Scale(2)
        self.mixer = Mixer()

    def forward(self, x):
        h = self.stage1(x + self.pos_bias[: x.shape[1]])
        h = torch.relu(self.stage2(self.quirk(h)))
        return self.mixer(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()

    def forward(self, x):
        h = self.model(x)
        return h, h.sum(dim=1)  # per-position states and a pooled head


def request(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, F, generator=torch.Generator().manual_seed(seed))


def layout(kind: str):
    """(x, row_map) for request 'q' alone (1 x S) or packed with two others (3 x S)."""
    q = request(7, S)
    if kind == "alone":
        return q[None].clone(), [("q", j) for j in range(S)]
    x = torch.zeros(len(LENGTHS), S, F)
    rows = []
    for i, (rid, n) in enumerate(LENGTHS.items()):
        x[i, :n] = q if rid == "q" else request(100 + i, n)
        rows += [(rid, j) if j < n else None for j in range(S)]
    return x, rows


def run(model, kind: str):
    x, _ = layout(kind)
    with torch.no_grad():
        return model(x)
