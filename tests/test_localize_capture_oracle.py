"""A capture's host digests on a tiny Llama against an oracle of our own.

The oracle: plain torch forward hooks on the same modules, cloning each output when its
hook runs, and the ``xxhash`` (default scheme) or ``blake3`` package (``hash="blake3"``)
on its bytes: the whole tensor, each index of the first axis, and per request its rows
in position order, in blocks of ``BLOCK`` positions (tests/_support/tree.py). Left padding makes one request start
mid-row; several blocks per request exercise the block offsets.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _support.tree import SCHEME, leaf, tree_request  # noqa: E402

import dmlib  # noqa: E402
from dmlib.localize.capture import default_modules  # noqa: E402

B, S, BLOCK = 3, 13, 4


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _row_map() -> list[list[object]]:
    """Request "r{b}" fills batch row b; row 2 is left-padded by 5 positions."""
    rows: list[list[object]] = [[(f"r{b}", j) for j in range(S)] for b in range(2)]
    rows.append([None] * 5 + [("r2", j) for j in range(S - 5)])
    return rows


def _oracle_outputs(model, ids, mask, names):
    seen, hooks = {}, []
    mods = dict(model.named_modules())
    for n in names:

        def hook(m, a, o, n=n):
            t = o[0] if isinstance(o, tuple) else o
            if torch.is_tensor(t):
                seen[n] = t.detach().clone().numpy()

        hooks.append(mods[n].register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("scheme", ["xxh3", "blake3"])
def test_llama_capture_digests_match_the_hash_of_hooked_outputs(tmp_path, threads, scheme):
    model = _model()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[2, :5] = 0
    names = default_modules(model)
    seen = _oracle_outputs(model, ids, mask, names)
    rm = _row_map()
    with torch.no_grad(), dmlib.capture(model, tmp_path / "c", row_map=rm, block_rows=BLOCK,
                                        hash_threads=threads, hash=scheme):  # fmt: skip
        model(input_ids=ids, attention_mask=mask)
    c = dmlib.open_capture(tmp_path / "c")
    flat = [e for row in rm for e in row]
    checked = 0
    for name, x in seen.items():
        b = c.boundary(name)
        assert b.hash == SCHEME[scheme] and b.digest == leaf(x, scheme), name
        if x.ndim >= 2 and x.shape[:2] == (B, S):
            rows = x.reshape(B * S, *x.shape[2:])
            for rid in ("r0", "r1", "r2"):
                mine = rows[[i for i, e in enumerate(flat) if e is not None and e[0] == rid]]
                blocks = [leaf(mine[i : i + BLOCK], scheme) for i in range(0, len(mine), BLOCK)]
                got = b.requests[rid]
                assert got.blocks == blocks, (name, rid)
                # a request of several blocks: its digest is the tree over its blocks
                assert got.digest == tree_request(mine, BLOCK, scheme)[0], (name, rid)
                assert (len(blocks) == 1) == (got.digest == leaf(mine, scheme)), (name, rid)
                assert got.n_rows == len(mine)
            checked += 1
        elif b.leading is not None:
            assert b.leading == [leaf(row, scheme) for row in x], name
    assert checked >= 10  # embeddings, projections, MLPs, norms, logits
