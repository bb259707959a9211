"""A tiny PyTorch transformer classifier for tests, unlike the lab's MiniLM.

Token and positional embeddings, two attention blocks, a mean-pooled sequence
representation and a linear classification head. Every op runs one sequence at a time,
so a sequence's numbers do not depend on what else is in the batch on any CPU; the one
batch-dependent op is planted: ``PlantedHead`` nudges its output by one ULP when the
batch holds more than one sequence (standing in for a GEMM whose result depends on the
batch size). Tests therefore know the ground truth without trusting this machine's GEMM.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, D, HEADS, CLASSES, MAX_LEN = 40, 12, 2, 3, 20


class Block(nn.Module):
    """Pre-norm attention + MLP; attention only within a segment (0 = padding)."""

    def __init__(self, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.ln1_w, self.ln1_b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.qkv_w = nn.Parameter(torch.randn(3 * d, d) / math.sqrt(d))
        self.qkv_b = nn.Parameter(torch.zeros(3 * d))
        self.out_w = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
        self.ln2_w, self.ln2_b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.up_w = nn.Parameter(torch.randn(2 * d, d) / math.sqrt(d))
        self.down_w = nn.Parameter(torch.randn(d, 2 * d) / math.sqrt(2 * d))

    def _one(self, x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[-2:]
        h = F.layer_norm(x, (d,), self.ln1_w, self.ln1_b)
        q, k, v = F.linear(h, self.qkv_w, self.qkv_b).split(d, dim=-1)
        q, k, v = (z.reshape(t, self.heads, d // self.heads).transpose(0, 1) for z in (q, k, v))
        allowed = (seg[:, None] == seg[None, :]) & (seg[None, :] != 0)
        allowed |= torch.eye(t, dtype=torch.bool)  # padding rows attend to themselves
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
        x = x + F.linear((att @ v).transpose(0, 1).reshape(t, d), self.out_w)
        h = F.layer_norm(x, (d,), self.ln2_w, self.ln2_b)
        return x + F.linear(F.gelu(F.linear(h, self.up_w)), self.down_w)

    def forward(self, x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        return torch.stack([self._one(x[b], seg[b]) for b in range(x.shape[0])])


class MeanPool(nn.Module):
    """Mean over the non-padding positions of each sequence: [B, T, D] -> [B, D]."""

    def forward(self, x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[b][seg[b] != 0].mean(0) for b in range(x.shape[0])])


class PlantedHead(nn.Module):
    """Linear head computed row by row; with more than one row, one ULP up (planted)."""

    def __init__(self, d: int = D, classes: int = CLASSES, planted: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, d) / math.sqrt(d))
        self.bias = nn.Parameter(torch.zeros(classes))
        self.planted = planted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.stack([F.linear(x[b], self.weight, self.bias) for b in range(x.shape[0])])
        if self.planted and x.shape[0] > 1:
            up = torch.nextafter(y.detach(), torch.full_like(y, float("inf")))
            y = y + (up - y.detach())  # keeps the gradient; the value moves one ULP
        return y


class TinyClassifier(nn.Module):
    def __init__(self, *, planted: bool = True, d: int = D) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(MAX_LEN, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.pool = MeanPool()
        self.head = PlantedHead(d, planted=planted)

    def forward(self, ids: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1])[None, :])  # pos: [1, T, D]
        for blk in self.blocks:
            x = blk(x, seg)
        return self.head(self.pool(x, seg))


def batch(seqs: list[list[tuple[str, list[int]]]], t: int):
    """Token ids, segment ids and the nested row map of batch rows packing requests.

    ``seqs[b]`` lists the ``(request, token ids)`` placed one after another in batch row
    ``b``; the rest of the row is padding.
    """
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    seg = torch.zeros(len(seqs), t, dtype=torch.long)
    rows = []
    for b, parts in enumerate(seqs):
        row: list[tuple[str, int] | None] = [None] * t
        at = 0
        for s, (rid, toks) in enumerate(parts, start=1):
            ids[b, at : at + len(toks)] = torch.tensor(toks)
            seg[b, at : at + len(toks)] = s
            for p in range(len(toks)):
                row[at + p] = (rid, p)
            at += len(toks)
        rows.append(row)
    return ids, seg, rows


def model(seed: int = 0, *, planted: bool = True, d: int = D) -> TinyClassifier:
    torch.manual_seed(seed)
    return TinyClassifier(planted=planted, d=d).eval()


def train(
    seed: int, steps: int, save_at: list[int], *, nudge_at: int | None = None
) -> dict[int, tuple[dict[str, torch.Tensor], dict]]:
    """AdamW on random token classification; ``{step: (model state, optimizer state)}``.

    ``nudge_at``: after that step's update, ``head.weight[0, 0]`` moves up one ULP (a
    planted divergence between otherwise equal runs).
    """
    torch.manual_seed(seed)
    m = TinyClassifier(planted=False).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1234)
    out = {}
    for step in range(1, steps + 1):
        ids = torch.randint(1, VOCAB, (4, 8), generator=data)
        seg = torch.ones(4, 8, dtype=torch.long)
        labels = torch.randint(0, CLASSES, (4,), generator=data)
        opt.zero_grad()
        F.cross_entropy(m(ids, seg), labels).backward()
        opt.step()
        if step == nudge_at:
            with torch.no_grad():
                w = m.head.weight
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf")))
        if step in save_at:
            sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
            out[step] = (sd, copy.deepcopy(opt.state_dict()))  # the live state moves on
    return out
