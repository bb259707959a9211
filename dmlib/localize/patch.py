"""Patch test: does the first divergent boundary *cause* the downstream difference?

:func:`patch_test` re-runs the second layout's forward pass twice under
:func:`dmlib.capture`: once as is, once with one request's rows at ``boundary`` replaced
by the rows dumped in the ``source`` capture (a module output through a forward hook, an
op output through a dispatch mode). The difference is confirmed as caused there when
the boundary differed before the patch and every later comparable boundary of that
request matches the source after it. A patch at a boundary that already matched changes
nothing and is never confirmed. Several boundaries can be patched in one run (the same
op in every layer, say); those that already matched before the patch are skipped, and
the result says which.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dmlib.errors import CaptureError
from dmlib.localize.boundaries import compare_captures
from dmlib.localize.capture.format import request_key, root_label
from dmlib.localize.capture.reader import Capture, open_capture
from dmlib.localize.capture.rowmap import RowMap
from dmlib.localize.ops import ModuleStack, op_table


@dataclass
class PatchResult:
    """Outcome of :func:`patch_test`; true when the patch confirmed the cause."""

    confirmed: bool
    boundary: str  # the patched boundaries, comma-separated
    request: str
    first_still_differing: str | None
    reason: str
    table: pd.DataFrame

    def __bool__(self) -> bool:
        return self.confirmed

    def __str__(self) -> str:
        head = "confirmed" if self.confirmed else "NOT confirmed"
        still = self.first_still_differing or "none"
        return (
            f"patch at {self.boundary} (request {self.request!r}): {head}: {self.reason}; "
            f"first boundary still differing after the patch: {still}"
        )


def _to_torch(arr: np.ndarray, like: Any) -> Any:
    import torch

    a = np.ascontiguousarray(arr)
    if a.dtype.kind == "V" or a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        bits = {1: torch.uint8, 2: torch.int16}[a.dtype.itemsize]
        t = torch.from_numpy(a.view({1: np.uint8, 2: np.int16}[a.dtype.itemsize])).view(bits)
        return t.view(like.dtype).to(like.device)
    return torch.from_numpy(a.copy()).to(device=like.device, dtype=like.dtype)


def _patched(out: Any, rows: np.ndarray, idx: np.ndarray, rm: RowMap, name: str, axes: Any) -> Any:
    new = out.detach().clone()
    # rows on (batch, position) axes elsewhere than in front: a view with them in front
    lead = new.movedim(tuple(axes), (0, 1)) if axes is not None else new
    k = 2 if axes is not None else rm.row_dims(tuple(out.shape))
    if k is None or (axes is not None and lead.shape[0] * lead.shape[1] != len(rm)):
        raise CaptureError(
            f"boundary {name!r} has shape {list(out.shape)} in this run, which does not "
            f"flatten to the row map's {len(rm)} rows: its request rows cannot be patched"
        )
    if axes is not None:
        n_pos = lead.shape[1]
        bi, pi = torch_index(idx // n_pos, new), torch_index(idx % n_pos, new)
        src = _to_torch(rows, new)
        if tuple(src.shape) != (len(idx), *lead.shape[2:]):
            raise CaptureError(f"dumped rows of {name!r} are {list(src.shape)}; this run's "
                               f"rows are {[len(idx), *lead.shape[2:]]}")  # fmt: skip
        lead[bi, pi] = src  # writes through the view into new
        return new
    view = new.view(len(rm), *new.shape[k:])
    src = _to_torch(rows, view)
    if tuple(src.shape) != (len(idx), *view.shape[1:]):
        raise CaptureError(
            f"dumped rows of {name!r} are {list(src.shape)}; this run's rows are "
            f"{[len(idx), *view.shape[1:]]}"
        )
    view[torch_index(idx, view)] = src
    return new


def torch_index(idx: np.ndarray, like: Any) -> Any:
    """``idx`` as an int64 torch tensor on ``like``'s device."""
    import torch

    return torch.from_numpy(np.asarray(idx, dtype=np.int64)).to(like.device)


class _OpPatch(ModuleStack):
    """Replaces the request's rows of some ops' first outputs (by op id)."""

    def __init__(
        self, selected, patches: dict[str, Callable[[Any], Any]], hits: dict, root: str
    ) -> None:
        super().__init__(selected, root)
        self.patches = patches
        self.hits = hits

    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        oid = self.next_id(func)
        out = func(*args, **kwargs)
        fn = self.patches.get(oid) if oid is not None else None
        if fn is None:
            return out
        self.hits[oid] = self.hits.get(oid, 0) + 1
        if isinstance(out, tuple):
            return (fn(out[0]), *out[1:])
        return fn(out)


