"""Each lab dataset's ``study.toml``, written by ``python -m dmlib.lab`` beside its data.

The study names what the report analyses and, in ``made_on``, the machine that made the
data, computed from the environment the manifest recorded for that dataset (so a
regeneration on another machine rewrites it, and a test checks that the committed
files are what :func:`study_text` makes from the committed manifest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dmlib._atomic import atomic_write_text
from dmlib.lab.manifest import MANIFEST

__all__ = ["made_on", "study_text", "write_studies", "FOLDER"]

# manifest dataset -> the folder whose study it belongs to
FOLDER = {
    "qr_init": "qr_init",
    "step_ladder": "step_ladder",
    "packed": "packed",
    "packed_ops": "packed",
    "logprob_drift": "logprob_drift",
    "lora_steps": "lora_steps",
    "moe_packed": "moe_packed",
}
_HEAD = "# The lab's {what} as a study (format: dmlib.report.study; README).\n"


def _isa(env: dict[str, Any]) -> str:
    disp = env.get("torch_dispatch")
    if disp:
        return f"torch dispatching to {disp['cpu_capability']}"
    return "the ISA torch dispatched to was not recorded then"


def made_on(dataset: str, env: dict[str, Any]) -> str:
    """The ``made_on`` line of ``dataset``'s study, from its recorded environment."""
    libs = env.get("libraries", {})
    cpu = f"{env.get('cpu') or 'an unrecorded CPU'}, {env.get('cpu_count')} logical CPUs"
    if dataset == "qr_init":
        return (
            f"{cpu}, numpy {libs.get('numpy')} (data/MANIFEST.json); the QR reductions add in "
            "the explicit orders of dmlib.lab.autotune"
        )
    if dataset == "step_ladder":
        return f"{cpu}, torch {libs.get('torch')} (data/MANIFEST.json; threads per run in index.json; {_isa(env)})"
    if dataset == "packed":
        from dmlib.lab.packed import THREADS

        threads = f"{THREADS} thread" + ("" if THREADS == 1 else "s")
        return f"{cpu}, torch {libs.get('torch')}, {threads} (data/MANIFEST.json; {_isa(env)})"
    if dataset == "logprob_drift":
        return (
            f"{cpu}, torch {libs.get('torch')}, transformers {libs.get('transformers')}, 1 "
            f"thread, bfloat16 forwards (data/MANIFEST.json; {_isa(env)})"
        )
    if dataset == "lora_steps":
        return (
            f"{cpu}, torch {libs.get('torch')}, transformers {libs.get('transformers')}, peft "
            f"{libs.get('peft')}, 1 thread, float32 (data/MANIFEST.json; {_isa(env)})"
        )
    if dataset == "moe_packed":
        return (
            f"{cpu}, torch {libs.get('torch')}, transformers {libs.get('transformers')}, 1 "
            f"thread, bfloat16 (data/MANIFEST.json; {_isa(env)})"
        )
    raise KeyError(dataset)


