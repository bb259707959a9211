"""The qr_init dataset's checkpoint-records file: model + optimizer + EMA back to back.

Every record is assembled in one float32 scratch arena that is filled with NaN when
created and never cleared, so the alignment gaps between tensors and records hold stale
values of earlier computation (NaN fill, -1e30 logit sentinels, gradients), as a writer
that reuses its allocation without zeroing it would leave them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------- checkpoint records

RECORDS_FILE = "checkpoint_records.bpk"
RECORDS_MODEL_FILE = "checkpoint_model.bpk"
MASKED = np.float32(-1e30)  # logit sentinel of the padded classes: exp() of it is 0
BATCH = 512  # rows of the synthetic objective's logits tile


class _Arena:
    """One float32 scratch buffer, bump-allocated and never cleared.

    It is NaN-filled once when created, the way debug allocators poison fresh memory
    (PyTorch's ``fill_uninitialized_memory`` does the same); every allocation is rounded
    up to 512 bytes (as PyTorch's caching allocator rounds its blocks) and the rounding
    slack is never written, so it keeps the poison. After that every byte holds whatever
    was last written there.
    """

    GRANULE = 128  # float32 slots = 512 bytes

    def __init__(self, nbytes: int) -> None:
        self.buf = np.full(-(-nbytes // 512) * self.GRANULE, np.nan, np.float32)
        self.bytes = self.buf.view(np.uint8)
        self.top = 0

    def alloc(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        view = self.buf[self.top : self.top + n].reshape(shape)
        self.top += -(-n // self.GRANULE) * self.GRANULE
        return view


def _train(
    params: dict[str, np.ndarray], arena: _Arena, seed: int, steps: int
) -> tuple[dict, dict, dict, dict]:
    """A few Adam steps on a synthetic objective, with all temporaries in ``arena``.

    Objective: softmax cross-entropy of ``x @ head.weight + head.bias`` on seeded inputs
    and labels, plus ``0.5 * 1e-2 * ||p||^2`` on every other parameter. Logits and softmax
    are computed in 64-column tiles: the logits tile's padded columns hold
    :data:`MASKED`, the softmax tile's are never written.
    Returns (params, Adam first moments, Adam second moments, EMA) after ``steps`` steps.
    """
    rng = np.random.default_rng([seed, 1])
    w = {n: a.copy() for n, a in params.items()}
    d, c = w["head.weight"].shape
    batch = BATCH
    x = rng.standard_normal((batch, d), np.float32)
    onehot = np.eye(c, dtype=np.float32)[rng.integers(0, c, batch)]
    m1 = {n: np.zeros_like(a) for n, a in w.items()}
    m2 = {n: np.zeros_like(a) for n, a in w.items()}
    ema = {n: a.copy() for n, a in w.items()}
    lr, b1, b2, eps, wd, decay = 1e-3, 0.9, 0.999, 1e-8, 1e-2, 0.99
    for t in range(1, steps + 1):
        arena.top = 0  # each step reuses the same workspace
        # softmax and logits live in 64-column tiles; only the first c columns of the
        # softmax tile are ever written, the logits tile's padded columns hold the sentinel
        probs_tile = arena.alloc((batch, 64))
        tile = arena.alloc((batch, 64))
        tile[:] = MASKED
        tile[:, :c] = x @ w["head.weight"] + w["head.bias"]
        probs = probs_tile[:, :c]
        np.exp(tile[:, :c] - tile.max(axis=1, keepdims=True), out=probs)
        probs /= probs.sum(axis=1, keepdims=True)
        probs -= onehot
        probs /= batch
        grads = {n: arena.alloc(p.shape) for n, p in w.items()}
        for n, p in w.items():
            g = grads[n]
            if n == "head.weight":
                g[:] = x.T @ probs
            elif n == "head.bias":
                g[:] = probs.sum(axis=0)
            else:
                np.multiply(p, np.float32(wd), out=g)
            m1[n] = (b1 * m1[n] + (1 - b1) * g).astype(np.float32)
            m2[n] = (b2 * m2[n] + (1 - b2) * g * g).astype(np.float32)
            step = lr * (m1[n] / (1 - b1**t)) / (np.sqrt(m2[n] / (1 - b2**t)) + eps)
            w[n] = (p - step).astype(np.float32)
            ema[n] = (decay * ema[n] + (1 - decay) * w[n]).astype(np.float32)
    return w, m1, m2, ema


def write_checkpoint(
    out: Path,
    params: dict[str, np.ndarray],
    ids: dict[str, int],
    meta: dict[str, str],
    *,
    seed: int,
    steps: int = 3,
) -> dict[str, Any]:
    """Write model + optimizer + EMA records into one file the way a careless writer does.

    The writer assembles each record image in one reused scratch buffer (the training
    step's workspace) and copies only the header and the tensors into it: the alignment
    gaps between tensors, and between records, keep whatever the buffer held before:
    the previous record, the step's gradients and logits (with their ``-1e30`` mask
    sentinel), or the NaN the buffer was poisoned with. The same model record is also
    written by Burn's own writer (zero padding) to :data:`RECORDS_MODEL_FILE`.
    """
    from dmlib.io.burnpack import BurnTensor, encode_burnpack, write_burnpack, write_records

    scalars = {"step": steps}
    kinds = {"step": "UInt"}
    w0 = {n: BurnTensor(a, param_id=ids[n]) for n, a in params.items()}
    opt_meta = {**meta, **{str(ids[n]): n for n in params}}
    # sizes first (zero padding), so the scratch fits the largest record
    opt_shape = {
        f"{ids[n]}.{k}": a
        for n in params
        for k, a in (("moment_1", params[n]), ("moment_2", params[n]))
    }
    largest = max(
        len(encode_burnpack(w0, metadata=meta)), len(encode_burnpack(opt_shape, metadata=opt_meta))
    )
    workspace = 2 * BATCH * 64 * 4 + sum(a.nbytes + 512 for a in params.values())
    arena = _Arena(max(largest + 1024, workspace))
    w, m1, m2, ema = _train(params, arena, seed, steps)
    images = [
        ({n: BurnTensor(a, param_id=ids[n]) for n, a in w.items()}, meta),
        (
            {f"{ids[n]}.{k}": d[n] for n in w for k, d in (("moment_1", m1), ("moment_2", m2))},
            opt_meta,
        ),
        ({n: BurnTensor(a, param_id=ids[n]) for n, a in ema.items()}, {**meta, "record": "ema"}),
    ]
    blobs: list[bytes] = []
    gaps: dict[int, bytes] = {}
    pos = 0
    for tensors, md in images:
        img = encode_burnpack(
            tensors,
            metadata=md,
            scalars=scalars,
            scalar_kinds=kinds,
            pad_fill=lambda off, n: arena.bytes[off : off + n].tobytes(),
        )
        arena.bytes[: len(img)] = np.frombuffer(img, np.uint8)
        pos += len(img)
        # the bytes up to the next record's start are streamed from the same buffer
        gaps[pos] = arena.bytes[len(img) : len(img) + (-pos % 256)].tobytes()
        pos += -pos % 256
        blobs.append(img)
    write_records(out / RECORDS_FILE, blobs, pad_fill=lambda off, n: gaps[off][:n])
    write_burnpack(
        out / RECORDS_MODEL_FILE, images[0][0], metadata=meta, scalars=scalars, scalar_kinds=kinds
    )
    return {
        "file": RECORDS_FILE,
        "model_file": RECORDS_MODEL_FILE,
        "step": steps,
        "records": ["model", "optimizer", "ema"],
    }
