"""The hooks a capture installs: one pre- and one post-forward hook per selected module, and
one on the model that numbers its forward passes (decode steps).
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
        handles.append(model.register_forward_pre_hook(_step_hook(rec), prepend=True))
        rec.coverage["root_hooked"] = False
        handles += _install_hooks(model, modules, rec, named)
        rec.coverage["arg_names"] = {rec.root: _arg_names(model)}
        from dmlib.localize.capture import routers

        handles += routers.install(rec, dict(model.named_modules()) if named is None else named)
        if rec.options.backward:
            from dmlib.localize.capture import backward

            handles += backward.install(model, modules, rec, named)
        # after the root's own hook: what the pass produced and left behind
        handles.append(model.register_forward_hook(_pass_hook(rec), with_kwargs=True))
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
) -> Iterator[Any]:
    """Register a pre- and a post-forward hook on every selected module; yields the handles."""
    for name, mod in _select(model, modules, named):
        label = name or rec.root
        if not name:
            rec.coverage["root_hooked"] = True
        yield mod.register_forward_pre_hook(_pre_hook(rec, label), with_kwargs=True)
        yield mod.register_forward_hook(_post_hook(rec, label), with_kwargs=True)


def _step_hook(rec: Recorder) -> Callable[..., None]:
    """Numbers the model's forward passes: the n-th (from 0) sets ``rec.step = n``."""
    calls = [0]

    def hook(mod: Any, args: Any) -> None:
        rec.step = calls[0]
        calls[0] += 1
        rec.pass_outputs.clear()  # (a pass's outputs, looked for by its pass hook)

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


def _pass_hook(rec: Recorder) -> Callable[..., None]:
    """After each forward pass of the model: the outputs a capture without the root did
    not see are listed, and the states its cache holds recorded (:mod:`.states`)."""
    from dmlib.localize.capture.states import record_states
    from dmlib.localize.ops import quiet

    def hook(mod: Any, args: Any, kwargs: Any, output: Any) -> None:
        with quiet():
            if not rec.coverage["root_hooked"]:
                seq = output if isinstance(output, (tuple, list)) else (output,)
                seen = _recorded(rec)
                for slot, t in _tensors(seq, "output"):
                    if (id(t), getattr(t, "_version", None)) not in seen:
                        rec.note_unseen(f"{rec.root}:{slot}", NOT_HOOKED)
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
