"""The tables of peers.md from the cells peers.sh kept (docs/results/network/peers/).

  PYTHONPATH=. python docs/results/network/peers_table.py [CELLS_DIR]

Step times as the lab's report reads them (jaxcomp.study._network.step_times: the steps after
the first 2); torch's runs are read the same way (their timing.jsonl has the trainer's format).
AB runs are split by the kind of each step (jaxcomp.transforms.ABSchedule.step_kind of the
step's index), and their mean is compared with data parallelism's mean.
"""

from __future__ import annotations

import collections
import json
import os
import re
import statistics
import sys

from jaxcomp.lab import _train
from jaxcomp.study import _network
from jaxcomp.transforms import ABSchedule

CELL = re.compile(r"^(?P<label>.+)-(?P<layout>\d+x\d+)-(?P<rate>[^-]+)-r(?P<round>\d+)$")
RATES = ("unlimited", "1gbit", "100mbit", "10mbit")
PEER_LABELS = ("dense", "torch-dense", "powersgd", "torch-powersgd")


def _json(path):
    with open(path) as f:
        return json.load(f)


def _ms(x) -> str:
    return f"{1e3 * x:.1f}"


def cells(root):
    out = {}
    for name in sorted(os.listdir(root)):
        m = CELL.match(name)
        if m and os.path.isfile(os.path.join(root, name, "cell.json")):
            out[name] = dict(m.groupdict(), dir=os.path.join(root, name))
    return out


def _load(c) -> str:
    rec = _json(os.path.join(c["dir"], "cell.json"))
    return f"{rec['load_before'][0]:.1f}/{rec['load_after'][0]:.1f}"


def _bytes(c) -> str:
    s = _json(os.path.join(c["dir"], "summary.json"))
    if "wire_bytes_per_step" in s:
        return f"{s['wire_bytes_per_step']:,.0f} (HLO, per device)"
    return f"{s['nic_tx_bytes_per_host_per_step']:,.0f} (NIC tx, per host)"


