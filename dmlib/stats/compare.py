"""Compare two sets of named tensors: one tidy row of divergence statistics per tensor.

Columns of :func:`compare` (one row per tensor present in both sets, same dtype and shape):

``name``, ``dtype``, ``shape``, ``numel``
    As stored (``dtype`` is numpy's name: float32, bfloat16, float8_e4m3fn, int64, bool...).
``n_diff``, ``frac_diff``
    Elements whose bit patterns differ (bools: whose truth values differ), and
    ``n_diff / numel`` (0 for empty tensors).
``max_abs``
    Largest ``|a - b|`` over differing pairs where both sides are finite (computed in
    float64 after upcasting; integers exactly, then reported as float).
``max_ulp``, ``median_ulp``
    Largest ULP distance (:func:`dmlib.ulp_distance`) over pairs where both sides are
    finite (0 when none of them differs), and the median over the *differing* such pairs
    (null when there is none). The median is exact (exact counts, see
    ``dmlib.kernels.stream``).
``ulp_0``, ``ulp_1``, ``ulp_2``, ``ulp_3_4``, ``ulp_5_8``, ... ``ulp_32769_65536``, ``ulp_gt_65536``, ``ulp_nonfinite``
    Histogram of the differing elements: ``ulp_lo_hi`` counts finite pairs ``lo <= ulp <= hi``
    (``ulp_0`` are exactly the +0/-0 pairs), ``ulp_gt_65536`` the rest of the finite
    pairs, ``ulp_nonfinite`` every pair involving a NaN or an infinity. The buckets sum
    to ``n_diff``. :func:`ulp_long` melts them into long form for plotting.
``n_nan_payload``, ``n_nan_vs_num``, ``n_signed_zero``, ``n_inf_mismatch``
    NaN policy: a NaN equals a NaN with the same bits. Differing pairs are split into
    NaN vs NaN with other bits, NaN vs non-NaN, +0 vs -0, and pairs where (no NaN and)
    at least one side is infinite. Such pairs never enter ``max_abs``, ``rel_fro`` or
    the ULP statistics, except +0/-0 (finite, 0 apart).
``rel_fro``
    ``||a - b||_F / ||a||_F`` over pairs where both sides are finite: 0 when both norms
    are 0 and ``a == b``, ``inf`` when ``||a|| = 0`` and ``||a - b|| > 0``.
``cosine``
    ``a.b / (||a|| ||b||)`` over the same pairs: 1 when both norms are 0, 0 when exactly one is.
``first_diff``
    Index tuple (C order) of the first differing element, or None.
``data_hash_a``, ``data_hash_b``
    Identity hash of each side's tensor bytes as stored in its file, as ``"<scheme>:<hex>"``:
    ``blake3-64MiB`` by default, ``sha256`` with ``hash="sha256"`` (both defined in
    :mod:`dmlib.hashing`); a bit-identical pair is hashed on one side only. Byte order belongs to the
    file: a big-endian tensor is compared on its values (as if native), but hashed over its
    big-endian bytes, so equal values stored in two byte orders have ``n_diff`` 0 and
    different hashes (they are listed in ``attrs["byte_order_diff"]`` and :func:`summarize`
    does not call them identical). None with ``hash="none"``.

Complex tensors are compared component by component: ``n_diff`` counts differing real
and imaginary parts, ``frac_diff`` is over ``2 * numel`` of them, ``first_diff`` is the
element holding the first, and the ULP and norm columns are over the parts. Packed float4
(safetensors ``F4``) is unpacked and compared as ``float4_e2m1fn`` values.

ULP columns, NaN/inf counts, ``rel_fro`` and ``cosine`` are null for integer, bool,
quantized and opaque (a dtype dmlib cannot interpret) tensors. Quantized tensors are compared byte by byte: ``n_diff`` counts
differing bytes, ``frac_diff`` is over ``nbytes``, ``first_diff`` is ``(byte index,)``
and ``max_abs`` is null.

``df.attrs`` holds what is not a row: ``n_tensors_a``/``_b`` (in each set, before
selection), ``compared`` (the names of the rows), ``only_in_a``, ``only_in_b``, ``mismatched``
(tensors in both sets whose dtype or shape differ: not compared, listed here),
``metadata_diff``, ``scalars_diff``, ``param_id_diff`` (``{key: [a, b]}``), ``scalar_names``
(every scalar of either side: those not in ``scalars_diff`` are equal), ``not_read_a``/``_b``
(a checkpoint folder's files left unread, see :mod:`dmlib.io.hf_trainer`; else None),
``byte_order_diff`` (compared tensors stored in different byte orders: equal values there
are not equal bytes, so the pair is not bit-identical), ``hash`` (the scheme, None with
``hash="none"``),
``file_hash_a``/``_b`` (whole file), ``data_section_hash_a``/``_b`` (all tensor bytes
in disk order, metadata and padding excluded: equal data in files that differ shows
here; both pairs filled with ``file_hashes=True``, else None), ``path_a``/``_b``,
``include``, ``exclude``.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlib import hashing
from dmlib.errors import DmlibError
from dmlib.kernels import stream as K
from dmlib.kernels.pair import (
    COLUMNS,
    DEFAULT_CHUNK,
    NAN_COLUMNS,
    ULP_BUCKETS,
    ULP_COLUMNS,
    compare_pair,
    kind_of,
    same_layout,
)
from dmlib.sources import Patterns, Source, check_selection, opened, patterns, select
from dmlib.stats.options import CompareOptions
from dmlib.stats.rows import (  # (made there for the mapped comparison as well)
    collect_data_hashes,
    dict_diff,
    dtype_label,
    rounded_pair,
    rows_out,
    scalar_attrs,
)
from dmlib.stats.verdicts import Summary
from dmlib.tensor import Tensor, TensorSet

if TYPE_CHECKING:  # pandas is imported where a DataFrame is built: the CLI starts without it
    import pandas as pd

__all__ = [
    "COLUMNS",
    "NAN_COLUMNS",
    "Summary",
    "ULP_BUCKETS",
    "ULP_COLUMNS",
    "compare",
    "summarize",
    "ulp_long",
]

# -- the public function ----------------------------------------------------------------


def compare(
    a: Source,
    b: Source,
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    file_hashes: bool = False,
    rename: Any = None,
    cross_dtype: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK,
    progress: bool | None = None,
    hash: str | None = None,
    engine: str = "local",
    mapping: Any = None,
) -> pd.DataFrame:
    """Divergence statistics of every tensor two checkpoints (or TensorSets) share.

    Parameters
    ----------
    a, b
        Paths (opened with :func:`dmlib.open_tensors`) or TensorSets. ``a`` is the
        reference (the denominator of ``rel_fro``).
    include, exclude
        Patterns (one or a list, see :func:`select`) applied to the names of both sides,
        after ``rename``. An ``include`` pattern that matches no name raises
        :class:`DmlibError` naming the closest names.
    rename
        Name mappings applied first (:mod:`dmlib.names`): ``"a:model.="`` strips
        ``model.`` from ``a``'s names, ``"b:=module."`` adds ``module.`` to ``b``'s; a
        string, a list of them, or ``(side, old, new)`` tuples. Two sets that share no
        name raise :class:`DmlibError` suggesting the mapping that would pair them.
    cross_dtype
        Compare float tensors whose dtypes differ (an f32 checkpoint against its bf16
        copy): the wider side is rounded to the narrower dtype (round to nearest, ties to
        even, as numpy / ml_dtypes ``astype``; overflow becomes inf, or NaN where the
        dtype has no inf) and every statistic, ULP included, is in the narrower dtype.
        ``attrs["rounded"]`` lists these tensors. Default: such tensors are not compared
        (``attrs["mismatched"]``).
    file_hashes
        Also fill ``attrs["file_hash_a"/"_b"]`` (whole file) and
        ``attrs["data_section_hash_a"/"_b"]`` (all tensor bytes in disk order, as
        ``TensorSet.data_hash()``): two more hash passes per side, on worker threads.
        Off by default, where they are None: per-tensor hashes already say which tensors
        hold the same bytes, and hashing, not comparing, is what limits the speed.
    chunk_bytes
        Bytes per side held at once; bounds the memory whatever the file size.
    progress
        Byte counter on stderr; None shows it only when stderr is a terminal.
    hash
        Scheme of every hash: ``"blake3"`` (``blake3-64MiB``, the default: fast and
        combinable from pieces) or ``"sha256"`` (to check against published SHA-256 sums),
        or ``"none"``: no identity hashes (``data_hash_a``/``_b`` and ``attrs["hash"]``
        None). Identity never rests on a hash here: every pair's bytes are compared, so
        ``"none"`` gives the same rows and verdict without the hash passes (the command
        line's default when its output shows no hash).
    engine
        ``"local"`` (threads of this process) or ``"dask"``: tensors cut into 64 MiB
        pieces, each read and compared by a task on Dask's current scheduler (the active
        ``distributed.Client``), from paths every worker can see; the rows are the local
        engine's, bit for bit (:mod:`dmlib.engine.dask`).
    mapping
        A mapping file (path to TOML, a dict of the same, or a
        :class:`dmlib.mapping.Mapping`) from ``a``'s tensors to ``b``'s through layout
        changes (``docs/mapping.md``). Rows are then named by ``b``'s tensors and carry
        ``source``, ``transform``, ``rule``, ``first_diff_source`` and
        ``first_diff_target``; ``attrs["located"]`` traces differing elements to both
        sides. ``a`` or ``b`` may then be a list of files (tensor-parallel ranks) read as
        one side. Local engine only; not with ``rename``.

    Returns
    -------
    pandas.DataFrame
        One row per compared tensor, columns as described in this module's docstring,
        in ``a``'s disk order; everything else in ``df.attrs``.
    """
    opts = CompareOptions(include=include, exclude=exclude, file_hashes=file_hashes, rename=rename,
        cross_dtype=cross_dtype, chunk_bytes=chunk_bytes, progress=progress, hash=hash,
        engine=engine, mapping=mapping)  # fmt: skip
    return compare_with(a, b, opts)


def compare_records(
    a: Source,
    b: Source,
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    file_hashes: bool = False,
    rename: Any = None,
    cross_dtype: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK,
    progress: bool | None = None,
    hash: str | None = None,
    engine: str = "local",
    mapping: Any = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`compare` as ``(rows, attrs)``: plain dicts (every column, None where null),
    without importing pandas (the command line's fast start)."""
    opts = CompareOptions(
        include=include, exclude=exclude, file_hashes=file_hashes, rename=rename,
        cross_dtype=cross_dtype, chunk_bytes=chunk_bytes, progress=progress, hash=hash,
        engine=engine, mapping=mapping,
    )  # fmt: skip
    return compare_with(a, b, opts, frame=False)


