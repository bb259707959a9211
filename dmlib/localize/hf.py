"""Row maps of Hugging Face batches, and ``generate()`` captured whole.

:func:`row_map_from_attention_mask` reads a padded batch (left or right padding) and
:func:`row_map_packed` a packed one (``position_ids`` restarting at 0, or ``cu_seqlens``)
into the nested row map :func:`dmlib.capture` takes: one list per batch row, one entry
``(request_id, position)`` or ``None`` (padding) per position.

:func:`capture_generate` runs ``model.generate(...)`` under :func:`dmlib.capture`: every
forward pass (the prompt, then one per generated token) is recorded and numbered
(``step``), and the tokens chosen for each request are stored in the manifest.
:func:`compare_generations` compares two such captures: per request, both completions,
the first step at which the chosen tokens part and, for that step's forward pass (the
one that chose the token), its first divergent boundary and culprit.

Nothing here imports torch or transformers at module level; masks and ids may be torch
tensors, numpy arrays or nested lists.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from dmlib.errors import CaptureError
from dmlib.localize.capture.options import CaptureOptions

RowEntries = list[list[tuple[Any, int] | None]]


def _array(x: Any, what: str) -> np.ndarray:
    """A 2-d integer numpy array of ``x`` (a tensor, an array or nested lists)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise CaptureError(f"{what} has shape {list(a.shape)}; expected (batch, positions)")
    return a


def _ids(request_ids: Sequence[Any] | None, n: int, what: str) -> list[Any]:
    ids = list(range(n)) if request_ids is None else list(request_ids)
    if len(ids) != n:
        raise CaptureError(f"{len(ids)} request ids for {n} {what}")
    if len({str(i) for i in ids}) != len(ids):
        raise CaptureError(f"request ids repeat: {ids}")
    return ids


def row_map_from_attention_mask(
    attention_mask: Any, request_ids: Sequence[Any] | None = None
) -> RowEntries:
    """The row map of a padded batch: one request per batch row, padding where the mask is 0.

    Works for left and right padding alike (and any other placement of the zeros): the
    request's positions are counted over the mask's ones, in order. ``request_ids``
    names the batch rows' requests (default ``0, 1, ...``).
    """
    mask = _array(attention_mask, "attention_mask") != 0
    ids = _ids(request_ids, mask.shape[0], "batch rows")
    out: RowEntries = []
    for rid, row in zip(ids, mask, strict=True):
        pos = np.cumsum(row) - 1
        out.append([(rid, int(p)) if on else None for on, p in zip(row, pos, strict=True)])
    return out


def row_map_packed(
    *,
    position_ids: Any = None,
    cu_seqlens: Any = None,
    request_ids: Sequence[Any] | None = None,
    length: int | None = None,
) -> RowEntries:
    """The row map of a packed batch: several requests one after another in a row.

    Give ``position_ids`` (batch, positions) that restart at 0 where a request begins
    (a row's trailing positions after the last request may be padding only when
    ``attention_mask`` says so; here every position belongs to a request), or
    ``cu_seqlens`` (cumulative lengths ``[0, n1, n1+n2, ...]`` of one packed row;
    positions from the last offset to ``length`` are padding). Requests are numbered in
    order of appearance unless ``request_ids`` names them.
    """
    if (position_ids is None) == (cu_seqlens is None):
        raise CaptureError("row_map_packed needs exactly one of position_ids and cu_seqlens")
    if cu_seqlens is not None:
        cu = np.asarray(cu_seqlens.detach().cpu() if hasattr(cu_seqlens, "detach") else cu_seqlens)
        cu = cu.astype(np.int64).reshape(-1)
        if len(cu) < 2 or cu[0] != 0 or np.any(np.diff(cu) <= 0):
            raise CaptureError(
                f"cu_seqlens {cu.tolist()[:8]}: expected 0 then strictly increasing offsets"
            )
        total = int(cu[-1]) if length is None else int(length)
        if total < cu[-1]:
            raise CaptureError(f"length {total} is shorter than cu_seqlens' last offset {cu[-1]}")
        ids = _ids(request_ids, len(cu) - 1, "packed requests")
        row: list[tuple[Any, int] | None] = [None] * total
        for k, rid in enumerate(ids):
            for p in range(int(cu[k]), int(cu[k + 1])):
                row[p] = (rid, p - int(cu[k]))
        return [row]
    pos = _array(position_ids, "position_ids").astype(np.int64)
    starts = [(b, j) for b in range(pos.shape[0]) for j in range(pos.shape[1]) if pos[b, j] == 0]
    if any(pos[b, 0] != 0 for b in range(pos.shape[0])):
        raise CaptureError("position_ids of a packed batch must start every row at 0")
    ids = _ids(request_ids, len(starts), "packed requests (positions restarting at 0)")
    out: RowEntries = []
    k = -1
    for b in range(pos.shape[0]):
        entries: list[tuple[Any, int] | None] = []
        for j in range(pos.shape[1]):
            if pos[b, j] == 0:
                k += 1
            elif pos[b, j] != pos[b, j - 1] + 1:
                raise CaptureError(
                    f"position_ids row {b} jumps from {pos[b, j - 1]} to {pos[b, j]} at {j}; "
                    "expected each request's positions to count up from 0"
                )
            entries.append((ids[k], int(pos[b, j])))
        out.append(entries)
    return out


