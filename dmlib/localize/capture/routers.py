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

The scores are those the router ranks by (:data:`SCORES`): the softmax in float32 of the
logits for the softmax routers, sigmoid plus the correction bias for DeepSeek-V3 (whose
group limit may pass over a higher score: the margin is then taken against the best
expert not chosen, and is negative where the limit decided), the logits themselves for a router of another class.
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

#: router classes -> how the scores they rank experts by follow from their logits
SCORES: dict[str, str] = {
    "Qwen3MoeTopKRouter": "softmax", "Qwen3NextTopKRouter": "softmax",
    "Qwen3_5MoeTopKRouter": "softmax", "MixtralTopKRouter": "softmax",
    "OlmoeTopKRouter": "softmax", "Qwen2MoeTopKRouter": "softmax",
    "DeepseekV3TopkRouter": "sigmoid+bias", "DeepseekV2TopkRouter": "softmax",
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
    for name, mod in routers(named):
        yield mod.register_forward_hook(_hook(rec, name or rec.root))


def _hook(rec: Recorder, name: str) -> Callable[..., None]:
    from dmlib.localize.ops import quiet

    calls = [0]

    def hook(mod: Any, args: Any, output: Any) -> None:
        found = router_outputs(output)
        if found is None:
            return
        with quiet(), torch.no_grad():
            call = calls[0]
            calls[0] += 1
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


def choice_scores(mod: Any, logits: Any) -> Any:
    """The scores the router ranks experts by (:data:`SCORES`), in float32."""
    how = SCORES.get(type(mod).__name__)
    if how == "softmax":
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
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


__all__ = ["SCORES", "choice_scores", "install", "router_outputs", "routers"]
