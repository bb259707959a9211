"""The hooks a capture installs: one pre- and one post-forward hook per selected module, and
those on the model (and on each submodule ``generate()`` may run) that number its forward
passes (decode steps).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dmlib.errors import CaptureError
from dmlib.localize.capture.recorder import (
    Recorder,
)
from dmlib.localize.capture.tensors import (
    _inputs,
    _select,
    _tensors,
)

try:
    import torch
except ImportError:  # pragma: no cover - reading captures needs no torch; writing does
    torch = None  # type: ignore[assignment]

if TYPE_CHECKING:  # (ops.py is imported when a hook is made: it imports this package)
    from dmlib.localize.ops import OpRecorder


@contextlib.contextmanager
def _hooked(
    model: torch.nn.Module,
    modules: str | Iterable[str] | None,
    rec: Recorder,
    tracker: OpRecorder | None,
    named: dict[str, Any] | None = None,
) -> Iterator[None]:
    """Hooks installed for the block's duration; an exception marks the capture interrupted."""
    handles: list[Any] = []
    try:
        passes = _Passes(rec, model, named)
        handles += passes.begin_hooks()  # first: a pass's number is set before it records
        rec.coverage["root_hooked"] = False
        handles += _install_hooks(model, modules, rec, named, passes.hooked)
        rec.coverage["arg_names"] = {rec.root: _arg_names(model)}
        from dmlib.localize.capture import routers

        handles += routers.install(rec, dict(model.named_modules()) if named is None else named)
        if rec.options.backward:
            from dmlib.localize.capture import backward

            handles += backward.install(model, modules, rec, named)
        # after the modules' own hooks: what the pass produced and left behind
        handles += passes.end_hooks()
        if tracker is None:
            yield
        else:
            handles += tracker.install()
            with tracker:
                yield
    except BaseException as err:
        with contextlib.suppress(Exception):
            rec.finish()
        rec.write_manifest(
            complete=False, error=f"capture interrupted by {type(err).__name__}: {err}"
        )
        raise
    finally:
        for h in handles:
            h.remove()


def _conclude(rec: Recorder, path: Path) -> None:
    """Wait for the hashes, check the row map fitted, and write the complete manifest."""
    rec.finish()
    if not rec.boundaries:
        rec.write_manifest(complete=False, error="no hooked module ran inside the capture block")
        raise CaptureError("no hooked module ran inside the capture block", path=path)
    try:
        rec.settle_batch()
    except CaptureError as err:
        rec.write_manifest(complete=False, error=str(err))
        raise
    rec.write_manifest(complete=True)


def _install_hooks(
    model: torch.nn.Module,
    modules: str | Iterable[str] | None,
    rec: Recorder,
    named: dict[str, Any] | None = None,
    hooked: set[str] | None = None,
) -> Iterator[Any]:
    """Register a pre- and a post-forward hook on every selected module; yields the handles
    (their names added to ``hooked``)."""
    for name, mod in _select(model, modules, named):
        label = name or rec.root
        if hooked is not None:
            hooked.add(name)
        if not name:
            rec.coverage["root_hooked"] = True
        yield mod.register_forward_pre_hook(_pre_hook(rec, label), with_kwargs=True)
        yield mod.register_forward_hook(_post_hook(rec, label), with_kwargs=True)