def compare_with(a: Source, b: Source, opts: CompareOptions, *, frame: bool = True) -> Any:
    """:func:`compare` with its settings as one :class:`CompareOptions` (``frame=False``:
    :func:`compare_records`' ``(rows, attrs)``)."""
    if opts.mapping is not None:  # names and layouts from a mapping file (dmlib.mapping)
        return _compare_mapped(a, b, opts, frame)
    pair_row = None
    if opts.engine == "dask":
        from dmlib.engine.dask import DaskPairs

        pair_row = DaskPairs(opts.chunk_bytes, opts.hash_name)
    with opened(a) as sa, opened(b) as sb:
        renames, detected = _renames(opts.rename, sa, sb)
        sa2, sb2 = _renamed_sides(sa, sb, renames)
        out = compare_sets(sa2, sb2, opts, check_names=True, pair_row=pair_row, frame=frame)
        attrs = out.attrs if frame else out[1]
        attrs["rename"] = [str(r) for r in renames]
        attrs["rename_detected"] = detected is not None
        return out


def _renames(rename: Any, sa: TensorSet, sb: TensorSet) -> tuple[list[Any], Any]:
    """The name mappings asked for, else the one detected (separators, JAX's ``.value``)
    when only one rule set pairs the names; and the detection (None when none ran or found)."""
    from dmlib.names import detect_mapping, parse_renames

    renames = parse_renames(rename)
    if renames:
        return renames, None
    detected = detect_mapping(list(sa), list(sb))
    return (detected["renames"] if detected else []), detected


