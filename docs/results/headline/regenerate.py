r"""Regenerates the numbers the README and the digits configs' docstrings state, or checks them.

  python docs/results/headline/regenerate.py            # rerun every config, write headline.json
  python docs/results/headline/regenerate.py --check    # rerun, compare with headline.json
  python docs/results/headline/regenerate.py --configs digits_dense,digits_ab --check
  python docs/results/headline/regenerate.py --out DIR   # write DIR/headline.json instead

Each config of :data:`CONFIGS` runs in full (``python -m jaxcomp.main --config NAME``, 8 fake
CPU devices, a fresh workdir) and its ``summary.json`` gives the numbers: final test accuracy
with compression on and off, bytes per step, the compression ratio, steps and wall time.
``headline.json`` holds them with a stamp (:func:`jaxcomp._stamp.stamp`: commit, a dirty
flag, jax / jaxlib / Python versions, date, CPU count). The runs are deterministic on one
machine and library version (a rerun, or a resumed run, gives the same bits), so ``--check``
compares accuracies and bytes exactly and wall times not at all; another jax/jaxlib or CPU
may round differently (the stamp says which produced the file). ``tests/test_headline.py``
checks that the README and the config docstrings quote these numbers. All five configs take
about 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
RESULTS = HERE / "headline.json"
CONFIGS = (
    "digits_pipeline",
    "digits_pipeline_1f1b_powersgd",
    "digits_dense",
    "digits_accordion",
    "digits_ab",
)
#: the summary's numbers that must reproduce exactly; wall time is recorded, never compared
EXACT = (
    "final_accuracy",
    "final_accuracy_uncompressed",
    "final_loss",
    "wire_bytes_per_step",
    "dense_bytes_per_step",
    "compression_ratio",
    "steps",
)


def run_config(name: str, workdir: str) -> dict:
    """Runs ``name`` in full in ``workdir``; its summary's numbers."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXCOMP_COMPILE_CACHE")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "jaxcomp.main", "--config", name, "--workdir", workdir]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    out = {k: summary[k] for k in EXACT if k in summary}
    out["wall_time_s"] = round(summary["wall_time_s"], 1)
    out["command"] = f"python -m jaxcomp.main --config {name} --workdir runs/{name}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python docs/results/headline/regenerate.py",
                                description=__doc__.strip().splitlines()[0])  # fmt: skip
    p.add_argument("--check", action="store_true", help="compare with headline.json, write nothing")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated config names")
    p.add_argument("--out", default=str(HERE), help="the folder of the headline.json written")
    args = p.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        p.error(f"unknown config(s) {unknown}; known: {list(CONFIGS)}")
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"configs": {}}
    sys.path.insert(0, str(ROOT))
    from jaxcomp import _stamp

    produced_by = _stamp.stamp()  # before the runs: the tree they ran from
    fresh = {}
    with tempfile.TemporaryDirectory(prefix="jaxcomp-headline-") as tmp:
        for name in names:
            fresh[name] = run_config(name, os.path.join(tmp, name))
            print(f"{name}: {json.dumps({k: fresh[name][k] for k in EXACT if k in fresh[name]})}")
    if args.check:
        diffs = [
            f"{name}.{k}: recorded {recorded['configs'].get(name, {}).get(k)!r}, now {v!r}"
            for name, numbers in fresh.items()
            for k, v in numbers.items()
            if k in EXACT and recorded["configs"].get(name, {}).get(k) != v
        ]
        print("\n".join(diffs) or f"all {len(fresh)} configs reproduce headline.json exactly")
        return 1 if diffs else 0
    recorded["configs"].update(fresh)
    recorded["stamp"] = produced_by
    out = pathlib.Path(args.out) / RESULTS.name
    out.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
