"""``python -m jaxcomp.lab report``: the table and plots of lab runs given by their workdirs."""

from __future__ import annotations

import os
from collections.abc import Sequence

from jaxcomp.study import _network


def find_runs(paths: Sequence[str]) -> list[str]:
    """The lab runs' workdirs among ``paths`` and their subfolders (those holding ``lab.json``),
    in order.

    Raises:
      ValueError: if none of ``paths`` holds a lab run.
    """
    found = []
    for path in paths:
        for root, dirs, files in os.walk(path):
            dirs.sort()
            if _network.LAB_FILE in files:
                found.append(root)
                dirs.clear()
    if not found:
        raise ValueError(f"no lab run ({_network.LAB_FILE}) under {list(paths)}.")
    return found


def write(paths: Sequence[str], out_dir: str) -> str:
    """Writes ``report.md`` (the runs' table, :func:`jaxcomp.study._network.table`) and the
    plots of accuracy against training time per rate and of measured against predicted step
    time into ``out_dir``; returns the markdown's path."""
    records = _network.predict([_network.read_lab_run(w) for w in find_runs(paths)])
    os.makedirs(out_dir, exist_ok=True)
    lines = ["# Lab runs", "", _network.TABLE_NOTE, "", _network.table(records), ""]
    notes = sorted({f"{r['name']}: no prediction ({r['prediction']['why']})" for r in records
                    if r["prediction"].get("step_s") is None})  # fmt: skip
    if notes:
        lines += ["Notes:", *[f"- {n}" for n in notes], ""]
    plots = _network.plots(records, out_dir)
    lines += [f"![{k}]({os.path.basename(v)})" for k, v in plots.items()]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    return path
