"""The backward pass in a capture (``capture(..., backward=True)``): gradient boundaries.

Each hooked module's gradient with respect to its output (``grad_output<i>``, recorded by
a full backward pre-hook, before the module's backward runs) and to its input
(``grad_input<i>``, by a full backward hook, after), in the order the hooks fire (backward
order), read per request through the capture's row map like the forward tensors they are
the gradients of; and at the end of each backward pass every parameter's ``.grad``
(``<parameter>:grad#k`` after the k-th pass: accumulated over the micro-batches before it
where the capture spans several). Their kinds are rows of
:data:`~dmlib.localize.capture.format.KINDS` (``grad_output``, ``grad_input``,
``param_grad``).

:meth:`GradHooks.upstream` draws the seeded random upstream gradient of
``Recorder.backward(out)``: ``out.sum().backward()`` sends the same gradient (ones) to
every element, and a backward whose sums are taken by atomic adds in an order that varies
gives the same bits far more often with a uniform gradient than with a random one (every
addend equal: their order hardly matters), so the test that shows such a backward is one
with a random upstream gradient. The seed and the draws are written in the manifest
(``metadata.backward``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

from dmlib.localize.capture.format import boundary_name
from dmlib.localize.capture.tensors import _select, torch


class GradHooks:
    """The backward hooks of one capture and what they count (calls per module, passes)."""

    def __init__(self, rec: Any, params: list[tuple[str, Any]]) -> None:  # rec: a Recorder
        self.rec = rec
        self.params = params  # (name, parameter) of every parameter that requires grad
        self.calls: dict[str, int] = {}  # module -> backward calls begun
        self.open: dict[str, list[int]] = {}  # module -> calls begun, not yet finished
        self.in_pass = False
        self.passes = 0  # backward passes finished
        self.generator: Any = None
        self.draws = 0

    def pre(self, name: str) -> Any:
        """The full backward pre-hook of module ``name``: its gradients w.r.t. its outputs."""
        from dmlib.localize.ops import quiet

        def hook(mod: Any, grad_output: Any) -> None:
            self._begin()
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            self.open.setdefault(name, []).append(call)
            with quiet():
                for i, g in enumerate(grad_output):
                    if isinstance(g, torch.Tensor):
                        self.rec.record(name, call, "output", f"grad_output{i}", g,
                                        extra={"grad": True})  # fmt: skip

        return hook

    def post(self, name: str) -> Any:
        """The full backward hook of module ``name``: its gradients w.r.t. its inputs."""
        from dmlib.localize.ops import quiet

        def hook(mod: Any, grad_input: Any, grad_output: Any) -> None:
            self._begin()
            stack = self.open.get(name)
            call = stack.pop() if stack else self.calls.get(name, 0)
            with quiet():
                for i, g in enumerate(grad_input):
                    if isinstance(g, torch.Tensor):
                        self.rec.record(name, call, "input", f"grad_input{i}", g,
                                        extra={"grad": True})  # fmt: skip

        return hook

    def _begin(self) -> None:
        """At the first hook of a backward pass: the parameters' grads recorded at its end."""
        if not self.in_pass:
            self.in_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_pass)

    def end_pass(self) -> None:
        """Every parameter's ``.grad`` as the backward pass leaves it (``<name>:grad#k``)."""
        from dmlib.localize.ops import quiet

        self.in_pass = False
        self.open.clear()
        with quiet():
            for pname, p in self.params:
                g = p.grad
                if g is None:
                    continue
                if self.rec._wants_dump(boundary_name(pname, self.passes, "output", "grad")):
                    g = g.clone()  # the next pass adds to .grad in place; a dump is written later
                self.rec.record(pname, self.passes, "output", "grad", g,
                                row_mapped=False, extra={"param_grad": True})  # fmt: skip
        self.passes += 1

    def upstream(self, out: Any) -> Any:
        """The upstream gradient for ``out``: drawn from ``N(0, 1)`` by one generator seeded
        with the capture's ``grad_seed`` (successive calls continue its sequence), or ones
        (what ``out.sum().backward()`` sends) where no seed was given."""
        seed = self.rec.options.grad_seed
        if seed is None:
            grad = torch.ones_like(out)
        else:
            if self.generator is None:
                self.generator = torch.Generator(device=out.device)
                self.generator.manual_seed(seed)
            grad = torch.randn(out.shape, generator=self.generator, dtype=out.dtype,
                               device=out.device)  # fmt: skip
        self.draws += 1
        self.rec.metadata["backward"] = {
            "upstream": "ones" if seed is None else "randn",
            "grad_seed": seed,
            "draws": self.draws,
        }
        return grad


def install(
    model: Any, modules: str | Iterable[str] | None, rec: Any, named: dict[str, Any] | None
) -> Iterator[Any]:
    """Register the backward hooks on every selected module; yields the handles."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = GradHooks(rec, params)
    rec.grads = grads
    rec.metadata.setdefault("backward", {"upstream": None, "grad_seed": rec.options.grad_seed})
    for name, mod in _select(model, modules, named):
        label = name or rec.root
        yield mod.register_full_backward_pre_hook(grads.pre(label))
        yield mod.register_full_backward_hook(grads.post(label))


def run_backward(rec: Any, out: Any) -> None:
    """``out.backward(upstream)``: a scalar's own backward where no seed was given, else
    the upstream gradient of :meth:`GradHooks.upstream` (seeded random, or ones)."""
    grads = rec.grads if rec.grads is not None else GradHooks(rec, [])
    if rec.grads is None:
        rec.grads = grads
    grad = None if out.numel() == 1 and rec.options.grad_seed is None else grads.upstream(out)
    with warnings.catch_warnings():
        # torch's note on a hooked module whose inputs need no grad (an embedding): its
        # gradient w.r.t. its output is recorded all the same
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        out.backward(grad)


__all__ = ["GradHooks", "install", "run_backward"]
