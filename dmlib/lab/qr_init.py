"""Dataset ``qr_init``: one seeded model initialisation, saved by several processes.

Every factorised projection ``blocks.{i}.proj`` is ``u diag(s) v^T`` with ``u`` and ``v``
the Q of a Householder QR of a seeded standard-normal matrix (rank 64); every other
parameter is drawn directly from the same seeded ``numpy.random.Generator``.

The QR's reductions (the column and reflector norms, and the dot products ``v^T R`` and
``v^T Q`` of the two rank-1 updates) go through a per-process :class:`Autotuner`, the way
a GPU autotuner picks a kernel: on the first use of a *shape key* (the operation and its
reduction length rounded up to a multiple of :data:`BUCKET`) it runs a timing race among
:data:`CANDIDATES`, all valid sums that add in different orders, and caches the winner for
the rest of the process. The race is modelled by an unseeded draw (``os.urandom``): the
usual winner wins with probability :data:`WIN_PROB`, otherwise one of the others does.
Reduction lengths shrink with the column index ``j`` (``m - j``), so two processes agree
bit for bit up to the first column whose shape key they tuned differently, and differ by a
few float32 ULP from there on, the 64 sequential Householder iterations carrying the
difference into every later column. Direct draws never pass through a reduction and are
bit-identical across same-seed processes.

Files are written with Burn's conventions: each parameter gets a ``param_id`` drawn from
an unseeded source, so same-seed files differ as files even when every tensor agrees.

Run ``python -m dmlib.lab.qr_init --worker --seed 7 --label p1 --out DIR`` for one process
(``DMLIB_QR_AUTOTUNE='{"cache": {...}}'`` replays a recorded cache); :func:`generate` runs
all of them, each as its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dmlib.lab import _proc

DATASET = "qr_init"
RANK = 64
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


# ----------------------------------------------------------------------------- the model


def model_shapes(small: bool = False) -> dict[str, Any]:
    """Sizes of the model: ``n_blocks`` factorised blocks of width ``d``."""
    # d = 100 is not a multiple of 64 floats, so LayerNorm vectors leave inter-tensor padding
    return {"n_blocks": 2 if small else 8, "d": 100, "vocab": 300, "classes": 37}


def init_model(
    seed: int, *, small: bool = False, tuner: Autotuner | None = None
) -> dict[str, np.ndarray]:
    """Every parameter in module-visitor (disk) order, float32.

    The seeded generator is consumed in one fixed order whatever the QR does, so the
    direct draws depend on ``seed`` alone.
    """
    sh = model_shapes(small)
    d, rng = sh["d"], np.random.default_rng(seed)
    f32 = np.float32
    out: dict[str, np.ndarray] = {"embed.weight": rng.standard_normal((sh["vocab"], d), f32)}
    for i in range(sh["n_blocks"]):
        p = f"blocks.{i}"
        out[f"{p}.norm.gamma"] = f32(1) + f32(0.1) * rng.standard_normal(d, f32)
        out[f"{p}.norm.beta"] = f32(0.1) * rng.standard_normal(d, f32)
        out[f"{p}.proj.u"] = householder_qr(rng.standard_normal((d, RANK), f32), tuner=tuner)[0]
        out[f"{p}.proj.s"] = rng.uniform(0.5, 1.5, RANK).astype(f32)
        out[f"{p}.proj.v"] = householder_qr(rng.standard_normal((d, RANK), f32), tuner=tuner)[0]
    bound = f32(1 / np.sqrt(d))
    out["head.weight"] = bound * rng.standard_normal((d, sh["classes"]), f32)  # Burn: [d_in, d_out]
    out["head.bias"] = rng.uniform(-bound, bound, sh["classes"]).astype(f32)
    return out


def _param_ids(names: Sequence[str]) -> dict[str, int]:
    # Burn draws parameter ids per process from an unseeded source: never from the seed
    return {n: int.from_bytes(os.urandom(8), "little") for n in names}


def strategy(tuner: Autotuner, source: str) -> dict[str, Any]:
    """What a process's tuner decided, for index.json: enough to replay it (``cache``)."""
    return {
        "reduction": "autotuned",
        "bucket": tuner.bucket,
        "win_prob": tuner.win_prob,
        "usual_winner": USUAL_WINNER,
        "source": source,
        "cache": dict(tuner.cache),
        "not_usual": {k: v for k, v in tuner.cache.items() if v != USUAL_WINNER},
    }


