"""The capture's compiled module against hostile callers: no crash, no read of freed memory.

A library user's ``hasher`` runs Python code in the middle of the compiled loops. Two such
callbacks crashed the process (segfault) before: one that empties the span list while it
is iterated, and one that keeps the memoryview it was handed and reads it after the
buffer behind it is gone. Each case runs in a subprocess, so that a crash fails the test
instead of ending pytest; the oracle is the bytes the hasher saw during its call (copied
there) and XXH3-128 of the spans as they were passed (the list is read once, at the call).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dmlib.localize.capture import treehash

pytestmark = pytest.mark.skipif(
    not treehash.USE_COMPILED, reason="the capture's compiled module is not built"
)

_PRELUDE = """
import gc, sys
import numpy as np
import xxhash
from dmlib.localize.capture import treehash
mod = treehash._capture
sys.path.insert(0, TESTS)
from _support.tree import leaf, tree_request
"""

SHORTEN = """
buf = np.arange(4096, dtype=np.uint8)
spans = [(0, 4), (4, 4), (8, 5)] * 20
rows = buf.reshape(-1, 16)
want = [tree_request(rows[s : s + n], 2, "xxh3")[0] for s, n in spans]
def hasher(mv):
    del spans[1:]  # the caller's list shortened while it is iterated
    return xxhash.xxh3_128_digest(mv)
got = mod.request_blocks(hasher, buf.data, 16, spans, 2, b"dmlib xxh3-128-tree-v1 request\\0",
                         1 << 30, 16)
assert [d for d, _ in got] == want, "digests of the spans as passed"
rspans = [("r%d" % i, 2 * i, 2) for i in range(30)]
calls = []
def hasher2(mv):
    calls.append(1)
    if len(calls) == 3:  # the whole tensor, the first request, then inside the second one
        rspans.clear()
    return xxhash.xxh3_128_digest(mv)
whole, lead, reqs = mod.hash_boundary(hasher2, buf.data, -1, buf.data, 16, rspans, 64, b"t",
                                      1 << 30, 16)
assert sorted(reqs) == sorted("r%d" % i for i in range(30))
assert reqs["r3"]["digest"] == leaf(buf[6 * 16 : 8 * 16].tobytes(), "xxh3")
print("ok")
"""

KEEP = """
kept, seen = [], []
def hasher(mv):
    kept.append(mv)
    seen.append(bytes(mv))  # what the hasher was handed, during its call
    return xxhash.xxh3_128_digest(mv)
a = np.arange(1 << 16, dtype=np.uint8)
mod.request_blocks(hasher, a.data, 16, [(0, 4000)], 2, b"t", 1 << 30, 16)
b = np.arange(1 << 12, dtype=np.uint8) * 3
mod.hash_boundary(hasher, b.data, 4, b.data, 64, [("r", 0, 64)], 8, b"u", 1 << 30, 16)
del a, b
gc.collect()
junk = [np.full(1 << 16, 7, np.uint8) for _ in range(64)]  # reuse the freed memory
after = []
for mv in kept:
    try:
        after.append(bytes(mv))
    except ValueError:  # a released view refuses to be read: also safe
        after.append(None)
assert len(kept) > 2000
assert all(x is None or x == y for x, y in zip(after, seen)), "a kept view changed"
print("ok", sum(x is not None for x in after))
"""


def _run(body: str) -> subprocess.CompletedProcess[str]:
    tests = f"TESTS = {str(Path(__file__).resolve().parent)!r}\n"
    code = tests + textwrap.dedent(_PRELUDE) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_a_hasher_that_shortens_the_span_list_does_not_crash():
    out = _run(SHORTEN)
    assert out.returncode == 0 and out.stdout.startswith("ok"), (out.returncode, out.stderr[-2000:])


def test_a_memoryview_kept_by_the_hasher_keeps_its_bytes():
    out = _run(KEEP)
    assert out.returncode == 0 and out.stdout.startswith("ok"), (out.returncode, out.stderr[-2000:])
