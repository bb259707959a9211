"""Every setting of a capture in one frozen, validated object.

:func:`dmlib.capture`, :func:`dmlib.localize.hf.capture_generate` and
:class:`~dmlib.localize.capture.recorder.Recorder` take a :class:`CaptureOptions`; their
keyword arguments (the settings' old spelling) keep working and build one. A setting's
default lives here and nowhere else; each is checked once, when the options are built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dmlib.errors import CaptureError
from dmlib.localize.capture.format import HOST_SCHEMES, LAYOUT_INPUTS

__all__ = ["CaptureOptions", "UNSET"]

#: a keyword argument not given (its default is the :class:`CaptureOptions` field's)
UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<default>"})()


def _patterns(value: Any) -> tuple[str, ...]:
    """A glob pattern or several as a tuple of strings (None: none)."""
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _modules(value: Any) -> str | tuple[str, ...] | None:
    """Module patterns as given: None (the default choice), one pattern, or a tuple."""
    return value if value is None or isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class CaptureOptions:
    """The settings of one capture (see :func:`dmlib.capture` for each one's meaning).

    Built once, from keyword arguments or directly; raises :class:`CaptureError` on the
    first setting that cannot be honoured (``block_rows`` below one, an unknown
    ``hash``, a negative ``hash_threads``). Patterns are kept as tuples, ``dump_requests``
    as a frozenset of request keys, ``metadata`` as a dict of its own.
    ``with_(**changes)`` gives a validated copy.

    Examples
    --------
    >>> opts = CaptureOptions(block_rows=16, hash="blake3")
    >>> opts.scheme, opts.dump, opts.with_(ops=True).ops
    ('blake3-tree-v1', (), True)
    """

    modules: str | tuple[str, ...] | None = None
    row_map: Sequence[Any] | None = None
    block_rows: int = 64
    dump: tuple[str, ...] = ()
    dump_requests: frozenset[str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    overwrite: bool = False
    hash_threads: int = 2
    device_hash: bool = True
    ops: bool = False
    op_modules: str | tuple[str, ...] | None = None
    layout_inputs: tuple[str, ...] = ()
    hash: str = "xxh3"
    # the backward pass too: each hooked module's gradients and every parameter's .grad
    backward: bool = False
    # Recorder.backward(out): a random upstream gradient from this seed (None: ones)
    grad_seed: int | None = None
    # each expert's rows per routed token (kind "expert": expertrows.py); off by default:
    # a TorchFunctionMode sees every torch call inside the experts modules, and a SHA-256
    # per row (cost: benchmarks/README.md)
    experts: bool = False

    def __post_init__(self) -> None:
        n = self.block_rows
        if isinstance(n, bool) or not hasattr(n, "__index__") or n < 1:
            raise CaptureError(f"block_rows={n}; expected a positive integer")
        if HOST_SCHEMES.get(str(self.hash).lower()) is None:
            raise CaptureError(f"hash={self.hash!r}; expected 'xxh3' or 'blake3'")
        t = self.hash_threads
        if isinstance(t, bool) or not hasattr(t, "__index__") or t < 0:
            raise CaptureError(f"hash_threads={t!r}; expected 0 or a positive integer")
        put = object.__setattr__  # (frozen: the normal forms are set once, here)
        put(self, "block_rows", int(n))
        put(self, "hash_threads", int(t))
        put(self, "modules", _modules(self.modules))
        put(self, "op_modules", _modules(self.op_modules))
        put(self, "dump", _patterns(self.dump))
        put(self, "layout_inputs", _patterns(self.layout_inputs))
        reqs = self.dump_requests
        put(self, "dump_requests", None if reqs is None else frozenset(str(r) for r in reqs))
        put(self, "metadata", dict(self.metadata or {}))
        g = self.grad_seed
        if g is not None and (isinstance(g, bool) or not hasattr(g, "__index__") or g < 0):
            raise CaptureError(f"grad_seed={g!r}; expected None or an integer >= 0")
        put(self, "grad_seed", None if g is None else int(g))
        for key in ("overwrite", "device_hash", "ops", "backward", "experts"):
            put(self, key, bool(getattr(self, key)))

    @property
    def scheme(self) -> str:
        """The host hash scheme ``hash`` names (``"xxh3-128-tree-v1"``, ``"blake3-tree-v1"``)."""
        return HOST_SCHEMES[str(self.hash).lower()]

    @property
    def layout_patterns(self) -> tuple[str, ...]:
        """Every layout-input pattern: :data:`LAYOUT_INPUTS` and ``layout_inputs``."""
        return (*LAYOUT_INPUTS, *self.layout_inputs)

    def with_(self, **changes: Any) -> CaptureOptions:
        """A copy with ``changes`` applied, validated again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, options: CaptureOptions | None = None, **settings: Any) -> CaptureOptions:
        """``options`` (or the defaults) with the keyword ``settings`` given applied (those
        equal to :data:`UNSET` left out): how the public functions build theirs."""
        given = {k: v for k, v in settings.items() if v is not UNSET}
        unknown = sorted(set(given) - _FIELDS)
        if unknown:
            raise TypeError(f"unknown capture setting(s) {unknown}; expected {sorted(_FIELDS)}")
        if options is None:
            return cls(**given)
        if not isinstance(options, CaptureOptions):
            raise TypeError(f"options must be a CaptureOptions, not {type(options).__name__}")
        return options.with_(**given) if given else options


_FIELDS = frozenset(f.name for f in dataclasses.fields(CaptureOptions))