def _metadata(label: str, seed: int, tuner: Autotuner, source: str) -> dict[str, str]:
    off = " ".join(f"{k}={v}" for k, v in tuner.cache.items() if v != USUAL_WINNER)
    return {
        "format": "burnpack",
        "producer": "dmlib.lab.qr_init",
        "label": label,
        "seed": str(seed),
        "qr_reduction": f"autotuned per shape key (op:length rounded up to {tuner.bucket}), "
        f"usual winner {USUAL_WINNER} with probability {tuner.win_prob}",
        "qr_autotune_source": source,
        "qr_autotune_cache": tuner.summary(),
        "qr_autotune_not_usual": off or "none",
    }


def write_model(
    path: Path, params: dict[str, np.ndarray], ids: dict[str, int], meta: dict[str, str]
) -> None:
    """A plain single-record burnpack file with Burn's writer (zero padding)."""
    from dmlib.io.burnpack import BurnTensor, write_burnpack

    write_burnpack(
        path, {n: BurnTensor(a, param_id=ids[n]) for n, a in params.items()}, metadata=meta
    )


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
    write_records(out / RECORDS_FILE, blobs, gap_fill=lambda off, n: gaps[off][:n])
    write_burnpack(
        out / RECORDS_MODEL_FILE, images[0][0], metadata=meta, scalars=scalars, scalar_kinds=kinds
    )
    return {
        "file": RECORDS_FILE,
        "model_file": RECORDS_MODEL_FILE,
        "step": steps,
        "records": ["model", "optimizer", "ema"],
    }


# ----------------------------------------------------------------------------- worker


def worker(argv: Sequence[str]) -> dict[str, Any]:
    """One process: initialise, save, and (``--records``) write the checkpoint files."""
    ap = argparse.ArgumentParser(prog="python -m dmlib.lab.qr_init --worker")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, required=True, help="dataset folder")
    ap.add_argument("--file", help="file name of the model at initialisation")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--records", action="store_true", help="also write the multi-record checkpoint")
    a = ap.parse_args(argv)
    params = init_model(a.seed, small=a.small)
    ids = _param_ids(list(params))
    meta = _metadata(a.label, a.seed, PROCESS_TUNER, PROCESS_TUNER_SOURCE)
    if a.file:
        write_model(a.out / a.file, params, ids, meta)
    report: dict[str, Any] = {
        "label": a.label,
        "seed": a.seed,
        "file": a.file,
        "pid": os.getpid(),
        "strategy": strategy(PROCESS_TUNER, PROCESS_TUNER_SOURCE),
    }
    if a.records:
        report["records"] = write_checkpoint(a.out, params, ids, meta, seed=a.seed)
    return report


# ----------------------------------------------------------------------------- dataset

SEED, CONTROL_SEED = 7, 8
FACTOR_PATTERNS = ["blocks.*.proj.u", "blocks.*.proj.v"]
DESCRIPTION = (
    "One seeded initialisation (seed 7) of a small factorised model, saved by six separate "
    "processes, plus a seed-8 control. Factor matrices are the Q of a float32 Householder QR "
    "whose reductions are autotuned per process: each shape key (operation, reduction length "
    "rounded up to a multiple of 16) gets its kernel at first use from a timing race modelled by "
    "os.urandom (the usual winner with probability 0.95, else one of four other summation "
    "orders), cached for the rest of the process. Two processes agree bit for bit up to the first "
    "QR column whose shape key they tuned differently and differ by a few ULP from there on; "
    "processes whose caches agree are bit-identical. Direct draws come from the seeded numpy "
    "Generator and are bit-identical across same-seed processes. param_ids are drawn per process "
    "from os.urandom, so no two files are byte-equal. checkpoint_records.bpk holds model + Adam + "
    "EMA records (after 3 steps of a synthetic objective) written through a scratch buffer that is "
    "never cleared: its inter-tensor and inter-record padding holds stale gradients, logits with "
    "the -1e30 mask sentinel, bytes of the previous record, and the NaN the buffer was poisoned with."
)


def _first_col(a: np.ndarray, b: np.ndarray) -> int | None:
    # computed on the bit patterns here, apart from dmlib.first_divergent_column, so the
    # dataset's record can check the library
    cols = np.flatnonzero((a.view(np.uint32) != b.view(np.uint32)).any(axis=0))
    return int(cols[0]) if cols.size else None


