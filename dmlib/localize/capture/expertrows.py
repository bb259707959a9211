"""Each expert's rows of an experts module recorded as boundaries of kind ``expert``
(:data:`~dmlib.localize.capture.format.KINDS`), with ``capture(..., experts=True)``.

:func:`dmlib.localize.experts.record_expert_rows` keeps one SHA-256 digest per row of
each expert's ``gate_up_proj`` (``up_proj`` in an experts module without a gate) and
``down_proj`` computation, keyed by the token (the
index into the experts module's flattened ``hidden_states``); here those rows become one
boundary per (module, call, expert, stage), ``module:expert<e>.<stage>#call``, placed in
the manifest where its first row was computed (under the eager implementation, before the
activation's boundaries that follow it). Each token goes through the capture's row map to
(request, position), as a router's ``(tokens, k)`` output does: in the first pass the
tokens are the row map's rows; in a later pass (a decode step) one token per batch row,
that of the request filling the row alone, at the position after its prompt and the steps
before. The entry keeps, per request, ``[position, digest]`` of every token routed to the
expert (a padding token's rows are left out); its ``digest`` is the SHA-256 of the row
digests in the order the expert computed them, its ``dtype`` the stage weight's.

Not judged, with the reason written into the capture's ``not_captured`` (so a comparison
is never "identical" about them): an experts module that ``experts.py`` does not judge
(an ``experts_implementation`` it does not read row by row, a run that fails its checks:
that module's rows of the call are dropped, and of every call after), and a call whose
token count fits neither the row map nor its batch.

The experts modules themselves are hooked as any selected module is (their inputs, the
hidden rows and the routing, are what an expert row is judged against), unless the
capture's ``modules`` chose them already.

Every capture, with or without ``experts=True``, writes which modules are experts modules
(``localize/experts.py``'s detection, at the capture's start) into the manifest's
``coverage.experts_modules``: ``{module: {"calls": n, "routing": sha256 hex or null}}``,
the digest over every call's ``top_k_index`` (its dtype, shape and bytes, in call order;
null where a call's routing was not a tensor). A module called inside an experts module
(the eager implementation's activation, its n-th call the n-th expert hit) is judged by a
comparison only where both captures' calls provably line up (:mod:`dmlib.localize.expertjudge`):
one layout and, per call, the same expert rows' tokens or, without expert rows, the same
routing digest. Cost: one ``top_k_index`` (tokens x k integers) copied to the host and
hashed per experts module call.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlib.hashing import SHA256
from dmlib.localize.capture.digests import digest_hex
from dmlib.localize.capture.format import new_entry
from dmlib.localize.capture.tensors import _np_dtype, _select

if TYPE_CHECKING:
    from dmlib.localize.capture.recorder import Recorder


@contextlib.contextmanager
def recording(rec: Recorder, model: Any, named: dict[str, Any]) -> Iterator[None]:
    """Record every expert's rows of the forward passes run inside the block (its hooks
    come before the capture's module hooks, so that the rows precede the module's output)."""
    from dmlib.localize.experts import experts_modules, record_expert_rows

    mods = experts_modules(model)
    if not mods:
        yield
        return
    from dmlib.localize.capture.hooks import _post_hook, _pre_hook

    chosen = {n for n, _ in _select(model, rec.options.modules, named)}
    with record_expert_rows(model) as out:
        sink = _Rows(rec, out)
        out.rows = sink  # (each write lands in the capture)
        handles = []
        for name, mod in mods:
            handles.append(mod.register_forward_pre_hook(sink.pre(name), with_kwargs=True))
            handles.append(mod.register_forward_hook(sink.post(name)))
            if name not in chosen:
                label = name or rec.root
                handles.append(mod.register_forward_pre_hook(_pre_hook(rec, label),
                                                             with_kwargs=True))  # fmt: skip
                handles.append(mod.register_forward_hook(_post_hook(rec, label), with_kwargs=True))
        try:
            yield
            sink.reattribute(rec.metadata.get(PASS_ROWS))
        finally:
            for h in handles:
                h.remove()


#: the metadata key naming each pass's batch rows (``localize/positions.py``'s, written by
#: ``capture_generate`` at the end of its block, or given by the caller)
PASS_ROWS = "pass_rows"


#: the manifest's coverage key naming the experts modules (and each one's routing digest)
EXPERTS_MODULES = "experts_modules"


@contextlib.contextmanager
def routing_record(rec: Recorder, model: Any) -> Iterator[None]:
    """Write ``coverage.experts_modules`` (every capture): the experts modules and, per
    module, its calls' count and the SHA-256 of their ``top_k_index`` in call order."""
    from dmlib.localize.experts import experts_modules

    mods = experts_modules(model)
    seen: dict[str, dict[str, Any]] = {}
    rec.coverage[EXPERTS_MODULES] = seen
    if not mods:
        yield
        return
    hashes: dict[str, Any] = {}
    handles = []
    for name, mod in mods:
        label = name or rec.root
        seen[label] = {"calls": 0, "routing": None}
        hashes[label] = hashlib.sha256()
        handles.append(mod.register_forward_pre_hook(_routing_hook(seen[label], hashes, label),
                                                     with_kwargs=True))  # fmt: skip
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for label, got in seen.items():
            h = hashes[label]
            got["routing"] = None if h is None or not got["calls"] else h.hexdigest()


