"""save_pretrained folders (transformers model, PEFT adapter) read as checkpoints.

The folders are written by transformers and peft themselves (tiny random-init Qwen2 built
from a config); the oracle is safetensors' own reader, or torch.load for ``.bin`` files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import dmlib
import dmlib.io
from dmlib.cli import main
from dmlib.errors import FormatError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# peft 0.21 calls a transformers 5 method that warns of its own deprecation
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")


def _tiny_qwen2() -> object:
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    model = _tiny_qwen2()
    out = {k: root / k for k in ("model", "sharded", "model_bin", "adapter", "adapter_bin")}
    model.save_pretrained(out["model"])
    model.save_pretrained(out["sharded"], max_shard_size="20KB")
    model.save_pretrained(out["model_bin"], safe_serialization=False)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                           "o_proj"], init_lora_weights=False)  # fmt: skip
    pm = peft.get_peft_model(model, lora)
    pm.save_pretrained(out["adapter"])
    pm.save_pretrained(out["adapter_bin"], safe_serialization=False)
    return out


def _oracle(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's weights, read by safetensors or torch themselves."""
    from safetensors import safe_open

    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    out: dict[str, np.ndarray] = {}
    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(f, "np") as s:
                out.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118
        else:
            state = torch.load(f, weights_only=True)
            out.update({k: v.numpy() for k, v in state.items()})
    return out


@pytest.mark.parametrize(
    ("kind", "fmt"),
    [("model", "hf-model"), ("sharded", "hf-model"), ("model_bin", "hf-model"),
     ("adapter", "peft-adapter"), ("adapter_bin", "peft-adapter")],
)  # fmt: skip
def test_folder_reads_every_tensor_as_the_library_wrote_it(folders, kind, fmt):
    folder = folders[kind]
    assert dmlib.io.detect_format(folder) == fmt
    expected = _oracle(folder)
    assert len(expected) > 10
    with dmlib.open_tensors(folder) as ts:
        assert ts.format == fmt and set(ts) == set(expected)
        for name, arr in expected.items():
            got = ts[name].load()
            assert got.dtype == arr.dtype and got.shape == arr.shape
            np.testing.assert_array_equal(got, arr)
    if kind == "sharded":
        assert len(list(folder.glob("model-*.safetensors"))) > 1  # really sharded


def test_model_folder_keeps_its_config_as_metadata(folders):
    config = json.loads((folders["model"] / "config.json").read_text())
    with dmlib.open_tensors(folders["model"]) as ts:
        assert json.loads(ts.metadata["config.json"]) == config
        assert ts.layout["weights"] == "model.safetensors"


def test_adapter_folder_scalars_are_the_config_values_that_change_the_weight(folders):
    config = json.loads((folders["adapter"] / "adapter_config.json").read_text())
    with dmlib.open_tensors(folders["adapter"]) as ts:
        assert ts.scalars["adapter_config.r"] == config["r"] == 8
        assert ts.scalars["adapter_config.lora_alpha"] == config["lora_alpha"] == 16
        assert ts.scalars["adapter_config.use_rslora"] is False
        assert "adapter_config.peft_version" not in ts.scalars  # not a weight's value


def test_adapter_config_change_alone_makes_the_raw_comparison_differ(folders, tmp_path):
    changed = tmp_path / "alpha32"
    changed.mkdir()
    for f in folders["adapter"].iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    config = json.loads((changed / "adapter_config.json").read_text())
    config["lora_alpha"] = 32
    (changed / "adapter_config.json").write_text(json.dumps(config))
    df = dmlib.compare(folders["adapter"], changed)
    assert int(df["n_diff"].sum()) == 0  # the factors are equal...
    s = dmlib.summarize(df)
    assert not s and s.n_scalars_diff == 1  # ...but the weight added is not


def test_trainer_checkpoint_folder_is_still_the_trainer_format(folders, tmp_path):
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    for f in folders["model"].iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": []}))
    assert dmlib.io.detect_format(ckpt) == "hf-trainer"


@pytest.mark.parametrize("command", ["inspect", "compare"])
def test_command_line_takes_the_folders(folders, command, capsys):
    argv = [command, str(folders["model"])]
    if command == "compare":
        argv.append(str(folders["sharded"]))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ("IDENTICAL" in out) if command == "compare" else ("hf-model" in out)


def test_sharded_and_single_folders_compare_identical(folders):
    assert dmlib.summarize(dmlib.compare(folders["model"], folders["sharded"]))
    assert dmlib.summarize(dmlib.compare(folders["adapter"], folders["adapter_bin"]))


def test_folder_not_taken_says_what_was_looked_for(tmp_path, folders):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FormatError) as info:
        dmlib.open_tensors(empty)
    msg = str(info.value)
    for looked in ("config.json", "model.safetensors", "adapter_config.json",
                   "adapter_model.safetensors", "trainer_state.json"):  # fmt: skip
        assert looked in msg
    assert "\n" not in msg and str(empty) in msg


@pytest.mark.parametrize(
    ("keep", "expected"),
    [(["config.json"], "holds config.json but none of model.safetensors.index.json"),
     (["adapter_model.safetensors"], "holds adapter_model.safetensors but no adapter_config.json"),
     (["adapter_config.json"], "holds adapter_config.json but none of adapter_model.safetensors")],
)  # fmt: skip
def test_half_a_folder_is_named(tmp_path, folders, keep, expected):
    src = folders["adapter"] if keep[0].startswith("adapter") else folders["model"]
    half = tmp_path / "half"
    half.mkdir()
    for name in keep:
        (half / name).write_bytes((src / name).read_bytes())
    with pytest.raises(FormatError, match=expected):
        dmlib.open_tensors(half)
    assert main(["inspect", str(half)]) == 2


@pytest.mark.parametrize("config", ["adapter_config.json", "config.json"])
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"[" * 100_000])
def test_corrupt_config_is_refused_naming_the_file(tmp_path, folders, config, content):
    src = folders["adapter"] if config.startswith("adapter") else folders["model"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / config).write_bytes(content)
    with pytest.raises(FormatError) as info:
        dmlib.open_tensors(bad)
    assert os.path.join(str(bad), config) in str(info.value)


def test_config_that_is_a_fifo_is_refused_without_waiting(tmp_path, folders):
    import threading

    bad = tmp_path / "fifo"
    bad.mkdir()
    for f in folders["adapter"].iterdir():
        if f.name != "adapter_config.json":
            (bad / f.name).write_bytes(f.read_bytes())
    os.mkfifo(bad / "adapter_config.json")
    errors: list[BaseException] = []

    def read() -> None:
        try:
            dmlib.open_tensors(bad)
        except BaseException as err:  # noqa: BLE001  (the outcome is checked below)
            errors.append(err)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "opening waited on a FIFO"
    assert len(errors) == 1 and isinstance(errors[0], FormatError)
    assert "not a regular file" in str(errors[0])
