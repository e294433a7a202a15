"""``write_report(workdir)``: a study's markdown table, CSVs and plots, written beside its runs."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from typing import Any

from jaxcomp import _stamp
from jaxcomp.study import _cost
from jaxcomp.study import _network
from jaxcomp.study import _plots
from jaxcomp.study import _report
from jaxcomp.study import _runner


def _bytes(n: float | None) -> str:
    from jaxcomp.train._metrics import format_bytes

    return "—" if n is None else format_bytes(n)


def _pm(mean: float | None, std: float | None, fmt: str = ".3f") -> str:
    if mean is None:
        return "—"
    return f"{mean:{fmt}} ± {std:{fmt}}" if std else f"{mean:{fmt}}"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown_table(rows: list[dict[str, Any]], axes: list[str], gbits) -> str:
    """The comparison table (one line per variant and axis values) in markdown."""
    speed = " / ".join(f"{g:g}" for g in gbits)
    head = ["variant", *axes, "seeds", "diverged", "final acc (on)", "final acc (off)",
            "best acc (on)", "best acc (off)", "final loss", "bytes/step", "axis",
            "vs dense", "vs baseline", "wall s", f"speedup at {speed} Gbit/s"]  # fmt: skip
    ppl = any(r.get("final_ppl_off") is not None for r in rows)
    if ppl:  # language models: the validation perplexity beside the loss
        i = head.index("final loss")
        head[i:i] = ["final ppl (on)", "final ppl (off)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        seeds = f"{r['seeds']}/{r['of_seeds']}" + (
            f" ({r['unfinished']} unfinished)" if r["unfinished"] else ""
        )
        cells = [
            r["variant"],
            *[str(r.get(a)) for a in axes],
            seeds,
            str(r["diverged"]),
            _pm(r["final_acc_on"], r["final_acc_on_std"]),
            _pm(r["final_acc_off"], r["final_acc_off_std"]),
            _pm(r["best_acc_on"], r["best_acc_on_std"]),
            _pm(r["best_acc_off"], r["best_acc_off_std"]),
            *[_pm(r[k], r[k + "_std"]) for k in ("final_ppl_on", "final_ppl_off") if ppl],
            _pm(r["final_loss"], r["final_loss_std"], ".4f"),
            _bytes(r["wire_bytes"]),
            r["axis"] or "—",
            _x(r["x_fewer_than_dense"]),
            _x(r["x_fewer_than_baseline"]),
            _pm(r["wall_time_s"], r["wall_time_s_std"], ".0f"),
            " / ".join(_x(r.get(f"speedup_{g:g}gbit")) for g in gbits),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kind_table(rows: list[dict[str, Any]], axes: list[str]) -> str:
    """Bytes per mean step per collective kind (``kind/group size``), one line per variant."""
    kinds = sorted({k for r in rows for k in (r.get("bytes_by_kind") or {})})
    if not kinds:
        return ""
    head = ["variant", *axes, *kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        by = r.get("bytes_by_kind")
        cells = [r["variant"], *[str(r.get(a)) for a in axes]]
        cells += ["—" if by is None else _bytes(by.get(k, 0.0)) for k in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _flat(value: Any) -> Any:
    if isinstance(value, Mapping):  # bytes_by_kind: "all-reduce/8=1024.0; ..."
        return "; ".join(f"{k}={v:g}" for k, v in value.items())
    return value


def _write_csv(path: str, rows: list[Mapping[str, Any]]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else _flat(r.get(k))) for k in fields})


def write_report(
    workdir: str,
    out_dir: str | None = None,
    *,
    compute_s: float | None = None,
    links: Mapping[float, _cost.NetworkLink] | None = None,
) -> dict[str, str]:
    """Reads the study in ``workdir`` and writes ``report.md``, ``report.csv`` (one row per
    variant and axis values), ``cells.csv`` (one row per run) and the PNG plots; for cells run
    in the network lab also their step times beside the cost model's
    (:mod:`jaxcomp.study._network`).

    Args:
      workdir: a study's folder (``python -m jaxcomp.study run ... --workdir DIR``).
      out_dir: where to write (default ``workdir``).
      compute_s: compute seconds per step for the predicted speedups (see
        :func:`~jaxcomp.study._report.aggregate`).
      links: ``{gbit_per_s: NetworkLink}`` for the predictions (default 1, 10, 100 Gbit/s).

    Returns:
      ``{"markdown", "csv", "cells_csv", <plot names>: path}``.

    Raises:
      ValueError: if ``workdir`` holds no study, or a run's files are damaged.
    """
    out_dir = out_dir or workdir
    os.makedirs(out_dir, exist_ok=True)
    manifest, runs = _report.read_runs(workdir)
    links = dict(links or {g: _cost.network_link(g) for g in _cost.GBIT_PER_S})
    rows, notes = _report.aggregate(manifest, runs, compute_s=compute_s, links=links)
    axes = list(manifest.get("axes", []))
    paths = {"markdown": os.path.join(out_dir, "report.md")}
    paths["csv"] = os.path.join(out_dir, "report.csv")
    paths["cells_csv"] = os.path.join(out_dir, "cells.csv")
    _write_csv(paths["csv"], rows)
    cells = []
    for run in runs:
        m = _report.run_metrics(run)
        cells.append({"cell": run.name, "variant": run.variant, **run.axes, "seed": run.seed,
                      "status": run.status, **m})  # fmt: skip
    _write_csv(paths["cells_csv"], cells)
    plots = _plots.all_plots(rows, runs, axes, out_dir)
    done_dirs = [os.path.join(workdir, run.name) for run in runs if run.status == "done"]
    lab_runs = _network.predict([r for r in map(_network.read_lab_run, done_dirs) if r])
    if lab_runs:
        plots.update(_network.plots(lab_runs, out_dir))
    paths.update(plots)
    done = sum(r.status == "done" for r in runs)
    diverged = sum(r.status == "diverged" for r in runs)
    doc = manifest.get("doc") or ""
    lines = [
        f"# Study `{manifest['study']}`"
        + (" (smoke: 2 steps per run)" if manifest.get("smoke") else ""),
        "",
        doc.split("\n\n")[0] if doc else "",
        "",
        f"{done} of {len(runs)} runs done, {diverged} diverged; baseline variant "
        f"`{manifest.get('baseline')}`; extra overrides {manifest.get('extra') or 'none'}. "
        'Mean ± sample std over seeds; "on"/"off": compression at evaluation (modes '
        'without compressed evaluation show only "off"); bytes/step: per device on the '
        'named mesh axis; "vs": how many times fewer bytes.',
        "",
        markdown_table(rows, axes, list(links)),
        "",
    ]
    kinds = kind_table(rows, axes)
    if kinds:
        lines += [
            "Bytes per step per device by collective kind and group size (`kind/devices`; "
            "the mean step of the run, what the predicted speedups price):",
            "",
            kinds,
            "",
        ]
    stamps = []
    for run in runs:
        record = _runner.read_cell_status(os.path.join(workdir, run.name)) or {}
        line = _stamp.describe(record["stamp"]) if record.get("stamp") else "not recorded"
        stamps += [line] if line not in stamps else []
    lines += [
        f"Produced by {'; '.join(stamps) or 'no run'}. Rerun: `python -m jaxcomp.study run "
        f"{manifest['study']} --workdir DIR`, then `python -m jaxcomp.study report DIR`.",
        "",
    ]
    if lab_runs:
        lines += [_network.TABLE_NOTE, "", _network.table(lab_runs), ""]
    if notes:
        lines += ["Notes:", *[f"- {n}" for n in notes], ""]
    for name, path in plots.items():
        lines.append(f"![{name}]({os.path.relpath(path, out_dir)})")
    with open(paths["markdown"], "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    return paths