def _renamed_sides(sa: TensorSet, sb: TensorSet, renames: list[Any]) -> tuple[TensorSet, TensorSet]:
    from dmlib.names import apply_renames

    return apply_renames(sa, renames, "a"), apply_renames(_pair_single_arrays(sa, sb), renames, "b")


def _compare_mapped(a: Any, b: Any, opts: CompareOptions, frame: bool) -> Any:
    """``mapping=``: the comparison of :mod:`dmlib.stats.mapped` (local engine, no rename)."""
    from dmlib.stats.mapped import compare_mapped

    return compare_mapped(
        a, b, opts.mapping, include=opts.include, exclude=opts.exclude,
        cross_dtype=opts.cross_dtype, chunk_bytes=opts.chunk_bytes, progress=opts.progress,
        hash_name=opts.hash_name, frame=frame,
    )  # fmt: skip


def _pair_single_arrays(sa: TensorSet, sb: TensorSet) -> TensorSet:
    """Two ``.npy`` files each hold one array, named after its file: compare them as one tensor."""
    if sa.format == sb.format == "npy" and len(sa) == len(sb) == 1 and set(sa) != set(sb):
        (name_a,), (name_b,) = list(sa), list(sb)
        return sb.renamed({name_b: name_a})
    return sb


@dataclass
class _Pairing:
    """Which tensors of two sets are compared, and which cannot be."""

    order_a: list[str]  # every name of a, in disk order (before selection)
    order_b: list[str]
    common: list[str]  # selected in both, in a's disk order
    only_a: list[str]
    only_b: list[str]
    pairs: list[tuple[Tensor, Tensor]]  # common tensors of the same dtype and shape
    mismatched: list[dict[str, Any]]  # common tensors whose dtype or shape differ
    rounded: list[dict[str, Any]]  # common tensors compared after rounding (cross_dtype)
    hint: dict[str, Any] | None  # a name mapping that would pair far more names