def peers_table(found) -> str:
    lines = [
        "| hosts x ranks | rate | round | jaxcomp dense | torch dense | jax/torch | "
        "jaxcomp PowerSGD | torch PowerSGD | jax/torch | dense/PowerSGD jaxcomp, torch | "
        "load 1-min (each run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = collections.defaultdict(dict)
    for c in found.values():
        if c["label"] in PEER_LABELS:
            by[(c["layout"], c["rate"], int(c["round"]))][c["label"]] = c
    for layout, rate in sorted({k[:2] for k in by}, key=lambda k: (k[0][::-1], RATES.index(k[1]))):
        rounds = sorted(r for (lt, rt, r) in by if (lt, rt) == (layout, rate))
        pooled = collections.defaultdict(list)
        for r in rounds:
            row = by[(layout, rate, r)]
            if len(row) != 4:
                continue
            med = {}
            for label, c in row.items():
                st = _network.step_times(c["dir"])
                med[label] = st
                pooled[label] += _timing(c["dir"])

            def cell(label, med=med):
                st = med[label]
                return f"{_ms(st['median_s'])} [{_ms(st['q25_s'])}, {_ms(st['q75_s'])}]"

            m = {k: v["median_s"] for k, v in med.items()}
            loads = ", ".join(_load(row[k]) for k in PEER_LABELS)
            lines.append(
                f"| {layout} | {rate} | {r} | {cell('dense')} | {cell('torch-dense')} | "
                f"{m['dense'] / m['torch-dense']:.2f} | {cell('powersgd')} | "
                f"{cell('torch-powersgd')} | {m['powersgd'] / m['torch-powersgd']:.2f} | "
                f"{m['dense'] / m['powersgd']:.2f}, {m['torch-dense'] / m['torch-powersgd']:.2f} "
                f"| {loads} |"
            )
        if pooled:
            p = {k: statistics.median(v) for k, v in pooled.items()}
            lines.append(
                f"| {layout} | {rate} | all | {_ms(p['dense'])} | {_ms(p['torch-dense'])} | "
                f"**{p['dense'] / p['torch-dense']:.2f}** | {_ms(p['powersgd'])} | "
                f"{_ms(p['torch-powersgd'])} | **{p['powersgd'] / p['torch-powersgd']:.2f}** | "
                f"{p['dense'] / p['powersgd']:.2f}, "
                f"{p['torch-dense'] / p['torch-powersgd']:.2f} | |"
            )
    return "\n".join(lines)


def _timing(workdir) -> list[float]:
    st = _network.step_times(workdir)
    rows = _network._jsonl(os.path.join(workdir, _network.TIMING))
    return [r["step_s"] for r in rows if r["step"] not in set(st["left_out"])]


def bytes_table(found) -> str:
    seen = {}
    for c in found.values():
        if c["label"] in (*PEER_LABELS, "ab", "dp-dense") and (c["label"], c["layout"]) not in seen:
            seen[c["label"], c["layout"]] = _bytes(c)
    return "\n".join(f"- {k[0]} {k[1]}: {v} bytes/step" for k, v in sorted(seen.items()))


def accuracy_lines(found) -> str:
    out = []
    for name, c in found.items():
        s = _json(os.path.join(c["dir"], "summary.json"))
        if "test_accuracy" in s:
            out.append(f"{name} {s['test_accuracy']:.3f}")
    return "; ".join(out)


def ab_table(found) -> str:
    """AB-Training against data parallelism: mean step over the run, and per step kind."""
    lines = [
        "| rate | round | run | steps | mean ms | median ms | AB mean / DP mean | load 1-min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    kinds_lines = [
        "| rate | round | step kind | steps | mean ms | median ms [q25, q75] |",
        "|---|---|---|---|---|---|",
    ]
    by = collections.defaultdict(dict)
    for c in found.values():
        if c["label"] in ("ab", "dp-dense"):
            by[RATES.index(c["rate"]), int(c["round"])][c["label"]] = c
    for key in sorted(by):
        row, rate, r = by[key], RATES[key[0]], key[1]
        if len(row) != 2:
            continue
        means = {}
        for label in ("ab", "dp-dense"):
            vals = _timing(row[label]["dir"])
            means[label] = statistics.fmean(vals)
        for label in ("ab", "dp-dense"):
            st = _network.step_times(row[label]["dir"])
            ratio = f"**{means['ab'] / means['dp-dense']:.2f}**" if label == "ab" else ""
            lines.append(
                f"| {rate} | {r} | {label} | {st['n']} | {_ms(means[label])} | "
                f"{_ms(st['median_s'])} | {ratio} | {_load(row[label])} |"
            )
        lab = _json(os.path.join(row["ab"]["dir"], "lab.json"))
        cfg = _train.resolve_config(lab["config"], lab["overrides"])
        sched = ABSchedule(cfg.ab.warmup_steps, cfg.ab.sync_every, cfg.ab.full_rank_steps)
        st = _network.step_times(row["ab"]["dir"])
        rows = _network._jsonl(os.path.join(row["ab"]["dir"], _network.TIMING))
        groups = collections.defaultdict(list)
        for rec in rows:
            if rec["step"] in st["left_out"]:
                continue
            t = rec["step"] - 1  # the step's index (the state's count before it)
            kind = sched.step_kind(t)
            if kind == "dense":
                kind = "dense (warm-up)" if t < sched.warmup_steps else "dense (after a sync)"
            groups[kind].append(rec["step_s"])
        cycle = [
            rec["step_s"]
            for rec in rows
            if sched.first_sync
            <= rec["step"] - 1
            < sched.first_sync
            + sched.sync_every * ((len(rows) - sched.first_sync) // sched.sync_every)
        ]
        for kind in ("dense (warm-up)", "dense (after a sync)", "dense_then_refactor", "ab",
                     "ab_then_sync"):  # fmt: skip
            v = groups.get(kind)
            if not v:
                continue
            q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
            kinds_lines.append(
                f"| {rate} | {r} | {kind} | {len(v)} | {_ms(statistics.fmean(v))} | "
                f"{_ms(statistics.median(v))} [{_ms(q[0])}, {_ms(q[2])}] |"
            )
        if cycle:
            kinds_lines.append(
                f"| {rate} | {r} | whole cycles after the warm-up "
                f"({len(cycle) // sched.sync_every} x {sched.sync_every}) | {len(cycle)} | "
                f"{_ms(statistics.fmean(cycle))} | "
                f"{_ms(statistics.median(cycle))} (/ DP mean: "
                f"{statistics.fmean(cycle) / means['dp-dense']:.2f}) |"
            )
    return "\n".join(lines) + "\n\n" + "\n".join(kinds_lines)


def main(argv) -> int:
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "peers")
    found = cells(root)
    print(peers_table(found), end="\n\n")
    print(bytes_table(found), end="\n\n")
    print("torch test accuracy at the end:", accuracy_lines(found), end="\n\n")
    print(ab_table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
