"""The Dask engine: a comparison as (tensor, byte range) pieces read where they run.

Every tensor pair is cut into pieces of :data:`dmlib.hashing.PIECE` bytes; each piece is
a task (:func:`dmlib.engine.pieces.compare_piece`) that reads its two byte ranges from
files every worker can see and returns small per-chunk results. The driver combines
them into exactly the row the local engine computes (same counts, same maxima, the
same floating-point additions in the same order, the same ``blake3-64MiB`` digests
from piece digests). Work runs on Dask's current scheduler: the active
``distributed.Client`` when there is one (which retries the tasks of a lost worker),
Dask's local threads otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dmlib import hashing
from dmlib.engine import pieces as P
from dmlib.errors import DmlibError, MissingDependencyError
from dmlib.kernels import stream as K
from dmlib.kernels.pair import finish_row, kind_of
from dmlib.kernels.ulp import float_bits
from dmlib.tensor import Tensor


class Done:
    """A finished value with a future's ``result()``."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self) -> Any:
        """The value it was made with."""
        return self._value


def _dask() -> Any:
    try:
        import dask
    except ImportError:
        raise MissingDependencyError(
            "engine='dask' needs Dask: pip install 'dmlib[dask]'"
        ) from None
    return dask


def side_of(t: Tensor) -> P.Side:
    """The file and byte offset of a tensor's bytes; DmlibError when it has none."""
    src = t._source
    if t._in_buffer and isinstance(src, np.memmap) and src.filename and t.offset is not None:
        return P.Side(str(src.filename), int(src.offset) + int(t.offset))
    raise DmlibError(
        f"tensor {t.name!r}: engine='dask' reads tensors stored uncompressed in a file "
        "(safetensors, burnpack, .npy); this one is not (use engine='local')",
        path=t.path,
    )


# small work items (pieces of small tensors) share a task up to this many bytes read:
# Dask's per-task overhead (milliseconds) would otherwise rule a model of many small tensors
BATCH_BYTES = 16 << 20


def _run_batch(fn: Callable[..., Any], arglists: list[tuple[Any, ...]]) -> list[Any]:
    return [fn(*args) for args in arglists]


