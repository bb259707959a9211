"""Every setting of a comparison in one frozen, validated object.

:func:`dmlib.compare`, :func:`dmlib.matrix` and the ladders keep their keyword arguments;
each builds one :class:`CompareOptions` from them, which checks every setting once, and
passes it inward. A setting's default lives here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dmlib import hashing
from dmlib.errors import DmlibError
from dmlib.kernels.pair import DEFAULT_CHUNK
from dmlib.sources import Patterns

__all__ = ["CompareOptions", "no_hash"]


def no_hash(hash: Any) -> bool:
    """True for ``hash="none"`` (or False): no identity hashes, bytes compared only."""
    return hash is False or (isinstance(hash, str) and hash.lower() == "none")


@dataclass(frozen=True)
class CompareOptions:
    """The settings of one comparison (see :func:`dmlib.compare` for each one's meaning).

    Built once from a public function's keyword arguments; raises :class:`DmlibError`
    on the first setting that cannot be honoured (an unknown engine or hash scheme, a
    chunk size below one byte, whole-file hashes without a scheme or on the Dask engine,
    ``mapping`` combined with a setting it replaces). ``with_(**changes)`` gives a
    validated copy.
    """

    include: Patterns = None
    exclude: Patterns = None
    file_hashes: bool = False
    rename: Any = None
    cross_dtype: bool = False
    chunk_bytes: int = DEFAULT_CHUNK
    progress: bool | None = None
    hash: str | None = None
    engine: str = "local"
    mapping: Any = None

    def __post_init__(self) -> None:
        if self.mapping is not None:
            self._check_mapped()
        self._check_chunk()
        from dmlib.engine import check_engine

        check_engine(self.engine)
        name = self.hash_name  # an unknown scheme raises here
        if name is None and self.file_hashes:
            raise DmlibError(
                "whole-file hashes (file_hashes=True, --file-hashes) need a hash scheme: "
                "blake3 or sha256, not none"
            )
        if self.engine == "dask" and self.file_hashes:
            raise DmlibError("file_hashes=True reads whole files here: use engine='local'")

    def _check_mapped(self) -> None:
        """``mapping=`` names the tensors and runs here: no rename, dask or file hashes."""
        for key, off in (("rename", None), ("engine", "local"), ("file_hashes", False)):
            if getattr(self, key) not in (off, [], ()):
                raise DmlibError(
                    f"mapping= does not combine with {key}= (the mapping names the tensors)"
                )

    def _check_chunk(self) -> None:
        n = self.chunk_bytes
        if isinstance(n, bool) or not hasattr(n, "__index__") or n < 1:
            raise DmlibError(f"chunk_bytes must be a positive number of bytes, got {n!r}")

    @property
    def hash_name(self) -> str | None:
        """The canonical hash scheme (``"blake3-64MiB"``, ``"sha256"``), None for ``"none"``."""
        return None if no_hash(self.hash) else hashing.algorithm(self.hash)

    def with_(self, **changes: Any) -> CompareOptions:
        """A copy with ``changes`` applied, validated again."""
        return dataclasses.replace(self, **changes)
