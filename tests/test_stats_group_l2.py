"""The global relative L2 over a group of tensors, against numpy over the concatenated arrays.

The gradient figures come from a generator whose ground truth is known: a tiny random-init
Qwen2 with a PEFT LoRA, sequences of unequal lengths, gradients from plain torch autograd
saved by hand (one backward over all sequences together; micro-batches accumulated with
the correct normalisation, and with the per-micro-batch mean bug).
"""

from __future__ import annotations

import numpy as np
import pytest

import dmlib
from dmlib.cli import main
from dmlib.errors import DmlibError
from dmlib.stats.group_l2 import group_l2, parse_groups


def _oracle(a: dict[str, np.ndarray], b: dict[str, np.ndarray], names: list[str]) -> float:
    x = np.concatenate([a[n].astype(np.float64).ravel() for n in names])
    y = np.concatenate([b[n].astype(np.float64).ravel() for n in names])
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def test_hand_computed_case():
    a = {"x": np.array([3.0, 0.0], np.float32), "y": np.array([4.0], np.float32)}
    b = {"x": np.array([3.0, 1.0], np.float32), "y": np.array([4.0], np.float32)}
    row = group_l2(a, b).iloc[0]
    assert row["rel_l2"] == 0.2 and row["norm_a"] == 5.0 and row["norm_diff"] == 1.0
    assert row["n_tensors"] == 2 and row["numel"] == 3
    zero = {"x": np.zeros(2)}
    assert group_l2(zero, zero)["rel_l2"][0] == 0.0
    assert group_l2(zero, {"x": np.ones(2)})["rel_l2"][0] == np.inf