class _Passes:
    """Numbers the model's forward passes (``rec.step``) and ends each with the pass hook.

    A pass is a forward of the outermost *pass module* running: the model itself, or a
    submodule whose class has a ``generate`` method. ``generate()`` runs the forward of
    the module it is a method of, which need not be the model handed to the capture: a
    PEFT model's ``generate()`` calls its base model's (``base_model.model``, through the
    LoRA wrapper), never its own forward; a vision-language model's may call its language
    model's. A pass module running inside another's forward (the base model inside the
    PEFT model's plain forward) is part of that pass, so a plain forward counts once."""

    def __init__(self, rec: Recorder, model: Any, named: dict[str, Any] | None) -> None:
        named = dict(model.named_modules()) if named is None else named
        self.rec, self.count = rec, 0
        self.running: list[int] = []  # the pass modules whose forward is running, outermost first
        self.modules = [("", model)] + [
            (n, m) for n, m in named.items() if n and callable(getattr(type(m), "generate", None))
        ]
        self.hooked: set[str] = set()  # the selected modules' names (_install_hooks)

    def begin_hooks(self) -> list[Any]:
        return [m.register_forward_pre_hook(self._begin, prepend=True) for _, m in self.modules]

    def end_hooks(self) -> list[Any]:
        # always_call: a forward that raises still leaves the running stack
        return [m.register_forward_hook(self._end(n), always_call=True) for n, m in self.modules]

    def _begin(self, mod: Any, args: Any) -> None:
        if not self.running:
            self.rec.step = self.count
            self.count += 1
            self.rec.pass_outputs.clear()  # (a pass's outputs, looked for by its pass hook)
        self.running.append(id(mod))

    def _end(self, name: str) -> Callable[..., None]:
        end_pass = _pass_hook(self.rec, name, name in self.hooked)

        def hook(mod: Any, args: Any, output: Any) -> None:
            if not self.running or self.running[-1] != id(mod):
                return  # its pre-hook never ran (an earlier pre-hook raised)
            self.running.pop()
            if not self.running and output is not None:
                end_pass(output)

        return hook


def _arg_names(model: Any) -> list[str]:
    """The names of the model's forward parameters that a positional argument may fill, in
    order: a comparison pairs ``input0`` of one capture with ``input.<name>`` of another."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


NOT_HOOKED = 'the model itself was not hooked (modules did not include ""): not captured'


def _pass_hook(rec: Recorder, name: str = "", hooked: bool = False) -> Callable[[Any], None]:
    """After each forward pass of pass module ``name`` (``""``: the model itself): the
    outputs a capture that did not hook it did not see are listed, and the states its
    cache holds recorded (:mod:`.states`)."""
    from dmlib.localize.capture.states import record_states
    from dmlib.localize.ops import quiet

    label = name or rec.root
    reason = NOT_HOOKED if not name else (
        f"the module whose forward made the pass ({name}) was not hooked (modules did not "
        f"include {name!r}): not captured"
    )  # fmt: skip

    def hook(output: Any) -> None:
        with quiet():
            if not hooked:
                seq = output if isinstance(output, (tuple, list)) else (output,)
                seen = _recorded(rec)
                for slot, t in _tensors(seq, "output"):
                    if (id(t), getattr(t, "_version", None)) not in seen:
                        rec.note_unseen(f"{label}:{slot}", reason)
            record_states(rec, output)

    return hook


def _recorded(rec: Recorder) -> set[tuple[int, Any]]:
    """(id, version) of the live tensors a hooked module output in this pass (a model's
    logits are often its head's output itself: captured, though the root was not hooked).

    Only this pass's outputs are walked (``rec.pass_outputs``, emptied as each pass
    begins), so a pass costs the same however many passes came before it."""
    out = set()
    for ref, version in rec.pass_outputs:
        t = ref()
        if t is not None:
            out.add((id(t), version))
    return out


def _pre_hook(rec: Recorder, name: str) -> Callable[..., None]:
    """Records the inputs of module ``name``'s next call."""
    from dmlib.localize.ops import quiet

    def hook(mod: Any, args: Any, kwargs: Any) -> None:
        call = rec.calls.get(name, 0)
        with quiet():  # the recorder's own tensor calls are not the model's ops
            for slot, t, cache in _inputs(args, kwargs):
                if cache:
                    rec.record_cache(name, call, slot, t, rolled=cache == "rolled")
                elif rec.is_layout(name, slot):
                    rec.record(name, call, "input", slot, t, row_mapped=False,
                               extra={"layout": True})  # fmt: skip
                else:
                    rec.record(name, call, "input", slot, t)

    return hook


def _post_hook(rec: Recorder, name: str) -> Callable[..., None]:
    """Records the outputs of module ``name``'s call and counts the call."""
    from dmlib.localize.ops import quiet

    def hook(mod: Any, args: Any, kwargs: Any, output: Any) -> None:
        call = rec.calls.get(name, 0)
        rec.calls[name] = call + 1
        with quiet():
            if type(output) is torch.Tensor:  # the common case, without the walk
                rec.record(name, call, "output", "output0", output)
                return
            for slot, t in _tensors(
                output if isinstance(output, (tuple, list)) else (output,), "output"
            ):
                rec.record(name, call, "output", slot, t)

    return hook