def _settings(src: Capture, model: Any) -> dict[str, Any]:
    """The hook selection that reproduces the source capture's boundary names."""

    def real(label: str) -> str:
        return "" if label == src.root else label

    ops = op_table(src)
    op_names = {n for o in ops for n in [*o.inputs, *o.outputs]}
    modules = sorted({real(b.module) for b in src.boundaries if b.name not in op_names})
    owners = sorted({real(o.owner.split("#")[0]) for o in ops})
    return {"modules": modules, "ops": bool(ops), "op_modules": owners or None}


def patch_test(
    model: Any,
    *,
    source: Capture | str | os.PathLike[str],
    boundary: str | Sequence[str],
    request: Any,
    row_map: Sequence[Any],
    run: Callable[[], Any],
    workdir: str | os.PathLike[str] | None = None,
) -> PatchResult:
    """Re-run ``run()`` with ``request``'s rows at ``boundary`` taken from ``source``.

    Parameters
    ----------
    model
        The model ``run`` calls (its modules are hooked).
    source
        Capture of the reference layout holding the dumped rows of ``boundary`` for
        ``request`` (``dump=`` matching it).
    boundary
        A module output (``"encoder.layer.0.attention.self"``) or an op output
        (``"...self/aten.addmm#0"``) of the source capture, or several (all patched in
        one run).
    request
        Request id whose rows are patched and compared.
    row_map
        Row map of the layout ``run`` uses (as for :func:`dmlib.capture`).
    run
        Runs the second layout's forward pass (e.g. ``lambda: model(**packed)``).
    workdir
        Where the two captures are written (default: a temporary folder, removed).

    Returns
    -------
    PatchResult
        ``confirmed``, ``first_still_differing``, ``reason`` and ``table``: one row per
        boundary of the source with ``identical_before``, ``identical_after`` and
        ``after_patch`` (the boundary runs after the first patched one, and is neither
        patched nor another output of a patched op).
    """
    src = open_capture(source) if not isinstance(source, Capture) else source
    names = [boundary] if isinstance(boundary, str) else list(boundary)
    if not names or len(set(names)) != len(names):
        raise CaptureError(f"boundary {boundary!r}: expected one name or distinct names",
                           path=src.path)  # fmt: skip
    rm = RowMap(list(row_map))
    key = request_key(request)
    if key not in rm.requests:
        raise CaptureError(f"request {request!r} is not in the row map of this run")
    idx = rm.requests[key]
    ops = {o.id: o for o in op_table(src)}
    mod_patches: dict[str, Callable[[Any], Any]] = {}
    op_patches: dict[str, Callable[[Any], Any]] = {}
    for name in names:
        b = src.boundary(name)
        if b.kind != "output" or ":" in b.name:
            raise CaptureError(f"{name!r} is not a first output; patch a module or op output",
                               path=src.path)  # fmt: skip
        rows = src.tensor(b, request)  # raises, naming the boundary, when not dumped
        fn = _patcher(rows, idx, rm, b.name, b.row_axes)
        (op_patches if b.name in ops else mod_patches)[b.name] = fn
    settings = _settings(src, model)
    with _folder(workdir) as tmp:
        kw = dict(settings, row_map=list(row_map), block_rows=src.block_rows, overwrite=True)
        _capture(model, tmp / "before", run, kw, {}, {})
        hits = _capture(model, tmp / "after", run, kw, mod_patches, op_patches)
        missing = [n for n in names if not hits.get(n)]
        if missing:
            raise CaptureError(
                f"boundary {missing[0]!r} never ran in this run: nothing was patched"
            )
        before = compare_captures(src, tmp / "before", request=key)
        after = compare_captures(src, tmp / "after", request=key)
    return _result(names, key, before, after)


def _patcher(
    rows: np.ndarray, idx: np.ndarray, rm: RowMap, name: str, axes: Any
) -> Callable[[Any], Any]:
    return lambda out: _patched(out, rows, idx, rm, name, axes)


@contextlib.contextmanager
def _folder(workdir: str | os.PathLike[str] | None) -> Iterator[Path]:
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
        return
    with tempfile.TemporaryDirectory(prefix="dmlib-patch-") as d:
        yield Path(d)


