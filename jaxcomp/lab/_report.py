"""``python -m jaxcomp.lab report``: the table and plots of lab runs given by their workdirs."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from jaxcomp.lab import _calibrate
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


def find_calibrations(paths: Sequence[str]) -> list[dict]:
    """The calibrations (JSON files with ``fits`` and ``achieved``) among ``paths`` and their
    subfolders, in order."""
    found = []
    for path in paths:
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".json")):
                try:
                    with open(os.path.join(root, name)) as f:
                        record = json.load(f)
                except (OSError, json.JSONDecodeError):
                    continue
                if isinstance(record, dict) and {"fits", "achieved", "network"} <= set(record):
                    found.append(record)
    return found


def calibration_table(calibrations: Sequence[dict]) -> str:
    """Markdown: one line per calibrated network, the achieved TCP rate, each kind's fit and the
    chain fit of a calibration on 3 hosts or more (:func:`jaxcomp.lab._calibrate.chain`: a
    send whose receiver also sends starts ``min(max(n - o, 0), c) / beta`` late; ``—`` where
    none was probed)."""
    head = ["topology", "hosts x devices", "rate", "achieved Mbit/s", "all-reduce alpha us",
            "all-reduce beta Mbit/s", "max error", "permute alpha us", "permute beta Mbit/s",
            "max error", "chain o bytes", "chain c bytes", "chain max error ms",
            "load before / after"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in calibrations:
        net, fits = c["network"], c["fits"]
        cells = [net["topology"], f"{net['hosts']} x {net['devices_per_host']}", net["rate"],
                 f"{c['achieved']['bit_s'] / 1e6:.1f}"]  # fmt: skip
        for kind in ("all-reduce", "collective-permute"):
            f = fits.get(kind)
            if f is None:
                cells += ["—"] * 3
                continue
            cells += [f"{1e6 * f['alpha_s']:.0f}", f"{f['beta_bit_s'] / 1e6:.1f}",
                      f"{100 * f['max_rel_error']:.0f}%"]  # fmt: skip
        chain = c.get("chain")
        if chain:
            cap = chain["cap_bytes"]
            cells += [f"{chain['offset_bytes']:,.0f}", "none" if cap == math.inf else f"{cap:,.0f}",
                      f"{1e3 * chain['max_abs_error_s']:.1f}"]  # fmt: skip
        else:
            cells += ["—"] * 3
        cells.append(f"{c['load_before'][0]} / {c['load_after'][0]}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(paths: Sequence[str], out_dir: str) -> str:
    """Writes ``report.md`` (the runs' table, :func:`jaxcomp.study._network.table`, and the
    calibrations found among ``paths``, :func:`calibration_table`) and the plots of accuracy
    against training time per rate and of measured against predicted step time into
    ``out_dir``; returns the markdown's path."""
    records = [_network.read_lab_run(w) for w in find_runs(paths)]
    # calibrations stored before the ping-pong's fit knew the token bucket: refitted from
    # their probes (_calibrate.refit)
    records = _network.predict([
        {**r, "calibration": _calibrate.refit(r["calibration"])} if r.get("calibration") else r
        for r in records
    ])  # fmt: skip
    os.makedirs(out_dir, exist_ok=True)
    lines = ["# Lab runs", "", _network.TABLE_NOTE, "", _network.table(records), ""]
    calibrations = [_calibrate.refit(c) for c in find_calibrations(paths)]
    if calibrations:
        lines += ["Calibrations (cost model fits on the lab's links; alpha per message, beta "
                  "the bandwidth the collective achieves; chain: a send whose receiver also "
                  "sends in the same permute starts min(max(n - o, 0), c) / beta later, fitted "
                  "on 3 hosts or more):", "", calibration_table(calibrations), ""]  # fmt: skip
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