def _row_owners(row_map: RowEntries) -> list[Any]:
    """The request filling each batch row alone (None where a row holds several or none)."""
    owners = []
    for row in row_map:
        ids = {str(e[0]) for e in row if e is not None}
        owners.append(next(iter(ids)) if len(ids) == 1 else None)
    return owners


def capture_generate(
    model: Any,
    path: str | os.PathLike[str],
    *,
    row_map: RowEntries,
    generate_kwargs: dict[str, Any],
    options: CaptureOptions | None = None,
    **capture_kwargs: Any,
) -> Any:
    """``model.generate(**generate_kwargs)`` under :func:`dmlib.capture`; returns its output.

    ``row_map`` is the nested row map of the prompt batch (one list per batch row, as
    :func:`row_map_from_attention_mask` gives). Every forward pass is captured (its
    boundaries carry ``step``): a pass is a forward of the module ``generate()`` runs,
    which for a wrapper is not the wrapper's own (a PEFT model's ``generate()`` runs its
    base model's forward, ``base_model.model``; a ``torch.compile`` wrapper's, the
    original module's); where ``generate()`` made more tokens per row than the passes
    seen (its forward ran in a module that is neither the model nor a submodule with a
    ``generate`` method), :class:`CaptureError` is raised and the capture is left
    incomplete rather than numbered wrong. The manifest's metadata gains ``generate``: the
    prompt length and, per request filling a batch row alone, the token ids it generated and
    (``lengths``, where generate()'s stopping criteria were seen) how many of them its
    sequence holds: up to the token generate() ended it on (a stop string, an
    end-of-sequence id, a criterion of one's own; the tokens after it are padding or what
    generate() went on computing for the row). ``pass_rows`` names each pass's batch
    rows (:func:`_pass_rows`).
    ``options`` and ``capture_kwargs``: the capture's settings, as :func:`dmlib.capture`
    takes them (a :class:`~dmlib.localize.capture.options.CaptureOptions`, keywords).
    ``backward=True`` is refused: ``generate()`` runs without gradients (there is no
    backward to record).
    """
    from dmlib.localize.capture import capture

    wants = capture_kwargs.get("backward", options.backward if options is not None else False)
    if wants:
        raise CaptureError("capture_generate records no backward: generate() runs without "
                           "gradients (capture a forward pass with dmlib.capture and "
                           "rec.backward instead)", path=path)  # fmt: skip
    rows = [list(r) for r in row_map]
    if not rows or not all(isinstance(r, list) for r in rows):
        raise CaptureError("capture_generate needs a nested row map (one list per batch row)")
    kw = dict(generate_kwargs)
    kw.setdefault("return_dict_in_generate", False)
    with (
        capture(model, path, options, row_map=rows, **capture_kwargs) as rec,
        _Stops(model, rec) as stops,
    ):
        out = model.generate(**kw)
        seqs = out if hasattr(out, "shape") else out.sequences
        seq = _array(seqs, "generate() output")
        prompt = len(rows[0])
        tokens = {
            str(o): [int(t) for t in seq[b, prompt:]]
            for b, o in enumerate(_row_owners(rows))
            if o is not None
        }
        rec.metadata["generate"] = {"prompt_positions": prompt, "tokens": tokens,
                                    "passes": rec.step + 1}  # fmt: skip
        ends, passes = _ends(model, kw), rec.step + 1
        _check_passes(seq, prompt, passes, ends[1] == 1 and len(seq) == len(rows), path)
        ended = stops.ended(len(rows)) if stops.observed else None
        done = None if ended is None else [passes if e is None else e + 2 for e in ended]
        if done is None and not ends[2]:  # no observation: the end-of-sequence ids alone
            done = _eos_done(seq, len(rows[0]), passes, ends[0])
        if ended is not None and len(seq) == len(rows) and ends[1] == 1:
            rec.metadata["generate"]["lengths"] = {
                str(o): len(tokens[str(o)]) if e is None else min(e + 1, len(tokens[str(o)]))
                for o, e in zip(_row_owners(rows), ended, strict=True)
                if o is not None
            }
        rec.metadata["pass_rows"] = _pass_rows(rows, seq, passes, done, ends[1])
    return out