def _q(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _table(name: str, items: dict[str, str]) -> list[str]:
    return ["", f"[{name}]", *(f"{k} = {_q(v)}" for k, v in items.items())]


def _logprob_drift_lines(env: dict[str, Any], folder: Path) -> list[str]:
    return [
        _HEAD.format(what="sampler-vs-trainer log-prob dataset").rstrip("\n"),
        'title = "A tiny Qwen2: sampler (KV cache) against trainer log-probs, lr 3e-3 and lr 0"',
        f"made_on = {_q(made_on('logprob_drift', env))}",
        "",
        "[logprobs]",
        'control = "lr0"',
        "",
        "[logprobs.runs]",
        *(
            f'{run} = {{ a = "{run}/sampler_*.jsonl", b = "{run}/trainer_*.safetensors" }}'
            for run in ("policy", "lr0")
            if (folder / run).is_dir()
        ),
    ]


def study_text(dataset: str, env: dict[str, Any], folder: Path) -> str:
    """The study of ``dataset`` whose files are in ``folder`` (what exists there is listed)."""
    if dataset in _OWN_LINES:  # datasets whose study is written by a helper of its own
        return "\n".join(_OWN_LINES[dataset](env, folder)) + "\n"
    if dataset == "qr_init":
        runs = {f"p{i}": f"seed7_p{i}.bpk" for i in range(1, 7)} | {"seed8": "seed8_control.bpk"}
        runs = {k: v for k, v in runs.items() if (folder / v).is_file()}
        lines = [
            _HEAD.format(what="QR-initialisation dataset").rstrip("\n"),
            'title = "QR initialisation: six same-seed processes and a different-seed control"',
            f"made_on = {_q(made_on(dataset, env))}",
            'control = "seed8"',
            *_table("runs", runs),
            "",
            "[[factor_groups]]",
            'kind = "svd"',
            'u = "{prefix}.u"',
            's = "{prefix}.s"',
            'v = "{prefix}.v"',
            "",
            "[anatomy]",
            "# model + optimizer + EMA records written through a never-cleared scratch buffer, and",
            "# the same model written by a zero-padding writer",
            'files = ["checkpoint_records.bpk", "checkpoint_model.bpk"]',
        ]
    elif dataset == "step_ladder":
        from dmlib.lab.train_ladder import RUNS

        runs = {
            k: f"{k}/" for k in ["base", *[r for r in RUNS if r != "base"]] if (folder / k).is_dir()
        }
        lines = [
            _HEAD.format(what="MiniLM fine-tune step ladder").rstrip("\n"),
            'title = "MiniLM fine-tune: a repeat and three variants that reorder floating-point work"',
            f"made_on = {_q(made_on(dataset, env))}",
            'reference = "base"',
            *_table("runs", runs),
            *(_table("repeats", {"repeat": "base"}) if "repeat" in runs else []),
            "",
            "[groups]",
            "\"attention.key.bias\" = 'attention\\.self\\.key\\.bias$'",
            "\"attention.query.bias\" = 'attention\\.self\\.query\\.bias$'",
            "\"attention.value.bias\" = 'attention\\.self\\.value\\.bias$'",
            "\"dense.bias\" = '(attention\\.output|intermediate|output)\\.dense\\.bias$'",
            "LayerNorm = 'LayerNorm\\.(weight|bias)$'",
        ]
    elif dataset == "packed":
        from dmlib.lab.packed_ops import FINDINGS, OPS_DIR

        names = ("alone", "packed", "padded", "packed_unpadded")
        lines = [
            _HEAD.format(what="packed-vs-alone captures").rstrip("\n"),
            'title = "One MiniLM request captured alone, padded and packed"',
            f"made_on = {_q(made_on(dataset, env))}",
            "",
            "[captures]",
            'request = "probe"',
            'reference = "alone"',
            'negative = "different"',
            *_table("captures.folders", {k: k for k in names if (folder / k).is_dir()}),
            *_table(
                "captures.repeats",
                {
                    k: f"{k}_repeat"
                    for k in ("alone", "packed")
                    if (folder / f"{k}_repeat").is_dir()
                },
            ),  # fmt: skip
        ]
        ops = folder / OPS_DIR
        if (ops / FINDINGS).is_file():
            lines += [
                "",
                "[captures.ops]  # ops of one encoder layer; the culprit op's tensors dumped whole",
                f'alone = "{OPS_DIR}/alone"',
                f'packed = "{OPS_DIR}/packed"',
                f'findings = "{OPS_DIR}/{FINDINGS}"  # the patch test, run by the lab with the live model',
            ]
    else:
        raise KeyError(dataset)
    return "\n".join(lines) + "\n"


def write_studies(out: Path, datasets: list[str]) -> list[Path]:
    """Write the study of every folder ``datasets`` touched, from ``out/MANIFEST.json``."""
    doc = json.loads((out / MANIFEST).read_text(encoding="utf-8"))["datasets"]
    written = []
    for folder in dict.fromkeys(FOLDER[d] for d in datasets if d in FOLDER):
        if folder not in doc:
            continue
        path = out / folder / "study.toml"
        atomic_write_text(path, study_text(folder, doc[folder]["environment"], out / folder))
        written.append(path)
    return written


def _lora_steps_lines(env: dict[str, Any], folder: Path) -> list[str]:
    """The LoRA dataset's study: the runs' adapter folders, their gradients, the control."""
    from dmlib.lab.lora_steps import LORA_SEED

    runs = [r for r in LORA_SEED if (folder / r).is_dir()]
    return [
        _HEAD.format(what="LoRA dataset").rstrip("\n"),
        'title = "A tiny Qwen2 with a LoRA: one batch, micro-batches (correct and per-micro-batch '
        'mean) and another LoRA seed"',
        f"made_on = {_q(made_on('lora_steps', env))}",
        'control = "seed8"',
        'reference = "base"',
        "",
        "[runs]",
        *(f'{r} = "{r}/adapter/"' for r in runs),
        "",
        "[adapters]",
        'group = "adapter"',
        "",
        "[adapters.gradients]",
        *(f'{r} = "{r}/grads/step_*.safetensors"' for r in runs),
    ]


def _moe_packed_lines(env: dict[str, Any], folder: Path) -> list[str]:
    """The hybrid MoE captures' study: the bfloat16 captures (float32's are in index.json)."""
    names = [k for k in ("alone", "packed") if (folder / "bf16" / k).is_dir()]
    return [
        _HEAD.format(what="hybrid MoE packed-vs-alone captures").rstrip("\n"),
        'title = "A tiny hybrid MoE (Qwen3-Next) request captured alone and packed, bfloat16: '
        'states, routing flips, expert rows"',
        f"made_on = {_q(made_on('moe_packed', env))}",
        "",
        "[captures]",
        'request = "probe"',
        'reference = "alone"',
        *(['negative = "bf16/different"'] if (folder / "bf16" / "different").is_dir() else []),
        *_table("captures.folders", {k: f"bf16/{k}" for k in names}),
        *_table(
            "captures.repeats",
            {"alone": "bf16/alone_repeat"} if (folder / "bf16" / "alone_repeat").is_dir() else {},
        ),
    ]


# datasets whose study is written by a helper of its own (study_text looks here first)
_OWN_LINES = {
    "logprob_drift": _logprob_drift_lines,
    "lora_steps": _lora_steps_lines,
    "moe_packed": _moe_packed_lines,
}
