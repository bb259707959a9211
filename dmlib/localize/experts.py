"""Expert internals judged per (expert, token): the rows an experts module gathers for
each expert, mapped back to tokens through the routing it was called with.

A transformers experts module (``Qwen3MoeExperts`` and the other classes decorated with
``use_experts_implementation``) is called as ``experts(hidden_states (T, d), top_k_index
(T, k), top_k_weights (T, k))``: its inputs carry the routing. With
``experts_implementation="eager"`` it runs, for each expert ``e`` hit, ``torch.where`` on
the ``(k, T)`` mask of ``top_k_index == e`` and gathers those tokens' rows, so row ``r`` of
expert ``e``'s computation is the ``r``-th ``(k, t)`` pair in row-major order of that
mask; that order follows from ``top_k_index`` alone. :func:`record_expert_rows` hooks the
experts modules and, through a ``TorchFunctionMode``, every ``F.linear`` run with a slice
of their 3-D ``gate_up_proj`` / ``down_proj`` weights (the expert is read from the slice's
storage offset), and keeps one SHA-256 digest per row of each output, keyed by
``(module, call, expert, token, stage)``. :func:`compare_expert_rows` judges run A's row
of ``(e, t)`` against run B's row of the same ``(e, t)``.

Not judged, with the reason: a module run by another implementation (``grouped_mm``
gathers the ``(token, k)`` pairs in the order of ``torch.sort(top_k_index.flatten())``,
which is not stable, so the rows within an expert follow no order the routing fixes, and
no per-expert ``F.linear`` is run; ``batched_mm`` likewise runs no per-expert op), and
an ``(e, t)`` pair routed in one run only (a routing flip, reported by
:mod:`dmlib.localize.routing`). This record is kept in memory; it is not written into a
capture folder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dmlib.hashing import SHA256
from dmlib.localize.capture.digests import digest_hex
from dmlib.localize.capture.tensors import _to_numpy

try:
    import torch
    from torch.overrides import TorchFunctionMode
except ImportError:  # pragma: no cover - the record needs torch
    torch = None  # type: ignore[assignment]
    TorchFunctionMode = object  # type: ignore[assignment,misc]

#: the 3-D per-expert weights of a transformers experts module, in the order they run
STAGES = ("gate_up_proj", "down_proj")

#: why a module run by a non-eager implementation is not judged per expert
NOT_EAGER = (
    "experts_implementation {impl!r}: no per-expert op to read; grouped_mm orders the "
    "gathered (token, k) pairs by torch.sort(top_k_index.flatten()), not stable, so the "
    "rows within an expert follow no order the routing fixes"
)

Key = tuple[str, int, int, int, str]


@dataclass
class ExpertRows:
    """Per-row digests ``(module, call, expert, token, stage) -> sha256 hex`` and the
    experts modules not judged, ``{module: reason}``."""

    rows: dict[Key, str] = field(default_factory=dict)
    not_judged: dict[str, str] = field(default_factory=dict)


def experts_modules(model: Any) -> list[tuple[str, Any]]:
    """The modules holding 3-D ``gate_up_proj`` and ``down_proj`` weights, one slice per expert."""
    found = []
    for name, mod in model.named_modules():
        ws = [getattr(mod, s, None) for s in STAGES]
        if all(torch.is_tensor(w) and w.dim() == 3 for w in ws):
            found.append((name, mod))
    return found


def gathered_tokens(top_k_index: Any, expert: int) -> list[int]:
    """The tokens of expert ``expert``'s gathered rows, in the eager implementation's order
    (row-major over the ``(k, T)`` mask of ``top_k_index == expert``)."""
    mask = (top_k_index == expert).T
    return [int(t) for t in torch.where(mask)[1]]


class _Active:
    def __init__(self, name: str, mod: Any, call: int, index: Any) -> None:
        self.name, self.mod, self.call, self.index = name, mod, call, index
        self.kept = 0


class _Mode(TorchFunctionMode):
    def __init__(self, out: ExpertRows) -> None:
        super().__init__()
        self.out = out
        self.active: list[_Active] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        a = self.active[-1] if self.active else None
        if (
            func is torch.nn.functional.linear
            and a
            and a.name not in self.out.not_judged
            and len(args) >= 2
        ):
            with torch._C.DisableTorchFunction():
                self._keep(a, args[1], result)
        return result

    def _keep(self, a: _Active, weight: Any, result: Any) -> None:
        for stage in STAGES:
            whole = getattr(a.mod, stage)
            if (
                weight.dim() != 2
                or weight.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
            ):
                continue
            e, rest = divmod(weight.storage_offset() - whole.storage_offset(), whole.stride(0))
            if rest or not 0 <= e < whole.shape[0]:
                continue
            tokens = gathered_tokens(a.index, e)
            if len(tokens) != result.shape[0]:
                self.out.not_judged[a.name] = (
                    f"expert {e}: {result.shape[0]} rows computed for {len(tokens)} routed tokens"
                )
                return
            arr = _to_numpy(result)  # one copy to the host; a SHA-256 per row of its bytes
            for r, t in enumerate(tokens):
                self.out.rows[(a.name, a.call, e, t, stage)] = digest_hex(arr[r], SHA256)
            a.kept += 1
            return


@contextlib.contextmanager
def record_expert_rows(model: Any) -> Iterator[ExpertRows]:
    """Record the per-(expert, token) rows of every experts module run inside the block."""
    out = ExpertRows()
    mode = _Mode(out)
    calls: dict[str, int] = {}
    handles = []
    for name, mod in experts_modules(model):
        handles.append(mod.register_forward_pre_hook(_pre(mode, calls, name), with_kwargs=True))
        handles.append(mod.register_forward_hook(_post(mode)))
    try:
        with mode:
            yield out
    finally:
        for h in handles:
            h.remove()


def _post(mode: _Mode) -> Any:
    def hook(*_: Any) -> None:
        if not mode.active:
            return
        a = mode.active.pop()
        if a.kept == 0 and a.name not in mode.out.not_judged and a.index is not None:
            if bool((a.index < a.mod.gate_up_proj.shape[0]).any()):
                mode.out.not_judged[a.name] = (
                    "no per-expert F.linear on a slice of its weights was seen"
                )

    return hook


def _pre(mode: _Mode, calls: dict[str, int], name: str) -> Any:
    def hook(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call = calls.get(name, 0)
        calls[name] = call + 1
        impl = getattr(getattr(mod, "config", None), "_experts_implementation", None) or "eager"
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if impl != "eager" or not torch.is_tensor(index):
            mode.out.not_judged[name] = (
                NOT_EAGER.format(impl=impl)
                if impl != "eager"
                else "top_k_index not among the inputs"
            )
        mode.active.append(
            _Active(name, mod, call, index.detach() if torch.is_tensor(index) else None)
        )

    return hook


def compare_expert_rows(
    a: ExpertRows, b: ExpertRows, tokens: dict[int, int] | None = None
) -> dict[str, Any]:
    """Judge each ``(module, call, expert, token, stage)`` row of A against B's.

    ``tokens`` maps A's flat token index (batch x positions, as the experts module sees
    them) to B's, for one request alone in A and packed or padded in B; then only A's
    tokens in it and B's tokens it maps to are judged, keyed by A's index. Without it the
    same index is paired. Returns ``{"differ": [keys], "identical": n, "one_side": [keys],
    "not_judged": {module: reason}}``; a key of one run only is a token routed to that
    expert in one run (not judged, never counted identical). Modules not judged in
    either run are listed and their rows left out of the counts."""
    skip = {**a.not_judged, **b.not_judged}
    pair = tokens if tokens is not None else {k[3]: k[3] for k in (*a.rows, *b.rows)}
    back = {tb: ta for ta, tb in pair.items()}
    ra = {k: v for k, v in a.rows.items() if k[0] not in skip and k[3] in pair}
    rb = {
        (*k[:3], back[k[3]], k[4]): v
        for k, v in b.rows.items()
        if k[0] not in skip and k[3] in back
    }
    both = ra.keys() & rb.keys()
    differ = sorted(k for k in both if ra[k] != rb[k])
    return {
        "differ": differ,
        "identical": len(both) - len(differ),
        "one_side": sorted(ra.keys() ^ rb.keys()),
        "not_judged": dict(sorted(skip.items())),
    }