def _check_passes(seq: np.ndarray, prompt: int, passes: int, one_per_pass: bool, path: Any) -> None:
    """Raise where ``generate()`` chose more tokens per row than the capture counted passes
    (one token per pass: not beam search, assisted decoding or several sequences per
    prompt): its forward ran in a module whose calls were not numbered."""
    made = seq.shape[1] - prompt
    if one_per_pass and made > passes:
        raise CaptureError(
            f"generate() chose {made} tokens per row but the capture saw {passes} forward "
            "pass(es) of the model: its forward ran in a module that is neither the model "
            "nor a submodule with a generate() method; capture that module instead",
            path=path,
        )


#: generate() arguments under which a decode pass computes several positions of a row
#: (assisted / speculative decoding): capture_generate names no decode row then
_SEVERAL = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")

#: generate() arguments that end a sequence other than by an end-of-sequence id
_STOPS = ("stop_strings", "stopping_criteria", "max_time")


def _ends(model: Any, kw: dict[str, Any]) -> tuple[set[int], int, bool]:
    """The token ids that finish a sequence in this ``generate()`` call, its beams (or
    sequences per pass, where a pass computes several positions of a row: not the prompt
    batch's rows), and whether anything else may end a sequence (stop strings, criteria)."""
    cfg = kw.get("generation_config") or getattr(model, "generation_config", None)
    eos: Any = kw.get("eos_token_id", getattr(cfg, "eos_token_id", None))
    beams = int(kw.get("num_beams") or getattr(cfg, "num_beams", 1) or 1)
    if any(kw.get(k) is not None for k in _SEVERAL):
        beams = max(beams, 2)  # (the one-position-per-pass rule does not hold)
    if eos is not None and hasattr(eos, "tolist"):
        eos = eos.tolist()
    ids = [] if eos is None else eos if isinstance(eos, (list, tuple)) else [eos]
    other = any(kw.get(k) for k in _STOPS) or bool(getattr(cfg, "stop_strings", None))
    return {int(e) for e in ids}, beams, other


def _eos_done(seq: np.ndarray, prompt: int, passes: int, eos: set[int]) -> list[int]:
    """Per row: the first pass feeding a token after its end-of-sequence token."""
    done = []
    for b in range(len(seq)):
        gen = [int(t) for t in seq[b, prompt:]]
        end = next((i for i, t in enumerate(gen) if t in eos), None)
        done.append(passes if end is None else end + 2)
    return done


