"""``python -m dmlib.lab NAME... --out data``: regenerate the determinism lab's datasets.

Each dataset module exposes ``generate(out_dir, *, small=False) -> dict`` returning its
manifest section; this entry point runs the ones asked for and rewrites
``<out>/MANIFEST.json`` with the sha256 of every file, the library versions and the CPU,
then each touched dataset's ``study.toml`` (:mod:`dmlib.lab.studies`; ``made_on`` from that
manifest). ``packed_ops`` adds the op level to the ``packed`` folder and leaves its
module-boundary captures as they are.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from dmlib.lab.manifest import update_manifest
from dmlib.lab.studies import write_studies

DATASETS = {
    "qr_init": "dmlib.lab.qr_init",
    "step_ladder": "dmlib.lab.train_ladder",
    "packed": "dmlib.lab.packed",
    "packed_ops": "dmlib.lab.packed_ops",
    "logprob_drift": "dmlib.lab.logprob_drift",
    "lora_steps": "dmlib.lab.lora_steps",
    "moe_packed": "dmlib.lab.moe_packed",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dmlib.lab", description=__doc__)
    p.add_argument("names", nargs="+", choices=[*DATASETS, "all"], help="datasets to generate")
    p.add_argument("--out", type=Path, default=Path("data"), help="data folder (default: data)")
    p.add_argument("--small", action="store_true", help="tiny versions, for smoke tests")
    args = p.parse_args(argv)
    names = list(DATASETS) if "all" in args.names else args.names
    args.out.mkdir(parents=True, exist_ok=True)
    sections = []
    for name in names:
        t0 = time.perf_counter()
        print(f"[dmlib.lab] generating {name} ...", file=sys.stderr, flush=True)
        module = importlib.import_module(DATASETS[name])
        section = module.generate(args.out, small=args.small)
        section.setdefault("name", name)
        section["seconds"] = round(time.perf_counter() - t0, 1)
        sections.append(section)
        print(
            f"[dmlib.lab] {name}: {len(section.get('files', []))} files in {section['seconds']} s",
            file=sys.stderr,
        )
    update_manifest(args.out, sections)
    write_studies(args.out, [s["name"] for s in sections])
    return 0


if __name__ == "__main__":
    sys.exit(main())