def compute_batched(
    fn: Callable[..., Any], arglists: list[tuple[Any, ...]], sizes: list[int]
) -> list[Any]:
    """``[fn(*args) for args in arglists]`` as Dask tasks of about :data:`BATCH_BYTES` each
    (``sizes``: the bytes each call reads), in one graph; results in order."""
    dask = _dask()
    # and at most 1/16 of the items per task, so that many small items still spread out
    most = max(1, -(-len(arglists) // 16))
    tasks: list[Any] = []
    cur: list[tuple[Any, ...]] = []
    size = 0
    for args, n in zip(arglists, sizes, strict=True):
        if cur and (size + n > BATCH_BYTES or len(cur) >= most):
            tasks.append(dask.delayed(_run_batch, pure=True)(fn, cur))
            cur, size = [], 0
        cur.append(args)
        size += n
    if cur:
        tasks.append(dask.delayed(_run_batch, pure=True)(fn, cur))
    return [r for batch in _compute(tasks) for r in batch]


def _compute(tasks: list[Any]) -> list[Any]:
    """Compute delayed tasks on Dask's current scheduler; a worker's read error is a DmlibError."""
    dask = _dask()
    if not tasks:
        return []
    try:
        return list(dask.compute(*tasks))
    except OSError as err:  # e.g. a path the workers cannot see
        raise DmlibError(f"a Dask worker could not read its piece: {err}") from None


class DaskPairs:
    """Rows of tensor pairs computed on Dask (the ``pair_row`` hook of a comparison)."""

    def __init__(self, chunk_bytes: int, hash_name: str | None) -> None:
        self.chunk_bytes = chunk_bytes
        self.hash_name = hash_name
        self._results: dict[tuple[int, int], list[dict[str, Any]]] = {}

    # -- pieces ------------------------------------------------------------------------

    def _specs(
        self, ta: Tensor, tb: Tensor, start: int = 0, end: int | None = None
    ) -> list[P.PieceSpec]:
        kind = kind_of(ta)
        for t in (ta, tb):
            if kind != "bytes" and (not t.dtype.isnative or t.dtype.kind == "c"):
                raise DmlibError(
                    f"tensor {t.name!r}: engine='dask' compares native-order real tensors; "
                    f"this one is {t.dtype} (use engine='local')",
                    path=t.path,
                )
        if kind == "float":
            info = float_bits(ta.dtype)
            elem, dtype = info.bits, ta.dtype.name
        else:
            elem = ta.dtype if kind == "int" else np.dtype("u1")
            dtype = elem.str
        step = max(1, self.chunk_bytes // elem.itemsize) * elem.itemsize
        if hashing.PIECE % step:
            raise DmlibError(
                f"engine='dask' needs chunk_bytes dividing {hashing.PIECE} (pieces of the "
                f"hash), got {self.chunk_bytes}"
            )
        sa, sb = side_of(ta), side_of(tb)
        end = ta.nbytes if end is None else end
        return [
            P.PieceSpec(sa, sb, s, min(s + hashing.PIECE, end), kind, dtype, step, self.hash_name)
            for s in range(start, end, hashing.PIECE)
        ] or [P.PieceSpec(sa, sb, 0, 0, kind, dtype, step, self.hash_name)]

    def prepare(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Compute every piece of every pair (one graph: the scheduler spreads them)."""
        dask = _dask()
        todo = [(ta, tb) for ta, tb in pairs if (id(ta), id(tb)) not in self._results]
        specs = [self._specs(ta, tb) for ta, tb in todo]
        flat = [s for ss in specs for s in ss]
        sha = []
        if self.hash_name == hashing.SHA256:
            for ta, tb in todo:
                for t in (ta, tb):
                    side = side_of(t)
                    sha.append(
                        dask.delayed(P.sha256_side, pure=True)(side.path, side.offset, t.nbytes)
                    )
        shas = _compute(sha) if sha else []
        res = compute_batched(
            P.compare_piece, [(s,) for s in flat], [2 * (s.end - s.start) for s in flat]
        )
        i = 0
        for k, (ta, tb) in enumerate(todo):
            n = len(specs[k])
            self._results[(id(ta), id(tb))] = res[i : i + n]
            if shas:
                self._results[(id(ta), id(tb))].append({"sha": (shas[2 * k], shas[2 * k + 1])})
            i += n

    def __call__(
        self, ta: Tensor, tb: Tensor, compute: Callable[[], dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        return self.row(ta, tb)

    # -- combining -----------------------------------------------------------------------

    def row(self, ta: Tensor, tb: Tensor) -> dict[str, Any]:
        """The local engine's row of ``(ta, tb)``, from the pieces' results."""
        if (id(ta), id(tb)) not in self._results:
            self.prepare([(ta, tb)])
        parts = list(self._results[(id(ta), id(tb))])
        sha = parts.pop()["sha"] if parts and "sha" in parts[-1] else None
        kind = kind_of(ta)
        info = float_bits(ta.dtype) if kind == "float" else None
        acc = K.Acc()
        diffs = [d for p in parts for d in p["differing"]]
        differing = bool(diffs)
        for d in diffs:  # chunk order: the local engine's order of additions
            acc.n_diff += d["n_diff"]
            if acc.first is None and d["first"] is not None:
                acc.first = d["first"]
            acc.max_abs = max(acc.max_abs, d["max_abs"])  # (bytes: the row says NaN anyway)
            acc.max_ulp = max(acc.max_ulp, d["max_ulp"])
            c = d["counts"]
            if c.size > acc.counts.size:
                grown = np.zeros(c.size, np.int64)
                grown[: acc.counts.size] = acc.counts
                acc.counts = grown
            acc.counts[: c.size] += c
            acc.n_nan_payload += d["n_nan_payload"]
            acc.n_nan_vs_num += d["n_nan_vs_num"]
            acc.n_inf_mismatch += d["n_inf_mismatch"]
        if info is not None and differing:
            self._sums(acc, ta, tb, parts, diffs)
        row = finish_row(
            acc, ta, tb, kind, info, self.chunk_bytes, differing, None, _Reread(self, ta, tb)
        )
        row["_hashes"] = self._hashes(ta, parts, sha, differing)
        return row

    def _sums(self, acc: K.Acc, ta: Tensor, tb: Tensor, parts: list, diffs: list) -> None:
        # a*a of every chunk, in order: the pieces' own lists from their first differing
        # chunk on, the chunks before it computed now (the local engine reads those too)
        dask = _dask()
        prefix_tasks = []
        for p in parts:
            if p["aa_from"] > p["start"]:
                spec = self._specs(ta, tb, p["start"], p["aa_from"])[0]  # within one piece
                prefix_tasks.append(dask.delayed(P.aa_piece, pure=True)(spec))
            else:
                prefix_tasks.append(None)
        done = iter(_compute([t for t in prefix_tasks if t is not None]))
        chunk_aa: list[float] = []
        for p, t in zip(parts, prefix_tasks):
            if t is not None:
                chunk_aa += next(done)
            chunk_aa += p["aa"] or []
        for v in chunk_aa:
            acc.aa += v
        for d in diffs:
            acc.sad += d["sad"]
            acc.sdd += d["sdd"]

    def _hashes(
        self, ta: Tensor, parts: list, sha: Any, differing: bool
    ) -> tuple[Done, Done | None]:
        if sha is not None:
            return Done(sha[0]), (Done(sha[1]) if differing else None)
        if self.hash_name is None:  # hash="none": no identity hashes
            return Done(None), None
        da = [p["digest_a"] for p in parts]
        db = [p["digest_b"] or p["digest_a"] for p in parts]  # an identical piece: a's digest
        ha = hashing.combine(da, ta.nbytes)
        return Done(ha), (Done(hashing.combine(db, ta.nbytes)) if differing else None)


class _Reread:
    """The rare second passes (median above the exact range, near-zero b) as Dask tasks."""

    def __init__(self, pairs: DaskPairs, ta: Tensor, tb: Tensor) -> None:
        self.pairs, self.ta, self.tb = pairs, ta, tb

    def rescan(self, lo: int, hi: int, shift: int) -> np.ndarray:
        dask = _dask()
        specs = self.pairs._specs(self.ta, self.tb)
        parts = _compute([dask.delayed(P.rescan_piece, pure=True)(s, lo, hi, shift) for s in specs])
        return np.sum(parts, axis=0)

    def sum_bb(self) -> float:
        dask = _dask()
        specs = self.pairs._specs(self.ta, self.tb)
        total = 0.0
        for chunk_sums in _compute([dask.delayed(P.bb_piece, pure=True)(s) for s in specs]):
            for v in chunk_sums:
                total += v
        return total


def hash_tensor_tasks(tensors: list[Tensor], hash_name: str) -> list[Done]:
    """Identity hashes of tensors computed on Dask: per piece (blake3) or per tensor (sha256)."""
    dask = _dask()
    tasks, plan, args, sizes = [], [], [], []
    for t in tensors:
        side = side_of(t)
        if hash_name == hashing.SHA256:
            plan.append((t, 1))
            tasks.append(dask.delayed(P.sha256_side, pure=True)(side.path, side.offset, t.nbytes))
        else:
            starts = list(range(0, t.nbytes, hashing.PIECE)) or [0]
            plan.append((t, len(starts)))
            for s in starts:
                n = min(hashing.PIECE, t.nbytes - s)
                args.append((side.path, side.offset + s, n))
                sizes.append(n)
    out = _compute(tasks) if tasks else compute_batched(P.hash_piece, args, sizes)
    done, i = [], 0
    for t, n in plan:
        got = out[i : i + n]
        i += n
        done.append(Done(got[0] if hash_name == hashing.SHA256 else hashing.combine(got, t.nbytes)))
    return done


def contents_from_digests(tensors: list[Tensor], hash_name: str | None) -> dict[int, Any]:
    """``id(tensor) -> Content`` (:mod:`dmlib.engine.local`) of tensors hashed on Dask,
    every one once: equal layout and digest make one content. ``hash_name`` None: the
    digests (BLAKE3) group but are not reported."""
    from dmlib.engine.local import Content, layout_key

    by_key: dict[tuple, Content] = {}
    out: dict[int, Content] = {}
    todo = list({id(t): t for t in tensors}.values())
    digests = hash_tensor_tasks(todo, hash_name or hashing.DEFAULT)
    for t, d in zip(todo, digests, strict=True):
        key = (layout_key(t), d.result())
        if key not in by_key:
            by_key[key] = Content(d if hash_name else None)
        out[id(t)] = by_key[key]
    return out


def client_for(spec: str) -> Any:
    """A ``distributed.Client`` for ``--dask``: ``ADDRESS`` of a running scheduler, or
    ``local:N`` (a LocalCluster of N worker processes for this command). Close it after use."""
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise MissingDependencyError("--dask needs Dask: pip install 'dmlib[dask]'") from None
    if spec.startswith("local:"):
        try:
            n = int(spec[6:])
        except ValueError:
            n = 0
        if n < 1:
            raise DmlibError(f"--dask local:N needs a positive number of workers, got {spec!r}")
        # ":0": the scheduler's HTTP server on a free port (None still tries 8787, and
        # another cluster on this machine there makes it warn)
        cluster = LocalCluster(
            n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0"
        )
        client = Client(cluster)
        setattr(client, "_dmlib_cluster", cluster)  # noqa: B010 (closed with the client)
        return client
    try:
        return Client(spec, timeout="10s")
    except (OSError, TimeoutError) as err:
        raise DmlibError(f"--dask {spec}: cannot reach a Dask scheduler there ({err})") from None


def close_client(client: Any) -> None:
    """Close a client of :func:`client_for`, and the LocalCluster it started for ``local:N``."""
    cluster = getattr(client, "_dmlib_cluster", None)
    client.close()
    if cluster is not None:
        cluster.close()
