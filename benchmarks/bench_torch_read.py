"""torch files read without torch: whole ``dmlib`` processes, interleaved, best of N, as ratios.

1. ``dmlib compare`` of two ``optimizer.pt`` files (AdamW state after one step, two seeds)
   vs the same compare of the ``model.safetensors`` files beside them (target <= 1.5x);
2. before/after: the same optimizer compare by the reader of revision ``--before`` (default:
   the last revision that read torch files with ``torch.load``), extracted with
   ``git archive`` under benchmarks/_work_torch/, vs this tree's;
3. the nesting bomb (a torch zip whose pickle nests 2**k references to the same lists):
   ``dmlib inspect`` time and peak RSS, before and after (before with a smaller k, since
   it expands the whole thing; ``--bomb-before`` sets k).

Every measurement is a child process timed from spawn to exit with its peak RSS and CPU
seconds from ``wait4`` (benchmarks/_proc.py).

    python -m benchmarks.bench_torch_read [--params 2000000] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from benchmarks._proc import run_cpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work_torch"
RESULTS = HERE / "results" / "torch_read.json"
BEFORE = "b6eb418"  # the tree before torch files were read without torch


def write_runs(params: int) -> None:
    """Two runs' model.safetensors and optimizer.pt (AdamW after one step), different seeds."""
    import torch
    from safetensors.torch import save_file

    width = max(8, int((params / 8) ** 0.5))
    for seed, run in ((0, "A"), (1, "B")):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(width, width) for _ in range(8)]
        model = torch.nn.Sequential(*layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, width)).square().mean().backward()
        opt.step()
        d = WORK / run
        d.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in model.state_dict().items()}, d / "model.safetensors"
        )
        torch.save(opt.state_dict(), d / "optimizer.pt")


def bomb(path: Path, levels: int) -> None:
    """A torch zip whose data.pkl is l0 = [0, 0]; l_{i+1} = [l_i, l_i] (2**(levels+1) leaves)."""
    pkl = b"\x80\x02(K\x00K\x00l" + b"q\x00(h\x00h\x00l" * levels + b"."
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")


def before_tree(rev: str) -> Path:
    """dmlib as it was at ``rev`` (its files only), for the 'before' rows."""
    out = WORK / f"before-{rev}"
    if not out.exists():
        data = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "dmlib"], capture_output=True, check=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(out, filter="data")
    return out


def best(cmds: dict[str, list[str]], repeat: int, ok: tuple[int, ...] = (0, 1)) -> dict:
    """Best-of-``repeat`` (seconds, peak MiB, CPU s) of each command, run interleaved."""
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cmds}
    for _ in range(repeat):
        for k, cmd in cmds.items():
            runs[k].append(run_cpu(cmd, ok, cwd=WORK))  # not the repo: -m puts cwd first
    return {k: {"s": min(r[0] for r in v), "mib": min(r[1] for r in v), "cpu_s": min(r[2] for r in v)}
            for k, v in runs.items()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--bomb-before", type=int, default=16)
    ap.add_argument("--bomb-after", type=int, default=26)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.params, args.repeat = 200_000, 1
    import compileall

    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    try:
        write_runs(args.params)
        old = before_tree(args.before)
        compileall.compile_dir(str(ROOT / "dmlib"), quiet=1)
        compileall.compile_dir(str(old / "dmlib"), quiet=1)
        py = sys.executable
        new_dm = ["env", f"PYTHONPATH={ROOT}", py, "-m", "dmlib"]
        old_dm = ["env", f"PYTHONPATH={old}", py, "-m", "dmlib"]
        a, b = WORK / "A", WORK / "B"
        rows = best(
            {
                "optimizer.pt (after)": [*new_dm, "compare", str(a / "optimizer.pt"), str(b / "optimizer.pt")],
                "model.safetensors": [*new_dm, "compare", str(a / "model.safetensors"), str(b / "model.safetensors")],
                "optimizer.pt (before)": [*old_dm, "compare", str(a / "optimizer.pt"), str(b / "optimizer.pt")],
            },
            args.repeat,
        )  # fmt: skip
        bomb(WORK / "bomb_before.pt", args.bomb_before)
        bomb(WORK / "bomb_after.pt", args.bomb_after)
        bombs = best(
            {
                f"bomb 2**{args.bomb_before + 1} leaves (before)": [*old_dm, "inspect", "--no-hash", str(WORK / "bomb_before.pt")],
                f"bomb 2**{args.bomb_before + 1} leaves (after)": [*new_dm, "inspect", "--no-hash", str(WORK / "bomb_before.pt")],
                f"bomb 2**{args.bomb_after + 1} leaves (after)": [*new_dm, "inspect", "--no-hash", str(WORK / "bomb_after.pt")],
            },
            args.repeat,
            ok=(0, 1, 2, 4),
        )  # fmt: skip
        opt, st, before = (
            rows[k]["s"]
            for k in ("optimizer.pt (after)", "model.safetensors", "optimizer.pt (before)")
        )
        doc = {
            "params_per_model": args.params,
            "optimizer_bytes": (a / "optimizer.pt").stat().st_size,
            "safetensors_bytes": (a / "model.safetensors").stat().st_size,
            "rows": rows,
            "bombs": bombs,
            "ratio_optimizer_vs_safetensors": opt / st,
            "ratio_before_vs_after": before / opt,
            "cpu_ratio_optimizer_vs_safetensors": rows["optimizer.pt (after)"]["cpu_s"] / rows["model.safetensors"]["cpu_s"],
            "cpu_ratio_before_vs_after": rows["optimizer.pt (before)"]["cpu_s"] / rows["optimizer.pt (after)"]["cpu_s"],
        }  # fmt: skip
        for k, v in {**rows, **bombs}.items():
            print(f"{k:40s} {v['s']:7.3f} s  {v['mib']:7.1f} MiB  {v['cpu_s']:6.2f} CPU s")
        print(
            f"optimizer.pt / model.safetensors compare: {doc['ratio_optimizer_vs_safetensors']:.2f}x (target <= 1.5x)"
        )
        print(f"before / after (optimizer.pt compare): {doc['ratio_before_vs_after']:.2f}x")
        print(
            f"CPU seconds: optimizer.pt / model.safetensors {doc['cpu_ratio_optimizer_vs_safetensors']:.2f}x, "
            f"before / after {doc['cpu_ratio_before_vs_after']:.2f}x"
        )
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
