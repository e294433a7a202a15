"""The hierarchical-mesh tables of README.md: per rate, each cell's median step time per round
and over both rounds' steps pooled, the ratios to flat dense, and time to 0.97 accuracy; the
bytes per step through each host's NIC (run.sh's `nic` target: a 40-step run less a 10-step one).

  PYTHONPATH=. python docs/results/network/hier_table.py [TAG]

With TAG, the cells of run.sh's ``TAG=... hier RATE`` series (``...-RATE-TAG-rN``).
"""

import glob
import os
import statistics
import sys

from jaxcomp.study import _network

HERE = os.path.dirname(os.path.abspath(__file__))
CELLS = ("dense-flat", "powersgd-hier", "accordion-hier")


def steps(workdir):
    """The step times the report's median uses (warm-up and after-evaluation steps left out)."""
    st = _network.step_times(workdir)
    timing = _network._jsonl(os.path.join(workdir, _network.TIMING))
    return [r["step_s"] for r in timing if r["step"] not in set(st["left_out"])]


def main(tag=None):
    print("| rate | cell | median ms per round | pooled median ms | flat dense / cell | "
          "time to 0.97 s (train) per round | load before per round |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    series = f"-{tag}" if tag else ""
    for rate in ("unlimited", "10gbit", "1gbit", "100mbit", "10mbit"):
        pooled = {}
        rows = []
        for cell in CELLS:
            pattern = f"{cell}-2x4-{rate}{series}-r*"
            runs = sorted(glob.glob(os.path.join(HERE, "cells", pattern)))
            if not runs:
                continue
            recs = [_network.read_lab_run(w) for w in runs]
            meds = [1e3 * r["measured"]["step_time"]["median_s"] for r in recs]
            pooled[cell] = 1e3 * statistics.median(s for w in runs for s in steps(w))
            tta = []
            for r in recs:
                t = (r["measured"]["time_to_accuracy"] or {}).get("0.97")
                tta.append("—" if not t else f"{t['train_s']:.1f}")
            load = [str(r["load_before"][0]) for r in recs]
            rows.append((cell, meds, tta, load))
        for cell, meds, tta, load in rows:
            ratio = pooled["dense-flat"] / pooled[cell]
            print(
                f"| {rate} | {cell} | {' / '.join(f'{m:.1f}' for m in meds)} | "
                f"{pooled[cell]:.1f} | {ratio:.2f} | {' / '.join(tta)} | {' / '.join(load)} |"
            )


def nic():
    print("\n| rate | cell | NIC bytes per host per step (host 0 / host 1) |\n|---|---|---|")
    for path in sorted(glob.glob(os.path.join(HERE, "nic_bytes-*.txt"))):
        rate = os.path.basename(path)[len("nic_bytes-") : -len(".txt")]
        runs = {}
        for line in open(path):
            cell, steps, *hosts = line.split()
            runs.setdefault(cell, {})[int(steps)] = [int(b) for b in hosts[1::2]]
        for cell, by in runs.items():
            (n0, b0), (n1, b1) = sorted(by.items())
            per = [(y - x) / (n1 - n0) for x, y in zip(b0, b1)]
            print(f"| {rate} | {cell} | {' / '.join(f'{p:,.0f}' for p in per)} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
    nic()