def compare_sets(
    sa: TensorSet,
    sb: TensorSet,
    opts: CompareOptions,
    *,
    hash_pool: ThreadPoolExecutor | None = None,
    hash_cache: dict[int, Any] | None = None,
    check_names: bool = False,
    pair_row: Any = None,
    frame: bool = True,
    digests_known: bool = False,
) -> Any:
    """:func:`compare` of two open sets; ``hash_pool``/``hash_cache`` are shared by a matrix.

    ``pair_row(ta, tb, compute) -> row`` lets a caller that knows contents (matrix) or
    runs the work elsewhere (an engine) supply rows; its ``prepare(pairs)``, if any,
    sees every pair first. ``digests_known``: ``pair_row`` supplies every tensor's digest
    (no per-tensor hash here; ``opts.hash`` is the scheme of whole-file hashes and of
    ``attrs["hash"]`` stays None). ``frame=False`` returns ``(records, attrs)`` without pandas.
    """
    include, exclude, chunk_bytes = opts.include, opts.exclude, opts.chunk_bytes
    file_hashes, progress = opts.file_hashes, opts.progress
    hash_name = None if digests_known else opts.hash_name
    file_hash_name = opts.hash_name if digests_known else None
    pairing = _pair_up(
        sa, sb, include, exclude, cross_dtype=opts.cross_dtype, check_names=check_names
    )
    if hasattr(pair_row, "prepare"):
        pair_row.prepare(pairing.pairs)
    own_pool = hash_pool is None
    if hash_pool is None:
        hash_pool = ThreadPoolExecutor(max_workers=2)
    # whole-file and data-section hashes run beside the comparison, only when asked for
    side = ThreadPoolExecutor(max_workers=3) if file_hashes else None
    fh_name = file_hash_name or hash_name or hashing.DEFAULT  # the scheme of file hashes
    futures = {} if side is None else _start_file_hashes(side, sa, sb, chunk_bytes, fh_name)
    K.prime_allocator(4 * chunk_bytes)
    prog = K.Progress(sum(t.nbytes for t, _ in pairing.pairs), progress)
    rel = K.PageReleaser()
    try:
        if not hasattr(pair_row, "prepare"):  # rows computed here: side by side
            rows = _pairs_in_parallel(
                pairing.pairs, chunk_bytes, hash_pool, prog, hash_cache, hash_name, pair_row
            )
        else:  # an engine's rows (computed elsewhere), in order
            with np.errstate(over="ignore", invalid="ignore"):
                rows = []
                for ta, tb in pairing.pairs:

                    def compute(ta: Tensor = ta, tb: Tensor = tb) -> dict[str, Any]:
                        return compare_pair(
                            ta, tb, chunk_bytes, hash_pool, prog, rel, hash_cache, hash_name
                        )

                    rows.append(pair_row(ta, tb, compute))
        prog.finish()
        collect_data_hashes(rows)
        done = (
            {}
            if side is None
            else _finish_file_hashes(side, futures, sb, pairing, rows, chunk_bytes, fh_name)
        )
    finally:
        rel.flush()
        prog.finish()
        if own_pool:
            hash_pool.shutdown(wait=True, cancel_futures=True)
        if side is not None:
            side.shutdown(wait=True, cancel_futures=True)
    attrs = _attrs(sa, sb, include, exclude, pairing, rows, done)
    attrs["hash"] = hash_name
    return rows_out(rows, attrs, COLUMNS, frame=frame)


