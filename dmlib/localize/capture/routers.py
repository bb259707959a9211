"""Mixture-of-experts routers found by their outputs and recorded as boundaries of kind
``router`` (:data:`~dmlib.localize.capture.format.KINDS`).

A router is a module whose output holds, per token, the chosen experts' integer ids
``(tokens, k)`` beside the scores of all ``E > k`` experts ``(tokens, E)`` (and usually
the chosen ones' weights ``(tokens, k)``): Qwen3-MoE, Mixtral, OLMoE, Qwen3-Next and
DeepSeek-V3 routers in transformers return ``(router_logits, weights, indices)``. Any module
of a known router class, or named ``*gate``/``*router``, is hooked; it is recorded only
where its output has that shape.

Two boundaries per router call, both hashed per token through the row map, their values
kept in the manifest (``coverage.routers``: they are small, ``k`` ids and two scores per
token), so that a comparison can say which token's expert set changed and how near the tie
was in each run:

``module:router.indices#call``  the chosen expert ids (int64, ``(tokens, k)``)
``module:router.margin#call``   per token, the lowest score among the chosen experts and
                                the highest among the others (``(tokens, 2)``, float32):
                                the k-th and the (k+1)-th score where the choice is the top k

and what those scores are, per router, in ``coverage.router_scores`` (:func:`score_kind`).

The scores are those the router ranks by (:data:`SCORES`, each row read from the class's
``forward`` in transformers 5.25; every one ranks by a score computed before its top-k,
the weights' renormalisation after it changes no choice): the softmax in float32 of the
logits for the softmax routers, sigmoid plus the correction bias for DeepSeek-V3 and, for
DeepSeek-V2, the softmax of logits it computes in float32 whatever the model's dtype. A
group-limited router (DeepSeek-V3; DeepSeek-V2 with ``topk_method="group_limited_greedy"``)
may pass over a higher score in a group it left out: the margin is then taken against the
best expert not chosen, and is negative where the limit decided. For a router of another
class the margins are taken on its logits, an assumption its :func:`score_kind` says.

A candidate whose output holds no such pair but does hold scores for several experts
(``(tokens, E)`` floats, E >= 2: DBRX's router returns its logits and leaves the choice to
its caller; Llama 4's returns the chosen scores scattered over all experts), or any module
of a class in :data:`SCORES` that returned something else, is listed in the manifest's
``coverage.routers_unread`` (``[{module, reason}]``) and in the routing report as not
judged: never skipped unseen. A scalar gate (Qwen2-MoE's ``shared_expert_gate``,
``(tokens, 1)``) chooses nothing and is not listed; nor is a candidate inside another
(AFMoE's ``router.gate``, the ``Linear`` its router calls).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

try:
    import torch
except ImportError:  # pragma: no cover - reading captures needs no torch; writing does
    torch = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from dmlib.localize.capture.recorder import Recorder

#: router classes -> how the scores they rank experts by follow from their logits:
#: "softmax" ``softmax(logits, dtype=float32)``, "float-softmax" ``softmax(logits.float())``
#: (Mixtral upcasts first; the same numbers where the softmax kernel computes in float32
#: either way, kept apart so that a device where they differ is followed exactly),
#: "sigmoid+bias" ``sigmoid(logits) + e_score_correction_bias``, "logits" the logits
#: themselves (GPT-OSS takes its top-k of them, its softmax after). Tested on tiny models of
#: each family: tests/test_localize_routing_families.py (and test_localize_routing.py);
#: Jamba's (a softmax in float32 of its logits), Nemotron-H's (float32 logits, sigmoid
#: plus bias, group-limited as DeepSeek-V3's) and GPT-OSS's: tests/test_localize_hybrid_moe.py.
SCORES: dict[str, str] = {
    "Qwen3MoeTopKRouter": "softmax", "Qwen3NextTopKRouter": "softmax",
    "Qwen3_5MoeTopKRouter": "softmax", "MixtralTopKRouter": "float-softmax",
    "OlmoeTopKRouter": "softmax", "Qwen2MoeTopKRouter": "softmax",
    "DeepseekV3TopkRouter": "sigmoid+bias", "DeepseekV2TopkRouter": "softmax",
    "JambaTopKRouter": "softmax", "NemotronHTopkRouter": "sigmoid+bias",
    "GptOssTopKRouter": "logits",
}  # fmt: skip

NAMES = ("gate", "router")  # a module whose name ends so is a router candidate


def routers(named: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, module) of every router candidate: a known class, or a name ending in
    ``gate``/``router`` (a ``Linear`` gate of an older MoE is recorded only if its output
    has a router's shape, which a plain logits tensor has not)."""
    out = []
    for name, mod in named.items():
        cls = type(mod).__name__
        if cls in SCORES or (name and name.rsplit(".", 1)[-1].endswith(NAMES)):
            out.append((name, mod))
    return out