class _Stops:
    """Which batch rows ``generate()``'s own stopping criteria ended, and after which pass.

    Every instance in the model whose class builds generate()'s criteria
    (``_get_stopping_criteria``: transformers' models, the one a PEFT wrapper runs) hands
    back its list wrapped, so that each call (after the pass that chose a token) is seen
    with the pass's number and the rows it found done: EOS ids, ``max_length``, stop
    strings and any custom criterion alike, as generate() itself decides. ``observed``:
    whether generate() built its criteria through one of them (else nothing is known)."""

    def __init__(self, model: Any, rec: Any) -> None:
        self.rec, self.seen, self.observed = rec, cast(list[tuple[int, list[bool]]], []), False
        self.mods = [m for m in _modules(model) if hasattr(type(m), "_get_stopping_criteria")]
        self.saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> _Stops:
        for m in self.mods:
            self.saved.append((m, m.__dict__.get("_get_stopping_criteria")))
            m._get_stopping_criteria = self._wrap(m._get_stopping_criteria)
        return self

    def __exit__(self, *exc: object) -> None:
        for m, old in reversed(self.saved):
            if old is None:
                del m._get_stopping_criteria
            else:
                m._get_stopping_criteria = old

    def _wrap(self, build: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            criteria = build(*args, **kwargs)
            self.observed = True
            seen, rec = self.seen, self.rec

            class Observed(type(criteria)):  # type: ignore[misc]
                def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                    done = super().__call__(input_ids, scores, **kw)
                    seen.append((rec.step, [bool(x) for x in done.tolist()]))
                    return done

            return Observed(criteria)

        return wrapped

    def ended(self, rows: int) -> list[int | None] | None:
        """Per batch row: the pass whose chosen token a criterion ended its sequence on
        (None where none did); None where a call saw another number of rows."""
        ended: list[int | None] = [None] * rows
        for step, flags in self.seen:
            if len(flags) != rows:
                return None
            for b, hit in enumerate(flags):
                if hit and ended[b] is None:
                    ended[b] = step
        return ended


def _modules(model: Any) -> list[Any]:
    """``model`` and its submodules (``modules()`` where it has one)."""
    return list(model.modules()) if hasattr(model, "modules") else [model]


def _pass_rows(
    rows: RowEntries, seq: np.ndarray, passes: int, done: list[int] | None, beams: int = 1
) -> dict[str, list[list[Any] | None]]:
    """``pass_rows`` of a ``generate()`` run: per pass, [request, position] or None per batch
    row. The prefill's entry is the row's last prompt column (what a one-column tensor of
    it holds); decode pass ``s`` feeds the token chosen by pass ``s - 1``, so the request
    filling row ``b`` alone, with ``P_b`` prompt positions (padding not counted), computes
    position ``P_b + s - 1``. A row is None where several requests or none fill it, and
    after its sequence ended: from pass ``done[b]`` on, the first feeding a token after
    the one generate()'s stopping criteria ended it on (``generate()`` still computes such
    rows). Where the decode batch is not the prompt's rows (beam search, several sequences
    per prompt, several positions per pass) or where the ends are not known (``done``
    None) no decode row is named, so those positions are listed as not captured rather
    than paired by guess."""
    owners = _row_owners(rows)
    table: dict[str, list[list[Any] | None]] = {
        "0": [
            None if not r or r[-1] is None or o is None else [o, int(r[-1][1])]
            for r, o in zip(rows, owners, strict=True)
        ]
    }
    if len(seq) != len(rows) or beams > 1 or done is None:  # not the prompt batch's rows
        return {**table, **{str(s): [None] * len(seq) for s in range(1, passes)}}
    for s in range(1, passes):
        table[str(s)] = [
            [o, 1 + max(e[1] for e in r if e is not None) + s - 1]
            if o is not None and s < done[b]
            else None
            for b, (r, o) in enumerate(zip(rows, owners, strict=True))
        ]
    return table


def compare_generations(
    a: Any, b: Any, *, request: Any = None, **compare_kwargs: Any
) -> dict[str, Any]:
    """Two :func:`capture_generate` captures: where do the chosen tokens first part?

    Returns ``{"requests": {id: {"tokens_a", "tokens_b", "first_parting_step",
    "first_divergent_boundary", "culprit"}}, "steps": [...], "table": DataFrame}``:
    ``first_parting_step`` is the index of the first generated token that differs (None
    where one completion is a prefix of the other); the boundary and culprit are those
    of that step's forward pass (the pass that chose it). ``steps`` lists each forward
    pass's first divergent boundary (:func:`dmlib.compare_captures`' ``attrs["steps"]``).
    """
    from dmlib.localize.boundaries import compare_captures
    from dmlib.localize.capture.format import request_key
    from dmlib.localize.capture.reader import open_capture

    ca, cb = open_capture(a), open_capture(b)
    for c in (ca, cb):
        if not c.metadata.get("generate"):
            raise CaptureError("not a capture_generate capture (no generate metadata)", path=c.path)
    ga: dict[str, Any] = ca.metadata["generate"]
    gb: dict[str, Any] = cb.metadata["generate"]
    wanted = [request_key(request)] if request is not None else None
    common = sorted(set(ga["tokens"]) & set(gb["tokens"]))
    keys = [k for k in common if wanted is None or k in wanted]
    if wanted and not keys:
        raise CaptureError(f"request {request!r} generated no tokens alone in a batch row",
                           path=ca.path)  # fmt: skip
    out: dict[str, Any] = {"requests": {}, "steps": None, "table": None}
    for k in keys:
        df = compare_captures(ca, cb, request=k, **compare_kwargs)
        ta, tb = ga["tokens"][k], gb["tokens"][k]
        part = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
        step = None
        if part is not None and df.attrs["steps"] is not None:
            step = next((s for s in df.attrs["steps"] if s["step"] == part), None)
        out["requests"][k] = {
            "tokens_a": ta, "tokens_b": tb, "first_parting_step": part,
            "first_divergent_boundary": None if step is None else step["first_divergent_boundary"],
            "culprit": None if step is None else step["culprit"],
        }  # fmt: skip
        out["steps"], out["table"] = df.attrs["steps"], df
    return out


__all__ = [
    "capture_generate", "compare_generations", "row_map_from_attention_mask", "row_map_packed",
]  # fmt: skip