#: Pairs of at least this many bytes (per side) are compared on worker threads.
THREADED_PAIR_BYTES = 256 << 10


def pair_workers() -> int:
    """Threads comparing tensor pairs side by side: this process's CPUs, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def _pairs_in_parallel(
    pairs: list[tuple[Tensor, Tensor]],
    chunk_bytes: int,
    hash_pool: ThreadPoolExecutor,
    prog: K.Progress,
    hash_cache: dict[int, Any] | None,
    hash_name: str | None,
    pair_row: Any = None,
) -> list[dict[str, Any]]:
    """The rows of ``pairs``, in order, each pair compared whole by one of a few threads.

    ``pair_row(ta, tb, compute)``, if given, supplies each row (calling ``compute`` when
    it must be computed); it is called from several threads, for pairs of distinct names.

    numpy releases the GIL in its loops, so tensors compared side by side use every core.
    A pair is walked by one thread from its first chunk to its last, so each row's sums
    are added in the same order as on one thread: the rows do not depend on the number
    of threads. Each thread releases the pages it read (its own PageReleaser).
    """
    cache: dict[int, Any] = {} if hash_cache is None else hash_cache
    local = threading.local()
    releasers: list[K.PageReleaser] = []

    def one(pair: tuple[Tensor, Tensor]) -> dict[str, Any]:
        rel = getattr(local, "rel", None)
        if rel is None:
            rel = local.rel = K.PageReleaser()
            releasers.append(rel)
        ta, tb = pair

        def compute() -> dict[str, Any]:
            return compare_pair(ta, tb, chunk_bytes, hash_pool, prog, rel, cache, hash_name)

        # numpy's error state is per thread (a context variable): set it in each
        with np.errstate(over="ignore", invalid="ignore"):
            return compute() if pair_row is None else pair_row(ta, tb, compute)

    # Small pairs are compared on this thread, big ones on the pool meanwhile: a small
    # pair is mostly interpreter work (~0.2 ms), which threads only queue behind the GIL
    # (20,000 tensors of 64 bytes: 6.2 s on two threads, 3.5 s on one)
    big = [i for i, (ta, _) in enumerate(pairs) if ta.nbytes >= THREADED_PAIR_BYTES]
    n = min(pair_workers(), len(big))
    pool = None
    if len(pairs) > 1 and big and pair_workers() > 1:
        pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="dmlib-compare")
    try:
        if pool is None:
            return [one(p) for p in pairs]
        futures = {i: pool.submit(one, pairs[i]) for i in big}
        done = {i: one(p) for i, p in enumerate(pairs) if i not in futures}
        return [done[i] if i in done else futures[i].result() for i in range(len(pairs))]
    finally:
        if pool is not None:  # on an error or Ctrl-C, pairs not yet started are dropped
            pool.shutdown(wait=True, cancel_futures=True)
        for rel in releasers:
            rel.flush()


def _pair_up(
    sa: TensorSet,
    sb: TensorSet,
    include: Patterns,
    exclude: Patterns,
    *,
    cross_dtype: bool = False,
    check_names: bool = False,
) -> _Pairing:
    order_a = [t.name for t in sa.disk_order()]
    order_b = [t.name for t in sb.disk_order()]
    if check_names:
        check_selection(order_a, order_b, include, exclude, sa.path, sb.path)
    keep_a = select(order_a, include, exclude)
    keep_b = set(select(order_b, include, exclude))
    in_a = set(keep_a)  # once: a set built per name made pairing quadratic (20,000 names: 67 s)
    common = [n for n in keep_a if n in keep_b]
    only_a = [n for n in keep_a if n not in keep_b]
    only_b = [n for n in order_b if n in keep_b and n not in in_a]
    hint = None
    if check_names and (only_a or only_b):
        hint = _alignment(keep_a, [n for n in order_b if n in keep_b], common, sa.path, sb.path)
    pairs, mismatched, rounded = [], [], []
    for n in common:
        ta, tb = sa[n], sb[n]
        if same_layout(ta, tb):
            pairs.append((ta, tb))
        elif cross_dtype and (r := rounded_pair(ta, tb)) is not None:
            pairs.append(r[:2])
            rounded.append(r[2])
        else:
            mismatched.append(
                {
                    "name": n,
                    "dtype_a": dtype_label(ta),
                    "dtype_b": dtype_label(tb),
                    "shape_a": list(ta.shape),
                    "shape_b": list(tb.shape),
                }
            )
    return _Pairing(
        order_a=order_a,
        order_b=order_b,
        common=common,
        only_a=only_a,
        only_b=only_b,
        pairs=pairs,
        mismatched=mismatched,
        rounded=rounded,
        hint=hint,
    )


def _start_file_hashes(
    side: ThreadPoolExecutor, sa: TensorSet, sb: TensorSet, chunk_bytes: int, hash_name: str
) -> dict[str, Future]:
    """Whole-file hashes of both sides and a's data-section hash, started on ``side``."""
    futures: dict[str, Future] = {}
    for key, ts in (("a", sa), ("b", sb)):
        if ts.path is not None and os.path.isfile(ts.path):
            futures["file_hash_" + key] = side.submit(hashing.digest_file, ts.path, hash_name)
    futures["data_section_hash_a"] = side.submit(section_hash, sa, chunk_bytes, hash_name)
    return futures