def install(rec: Recorder, named: dict[str, Any]) -> Iterator[Any]:
    """A forward hook on each router candidate; yields the handles."""
    found = routers(named)
    names = [n for n, _ in found]
    for name, mod in found:
        inner = any(name.startswith(f"{p}.") for p in names if p != name)
        yield mod.register_forward_hook(_hook(rec, name or rec.root, inner))


def _hook(rec: Recorder, name: str, inner: bool = False) -> Callable[..., None]:
    from dmlib.localize.ops import quiet

    calls = [0]

    def hook(mod: Any, args: Any, output: Any) -> None:
        found = router_outputs(output)
        if found is None:
            why = None if inner else unread_reason(mod, output)
            if why is not None:
                _note_unread(rec, name, why)
            return
        with quiet(), torch.no_grad():
            call = calls[0]
            calls[0] += 1
            if call == 0:
                rec.coverage.setdefault("router_scores", {})[name] = score_kind(mod)
            logits, indices = found
            scores = choice_scores(mod, logits)
            margin = _margins(scores, indices)
            _record(rec, name, call, "router.indices", indices.to(torch.int64))
            _record(rec, name, call, "router.margin", margin)

    return hook


def router_outputs(output: Any) -> tuple[Any, Any] | None:
    """(scores of all experts (tokens, E), chosen ids (tokens, k)) of a router's output,
    or None where it has no such pair."""
    if not isinstance(output, (tuple, list)):
        return None
    tensors = [t for t in output if torch.is_tensor(t) and t.dim() == 2]
    ids = [t for t in tensors if not t.is_floating_point() and not t.is_complex()]
    floats = [t for t in tensors if t.is_floating_point()]
    for idx in ids:
        for s in floats:
            if s.shape[0] == idx.shape[0] and s.shape[1] > idx.shape[1] >= 1:
                return s, idx
    return None


def unread_reason(mod: Any, output: Any) -> str | None:
    """Why a router candidate's output cannot be read as a choice of experts, or None
    where the candidate chooses nothing (no ``(tokens, E >= 2)`` scores, not a known
    router class)."""
    outs = output if isinstance(output, (tuple, list)) else (output,)
    tensors = [t for t in outs if torch.is_tensor(t)]
    wide = [t for t in tensors if t.is_floating_point() and t.dim() == 2 and t.shape[1] >= 2]
    if type(mod).__name__ not in SCORES and not wide:
        return None
    shapes = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
    return (
        f"{type(mod).__name__} returned ({shapes or 'no tensor'}): no chosen expert ids "
        "beside the experts' scores, so its choice (made by its caller, if at all) is not "
        "recorded and no token's experts are judged here"
    )


def _note_unread(rec: Recorder, name: str, why: str) -> None:
    """List router ``name`` as not read (once) in the manifest's coverage."""
    items = rec.coverage.setdefault("routers_unread", [])
    if not any(u["module"] == name for u in items):
        items.append({"module": name, "reason": why})


def score_kind(mod: Any) -> str:
    """What the router's margins are computed on: its :data:`SCORES` kind, or, for a class
    not in the table, ``"logits (<class> not in SCORES)"``: a ranking by its logits, assumed
    (a router adding a bias after its logits, such as AFMoE's, ranks by something else)."""
    cls = type(mod).__name__
    return SCORES.get(cls) or f"logits ({cls} not in SCORES)"


def choice_scores(mod: Any, logits: Any) -> Any:
    """The scores the router ranks experts by (:data:`SCORES`), in float32."""
    how = SCORES.get(type(mod).__name__)
    if how == "softmax":
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    if how == "float-softmax":
        return torch.softmax(logits.float(), dim=-1)
    if how == "sigmoid+bias":
        bias = getattr(mod, "e_score_correction_bias", None)
        s = logits.float().sigmoid()
        return s + bias.float() if torch.is_tensor(bias) else s
    return logits.float()


def _margins(scores: Any, indices: Any) -> Any:
    """(tokens, 2): the lowest chosen score and the highest score not chosen."""
    idx = indices.long()
    chosen = scores.gather(1, idx)
    rest = scores.scatter(1, idx, float("-inf"))
    return torch.stack([chosen.min(dim=1).values, rest.max(dim=1).values], dim=1).contiguous()


def _record(rec: Recorder, module: str, call: int, slot: str, t: Any) -> None:
    """Record ``t`` as a router boundary, its values kept in the manifest's coverage
    (``routers``: boundary name -> the tensor as nested lists, exact: int64 ids and float32
    scores are exact as JSON numbers). A few numbers per token: a dump file per router call
    would cost its fsync (measured: 8 of them doubled a tiny hybrid's capture)."""
    name = rec.record(module, call, "output", slot, t, extra={"router": True})
    rec.coverage.setdefault("routers", {})[name] = t.detach().cpu().tolist()


__all__ = [
    "SCORES", "choice_scores", "install", "router_outputs", "routers", "score_kind", "unread_reason",
]  # fmt: skip