def test_groups_and_what_is_not_compared():
    rng = np.random.default_rng(0)
    a = {n: rng.standard_normal(s).astype(np.float32) for n, s in
         [("m.q.lora_A.weight", (4, 8)), ("m.q.lora_B.weight", (8, 4)), ("m.q.weight", (8, 8)),
          ("m.norm", (8,))]}  # fmt: skip
    a["steps"] = np.arange(3)
    b = {n: v + np.float32(1e-3) if v.dtype.kind == "f" else v for n, v in a.items()}
    b["only_b"] = np.zeros(2, np.float32)
    df = group_l2(a, b, ["all", "adapter", "qkv=re:\\.q\\.", "norm"]).set_index("group")
    floats = [n for n in a if a[n].dtype.kind == "f"]
    assert df.loc["all", "rel_l2"] == pytest.approx(_oracle(a, b, floats), rel=1e-12)
    lora = ["m.q.lora_A.weight", "m.q.lora_B.weight"]
    assert df.loc["adapter", "rel_l2"] == pytest.approx(_oracle(a, b, lora), rel=1e-12)
    assert df.loc["qkv", "n_tensors"] == 3 and df.loc["norm", "n_tensors"] == 1
    assert df.loc["all", "n_not_compared"] == 2  # the int tensor, the name only b holds
    assert parse_groups(None) == {"all": None}
    with pytest.raises(DmlibError):
        parse_groups(["=x"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_random_arrays_against_numpy(dtype):
    import ml_dtypes  # noqa: F401  (bfloat16 in numpy)

    rng = np.random.default_rng(3)
    shapes = [(17, 5), (300,), (2, 3, 4), (1,)]
    a = {f"t{i}": rng.standard_normal(s).astype(dtype) for i, s in enumerate(shapes)}
    b = {n: (v.astype(np.float64) * (1 + 1e-2 * rng.standard_normal(v.shape))).astype(dtype)
         for n, v in a.items()}  # fmt: skip
    got = group_l2(a, b)["rel_l2"][0]
    assert got == pytest.approx(_oracle(a, b, list(a)), rel=1e-12)


# -- gradients of packed and split micro-batches ------------------------------------------


def _gradients(tmp_path):
    """Adapter gradients of one backward over four sequences, and of two micro-batches
    accumulated correctly (each token loss / all tokens) and with the per-micro-batch mean."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors.torch import save_file

    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                           "o_proj"], init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (n,), generator=gen) for n in (3, 14, 5, 9)]
    total = sum(len(s) - 1 for s in seqs)  # predicted tokens over all sequences

    def token_loss_sum(batch):
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        for i, s in enumerate(batch):
            ids[i, : len(s)], mask[i, : len(s)], labels[i, : len(s)] = s, 1, s
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, 64), labels[:, 1:].reshape(-1), reduction="sum"
        ), int((labels[:, 1:] != -100).sum())

    def grads(kind):
        model.zero_grad()
        if kind == "packed":
            loss, _ = token_loss_sum(seqs)
            (loss / total).backward()
        else:
            for mb in (seqs[:2], seqs[2:]):
                loss, n = token_loss_sum(mb)
                (loss / total if kind == "correct" else loss / n / 2).backward()
        out = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()
               if p.grad is not None}  # fmt: skip
        path = tmp_path / f"{kind}.safetensors"
        save_file(out, path)
        return path, {n: v.numpy() for n, v in out.items()}

    return {k: grads(k) for k in ("packed", "correct", "bug")}


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
def test_gradient_l2_of_the_per_micro_batch_mean_bug(tmp_path, capsys):
    g = _gradients(tmp_path)
    (packed, pa), (correct, ca), (bug, ba) = g["packed"], g["correct"], g["bug"]
    names = list(pa)
    assert names and all("lora_" in n for n in names)  # only the adapter is trained
    got_ok = group_l2(packed, correct, ["all", "adapter"]).set_index("group")["rel_l2"]
    got_bug = group_l2(packed, bug, ["all", "adapter"]).set_index("group")["rel_l2"]
    oracle_ok, oracle_bug = _oracle(pa, ca, names), _oracle(pa, ba, names)
    assert got_ok["all"] == pytest.approx(oracle_ok, rel=1e-12)
    assert got_bug["all"] == pytest.approx(oracle_bug, rel=1e-12)
    assert got_ok["adapter"] == got_ok["all"]
    # the bug weighs the short micro-batch's tokens more: far above float32 rounding
    assert oracle_ok < 1e-5 and oracle_bug > 1e-2 and oracle_bug > 1e3 * oracle_ok
    # the command line's figure is the same number
    assert main(["compare", str(packed), str(bug), "--group-l2", "all", "--json"]) == 1
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["group_l2"][0]["rel_l2"] == pytest.approx(oracle_bug, rel=1e-12)
    argv = ["matrix", f"packed={packed}", f"correct={correct}", f"bug={bug}", "--control",
            "bug", "--group-l2", "adapter", "--json"]  # fmt: skip
    assert main(argv) == 1
    rows = {(r["a"], r["b"]): r for r in json.loads(capsys.readouterr().out)["group_l2"]}
    assert rows["packed", "correct"]["rel_l2"] == pytest.approx(oracle_ok, rel=1e-12)
    assert rows["packed", "bug"]["rel_l2"] == pytest.approx(oracle_bug, rel=1e-12)
    assert rows["correct", "bug"]["rel_l2"] == pytest.approx(_oracle(ca, ba, names), rel=1e-12)
    print(f"global gradient L2: correct {oracle_ok:.3g}, per-micro-batch mean {oracle_bug:.4g}")


def test_dmlib_exports_group_l2():
    assert dmlib.group_l2 is group_l2


def test_figures_do_not_depend_on_blas_threads():
    # a threaded BLAS dot splits its sum by the thread count, so its last bits follow the
    # machine's cores; the same inputs must give the same bits under 1 and 4 BLAS threads
    from threadpoolctl import threadpool_limits

    from dmlib.stats.group_l2 import group_l2_records

    rng = np.random.default_rng(1)
    a = rng.standard_normal(3_000_001).astype(np.float32)
    b = a + (rng.standard_normal(a.size) * 1e-3).astype(np.float32)
    got = []
    for n in (1, 4):
        with threadpool_limits(limits=n, user_api="blas"):
            r = group_l2_records({"w": a}, {"w": b})[0]
        got.append((r["norm_a"].hex(), r["norm_diff"].hex()))
    assert got[0] == got[1]