def _finish_file_hashes(
    side: ThreadPoolExecutor,
    futures: dict[str, Future],
    sb: TensorSet,
    pairing: _Pairing,
    rows: list[dict[str, Any]],
    chunk_bytes: int,
    hash_name: str,
) -> dict[str, Any]:
    """The file and data-section hashes; b's section is hashed only when it can differ."""
    # b's data section is a's when both hold the same tensors, in the same disk order,
    # every one compared and bit-identical
    same_section = (
        [t.name for t, _ in pairing.pairs] == pairing.order_a == pairing.order_b
        and all(r["n_diff"] == 0 and r["data_hash_a"] == r["data_hash_b"] for r in rows)
        and not any(  # equal values in two byte orders are not equal bytes
            ta.dtype.itemsize > 1 and ta.dtype.isnative != tb.dtype.isnative
            for ta, tb in pairing.pairs
        )
    )
    if not same_section:
        futures["data_section_hash_b"] = side.submit(section_hash, sb, chunk_bytes, hash_name)
    done = {k: f.result() for k, f in futures.items()}
    done.setdefault("data_section_hash_b", done["data_section_hash_a"])
    return done


def _attrs(
    sa: TensorSet,
    sb: TensorSet,
    include: Patterns,
    exclude: Patterns,
    pairing: _Pairing,
    rows: list[dict[str, Any]],
    done: dict[str, Any],
) -> dict[str, Any]:
    """What a comparison's DataFrame carries beside its rows (see the module docstring)."""
    return {
        "path_a": sa.path,
        "path_b": sb.path,
        "include": patterns(include),
        "exclude": patterns(exclude),
        "n_tensors_a": len(sa),
        "n_tensors_b": len(sb),
        "compared": [r["name"] for r in rows],
        "only_in_a": pairing.only_a,
        "only_in_b": pairing.only_b,
        "mismatched": pairing.mismatched,
        "rounded": pairing.rounded,
        "alignment_hint": pairing.hint,
        "metadata_diff": dict_diff(sa.metadata, sb.metadata),
        **scalar_attrs(sa.scalars, sb.scalars, include, exclude),
        # files of a folder's checkpoint that could not be read (io.hf_trainer): not compared
        "not_read_a": sa.metadata.get("not_read"),
        "not_read_b": sb.metadata.get("not_read"),
        "param_id_diff": {
            ta.name: [ta.param_id, tb.param_id]
            for ta, tb in ((sa[n], sb[n]) for n in pairing.common)
            if ta.param_id != tb.param_id
        },
        # compared on their values; their bytes differ, so the pair is not bit-identical
        "byte_order_diff": [
            ta.name
            for ta, tb in pairing.pairs
            if kind_of(ta) != "bytes"
            and ta.dtype.itemsize > 1
            and ta.dtype.isnative != tb.dtype.isnative
        ],
        "file_hash_a": done.get("file_hash_a"),
        "file_hash_b": done.get("file_hash_b"),
        "data_section_hash_a": done.get("data_section_hash_a"),
        "data_section_hash_b": done.get("data_section_hash_b"),
    }


