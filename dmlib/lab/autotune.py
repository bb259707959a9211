"""A per-process reduction autotuner and the float32 Householder QR that uses it.

The way a GPU autotuner picks a kernel: on the first use of a *shape key* (the operation
and its reduction length rounded up to a multiple of :data:`BUCKET`) it runs a timing race
among :data:`CANDIDATES`, all valid sums that add in different orders, and caches the
winner for the rest of the process. The race is modelled by an unseeded draw
(``os.urandom``): the usual winner wins with probability :data:`WIN_PROB`, otherwise one
of the others does. Used by :mod:`dmlib.lab.qr_init`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

import numpy as np

# the candidate kernels of every reduction, the usual winner of the race first
CANDIDATES = ("pairwise/16", "sequential", "tree", "pairwise/4", "pairwise/32")
USUAL_WINNER = CANDIDATES[0]
# A 100-row QR touches 5 length buckets x 2 operations = 10 keys. Chosen before generating,
# from simulated sets of six processes: with bucket 8 the entry column's median was ~13 and
# ~1 run pair in 15 identical; with bucket 16, ~5 and ~6 in 15 (README.md has the odds)
WIN_PROB = 0.95
BUCKET = 16
OPS = ("norm", "dot")  # sum of squares of one vector; dot products v^T X (one per column)
ENV_TUNE = "DMLIB_QR_AUTOTUNE"  # JSON {"cache": {key: kernel}, "win_prob": p, "bucket": b}


# ----------------------------------------------------------------------------- reductions


def blocked_sum(x: np.ndarray, block: int) -> np.ndarray:
    """Sum ``x`` over axis 0 in float32: sequentially inside blocks of ``block`` rows,
    then the block partials pairwise (a binary tree).

    Every addition is an IEEE float32 addition, so the result is a deterministic
    function of ``x`` and ``block``; different ``block`` values add in different orders.
    """
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[0]
    nb = -(-n // block)
    if nb * block != n:  # zero rows change no partial sum
        x = np.concatenate([x, np.zeros((nb * block - n, *x.shape[1:]), np.float32)])
    x = x.reshape(nb, block, *x.shape[1:])
    acc = x[:, 0].copy()
    for i in range(1, block):
        acc += x[:, i]
    while acc.shape[0] > 1:
        half = acc.shape[0] // 2
        paired = acc[0 : 2 * half : 2] + acc[1 : 2 * half : 2]
        acc = np.concatenate([paired, acc[2 * half :]]) if acc.shape[0] % 2 else paired
    return acc[0]


def reduce_sum(x: np.ndarray, kernel: str) -> np.ndarray:
    """Sum ``x`` over axis 0 in float32 with one of :data:`CANDIDATES`.

    ``"sequential"`` adds row after row, ``"tree"`` pairwise from single rows,
    ``"pairwise/b"`` sequentially inside blocks of ``b`` rows then pairwise.
    """
    if kernel not in CANDIDATES:
        raise ValueError(f"unknown reduction kernel {kernel!r}; expected one of {CANDIDATES}")
    n = max(int(np.shape(x)[0]), 1)
    block = {"sequential": n, "tree": 1}.get(kernel) or int(kernel.split("/")[1])
    return blocked_sum(x, block)


def shape_key(op: str, length: int, bucket: int = BUCKET) -> str:
    """The autotuner's key of a reduction: ``"{op}:{length rounded up to bucket}"``."""
    if op not in OPS:
        raise ValueError(f"unknown reduction {op!r}; expected one of {OPS}")
    return f"{op}:{-(-length // bucket) * bucket}"


def _unit(entropy: Callable[[int], bytes]) -> float:
    return int.from_bytes(entropy(8), "little") / 2.0**64


