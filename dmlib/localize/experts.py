"""Expert internals judged per (expert, token): the rows an experts module computes for
each expert, mapped back to tokens through the routing it was called with.

A transformers experts module (``Qwen3MoeExperts``, ``MixtralExperts``, ``OlmoeExperts``,
``Qwen3NextExperts``, ``DeepseekV3Experts``, ``JambaExperts``, ``GptOssExperts``,
``NemotronHExperts`` and the other classes decorated with ``use_experts_implementation``)
holds 3-D per-expert weights, one slice per expert, and is called as
``experts(hidden_states (T, d), top_k_index (T, k), top_k_weights (T, k))``: its inputs
carry the routing. The layouts the decorator knows are all read: gated (``STAGES``: a
``gate_up_proj`` whose output is split into gate and up, concatenated or, GPT-OSS,
interleaved) or not (``UNGATED_STAGES``, ``has_gate=False``: an ``up_proj`` followed by the
activation alone, Nemotron-H), stored ``(E, out, in)`` or transposed ``(E, in, out)``
(``is_transposed``: GPT-OSS, Aria, Ergo), with or without biases. :func:`record_expert_rows`
hooks these modules and, through a ``TorchFunctionMode``, keeps one SHA-256 digest per
row of each expert's two matmuls (the first stage's output before its bias and the gate or
activation, the ``down_proj`` output before its bias, any post-expert norm and the routing
weight), keyed ``(module, call, expert, token, stage)`` with ``token`` the index into the
module's ``hidden_states`` rows (batch x positions, flattened). Which token a row belongs
to is read from what the module ran, never assumed, under each
``config._experts_implementation``:

- ``eager``: per expert ``e`` hit, ``torch.where`` over the ``(k, T)`` mask of
  ``top_k_index == e`` gathers the tokens, then ``F.linear(x, w[e])`` or, transposed,
  ``x @ w[e]`` on a slice of the 3-D weight (the expert is read from the slice's storage
  offset); row ``r`` is the ``r``-th pair of that mask in row-major order, a function of
  ``top_k_index`` alone; checked: the first stage's input rows equal ``hidden_states`` of
  those tokens (a forward that gathers in another order, such as Ergo's per-route rows
  with ``k > 1``, fails it and is not judged).
- ``grouped_mm``: the flattened ``(token, slot)`` pairs are ordered by
  ``torch.sort(top_k_index.reshape(-1))``, which is not stable (on CPU, torch 2.13, it
  returned equal expert ids out of pair order in every tiny model tried), so the
  permutation the sort returned is recorded as it runs (``torch.sort`` / ``argsort`` of
  that tensor inside the module's call), and row ``i`` of each grouped matmul
  (``torch._grouped_mm``, which ``F.grouped_mm`` calls and which runs on CPU here, or
  transformers' own ``grouped_mm_fallback`` op where neither can be used) is pair
  ``perm[i]``: token ``perm[i] // k``, expert ``top_k_index.reshape(-1)[perm[i]]``.
  Checked before any row is kept: the matmul's groups (its ``offs``) hold exactly those
  experts in that order, and the first matmul's input rows equal
  ``hidden_states[perm // k]``; the gate between the two keeps the row order and the
  second matmul must have the same groups.
- ``batched_mm``: ``gate_up_proj[expert_ids]`` / ``down_proj[expert_ids]`` gathered with
  ``expert_ids = top_k_index.reshape(-1)`` (recorded as they are indexed), then one
  ``torch.bmm`` over all ``T*k`` pairs in flattened order: row ``s`` is token ``s // k``,
  expert ``expert_ids[s]``; checked: the gather's ids equal ``top_k_index.reshape(-1)``
  and the first bmm's input rows equal ``hidden_states.repeat_interleave(k)``.

So the same forward gives the same keys under the three implementations (the values may
differ in their last bits: different kernels). :func:`compare_expert_rows` judges run A's
row of ``(e, t)`` against run B's row of the same ``(e, t)``, or of the token a map names
(a request alone against it packed in a batch).

Not judged, with the reason in ``ExpertRows.not_judged``: a module run by any other
implementation (``deepgemm``, ``sonicmoe``: their kernels are not read row by row), one
whose observed run fails a check above (the rows are then not mapped to tokens), a
token routed twice to one expert, and an ``(e, t)`` pair routed in one run only (listed
apart by the comparison: a routing flip, reported by :mod:`dmlib.localize.routing`).
An eager forward whose matmul runs on a copy of the expert's weight slice
(``w[e].float()`` of a bfloat16 module: OpenAI's privacy filter) shows no matmul on a slice
of the weights and is not judged, said so. A shared expert (Qwen3-Next's
``shared_expert``, DeepSeek-style ``shared_experts``) is an ordinary MLP of 2-D
``nn.Linear`` layers that sees every token: it is not an experts module here, and is
judged per token by the capture's module boundaries like any MLP. The record itself is
kept in memory.
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

#: the 3-D per-expert weights of a gated experts module (``has_gate=True``), in the order
#: they run: the row of ``gate_up_proj`` is taken before the gate, that of ``down_proj``
#: before the routing weight (and, with biases, each before its bias)
STAGES = ("gate_up_proj", "down_proj")

#: those of an experts module without a gate (``has_gate=False``: ``up_proj``, the
#: activation alone, then ``down_proj``), in the order they run
UNGATED_STAGES = ("up_proj", "down_proj")

#: the experts implementations whose rows are mapped to tokens
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")

#: why a module run by another implementation is not judged per expert
UNSUPPORTED = (
    "experts_implementation {impl!r}: its kernels are not read row by row (rows are "
    "judged under " + ", ".join(IMPLEMENTATIONS) + ")"
)

Key = tuple[str, int, int, int, str]


@dataclass
class ExpertRows:
    """Per-row digests ``(module, call, expert, token, stage) -> sha256 hex`` and the
    experts modules not judged, ``{module: reason}``."""

    rows: dict[Key, str] = field(default_factory=dict)
    not_judged: dict[str, str] = field(default_factory=dict)


def stages_of(mod: Any) -> tuple[str, str] | None:
    """The stages an experts module runs (:data:`STAGES` where it holds a 3-D
    ``gate_up_proj``, else :data:`UNGATED_STAGES` where it holds a 3-D ``up_proj``), or
    None where it is no experts module (no 3-D ``down_proj`` beside them)."""
    for stages in (STAGES, UNGATED_STAGES):
        ws = [getattr(mod, s, None) for s in stages]
        if all(torch.is_tensor(w) and w.dim() == 3 for w in ws):
            return stages
    return None


def experts_modules(model: Any) -> list[tuple[str, Any]]:
    """The modules holding 3-D ``gate_up_proj`` (or ``up_proj``) and ``down_proj`` weights,
    one slice per expert."""
    return [(name, mod) for name, mod in model.named_modules() if stages_of(mod) is not None]


def gathered_tokens(top_k_index: Any, expert: int) -> list[int]:
    """The tokens of expert ``expert``'s gathered rows, in the eager implementation's order
    (row-major over the ``(k, T)`` mask of ``top_k_index == expert``)."""
    mask = (top_k_index == expert).T
    return [int(t) for t in torch.where(mask)[1]]


class _Active:
    """One call of an experts module: its routing and what was seen of its run so far."""

    def __init__(self, name: str, mod: Any, call: int, impl: str, hidden: Any, index: Any):
        self.name, self.mod, self.call, self.impl = name, mod, call, impl
        self.order: tuple[str, ...] = stages_of(mod) or STAGES  # the stages it runs, in order
        self.hidden, self.index = hidden, index
        self.kept = 0
        self.stages: list[str] = []  # grouped / batched: the stages recorded, in order
        self.perm: Any = None  # grouped_mm: the permutation the sort returned
        self.offs: Any = None  # grouped_mm: the first matmul's group ends
        self.gathers: dict[int, tuple[str, Any, Any]] = {}  # batched_mm: id -> (stage, w, ids)


#: eager's per-expert matmuls: ``F.linear(x, w[e])`` (weights stored (E, out, in)) and
#: ``x @ w[e]`` (stored transposed, (E, in, out): GPT-OSS, Aria, Ergo)
def _eager_ops() -> set[Any]:
    return {torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def _matmul_ops() -> tuple[set[Any], set[Any], set[Any]]:
    """(sorts, grouped matmuls, tensor gathers) as the mode sees them."""
    sorts = {torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort}
    grouped: set[Any] = {f for f in (getattr(torch, "_grouped_mm", None),) if f is not None}
    if hasattr(torch.nn.functional, "grouped_mm"):  # a torch whose F.grouped_mm dispatches itself
        grouped.add(torch.nn.functional.grouped_mm)
    try:  # transformers' fallback op, registered when transformers.integrations.moe loads
        packet = torch.ops.transformers.grouped_mm_fallback
        grouped |= {packet, *(getattr(packet, o) for o in packet.overloads())}
    except (AttributeError, RuntimeError):
        pass
    return sorts, grouped, {torch.Tensor.__getitem__}


class _Mode(TorchFunctionMode):
    def __init__(self, out: ExpertRows) -> None:
        super().__init__()
        self.out = out
        self.active: list[_Active] = []
        self.sorts, self.grouped, self.gathers = _matmul_ops()
        self.eager = _eager_ops()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        a = self.active[-1] if self.active else None
        if a is None or a.name in self.out.not_judged or not args:
            return result
        with torch._C.DisableTorchFunction():
            if a.impl == "eager" and func in self.eager and len(args) >= 2:
                self._keep_eager(a, args[0], args[1], result)
            elif a.impl == "grouped_mm" and func in self.sorts:
                self._sorted(a, args[0], result)
            elif a.impl == "grouped_mm" and func in self.grouped and len(args) >= 2:
                self._keep_grouped(a, args, kwargs, result)
            elif a.impl == "batched_mm" and func in self.gathers and len(args) >= 2:
                self._gathered(a, args[0], args[1], result)
            elif a.impl == "batched_mm" and func is torch.bmm and len(args) >= 2:
                self._keep_batched(a, args, result)
        return result

    def _fail(self, a: _Active, reason: str) -> None:
        self.out.not_judged[a.name] = f"{a.impl}: {reason}"

    def _keep(self, a: _Active, stage: str, result: Any, keys: list[tuple[int, int, int]]):
        """Digest output rows ``r`` of ``keys = [(r, expert, token)]`` under ``stage``."""
        arr = _to_numpy(result.reshape(result.shape[0], -1))  # one host copy; a SHA-256 a row
        for r, e, t in keys:
            self.out.rows[(a.name, a.call, e, t, stage)] = digest_hex(arr[r], SHA256)
        a.kept += 1
        a.stages.append(stage)

    def _keep_eager(self, a: _Active, x: Any, weight: Any, result: Any) -> None:
        """A matmul of one expert's slice of a stage weight (``F.linear(x, w[e])`` or
        ``x @ w[e]``): its rows are the tokens of :func:`gathered_tokens`, checked for the
        first stage against ``hidden_states`` of those tokens."""
        if not torch.is_tensor(weight) or weight.dim() != 2 or not torch.is_tensor(x):
            return
        for stage in a.order:
            whole = getattr(a.mod, stage)
            if (
                weight.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
                or tuple(weight.shape) != tuple(whole.shape[1:])
                or tuple(weight.stride()) != tuple(whole.stride()[1:])
            ):
                continue
            e, rest = divmod(weight.storage_offset() - whole.storage_offset(), whole.stride(0))
            if rest or not 0 <= e < whole.shape[0]:
                continue
            tokens = gathered_tokens(a.index, e)
            if len(tokens) != result.shape[0] or x.dim() != 2 or x.shape[0] != len(tokens):
                return self._fail(
                    a,
                    f"expert {e}: {result.shape[0]} rows computed for {len(tokens)} routed tokens",
                )
            if stage == a.order[0] and not _rows_equal(x, a.hidden[tokens]):
                return self._fail(
                    a,
                    f"expert {e}'s {stage} input rows are not hidden_states of its routed "
                    "tokens in torch.where order over the (k, T) routing mask, so its rows "
                    "map to no token",
                )
            self._keep(a, stage, result, [(r, e, t) for r, t in enumerate(tokens)])
            return

    def _sorted(self, a: _Active, x: Any, result: Any) -> None:
        flat = a.index.reshape(-1)
        if torch.is_tensor(x) and x.shape == flat.shape and torch.equal(x, flat):
            a.perm = result if torch.is_tensor(result) else result[1]

    def _keep_grouped(self, a: _Active, args: Any, kwargs: Any, result: Any) -> None:
        x, w = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        stage = _stage_of(a, w)
        if stage is None:
            return
        if a.perm is None:
            return self._fail(
                a,
                "no torch.sort of top_k_index.reshape(-1) seen before "
                f"the {stage} grouped matmul, so its rows map to no token",
            )
        why, keys = _grouped_rows(a, x, offs, stage)
        if why:
            return self._fail(a, f"{stage} grouped matmul: {why}")
        if stage == a.order[0]:
            a.offs = offs.detach().clone()
        self._keep(a, stage, result, keys)

    def _gathered(self, a: _Active, w: Any, ids: Any, result: Any) -> None:
        for stage in a.order:
            if w is getattr(a.mod, stage) and torch.is_tensor(ids) and ids.dim() == 1:
                a.gathers[id(result)] = (stage, result, ids.detach().clone())

    def _keep_batched(self, a: _Active, args: Any, result: Any) -> None:
        for i in (0, 1):
            g = a.gathers.get(id(args[i]))
            if g is None or g[1] is not args[i]:
                continue
            stage, _, ids = a.gathers.pop(id(args[i]))  # the gathered weights freed
            flat = a.index.reshape(-1)
            k = a.index.shape[-1] if a.index.dim() > 1 else 1
            if result.shape[0] != flat.numel() or args[1 - i].shape[0] != flat.numel():
                return self._fail(
                    a, f"{stage} bmm of {result.shape[0]} rows for {flat.numel()} routed pairs"
                )
            if ids.shape != flat.shape or not torch.equal(ids, flat):
                return self._fail(
                    a,
                    f"{stage} gathered for expert ids other than "
                    "top_k_index.reshape(-1), so its rows map to no token",
                )
            x = args[1 - i].reshape(flat.numel(), -1)
            if stage == a.order[0] and not _rows_equal(x, a.hidden.repeat_interleave(k, dim=0)):
                return self._fail(
                    a,
                    f"{stage} bmm input rows are not hidden_states "
                    "repeated k times, so its rows map to no token",
                )
            keys = [(s, int(e), s // k) for s, e in enumerate(flat.tolist())]
            self._keep(a, stage, result, keys)
            return


def _stage_of(a: _Active, w: Any) -> str | None:
    """The stage whose 3-D weight ``w`` is (itself or its last two axes swapped)."""
    if not torch.is_tensor(w) or w.dim() != 3:
        return None
    for stage in a.order:
        whole = getattr(a.mod, stage)
        same = (
            w.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            and w.storage_offset() == whole.storage_offset()
        )
        shapes = (tuple(whole.shape), tuple(whole.transpose(-2, -1).shape))
        if same and tuple(w.shape) in shapes:
            return stage
    return None


def _rows_equal(x: Any, want: Any) -> bool:
    return bool(x.shape == want.shape and torch.equal(x, want.to(x.dtype)))


def _grouped_rows(a: _Active, x: Any, offs: Any, stage: str) -> tuple[str, Any]:
    """(why not, []) or ("", [(row, expert, token)]) for a grouped matmul's rows, from the
    observed sort's permutation, checked against the matmul's groups and input."""
    flat = a.index.reshape(-1)
    k = a.index.shape[-1] if a.index.dim() > 1 else 1
    perm = a.perm
    if not torch.is_tensor(offs) or offs.dim() != 1:
        return "no 1-D offs", []
    n = int(offs[-1]) if offs.numel() else 0
    if perm.shape != flat.shape or x.shape[0] != flat.numel() or n > x.shape[0]:
        return f"{x.shape[0]} rows for {flat.numel()} routed pairs", []
    if stage != a.order[0] and (a.offs is None or not torch.equal(offs, a.offs)):
        return f"its groups are not those of the {a.order[0]} matmul", []
    rows = torch.arange(n, device=offs.device)
    group = torch.searchsorted(offs.to(rows.dtype), rows, right=True)
    experts = flat[perm[:n]]
    if not torch.equal(group.to(experts.device), experts.to(torch.long)):
        return "its groups do not hold the experts of the sorted pairs in that order", []
    tokens = perm[:n] // k
    if stage == a.order[0] and not _rows_equal(x[:n], a.hidden[tokens]):
        return "its input rows are not hidden_states[perm // k]", []
    return "", list(zip(range(n), experts.tolist(), tokens.tolist(), strict=True))


@contextlib.contextmanager
def record_expert_rows(model: Any) -> Iterator[ExpertRows]:
    """Record the per-(expert, token) rows of every experts module run inside the block.

    The mode is on the torch-function stack only while an experts module runs (entered
    by the outermost call's pre-hook, left by its forward hook, which also runs when the
    forward raises): every observation it needs (the sort, the gathers, the matmuls) is
    made inside the module's forward, and the rest of the model's torch calls do not
    pass through it."""
    out = ExpertRows()
    mode = _Mode(out)
    calls: dict[str, int] = {}
    handles = []
    for name, mod in experts_modules(model):
        handles.append(mod.register_forward_pre_hook(_pre(mode, calls, name), with_kwargs=True))
        handles.append(mod.register_forward_hook(_post(mode), always_call=True))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
        if mode.active:  # a call left open (its forward hook removed or never run)
            mode.active.clear()
            _leave(mode)


def _leave(mode: _Mode) -> None:
    """Take ``mode`` off the torch-function stack, where it is (a mode pushed after it
    and not yet popped stays, in its order)."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def _post(mode: _Mode) -> Any:
    def hook(mod: Any, _args: Any, result: Any) -> None:
        if not mode.active or mode.active[-1].mod is not mod:
            return  # its pre-hook did not run for this call
        a = mode.active.pop()
        if not mode.active:
            _leave(mode)
        if a.name in mode.out.not_judged or a.index is None:
            return
        if not bool((a.index < getattr(a.mod, a.order[0]).shape[0]).any()):
            return  # no pair routed to an expert of this module: nothing to judge
        if a.impl == "eager" and a.kept == 0:
            mode.out.not_judged[a.name] = (
                "no per-expert F.linear or matmul on a slice of its weights was seen"
            )
        elif a.impl != "eager" and a.stages != list(a.order):
            seen = ", ".join(a.stages) or "none"
            mode._fail(a, f"stages recorded: {seen}; expected {', '.join(a.order)} once each")

    return hook


def _pre(mode: _Mode, calls: dict[str, int], name: str) -> Any:
    def hook(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call = calls.get(name, 0)
        calls[name] = call + 1
        impl = getattr(getattr(mod, "config", None), "_experts_implementation", None) or "eager"
        hidden: Any = args[0] if args else kwargs.get("hidden_states")
        index: Any = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        ok = torch.is_tensor(index) and torch.is_tensor(hidden)
        if impl not in IMPLEMENTATIONS:
            mode.out.not_judged[name] = UNSUPPORTED.format(impl=impl)
        elif not ok:
            mode.out.not_judged[name] = "hidden_states or top_k_index not among the inputs"
        elif index.dim() == 2 and index.shape[1] > 1:
            s = index.sort(dim=1).values
            if bool((s[:, 1:] == s[:, :-1]).any()):
                mode.out.not_judged[name] = "a token routed twice to one expert"
        if ok:
            hidden, index = hidden.detach(), index.detach()
        else:
            hidden = index = None
        if not mode.active:
            mode.__enter__()  # left by the outermost call's forward hook
        mode.active.append(_Active(name, mod, call, impl, hidden, index))

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
