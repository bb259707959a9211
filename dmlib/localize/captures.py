"""The capture reader's old import path: the names now live in the capture package's rooms.

``dmlib.localize.captures`` kept every name it had (the format's constants and
:class:`Boundary` in :mod:`dmlib.localize.capture.format`, :class:`RowMap` in
:mod:`~dmlib.localize.capture.rowmap`, the digest rules in
:mod:`~dmlib.localize.capture.digests`, :func:`open_capture` and :class:`Capture` in
:mod:`~dmlib.localize.capture.reader`); new code imports them from there.
"""

from __future__ import annotations

from dmlib.localize.capture.digests import (
    TREE_REQUEST_TAG,
    TREE_TAGS,
    XXH_REQUEST_TAG,
    digest_hex,
    n_blocks,
    request_hashes,
    tree_request,
)
from dmlib.localize.capture.format import (
    FORMAT,
    HOST_SCHEMES,
    LAYOUT_INPUTS,
    MANIFEST,
    OLD_ROOT,
    READS,
    REQUEST_PREFIX,
    ROOT,
    SCHEMES,
    TENSOR_DIR,
    TREE,
    VERSION,
    WHOLE_KEY,
    XXH_TREE,
    Boundary,
    RequestHash,
    is_layout_slot,
    request_key,
    root_label,
    same_scheme,
)
from dmlib.localize.capture.reader import (
    Capture,
    dump_files,
    judge_heads,
    lift_blake3,
    open_capture,
)
from dmlib.localize.capture.rowmap import RowMap

__all__ = [
    "Boundary", "Capture", "RowMap", "open_capture", "request_hashes", "digest_hex", "judge_heads",
    "same_scheme", "tree_request", "lift_blake3", "TREE", "XXH_TREE", "TREE_TAGS", "HOST_SCHEMES",
    "dump_files", "FORMAT", "VERSION", "SCHEMES", "ROOT", "LAYOUT_INPUTS", "root_label",
    "is_layout_slot", "MANIFEST", "TENSOR_DIR", "WHOLE_KEY", "REQUEST_PREFIX", "OLD_ROOT", "READS",
    "TREE_REQUEST_TAG", "XXH_REQUEST_TAG", "RequestHash", "request_key", "n_blocks",
]  # fmt: skip