def _routing_hook(got: dict[str, Any], hashes: dict[str, Any], label: str) -> Callable[..., None]:
    def hook(mod: Any, args: Any, kwargs: Any) -> None:
        got["calls"] += 1
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        h = hashes[label]
        if h is None:
            return
        if not hasattr(index, "detach") or not hasattr(index, "shape"):
            hashes[label] = None  # a routing not read: the calls cannot be shown to line up
            return
        import torch

        from dmlib.localize.ops import quiet

        with quiet(), torch._C.DisableTorchFunction():
            arr = index.detach().cpu().contiguous().numpy()
        h.update(f"{arr.dtype.str}{list(arr.shape)};".encode("ascii"))
        h.update(arr.tobytes())

    return hook


class _Rows(dict):
    """Takes the digests ``record_expert_rows`` writes and, when the experts module's call
    ends, turns each expert's rows of each stage into one manifest entry, placed where the
    first of them was computed (dropped where the module turned out not judged)."""

    def __init__(self, rec: Recorder, out: Any) -> None:
        super().__init__()
        self.rec, self.out = rec, out
        # (module, call, expert, stage) -> (manifest index at its first row, tokens, digests)
        self.pending: dict[tuple[str, int, int, str], tuple[int, list[int], list[str]]] = {}
        self.n_tokens: dict[str, int] = {}  # module -> tokens of its current call
        self.mods: dict[str, Any] = {}
        self.noted: set[str] = set()
        # a decode pass's entries: (entry, pass, tokens, digests), for pass_rows to attribute
        self.decode: list[tuple[dict[str, Any], int, list[int], list[str]]] = []

    def __setitem__(self, key: Any, digest: str) -> None:
        name, call, e, token, stage = key
        group = self.pending.get((name, call, e, stage))
        if group is None:
            group = self.pending[(name, call, e, stage)] = (len(self.rec.boundaries), [], [])
        group[1].append(int(token))
        group[2].append(digest)

    def pre(self, name: str) -> Callable[..., None]:
        def hook(mod: Any, args: Any, kwargs: Any) -> None:
            self.flush()
            hidden = args[0] if args else kwargs.get("hidden_states")
            self.n_tokens[name] = int(hidden.shape[0]) if hasattr(hidden, "shape") else -1
            self.mods[name] = mod

        return hook

    def post(self, name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.flush()
            reason = self.out.not_judged.get(name)
            if reason is not None and name not in self.noted:
                self.noted.add(name)
                self.rec.note_unseen(f"{name}: expert rows", f"not judged: {reason}")

        return hook

    def flush(self) -> None:
        """The pending experts' rows as entries, each inserted where it was computed."""
        pending, self.pending = self.pending, {}
        shift = 0  # entries inserted before, in the order of their places
        for (name, call, e, stage), (at, tokens, digests) in sorted(
            pending.items(), key=lambda kv: kv[1][0]
        ):
            entry = self._entry(name, call, e, stage, tokens, digests)
            if entry is not None:
                self.rec.boundaries.insert(at + shift, entry)
                shift += 1

    def _entry(
        self, name: str, call: int, e: int, stage: str, tokens: list[int], digests: list[str]
    ) -> dict[str, Any] | None:
        if name in self.out.not_judged:
            return None
        where = _positions(self.rec, self.n_tokens.get(name, -1))
        if isinstance(where, str):
            key = f"{name}: expert rows#{call}"
            if key not in self.noted:
                self.noted.add(key)
                self.rec.note_unseen(key, f"not judged: {where}")
            return None
        weight = getattr(self.mods[name], stage)
        rows: dict[str, list[list[Any]]] = {}
        for t, dg in zip(tokens, digests, strict=True):
            got = where(t)
            if got is not None:
                rows.setdefault(got[0], []).append([got[1], dg])
        extra = {"expert": {"index": e, "stage": stage,
                            "rows": {r: sorted(v) for r, v in rows.items()}}}  # fmt: skip
        entry = new_entry(name, call, "output", f"expert{e}.{stage}",
                          _np_dtype(weight.dtype).name, (len(tokens), int(weight.shape[1])),
                          SHA256, extra, self.rec.step)  # fmt: skip
        if self.rec.step > 0:
            self.decode.append((entry, self.rec.step, tokens, digests))
        joined = np.frombuffer("".join(digests).encode("ascii"), dtype=np.uint8)
        entry["digest"] = digest_hex(joined, SHA256)
        return entry

    def reattribute(self, table: Any) -> None:
        """A decode pass's rows attributed by ``pass_rows`` where it names that pass: batch
        row ``b``'s token to the ``[request, position]`` the table gives it, none where it
        gives None (a row after its request's end, which ``generate()`` still computes)
        or several columns; the row map's rule (the position after the prompt and the
        passes before) stays for the passes it does not name."""
        if not isinstance(table, dict):
            return
        for entry, step, tokens, digests in self.decode:
            cells = table.get(str(step))
            if not isinstance(cells, list):
                continue
            rows: dict[str, list[list[Any]]] = {}
            for t, dg in zip(tokens, digests, strict=True):
                cell = cells[t] if 0 <= t < len(cells) else None
                if isinstance(cell, (list, tuple)) and len(cell) == 2 and isinstance(cell[1], int):
                    rows.setdefault(str(cell[0]), []).append([int(cell[1]), dg])
            entry["expert"]["rows"] = {r: sorted(v) for r, v in rows.items()}


def _positions(rec: Recorder, n: int) -> Callable[[int], tuple[str, int] | None] | str:
    """token -> (request, position) or None (padding) for a call that saw ``n`` tokens, or
    why its tokens cannot be attributed."""
    rm = rec.row_map
    if rm is None:
        return "the capture has no row map: an expert's rows cannot be attributed to tokens"
    if rec.step == 0 and n == len(rm):
        entries = rm.entries
        return lambda t: entries[t]
    batch = rm.batch or (rec.layout[0] if rec.layout else None)
    if rec.step > 0 and batch and n == batch:
        owner: dict[int, tuple[str, int]] = {}
        for r, idx in rm.requests.items():
            row, _ = rm.sequence_row(r, batch)
            if row is not None:
                owner[row] = (str(r), len(idx) + rec.step - 1)
        return owner.get
    return (
        f"the experts module saw {n} tokens in pass {rec.step}; the row map has {len(rm)} "
        f"rows (batch {batch})"
    )


__all__ = ["EXPERTS_MODULES", "recording", "routing_record"]