def _capture(
    model: Any,
    path: Path,
    run: Callable[[], Any],
    kw: dict,
    mod_patches: dict[str, Callable[[Any], Any]],
    op_patches: dict[str, Callable[[Any], Any]],
) -> dict[str, int]:
    """Run ``run()`` under :func:`dmlib.capture` with the patches; returns hits per name."""
    from dmlib.localize.capture import capture
    from dmlib.localize.capture.tensors import _select

    hits: dict[str, int] = {}
    named = dict(model.named_modules())
    root = root_label(named)
    handles = []
    for name, fn in mod_patches.items():
        # a module output: a forward hook registered before the capture's own
        label, _, call = name.partition("#")
        mod = named["" if label == root else label]
        handles.append(mod.register_forward_hook(_module_patch(name, int(call or 0), fn, hits)))
    patcher = None
    if op_patches:
        # an op output: the patching mode is entered first, so the capture's mode (entered
        # second, on top) sees each op first and records the patched output; it hooks the
        # modules the capture gives ops to, so that it counts op calls as the capture names
        # them (a child's ops are the child's)
        patcher = _OpPatch(_select(model, kw["op_modules"]), op_patches, hits, root)
        handles += patcher.install()
    try:
        with (
            patcher if patcher is not None else contextlib.nullcontext(),
            capture(model, path, **kw),
        ):
            run()
    finally:
        for h in handles:
            h.remove()
    return hits


def _module_patch(name: str, call: int, fn: Callable[[Any], Any], hits: dict) -> Callable:
    seen = [0]

    def hook(m: Any, args: Any, output: Any) -> Any:
        seen[0] += 1
        if seen[0] - 1 != call:
            return None
        hits[name] = hits.get(name, 0) + 1
        return (fn(output[0]), *output[1:]) if isinstance(output, tuple) else fn(output)

    return hook


def _tri(v: Any) -> bool | None:
    return None if v is None or v is pd.NA else bool(v)


def _result(
    names: list[str], request: str, before: pd.DataFrame, after: pd.DataFrame
) -> PatchResult:
    t = pd.DataFrame(
        {
            "boundary": before["boundary"],
            "kind": before["kind"],
            "identical_before": before["identical"],
            "identical_after": after["identical"].values,
            "max_abs_after": after["max_abs"].values,
        }
    )
    bnames = t["boundary"].to_numpy()
    pos = {n: int(np.flatnonzero(bnames == n)[0]) for n in names}
    # a boundary that already matched is patched with its own bytes: it is skipped (said so)
    skipped = [n for n in names if _tri(t["identical_before"].iloc[pos[n]]) is True]
    active = {n: i for n, i in pos.items() if n not in skipped}
    patched = t["boundary"].isin(names).to_numpy()
    # the patched ops' other outputs (attention's logsumexp, say) are not downstream of them
    sibling = t["boundary"].str.startswith(tuple(n + ":output" for n in names)).to_numpy()
    start = min((active or pos).values())
    t["after_patch"] = (np.arange(len(t)) > start) & ~sibling & ~patched
    label = ", ".join(names)
    t.attrs.update({"boundary": label, "request": request, "skipped": skipped})
    later = t[t["after_patch"] & t["identical_after"].notna()]
    still = later[~later["identical_after"].astype(bool)]
    first = None if still.empty else str(still["boundary"].iloc[0])
    note = (
        f" (skipped {len(skipped)} that already matched the source: {', '.join(skipped[:4])})"
        if skipped and active
        else ""
    )

    def no(reason: str) -> PatchResult:
        return PatchResult(False, label, request, first, reason + note, t)

    if not active:
        what = names[0] if len(names) == 1 else f"all {len(names)} boundaries"
        return no(f"{what} already matched the source before the patch: patching changes nothing")
    for n, i in active.items():
        if _tri(t["identical_before"].iloc[i]) is None:
            return no(f"{n} is not comparable between the two captures")
        if _tri(t["identical_after"].iloc[i]) is not True:
            return no(f"the patched boundary {n} still differs from the source")
    if later.empty:
        return no("no comparable boundary after the patch")
    if first is not None:
        return no(f"{len(still)} later boundaries still differ: another cause lies downstream")
    return PatchResult(True, label, request, None,
                       f"all {len(later)} comparable later boundaries now match the source" + note,
                       t)  # fmt: skip


__all__ = ["PatchResult", "patch_test"]
