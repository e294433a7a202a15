r"""Regenerates the numbers the README and the digits configs' docstrings state, or checks them.

  python docs/results/headline/regenerate.py            # rerun every config, write headline.json
  python docs/results/headline/regenerate.py --check    # rerun, compare with headline.json
  python docs/results/headline/regenerate.py --configs digits_dense,digits_ab --check
  python docs/results/headline/regenerate.py --out DIR   # write DIR/headline.json instead

Each config of :data:`CONFIGS` runs in full (``python -m jaxcomp.main --config NAME``, 8 fake
CPU devices, a fresh workdir) and its ``summary.json`` gives the numbers: every number of the
summary (final test accuracy with compression on and off, bytes per step per axis and step
kind, the compression ratio, steps) and the wall time.
``headline.json`` holds them with a stamp (:func:`jaxcomp._stamp.stamp`: commit, a dirty
flag, jax / jaxlib / Python versions, date, CPU count). The runs are deterministic on one
machine and library version (a rerun, or a resumed run, gives the same bits), so ``--check``
compares every number exactly but the wall time; another jax/jaxlib or CPU
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
#: name -> (config, --set overrides): the configs the README's table lists, and the main job
#: trained uncompressed (the README's headline compares it)
CONFIGS = {
    "digits_pipeline": ("digits_pipeline", ()),
    "digits_pipeline_uncompressed": (
        "digits_pipeline",
        ('pipeline.forward="identity"', 'pipeline.backward="identity"'),
    ),
    "digits_pipeline_1f1b_powersgd": ("digits_pipeline_1f1b_powersgd", ()),
    "digits_dense": ("digits_dense", ()),
    "digits_accordion": ("digits_accordion", ()),
    "digits_ab": ("digits_ab", ()),
}
#: the summary's numbers are recorded and must reproduce exactly, but for these
NOT_EXACT = ("wall_time_s",)


def run_config(name: str, workdir: str) -> dict:
    """Runs ``name`` (:data:`CONFIGS`) in full in ``workdir``; its summary's numbers and the
    command that produced them."""
    config, sets = CONFIGS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXCOMP_COMPILE_CACHE")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    flags = [x for s in sets for x in ("--set", s)]
    cmd = [sys.executable, "-m", "jaxcomp.main", "--config", config, "--workdir", workdir, *flags]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    out = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and k not in NOT_EXACT}
    out["wall_time_s"] = round(summary["wall_time_s"], 1)
    shown = "".join(f" --set '{s}'" for s in sets)
    out["command"] = f"python -m jaxcomp.main --config {config} --workdir runs/{name}{shown}"
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
            print(f"{name}: {json.dumps(fresh[name])}")
    if args.check:
        diffs = [
            f"{name}.{k}: recorded {recorded['configs'].get(name, {}).get(k)!r}, now {v!r}"
            for name, numbers in fresh.items()
            for k, v in numbers.items()
            if k not in (*NOT_EXACT, "command") and recorded["configs"].get(name, {}).get(k) != v
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
