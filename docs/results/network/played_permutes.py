"""The lab's pipeline predictions with each boundary's own payloads (costsize, 2026-12-05).

The stored tick cells (`cells/pipeline-*-tick`) were run before the trainer recorded its step's
permutes (summary `boundary_permutes`), so the report plays every send at the mean payload. This
script copies those cells, adds the permutes of the same config compiled now (a 1-step run of
each variant in one process, 4 fake devices: the program the lab's 4 processes run; the tick
program is unchanged for boundaries alike), and prints measured / predicted before (mean) and
after (each boundary's forward and backward payload). The cells themselves are not changed.

  tools/cpu-slot env PYTHONPATH=$PWD python docs/results/network/played_permutes.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from jaxcomp.lab import _calibrate
from jaxcomp.study import _network

HERE = os.path.dirname(os.path.abspath(__file__))
ONE = ["--set", 'mesh=[("stage", 4)]', "--set", "total_steps=1", "--set", "eval_every=0",
       "--set", "checkpoint_every=0", "--set", "log_every=1"]  # fmt: skip
IDENTITY = ["--set", 'pipeline.forward="identity"', "--set", 'pipeline.backward="identity"']


def compiled_permutes(tmp: str, name: str, extra: list[str]) -> list[dict]:
    workdir = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "jaxcomp.main", "--config", "configs/digits_pipeline.py",
           "--workdir", workdir, "--cpu_devices", "4", *ONE, *extra]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)["boundary_permutes"]


def predictions(cells: str) -> dict[str, dict]:
    runs = [_network.read_lab_run(os.path.join(cells, n)) for n in sorted(os.listdir(cells))]
    runs = [{**r, "calibration": _calibrate.refit(r["calibration"])} if r.get("calibration")
            else r for r in runs]  # fmt: skip
    return {r["name"]: r for r in _network.predict(runs)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        permutes = {
            "quantized": compiled_permutes(tmp, "q", []),
            "identity": compiled_permutes(tmp, "i", IDENTITY),
        }
        cells = os.path.join(tmp, "cells")
        os.makedirs(cells)
        for name in sorted(os.listdir(os.path.join(HERE, "cells"))):
            if name.startswith("pipeline-") and name.endswith("-tick"):
                shutil.copytree(os.path.join(HERE, "cells", name), os.path.join(cells, name))
        before = predictions(cells)
        for name in before:
            path = os.path.join(cells, name, "summary.json")
            with open(path) as f:
                summary = json.load(f)
            summary["boundary_permutes"] = permutes[name.split("-")[1]]
            with open(path, "w") as f:
                json.dump(summary, f)
        after = predictions(cells)
    print("| cell | payloads fwd / bwd B | measured ms | predicted before (mean) | ratio | "
          "predicted after | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, b in before.items():
        a = after[name]
        sizes = a["measured"]["pipeline"]["payload_bytes"]
        meas = b["measured"]["step_time"]["median_s"]

        def cols(r):
            p = r["prediction"]
            if p.get("step_s") is None:
                return f"— ({p.get('why')})", "—"
            return f"{1e3 * p['step_s']:.1f}", f"{p['measured_over_predicted']:.2f}"

        print(f"| {name} | {' / '.join(str(x) for x in sizes[0])} | {1e3 * meas:.1f} | "
              f"{' | '.join(cols(b))} | {' | '.join(cols(a))} |")  # fmt: skip


if __name__ == "__main__":
    main()
