"""The adapters notebook's sections on a study of real LoRA runs, against numpy.

The study is generated here: a tiny random-init Qwen2 with a PEFT LoRA (r=8, alpha=16 on
q/k/v/o) trained a few SGD steps by plain torch, its adapter saved by ``save_pretrained``
at every step and its gradients saved by hand; a second run with the same seed and a
control with another seed. Oracles: numpy's ``scaling * B @ A`` and numpy's relative L2
over the concatenated gradient arrays, on the files as written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.numpy import load_file  # noqa: E402

from dmlib import report  # noqa: E402
from dmlib.report import prose  # noqa: E402
from dmlib.report import sections_adapters as sections  # noqa: E402
from dmlib.report.build import missing  # noqa: E402
from dmlib.report.study import load_study  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")
STEPS = 3
NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "adapters.ipynb"


def _train(root: Path, label: str, seed: int) -> None:
    from safetensors.torch import save_file

    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                           "o_proj"], init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(model, lora)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    data = torch.Generator().manual_seed(7)  # the same data for every run
    for step in range(STEPS):
        model.save_pretrained(root / "runs" / label / f"step_{step}")
        ids = torch.randint(0, 64, (2, 12), generator=data)
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()
                 if p.grad is not None}  # fmt: skip
        (root / "grads" / label).mkdir(parents=True, exist_ok=True)
        save_file(grads, root / "grads" / label / f"step_{step}.safetensors")
        opt.step()


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora_study")
    for label, seed in (("base", 0), ("repeat", 0), ("seed8", 8)):
        _train(root, label, seed)
    (root / "study.toml").write_text(
        'title = "LoRA runs"\ncontrol = "seed8"\n'
        '[runs]\nbase = "runs/base"\nrepeat = "runs/repeat"\nseed8 = "runs/seed8"\n'
        '[adapters]\ngroup = "adapter"\n[adapters.gradients]\n'
        'base = "grads/base/step_*.safetensors"\nrepeat = "grads/repeat/step_*.safetensors"\n'
        'seed8 = "grads/seed8/step_*.safetensors"\n'
    )
    return root


def _oracle_l2(a: Path, b: Path) -> float:
    x, y = load_file(a), load_file(b)
    names = [n for n in x if "lora_" in n]
    xa = np.concatenate([x[n].astype(np.float64).ravel() for n in names])
    ya = np.concatenate([y[n].astype(np.float64).ravel() for n in names])
    return float(np.linalg.norm(xa - ya) / np.linalg.norm(xa))


def test_sections_against_numpy(study_dir, tmp_path):
    study = report.setup(study_dir / "study.toml", tmp_path / "figures", "adapters")
    assert missing(json_nb(), study) is None
    ad = sections.adapters_of(study)
    assert list(ad.runs) == ["base", "repeat", "seed8"]
    assert all(sorted(v) == list(range(STEPS)) for v in ad.runs.values())
    growth = sections.delta_growth(ad)
    assert len(growth) == 3 * STEPS * 8
    for row in growth.sample(10, random_state=0).itertuples():
        t = load_file(
            study_dir / "runs" / row.run / f"step_{row.step}" / "adapter_model.safetensors"
        )
        a = t[f"base_model.model.{row.target}.lora_A.weight"].astype(np.float64)
        b = t[f"base_model.model.{row.target}.lora_B.weight"].astype(np.float64)
        assert row.delta_norm == pytest.approx(np.linalg.norm(2.0 * (b @ a)), rel=1e-12)
    l2 = sections.gradient_l2(ad)
    assert set(l2["pair"]) == {"base vs repeat", "base vs seed8"}
    for row in l2.itertuples():
        g = study_dir / "grads"
        expected = _oracle_l2(g / row.a / f"step_{row.step}.safetensors",
                              g / row.b / f"step_{row.step}.safetensors")  # fmt: skip
        assert row.rel_l2 == pytest.approx(expected, rel=1e-12, abs=0)
    assert l2.set_index("pair").loc["base vs seed8", "control"].all()
    sections.delta_figure(ad)
    sections.gradient_figure(ad)
    for fig in ("adapters_delta_growth", "adapters_gradient_l2"):
        assert (tmp_path / "figures" / f"{fig}.png").stat().st_size > 1000
    text = sections.adapters_finding(ad)
    assert text and "adapter" in text


def json_nb() -> object:
    import nbformat

    return nbformat.read(NOTEBOOK, as_version=4)


def test_a_study_without_adapters_is_explained_in_one_line(tmp_path, capsys):
    np.save(tmp_path / "w.npy", np.zeros(3, np.float32))
    (tmp_path / "study.toml").write_text('[runs]\na = "w.npy"\n')
    study = report.setup(tmp_path / "study.toml", tmp_path / "figures", "adapters")
    assert missing(json_nb(), study) is not None  # dmlib report lists it as not applicable
    ad = sections.adapters_of(study)
    assert ad.empty
    for cell in (sections.delta_growth, sections.gradient_l2, sections.adapters_finding):
        assert cell(ad) is None
    from dmlib.report.notebook import numbers_path

    assert report.load_numbers(numbers_path())["skipped"] == [prose.NO_ADAPTERS_HERE]
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("> *Skipped: this study has no LoRA adapter")


@pytest.mark.slow
def test_notebook_runs_headless_on_the_study(study_dir, tmp_path):
    from dmlib.report.build import build_report

    study = load_study(study_dir / "study.toml")
    (res,) = build_report(study, tmp_path / "out", only=["adapters"], small=True, jobs=1,
                          timeout=300)  # fmt: skip
    assert res.ok, (res.failed_cell, res.error)
    numbers = report.load_numbers(tmp_path / "out" / "numbers" / "adapters.json")
    assert numbers["figures"] == ["adapters_delta_growth", "adapters_gradient_l2"], sorted(numbers)
    assert "finding" in numbers


def test_study_init_and_runs_read_adapter_folders_as_checkpoints(study_dir, tmp_path):
    from dmlib.report.studyfile import init_from_folder

    text = init_from_folder(study_dir / "runs")
    assert 'base = "base/"' in text and "3 checkpoints: a step ladder" in text
    (study_dir / "runs" / "study.toml").write_text(text)
    study = load_study(study_dir / "runs" / "study.toml")
    assert sorted(study.runs["seed8"].steps) == list(range(STEPS))
    assert all(p.is_dir() for p in study.runs["base"].checkpoints.values())
    one = tmp_path / "one.toml"
    one.write_text(f'[runs]\na = "{study_dir / "runs" / "base" / "step_2"}"\n')
    (path,) = load_study(one).runs["a"].checkpoints.values()
    assert path == study_dir / "runs" / "base" / "step_2"  # the folder, not its files
    assert sections.adapter_run_labels(load_study(one)) == ["a"]


def test_plots_draw_the_frames_values():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from dmlib.plots.adapters import adapter_delta_growth, gradient_l2_steps

    growth = pd.DataFrame({"step": [0, 1, 0, 1], "target": ["q", "q", "k", "k"],
                           "delta_norm": [1.0, 2.0, 0.0, 3.0]})  # fmt: skip
    ax = adapter_delta_growth(growth, ax=plt.figure().gca())
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["q"].get_ydata()) == [1.0, 2.0]
    assert np.isnan(lines["k"].get_ydata()[0]) and lines["k"].get_ydata()[1] == 3.0  # 0: a gap
    l2 = pd.DataFrame({"pair": ["a vs b"] * 2 + ["a vs c"] * 2, "step": [0, 1, 0, 1],
                       "rel_l2": [0.0, 0.0, 0.5, 0.25], "control": [False, False, True, True]})  # fmt: skip
    ax = gradient_l2_steps(l2, ax=plt.figure().gca())
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert lines["a vs c (control)"].get_linestyle() == "--"
    assert list(lines["a vs c (control)"].get_ydata()) == [0.5, 0.25]
    assert "a vs b (0 at every step: bit-identical)" in lines
    plt.close("all")
