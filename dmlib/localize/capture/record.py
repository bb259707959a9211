"""Values computed outside any module, recorded by name: :func:`record` and :func:`recorded`.

Inside ``with dmlib.capture(...)``, ``dmlib.record("logprobs", torch.log_softmax(x, -1))``
records the tensor as a boundary of kind ``recorded`` (``logprobs``, ``logprobs#1`` from
its second call on), read per request through the capture's row map where its leading
dims are batch x positions (else whole, and per index of axis 0), and returns it
unchanged. Outside a capture it does nothing and returns the tensor: the call may stay in
the code. :func:`recorded` wraps a function so that its result is recorded so.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from dmlib.localize.capture.recorder import Recorder

T = TypeVar("T")
_ACTIVE: list[Recorder] = []  # the recorders of the capture blocks open, innermost last


@contextlib.contextmanager
def active(rec: Recorder) -> Iterator[None]:
    """``rec`` is where :func:`record` writes while the block runs."""
    _ACTIVE.append(rec)
    try:
        yield
    finally:
        _ACTIVE.remove(rec)


def record(name: str, tensor: T, *, rows: bool = True) -> T:
    """Record ``tensor`` under ``name`` in the capture running now; returns ``tensor``.

    ``rows=False``: hashed whole even where its leading dims fit the row map. Outside a
    capture: nothing is recorded (a no-op).
    """
    if not _ACTIVE:
        return tensor
    from dmlib.localize.ops import quiet

    rec = _ACTIVE[-1]
    call = rec.recorded_calls.get(name, 0)
    rec.recorded_calls[name] = call + 1
    with quiet():
        rec.record(str(name), call, "output", "output0", tensor, row_mapped=bool(rows),
                   extra={"recorded": True})  # fmt: skip
    return tensor


def recorded(
    name: str | None = None, *, rows: bool = True
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A decorator: the function's result is :func:`record`-ed under ``name`` (default:
    the function's qualified name) each time it is called inside a capture."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        label = name or fn.__qualname__

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> T:
            return record(label, fn(*args, **kwargs), rows=rows)

        return inner

    return wrap


__all__ = ["active", "record", "recorded"]