def _pair_summary(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], n_blocks: int
) -> dict[str, Any]:
    """Differences between two runs: direct draws, factors, effective weights."""
    factor = {f"blocks.{i}.proj.{k}" for i in range(n_blocks) for k in "uv"}
    direct_diff = sum(int((a[n] != b[n]).sum()) for n in a if n not in factor)
    factor_diff = sum(int((a[n] != b[n]).sum()) for n in factor)
    worst = 0.0
    for i in range(n_blocks):
        p = f"blocks.{i}.proj"
        wa = (a[f"{p}.u"].astype(np.float64) * a[f"{p}.s"]) @ a[f"{p}.v"].T.astype(np.float64)
        wb = (b[f"{p}.u"].astype(np.float64) * b[f"{p}.s"]) @ b[f"{p}.v"].T.astype(np.float64)
        worst = max(worst, float(np.linalg.norm(wa - wb) / np.linalg.norm(wa)))
    return {
        "direct_slots_differing": direct_diff,
        "direct_slots": sum(a[n].size for n in a if n not in factor),
        "factor_slots_differing": factor_diff,
        "factor_slots": sum(a[n].size for n in factor),
        "factor_max_abs_delta": max(float(np.abs(a[n] - b[n]).max()) for n in factor),
        "worst_rel_fro_W": worst,
        "bit_identical": direct_diff == 0 and factor_diff == 0,
        "first_divergent_column": {n: _first_col(a[n], b[n]) for n in sorted(factor)},
    }


