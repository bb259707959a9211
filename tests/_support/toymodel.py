"""A toy torch model with a planted, layout-dependent divergence.

``Toy`` is elementwise per row (no matrix products whose rounding could depend on the
batch shape), except ``Quirk`` in ``blocks.1``, which nudges positions ``QUIRK_POSITIONS``
by ``NUDGE`` only when it sees more than one batch row (the "packed" layout), and
``CumMix`` in ``blocks.2``, which mixes along the sequence (position j sees 0..j). So the
ground truth is known: the divergence enters at ``blocks.1.quirk``, in the blocks holding
positions 5 and 20, and ``blocks.2.mix`` spreads it to every later position.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dmlib  # noqa: E402

F = 4
N_REQ = 24  # positions of the request under study
BLOCK_ROWS = 8
QUIRK_POSITIONS = (5, 20)  # -> blocks 0 and 2
NUDGE = 1e-3


class Affine(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.rand(F, generator=g) + 0.5)
        self.bias = nn.Parameter(torch.rand(F, generator=g) - 0.5)

    def forward(self, x):
        return x * self.weight + self.bias


class Quirk(nn.Module):
    """Layout-dependent: with more than one batch row, adds NUDGE at chosen positions."""

    def __init__(self, positions=()) -> None:
        super().__init__()
        self.positions = tuple(positions)
        self.active = True

    def forward(self, x, pos):
        if not (self.active and self.positions and x.shape[0] > 1):
            return x.clone()
        hit = torch.isin(pos, torch.tensor(self.positions))[..., None]
        return torch.where(hit, x + NUDGE, x)


class CumMix(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=1)


class Block(nn.Module):
    def __init__(self, seed: int, quirk=(), mix: bool = False) -> None:
        super().__init__()
        self.fc = Affine(seed)
        self.quirk = Quirk(quirk)
        self.act = nn.Tanh()
        self.mix = CumMix() if mix else nn.Identity()

    def forward(self, h, pos):
        return self.mix(self.act(self.quirk(self.fc(h), pos)))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = Affine(0)
        self.blocks = nn.ModuleList([Block(1), Block(2, quirk=QUIRK_POSITIONS), Block(3, mix=True)])

    def forward(self, x, pos):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, pos)
        return h


def request_rows(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, F, generator=torch.Generator().manual_seed(seed))


def layout(kind: str):
    """(x, pos, row_map) for request 'r' alone (1 x 24) or packed (3 x 30, r in row 1)."""
    r = request_rows(7, N_REQ)
    if kind == "alone":
        x = r[None]
        pos = torch.arange(N_REQ)[None]
        return x, pos, [("r", j) for j in range(N_REQ)]
    lengths = {"a": 30, "r": N_REQ, "b": 11}
    S = 30
    x = torch.zeros(3, S, F)
    rows = []
    for i, (rid, n) in enumerate(lengths.items()):
        x[i, :n] = r if rid == "r" else request_rows(100 + i, n)
        rows += [(rid, j) if j < n else None for j in range(S)]
    pos = torch.arange(S).repeat(3, 1)
    return x, pos, rows


def run_capture(model, path, kind, **kw):
    x, pos, rows = layout(kind)
    kw.setdefault("block_rows", BLOCK_ROWS)
    with torch.no_grad(), dmlib.capture(model, path, row_map=rows, **kw):
        out = model(x, pos)
    return out