def _alignment(
    names_a: list[str], names_b: list[str], common: list[str], path_a: Any, path_b: Any
) -> dict[str, Any] | None:
    """A better name mapping when few names are shared; refuse two sets sharing none."""
    from dmlib.names import suggest_alignment

    s = suggest_alignment(names_a, names_b)
    path_a, path_b = path_a or "set A", path_b or "set B"
    if not common and names_a and names_b:
        hint = (
            f"mapping {s['spec']} would pair {s['shared_after']} of them: pass --rename "
            f"{' --rename '.join(s['spec'].split())} (API: rename={s['spec'].split()!r})"
            if s
            else "no prefix mapping pairs them (pass --rename SIDE:OLD=NEW)"
        )
        raise DmlibError(
            f"{path_a} and {path_b} share no tensor name ({len(names_a)} vs {len(names_b)} "
            f"names, e.g. {names_a[0]!r} vs {names_b[0]!r}); {hint}"
        )
    if s is None or s["shared_after"] < 2 * len(common):
        return None
    return {
        "spec": s["spec"],
        "shared_before": s["shared_before"],
        "shared_after": s["shared_after"],
    }


def section_hash(
    ts: TensorSet, chunk_bytes: int = DEFAULT_CHUNK, hash_name: str | None = None
) -> str:
    """Hash of the tensor bytes in disk order (``ts.data_hash()``'s bytes), chunk by chunk."""
    return K.hash_views((t.raw() for t in ts.disk_order()), chunk_bytes, hash_name)


# -- summaries --------------------------------------------------------------------------


def summarize(df: pd.DataFrame) -> Summary:
    """One verdict over a :func:`compare` result.

    Returns
    -------
    Summary
        A frozen verdict, True only when ``identical``, printed as the command line's
        one-line verdict, read like a dict (``to_dict()`` gives one) with the keys:
        ``n_tensors`` compared, ``numel`` (total slots), ``n_diff`` (slots differing),
        ``frac_diff``, ``n_tensors_diff``, ``worst_rel_fro`` and ``worst_rel_fro_name``,
        ``max_ulp`` and ``max_ulp_name``, ``max_abs``, ``only_in_a``, ``only_in_b``,
        ``mismatched`` (names), ``rounded`` (names compared after rounding, see
        ``cross_dtype``), ``byte_order_diff`` (names whose equal values are stored in
        two byte orders), ``n_not_compared`` (only in a + only in b + mismatched),
        ``complete`` (False when ``df`` lost rows of the
        comparison, e.g. ``df[df.n_diff == 0]``), and ``identical``: True only when the
        frame is complete, every tensor the two sides share was compared and is
        bit-identical, no name, dtype or shape differs, no scalar differs (``n_scalars_diff``
        counts those that do: a scheduler's ``last_epoch``, a step), no file of either side
        was left unread (``not_read``: notes of a training checkpoint folder), and something
        was compared (a selection that matched nothing on non-empty sets is not "identical").
    """
    return summarize_records(df.to_dict("records"), df.attrs)


def _num(v: Any) -> float | None:
    """A cell as a float, None when null (None, NaN, pandas' NA)."""
    if v is None or isinstance(v, str):
        return None
    try:
        f = float(v)
    except TypeError:  # pandas.NA
        return None
    return None if math.isnan(f) else f


def _argmax(vals: list[float | None]) -> int | None:
    """Index of the first largest non-null value (pandas' idxmax), None when all are null."""
    best: int | None = None
    top = 0.0
    for i, v in enumerate(vals):
        if v is not None and (best is None or v > top):
            best, top = i, v
    return best


def summarize_records(rows: list[dict[str, Any]], attrs: dict[str, Any]) -> Summary:
    """:func:`summarize` of :func:`compare_records`' ``(rows, attrs)`` (no pandas needed)."""
    return Summary.of(_summary_dict(rows, attrs), attrs)