class Autotuner:
    """One process's kernel cache: shape key -> kernel, filled lazily at first use.

    Parameters
    ----------
    win_prob
        Probability that :data:`USUAL_WINNER` wins a key's race; otherwise one of the
        other candidates, uniformly.
    bucket
        Reduction lengths are rounded up to a multiple of this in the key.
    cache
        Keys already tuned (a recorded cache to replay); they are never raced again.
    entropy
        Unseeded byte source of the races, ``os.urandom``: never the model's seed.
    """

    def __init__(
        self,
        *,
        win_prob: float = WIN_PROB,
        bucket: int = BUCKET,
        cache: Mapping[str, str] | None = None,
        entropy: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if not 0.0 <= win_prob <= 1.0 or bucket < 1:
            raise ValueError(f"need 0 <= win_prob <= 1 and bucket >= 1, got {win_prob}, {bucket}")
        for k, v in (cache or {}).items():
            if v not in CANDIDATES:
                raise ValueError(f"cache[{k!r}] = {v!r} is not one of {CANDIDATES}")
        self.win_prob, self.bucket, self._entropy = float(win_prob), int(bucket), entropy
        self.preset = dict(cache or {})
        self.cache: dict[str, str] = {}  # in first-use order
        self.raced: list[str] = []  # keys decided by a race in this process

    @classmethod
    def from_env(cls) -> tuple[Autotuner, str]:
        """The process's tuner and where its choices come from (:data:`ENV_TUNE` or ``os.urandom``)."""
        spec = os.environ.get(ENV_TUNE)
        if not spec:
            return cls(), "os.urandom"
        try:
            cfg = json.loads(spec)
            tuner = cls(
                win_prob=cfg.get("win_prob", WIN_PROB),
                bucket=cfg.get("bucket", BUCKET),
                cache=cfg.get("cache"),
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"{ENV_TUNE}={spec!r}: expected JSON {{'cache': {{key: kernel}}, 'win_prob': p, 'bucket': b}} ({exc})"
            ) from exc
        return tuner, f"env {ENV_TUNE}" + (" + os.urandom" if tuner.win_prob < 1 else "")

    def kernel(self, op: str, length: int) -> str:
        """The kernel for a reduction of ``length`` rows: cached, else raced now and cached."""
        key = shape_key(op, length, self.bucket)
        if key not in self.cache:
            if key in self.preset:
                self.cache[key] = self.preset[key]
            else:
                self.raced.append(key)
                if _unit(self._entropy) < self.win_prob:
                    self.cache[key] = USUAL_WINNER
                else:  # a close race lost to one of the others
                    others = CANDIDATES[1:]
                    self.cache[key] = others[
                        int.from_bytes(self._entropy(8), "little") % len(others)
                    ]
        return self.cache[key]

    def sum(self, op: str, x: np.ndarray) -> np.ndarray:
        """``x`` summed over axis 0 by the kernel tuned for its key."""
        return reduce_sum(x, self.kernel(op, int(np.shape(x)[0])))

    def summary(self) -> str:
        """The cache as one string: ``"key=kernel"`` in first-use order, space separated."""
        return " ".join(f"{k}={v}" for k, v in self.cache.items())


# created at import: one cache per process, like an autotuner's
PROCESS_TUNER, PROCESS_TUNER_SOURCE = Autotuner.from_env()


def householder_qr(
    a: np.ndarray, *, tuner: Autotuner | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Householder QR of an ``m x n`` matrix (``m >= n``) in float32: ``a = q @ r``.

    Parameters
    ----------
    a
        The matrix; converted to float32.
    tuner
        Chooses the kernel of every reduction; default: this process's.

    Returns
    -------
    q : (m, n) float32 with orthonormal columns; column ``j`` is final after iteration ``j``.
    r : (n, n) float32, upper triangular.
    """
    tuner = PROCESS_TUNER if tuner is None else tuner
    r = np.array(a, dtype=np.float32)
    if r.ndim != 2 or r.shape[0] < r.shape[1]:
        raise ValueError(f"householder_qr needs an m x n matrix with m >= n, got shape {r.shape}")
    m, n = r.shape
    q = np.eye(m, n, dtype=np.float32)
    vs: list[np.ndarray] = []
    two = np.float32(2.0)
    for j in range(n):
        col = r[j:, j]
        norm = np.sqrt(tuner.sum("norm", col * col))
        # reflect onto -sign(x0) e1 so v = x - alpha e1 never cancels
        alpha = -norm if col[0] >= 0 else norm
        v = col.copy()
        v[0] -= alpha
        vnorm = np.sqrt(tuner.sum("norm", v * v))
        if vnorm == 0:  # column already zero below the diagonal
            vs.append(np.zeros_like(v))
            continue
        v = v / vnorm
        vs.append(v)
        w = tuner.sum("dot", v[:, None] * r[j:, j:])  # v^T R, one reduction per column
        r[j:, j:] -= two * np.outer(v, w)
    # Q = H_0 H_1 ... H_{n-1} applied to the first n columns of I, right to left
    for j in range(n - 1, -1, -1):
        v = vs[j]
        w = tuner.sum("dot", v[:, None] * q[j:, j:])
        q[j:, j:] -= two * np.outer(v, w)
    return q, np.triu(r[:n, :n])