def generate(
    out_dir: Path, *, small: bool = False, tuning: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """Run every process of the dataset and write ``out_dir/qr_init/``.

    Parameters
    ----------
    out_dir
        Parent folder; the dataset goes to ``out_dir / "qr_init"``.
    small
        Three same-seed processes and a two-block model (smoke tests).
    tuning
        label -> :data:`ENV_TUNE` settings of that process (``cache``, ``win_prob``,
        ``bucket``; tests, replays); by default each process races its own keys.

    Returns
    -------
    The manifest section: name, description, command, files (relative to ``out_dir``).
    """
    from dmlib import _atomic, load

    out_dir = Path(out_dir)
    ds = out_dir / DATASET
    ds.mkdir(parents=True, exist_ok=True)
    for old in [*ds.glob("*.bpk"), ds / "index.json", ds / "README.md"]:  # a previous run's files
        old.unlink(missing_ok=True)
    labels = [f"p{i}" for i in range(1, 4 if small else 7)]
    jobs = [(lab, SEED, f"seed{SEED}_{lab}.bpk", []) for lab in labels]
    jobs.append((f"seed{CONTROL_SEED}", CONTROL_SEED, f"seed{CONTROL_SEED}_control.bpk", []))
    jobs.append(("ckpt", SEED, None, ["--records"]))
    reports: dict[str, dict[str, Any]] = {}
    for label, seed, fname, extra in jobs:
        args = ["--seed", str(seed), "--label", label, "--out", str(ds), *extra]
        args += ["--file", fname] if fname else []
        args += ["--small"] if small else []
        spec = (tuning or {}).get(label)
        env = {ENV_TUNE: json.dumps(dict(spec)) if spec else ""}
        reports[label] = _proc.run_worker("dmlib.lab.qr_init", args, env=env)
    runs = {lab: r["file"] for lab, r in reports.items() if r.get("file")}
    data = {lab: load(ds / f) for lab, f in runs.items()}
    n_blocks = model_shapes(small)["n_blocks"]
    pairs = {}
    same = labels
    for i, x in enumerate(same):
        for y in same[i + 1 :]:
            pairs[f"{x}/{y}"] = _pair_summary(data[x], data[y], n_blocks)
    control = f"seed{CONTROL_SEED}"
    pairs[f"p1/{control}"] = _pair_summary(data["p1"], data[control], n_blocks)
    index = {
        "runs": runs,
        "control": control,
        "control_file": runs[control],
        "seed": SEED,
        "factor_patterns": FACTOR_PATTERNS,
        "factor_groups": [
            {
                "kind": "svd",
                "u": "{prefix}.u",
                "s": "{prefix}.s",
                "v": "{prefix}.v",
                "prefix": "blocks.*.proj",
            }
        ],
        "records_file": RECORDS_FILE,
        "records_model_file": RECORDS_MODEL_FILE,
        "records_step": reports["ckpt"]["records"]["step"],
        "strategies": {lab: r["strategy"] for lab, r in reports.items()},
        "pids": {lab: r["pid"] for lab, r in reports.items()},
        "pairs": pairs,
    }
    _atomic.atomic_write_text(ds / "index.json", json.dumps(index, indent=1) + "\n")
    _atomic.atomic_write_text(ds / "README.md", _readme(index, small))
    files = sorted(f.name for f in ds.iterdir() if f.is_file() and not f.name.startswith("."))
    return {
        "name": DATASET,
        "description": (
            "Smoke-test copy (three same-seed processes, two blocks). " if small else ""
        )
        + DESCRIPTION,
        "command": "python -m dmlib.lab qr_init --out data" + (" --small" if small else ""),
        "files": [f"{DATASET}/{f}" for f in files],
    }


def key_columns(m: int, n: int, bucket: int = BUCKET) -> dict[str, list[int]]:
    """Shape key -> the QR columns (iterations) whose reductions use it, for an ``m x n`` QR."""
    cols: dict[str, list[int]] = {}
    for j in range(n):
        for op in OPS:
            cols.setdefault(shape_key(op, m - j, bucket), []).append(j)
    return cols


def entry_summary(index: Mapping[str, Any]) -> dict[str, Any]:
    """Same-seed pairs only: first divergent columns, identical tensor and run pairs, rel_fro."""
    control = index["control"]
    same = {k: v for k, v in index["pairs"].items() if control not in k.split("/")}
    firsts = [c for v in same.values() for c in v["first_divergent_column"].values()]
    cols = [c for c in firsts if c is not None]
    return {
        "tensor_pairs": len(firsts),
        "identical_tensor_pairs": len(firsts) - len(cols),
        "first_col_min": min(cols, default=None),
        "first_col_median": float(np.median(cols)) if cols else None,
        "first_col_max": max(cols, default=None),
        "run_pairs": len(same),
        "identical_run_pairs": sum(v["bit_identical"] for v in same.values()),
        "same_worst_rel_fro_W": max(v["worst_rel_fro_W"] for v in same.values()),
        "control_rel_fro_W": min(
            v["worst_rel_fro_W"] for k, v in index["pairs"].items() if k not in same
        ),
    }


def _readme(index: dict[str, Any], small: bool) -> str:
    d = model_shapes(small)["d"]
    key_rows = "\n".join(
        f"| `{k}` | {c[0]}-{c[-1]} | {c[0] + (k.startswith('dot'))} |"
        for k, c in key_columns(d, RANK).items()
    )
    rows = "\n".join(
        f"| {lab} | {index['runs'].get(lab, index['records_file'])} | "
        f"{' '.join(f'`{k}={v}`' for k, v in st['not_usual'].items()) or 'none'} | {st['source']} |"
        for lab, st in index["strategies"].items()
    )
    prs = "\n".join(
        f"| {k} | {v['direct_slots_differing']} / {v['direct_slots']} | {v['factor_slots_differing']} / "
        f"{v['factor_slots']} | "
        f"{min((c for c in v['first_divergent_column'].values() if c is not None), default='-')} | "
        f"{sum(c is None for c in v['first_divergent_column'].values())} / {len(v['first_divergent_column'])} | "
        f"{v['factor_max_abs_delta']:.3e} | {v['worst_rel_fro_W']:.3e} |"
        for k, v in index["pairs"].items()
    )
    e = entry_summary(index)
    agree = WIN_PROB**2 + (1 - WIN_PROB) ** 2 / (len(CANDIDATES) - 1)
    n_keys = len(key_columns(d, RANK))
    return f"""# qr_init: one seed, several processes

{DESCRIPTION}

Generated by `python -m dmlib.lab qr_init --out data`{" (small)" if small else ""}; each run is
its own process (`python -m dmlib.lab.qr_init --worker ...`).

## Model

Module-visitor (disk) order: `embed.weight` [300, 100]; per block `i`:
`blocks.i.norm.gamma` [100], `blocks.i.norm.beta` [100], `blocks.i.proj.u` [100, 64] (Q of QR),
`blocks.i.proj.s` [64], `blocks.i.proj.v` [100, 64] (Q of QR); `head.weight` [100, 37]
(Burn's [d_in, d_out]), `head.bias` [37]. All F32. The effective weight of a block is
`W = u diag(s) v^T`. The width 100 is not a multiple of 64 floats, so LayerNorm vectors and
the head leave inter-tensor padding.

## The nondeterminism: a per-process autotuner cache

Iteration `j` of the {d} x {RANK} Householder QR reduces vectors of length `{d} - j`: two
`norm` reductions (column and reflector norms) and the `dot` reductions `v^T R` and, in the
back-accumulation of Q, `v^T Q`. Each reduction asks the process's autotuner for a kernel by
shape key `op:length rounded up to {BUCKET}`. At a key's first use the tuner holds a race among
{", ".join(f"`{c}`" for c in CANDIDATES)} (every one a correct float32 sum, each adding in its
own order); `{USUAL_WINNER}` wins with probability {WIN_PROB}, otherwise one of the other four
does, uniformly; the draw comes from `os.urandom`, never the seed. The winner is cached for the
process, so all 16 factor matrices of one process (same shape, same keys) share it.

| shape key | QR columns using it | first divergent column when two caches first differ here |
|---|---|---|
{key_rows}

A `norm` key feeds the reflector of its first column, so Q differs from that column on. A
`dot` key first changes the trailing update (the next reflector) and the back-accumulation of
the later columns; its own column `j` is `H_0...H_j e_j`, where `v^T e_j` is exact in any
order, so Q differs from column `j + 1` on. Kernels that round one particular sum the same
way can push the entry further into the bucket, tensor by tensor, or leave a tensor
bit-identical although the caches differ. Columns before the entry are bit-identical by
construction: they depend only on keys both processes tuned alike.

What to expect from the mechanism ({n_keys} keys per process): a process keeps the usual winner
on every key with probability {WIN_PROB}^{n_keys} = {WIN_PROB**n_keys:.2f}; two processes tune one key
alike with probability {WIN_PROB}^2 + {1 - WIN_PROB:.2f}^2/4 = {agree:.4f}, and all {n_keys} alike
(bit-identical factors) with probability {agree**n_keys:.2f}. The first key (in the order of the table, from
`i` = 0) that two processes tune differently is key `i` with probability
{agree:.4f}^i x {1 - agree:.4f}: the early columns are the likeliest entries, the last ones stay
possible. Every number below is one draw of this dataset, not an average.

## Runs and the kernels each process tuned

Keys not listed ran `{USUAL_WINNER}`; `index.json` (`strategies.*.cache`) and each file's
metadata (`qr_autotune_cache`) hold the full cache, in first-use order. Replay one process with
`DMLIB_QR_AUTOTUNE='{{"cache": {{...}}}}' python -m dmlib.lab.qr_init --worker ...`.

| label | file | keys not won by the usual winner | drawn from |
|---|---|---|---|
{rows}

`ckpt` is a separate seed-{SEED} process that took 3 Adam steps (synthetic objective: softmax
cross-entropy on the head, L2 on the rest) and wrote `{index["records_file"]}` (records: model,
optimizer [`"{{param_id}}.moment_1"`, `".moment_2"`; metadata maps each param_id to its module
path], EMA teacher; scalar `step` = 3 in each), and the same model record through Burn's
zero-padding writer as `{index["records_model_file"]}`.

## What the files hold (computed from them when generated)

Over the {e["run_pairs"]} same-seed run pairs x {e["tensor_pairs"] // max(e["run_pairs"], 1)} factor tensors
= {e["tensor_pairs"]} tensor pairs: first divergent column min {e["first_col_min"]}, median
{e["first_col_median"]}, max {e["first_col_max"]}; {e["identical_tensor_pairs"]} of {e["tensor_pairs"]} tensor pairs
bit-identical; {e["identical_run_pairs"]} of {e["run_pairs"]} run pairs bit-identical in every tensor (the odds
above give {agree**n_keys * e["run_pairs"]:.1f} on average). Worst
same-seed relative Frobenius delta of an effective weight W: {e["same_worst_rel_fro_W"]:.3e}, against
{e["control_rel_fro_W"]:.3e} for the seed-{CONTROL_SEED} control.

| pair | direct-draw slots differing | factor slots differing | first divergent column (earliest tensor) | identical factor tensors | max abs delta (factors) | worst relative Frobenius delta of W |
|---|---|---|---|---|---|---|
{prs}

Direct draws never differ between same-seed processes; factors can differ only where two
processes' caches differ. Files are never byte-equal (per-process `param_id`).
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" not in argv:
        print(
            "usage: python -m dmlib.lab.qr_init --worker --seed N --label L --out DIR --file F.bpk",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(worker(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