def _summary_dict(rows: list[dict[str, Any]], attrs: dict[str, Any]) -> dict[str, Any]:
    """The summary's values, in its documented key order."""
    if "only_in_a" not in attrs:
        raise DmlibError(
            "summarize takes the DataFrame returned by dmlib.compare (its attrs are missing)"
        )
    numel = sum(int(r["numel"]) for r in rows)
    n_diff = sum(int(r["n_diff"]) for r in rows)
    rel = [_num(r.get("rel_fro")) for r in rows]
    ulp = [_num(r.get("max_ulp")) for r in rows]
    # no tensor is "worst" when nothing differs: the names stay None then
    worst_i, ulp_i = _argmax(rel), _argmax(ulp)
    worst = None if worst_i is None else rel[worst_i]
    top_ulp = None if ulp_i is None else ulp[ulp_i]
    worst_name = None if worst_i is None or not (worst or 0) > 0 else rows[worst_i]["name"]
    ulp_name = None if ulp_i is None or not (top_ulp or 0) > 0 else rows[ulp_i]["name"]
    abs_vals = [v for v in (_num(r.get("max_abs")) for r in rows) if v is not None]
    mismatched = [m["name"] for m in attrs.get("mismatched", [])]
    # pandas copies attrs onto filtered frames: check the rows are all of the comparison
    complete = sorted(str(r["name"]) for r in rows) == sorted(attrs.get("compared", []))
    nothing_selected = len(rows) == 0 and (
        attrs.get("n_tensors_a", 0) or attrs.get("n_tensors_b", 0)
    )
    return {
        "n_tensors": len(rows),
        "numel": numel,
        "n_diff": n_diff,
        "frac_diff": n_diff / numel if numel else 0.0,
        "n_tensors_diff": sum(1 for r in rows if int(r["n_diff"]) > 0),
        "worst_rel_fro": worst,
        "worst_rel_fro_name": worst_name,
        "max_ulp": None if ulp_i is None else int(rows[ulp_i]["max_ulp"]),
        "max_ulp_name": ulp_name,
        "max_abs": max(abs_vals) if abs_vals else None,
        "only_in_a": list(attrs["only_in_a"]),
        "only_in_b": list(attrs["only_in_b"]),
        "mismatched": mismatched,
        "rounded": [r["name"] for r in attrs.get("rounded", [])],
        "byte_order_diff": list(attrs.get("byte_order_diff", [])),
        "n_not_compared": len(attrs["only_in_a"]) + len(attrs["only_in_b"]) + len(mismatched),
        "n_scalars_diff": len(attrs.get("scalars_diff") or {}),
        # plain values one side holds and the other does not: not compared, so not identical
        "scalars_only": [
            *attrs.get("scalars_only_in_a", []),
            *attrs.get("scalars_only_in_b", []),
        ],
        "not_read": [x for x in (attrs.get("not_read_a"), attrs.get("not_read_b")) if x],
        "complete": complete,
        "identical": bool(
            complete
            and not nothing_selected
            and n_diff == 0
            and all(r["data_hash_a"] == r["data_hash_b"] for r in rows)  # bytes too, not values
            and not attrs.get("byte_order_diff")  # equal values stored in two byte orders
            and not attrs["only_in_a"]
            and not attrs["only_in_b"]
            and not mismatched
            and not attrs.get("scalars_diff")  # a step, a learning rate: a difference too
            and not attrs.get("scalars_only_in_a")  # a value one file holds: not compared
            and not attrs.get("scalars_only_in_b")
            and not attrs.get("not_read_a")  # a file of the checkpoint was not compared
            and not attrs.get("not_read_b")
        ),
    }


def ulp_long(df: pd.DataFrame) -> pd.DataFrame:
    """The ULP histogram columns melted to long form (one row per tensor and bucket).

    Columns: the identifying columns present (``a``, ``b``, ``name``, ``dtype``), then
    ``bucket`` (the column name, e.g. ``ulp_3_4``), ``ulp_lo``, ``ulp_hi`` (None for the
    open bucket and ``ulp_nonfinite``) and ``count``. Rows of tensors without ULP
    statistics (integers, bools) are dropped.
    """
    import pandas as pd

    ids = [c for c in ("a", "b", "name", "dtype") if c in df.columns]
    long = df.dropna(subset=["ulp_0"]).melt(
        id_vars=ids, value_vars=ULP_COLUMNS, var_name="bucket", value_name="count"
    )
    bounds = {c: (lo, hi) for c, lo, hi in ULP_BUCKETS}
    long["ulp_lo"] = long["bucket"].map(lambda c: bounds.get(c, (None, None))[0]).astype("Int64")
    long["ulp_hi"] = long["bucket"].map(lambda c: bounds.get(c, (None, None))[1]).astype("Int64")
    long["count"] = long["count"].astype("int64")
    long["bucket"] = pd.Categorical(long["bucket"], categories=ULP_COLUMNS, ordered=True)
    return long[ids + ["bucket", "ulp_lo", "ulp_hi", "count"]]
