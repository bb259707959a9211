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

A backward that raises partway (an op's backward, a hook) never reaches its end: torch
drops the end-of-pass callback, and the pass's parameters' ``.grad`` are not recorded.
The pass is listed in ``metadata.backward.failed`` (its index and the exception's type and
message): by :func:`run_backward` as the exception goes by (re-raised unchanged), else at
the next pass's first hook (the dropped callback is seen freed without having run) or at
the end of the capture. A comparison of a capture with a failed pass is never identical
about the backward (:mod:`dmlib.localize.gradients`).
"""

from __future__ import annotations

import warnings
import weakref
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
        self.failed: list[dict[str, Any]] = []  # passes that never reached their end
        self._end: Any = None  # a weak reference to the pass's queued end callback

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
        """At the first hook of a backward pass: the parameters' grads recorded at its end.

        A pass still open whose end callback was freed without running (torch drops it
        where the backward raised) failed: it is closed as such before this one begins."""
        if self.in_pass and self._end is not None and self._end() is None:
            self.fail("the backward ended without reaching its end (an exception)")
        if not self.in_pass:
            self.in_pass = True
            end = _PassEnd(self)
            self._end = weakref.ref(end)  # only the autograd engine holds it
            torch.autograd.Variable._execution_engine.queue_callback(end)

    def fail(self, error: str) -> None:
        """Close the current backward pass as failed (its ``.grad`` left unrecorded): listed
        in ``metadata.backward.failed``, so a comparison is never identical about it."""
        self.failed.append({"pass": self.passes, "error": error[:300]})
        self.in_pass = False
        self._end = None
        self.open.clear()
        self.passes += 1
        self.rec.metadata.setdefault("backward", {})["failed"] = list(self.failed)

    def close(self) -> None:
        """At the end of the capture: a pass begun and never ended failed."""
        if self.in_pass:
            self.fail("the backward never reached its end inside the capture")

    def end_pass(self) -> None:
        """Every parameter's ``.grad`` as the backward pass leaves it (``<name>:grad#k``)."""
        from dmlib.localize.ops import quiet

        self.in_pass = False
        self._end = None
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
        self.rec.metadata.setdefault("backward", {}).update(
            {"upstream": "ones" if seed is None else "randn", "grad_seed": seed,
             "draws": self.draws}
        )  # fmt: skip
        return grad


class _PassEnd:
    """The end-of-pass callback queued on torch's autograd engine for one backward pass."""

    def __init__(self, grads: GradHooks) -> None:
        self.grads = grads

    def __call__(self) -> None:
        self.grads.end_pass()


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
    try:
        with warnings.catch_warnings():
            # torch's note on a hooked module whose inputs need no grad (an embedding): its
            # gradient w.r.t. its output is recorded all the same
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            out.backward(grad)
    except BaseException as err:
        # the pass is over, its end never reached: listed as failed, the error unchanged
        grads.fail(f"{type(err).__name__}: {err}")
        raise


__all__ = ["GradHooks", "install", "run_backward"]
