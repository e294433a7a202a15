"""Reads a study's runs and compares its variants: one markdown table, CSVs and PNG plots.

For every (variant, axis values) the seeds are aggregated as mean ± sample standard deviation:
final and best-over-evaluations test accuracy with compression on and off at evaluation (a
mode without compressed evaluation has only the "off" column), final loss, bytes per step on
the mesh axis the mode's traffic uses, against dense and against the study's baseline variant,
and per collective kind and group size, wall time, how many seeds diverged, and the cost
model's predicted speedup over the baseline at 1, 10 and 100 Gbit/s (:mod:`jaxcomp.study._cost`).

Everything is read from what the trainer writes: ``summary.json``, ``metrics.jsonl`` and
``experiment.json`` in each cell's workdir, and the study's ``study.json``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

from jaxcomp import _validate
from jaxcomp.study import _cost
from jaxcomp.study import _runner

#: the mesh axis a mode's ``wire_bytes_per_step`` travels on
TRAFFIC_AXIS = {
    "pipeline": "stage",
    "data_parallel": "data",
    "ab": "group x member",
    "dense": "all",
}
METRICS = (
    "final_acc_on",
    "final_acc_off",
    "best_acc_on",
    "best_acc_off",
    "final_loss",
    "final_ppl_on",
    "final_ppl_off",
    "wire_bytes",
    "dense_bytes",
    "wall_time_s",
)


class Run(NamedTuple):
    """One cell of a study as found on disk."""

    name: str
    variant: str
    axes: dict[str, str]
    seed: int
    status: str  # running / done / diverged / failed / missing
    summary: dict[str, Any]
    evals: list[dict[str, Any]]
    train: list[dict[str, Any]]
    experiment: dict[str, Any]


def _load_json(path: str, default):
    if not os.path.isfile(path):
        return default
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}).") from e


def _metrics(cell_dir: str) -> list[dict[str, Any]]:
    """``metrics.jsonl`` records; a last line cut by a kill is dropped, other damage raises."""
    path = os.path.join(cell_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    out = []
    for j, (i, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if j == len(lines) - 1 and not line.endswith("\n"):
                break  # the run was killed while writing its last record
            raise ValueError(f"{path} line {i} is damaged ({e}).") from e
    return out


def read_runs(workdir: str) -> tuple[dict[str, Any], list[Run]]:
    """The manifest and every cell of the study in ``workdir`` (started or not)."""
    manifest = _runner.read_manifest(workdir)
    runs = []
    for cell in manifest["cells"]:
        cell_dir = os.path.join(workdir, cell["name"])
        status = (_runner.read_cell_status(cell_dir) or {"status": "missing"})["status"]
        summary = _load_json(os.path.join(cell_dir, "summary.json"), {})
        if status == "done" and not summary:
            raise ValueError(f"cell {cell['name']} is done but has no summary.json.")
        records = _metrics(cell_dir)
        runs.append(
            Run(
                cell["name"],
                cell["variant"],
                dict(cell["axes"]),
                int(cell["seed"]),
                status,
                summary if status == "done" else {},
                [r for r in records if r.get("split") == "eval"],
                [r for r in records if r.get("split") == "train"],
                _load_json(os.path.join(cell_dir, "experiment.json"), {}),
            )
        )
    return manifest, runs


def _finite(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def run_metrics(run: Run) -> dict[str, Any]:
    """The per-run figures the report aggregates (``None`` where a run has none)."""
    s = run.summary
    compressed_eval = "final_accuracy_uncompressed" in s
    on_key, off_key = (
        ("accuracy", "accuracy_uncompressed") if compressed_eval else (None, "accuracy")
    )

    def best(key):
        vals = [_finite(r.get(key)) for r in run.evals] if key else []
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    diverged = run.status == "diverged" or (bool(s) and _finite(s.get("final_loss")) is None)
    return {
        "final_acc_on": _finite(s.get("final_accuracy")) if compressed_eval else None,
        "final_acc_off": _finite(s.get("final_accuracy_uncompressed", s.get("final_accuracy"))),
        "best_acc_on": best(on_key),
        "best_acc_off": best(off_key),
        "final_loss": _finite(s.get("final_loss")),
        # a language model's validation perplexity (exp of the loss), on and off as accuracy
        "final_ppl_on": _finite(s.get("final_perplexity")) if compressed_eval else None,
        "final_ppl_off": _finite(s.get("final_perplexity_uncompressed", s.get("final_perplexity"))),
        "wire_bytes": _finite(s.get("wire_bytes_per_step")),
        "dense_bytes": _finite(s.get("dense_bytes_per_step")),
        "wall_time_s": _finite(s.get("wall_time_s")),
        "steps": s.get("steps"),
        "mode": s.get("mode"),
        "diverged": diverged,
    }


def _data_axis_size(experiment: Mapping[str, Any]) -> int | None:
    for name, size in experiment.get("mesh", []):
        if name == "data":
            return int(size) if int(size) > 0 else None
    return 1


def collectives_of(run: Run) -> tuple[list[_cost.Collective] | None, str]:
    """The collectives of a mean step of ``run`` for the cost model, and how they were obtained.

    From ``summary["collectives"]`` when the trainer writes it (the dense, data-parallel and AB
    modes: :mod:`jaxcomp.train._collectives`): records outside any branch run as listed;
    records inside ``lax.cond`` branches (Accordion's per-layer modes, an update every k
    micro-batches) hold every branch once, so their executions are scaled by one factor that
    makes the step's bytes equal the run's measured mean ``wire_bytes_per_step`` (the bytes are
    then exact up to the few bytes of the loss and metric means the transform does not count;
    the split between branches, hence the message count, is estimated). For the pipeline mode
    otherwise rebuilt from ``boundary_bytes_per_step`` (``permutes_per_step`` permutes, each
    with the mean bytes, where the run records it: one per tick and direction; else ``2 M
    (S-1)`` single-pair permutes, every boundary carrying the same payload; with adaptive
    links, whose modes change during the run, the run's measured mean ``wire_bytes_per_step``
    instead) and
    ``hlo_collective_bytes_per_step`` (the rest: the gradient mean over the ``data`` axis, an
    all-reduce); ``None`` otherwise.
    """
    s = run.summary
    if isinstance(s.get("collectives"), list):
        return _measured(s["collectives"], s.get("wire_bytes_per_step"))
    if s.get("mode") == "pipeline" and s.get("boundary_bytes_per_step") is not None:
        m, stages = int(s["microbatches"]), int(s["stages"])
        sends = 2 * m * (stages - 1)
        boundary = rest_base = float(s["boundary_bytes_per_step"])
        how = "boundary permutes + data-axis all-reduce of the rest of the HLO bytes"
        if s.get("adaptive"):  # the links switch modes: the run's mean, not the low links'
            boundary = _finite(s.get("wire_bytes_per_step"))
            if boundary is None:
                return None, "adaptive links but no finite mean boundary bytes per step"
            how = how.replace(
                "boundary permutes", "boundary permutes (the run's mean boundary bytes)"
            )
        # a run since one permute per tick and direction (2026-12-05) records how many ran:
        # each carries every sending boundary's pair, its bytes the mean per permute
        permutes = sends
        if s.get("permutes_per_step") is not None:
            permutes = _finite(s["permutes_per_step"])
            if permutes is None or permutes < 1:
                raise ValueError(f"summary.json permutes_per_step is damaged: "
                                 f"{s['permutes_per_step']!r}.")  # fmt: skip
        out = [_cost.Collective("collective-permute", boundary / max(permutes, 1), 2, permutes)]
        rest = float(s.get("hlo_collective_bytes_per_step", rest_base)) - rest_base
        replicas = _data_axis_size(run.experiment)
        if rest > 0 and replicas != 1:
            out.append(_cost.Collective("all-reduce", rest, replicas or 2, 1))
        if replicas is None:
            how += " (data axis size unknown: priced for 2 replicas)"
        return out, how
    return None, f"mode {s.get('mode')!r} writes no per-kind collective bytes"


def _measured(records: list, wire) -> tuple[list[_cost.Collective] | None, str]:
    try:
        colls = [
            (
                _cost.Collective(
                    r["kind"],
                    float(r["bytes_per_execution"]),
                    int(r["group_size"]),
                    float(r.get("executions", 1)),
                ),
                bool(r.get("conditional", False)),
            )
            for r in records
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"summary.json collectives are damaged ({type(e).__name__}: {e}).") from e
    size = lambda c: c.bytes_per_execution * c.executions  # noqa: E731
    branched = sum(size(c) for c, cond in colls if cond)
    if not branched:
        return [c for c, _ in colls], "measured per collective (compiled HLO)"
    wire = _finite(wire)
    if wire is None:
        return None, "collectives in branches but no finite mean bytes per step to scale them"
    fixed = sum(size(c) for c, cond in colls if not cond)
    share = max(wire - fixed, 0.0) / branched
    out = [c._replace(executions=c.executions * share) if cond else c for c, cond in colls]
    how = (
        "measured per collective (compiled HLO); those inside branches (per-layer modes, "
        "updates every k steps) scaled to the run's mean bytes per step, their message "
        "count estimated"
    )
    return out, how


def bytes_by_kind(colls: list[_cost.Collective]) -> dict[str, float]:
    """Bytes per step per collective kind (with the group size in the key: ``all-reduce/8``)."""
    out: dict[str, float] = {}
    for c in colls:
        key = f"{c.kind}/{c.group_size}"
        out[key] = out.get(key, 0.0) + c.bytes_per_execution * c.executions
    return out


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aggregate(
    manifest: Mapping[str, Any],
    runs: list[Run],
    *,
    compute_s: float | None = None,
    links: Mapping[float, _cost.NetworkLink] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (variant, axis values), mean and spread over seeds, and the report's notes.

    Args:
      manifest: the study's ``study.json``.
      runs: from :func:`read_runs`.
      compute_s: compute seconds per step for the cost model (same for every variant); default
        the baseline's measured wall time per step (an upper bound: it includes compilation and
        evaluation), per axis values.
      links: ``{gbit_per_s: NetworkLink}``; default 1, 10 and 100 Gbit/s at 10 us latency.

    Returns:
      ``(rows, notes)``.
    """
    links = dict(links or {g: _cost.network_link(g) for g in _cost.GBIT_PER_S})
    axes = list(manifest.get("axes", []))
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault((run.variant, tuple(run.axes.get(a) for a in axes)), []).append(run)
    notes: list[str] = []
    hows: dict[str, set[str]] = {}  # how each run's collectives were priced: its variants
    base_variant = manifest.get("baseline")
    rows = []
    for (variant, combo), members in groups.items():
        per = [run_metrics(r) for r in members]
        done = [(r, m) for r, m in zip(members, per) if r.status == "done" and not m["diverged"]]
        row: dict[str, Any] = {"variant": variant, **dict(zip(axes, combo))}
        row["seeds"] = len(done)
        row["of_seeds"] = len(members)
        row["diverged"] = sum(m["diverged"] for m in per)
        row["unfinished"] = sum(r.status in ("running", "missing", "failed") for r in members)
        for key in METRICS:
            row[key], row[key + "_std"] = _mean_std([m[key] for _, m in done])
        modes = {m["mode"] for _, m in done if m["mode"]}
        row["axis"] = ", ".join(sorted(TRAFFIC_AXIS.get(x, x) for x in modes))
        row["x_fewer_than_dense"] = (
            row["dense_bytes"] / row["wire_bytes"]
            if row["wire_bytes"] and row["dense_bytes"]
            else None
        )
        row["_done"] = [r for r, _ in done]
        row["bytes_by_kind"] = _mean_by_kind(row["_done"])
        rows.append(row)
    by_key = {(r["variant"], tuple(r.get(a) for a in axes)): r for r in rows}
    for row in rows:
        base = by_key.get((base_variant, tuple(row.get(a) for a in axes)))
        row["x_fewer_than_baseline"] = (
            base["wire_bytes"] / row["wire_bytes"]
            if base and base["wire_bytes"] and row["wire_bytes"]
            else None
        )
        _predict(row, base, links, compute_s, notes, hows)
    notes += [
        f"collectives for the cost model ({', '.join(sorted(vs))}): {how}."
        for how, vs in hows.items()
    ]
    for row in rows:
        row.pop("_done")
    return rows, sorted(set(notes))


def _mean_by_kind(runs: list[Run]) -> dict[str, float] | None:
    """Mean over ``runs`` of their bytes per step per collective kind and group size."""
    per = [collectives_of(r)[0] for r in runs]
    if not per or any(c is None for c in per):
        return None
    kinds = [bytes_by_kind(c) for c in per]
    keys = sorted({k for d in kinds for k in d})
    return {k: statistics.fmean(d.get(k, 0.0) for d in kinds) for k in keys}


def _predict(row, base, links, compute_s, notes, hows) -> None:
    for g in links:
        row[f"speedup_{g:g}gbit"] = None
    if base is None or not base["_done"] or not row["_done"]:
        return
    if compute_s is None:
        per_step = [
            r.summary["wall_time_s"] / r.summary["steps"]
            for r in base["_done"]
            if r.summary.get("steps")
        ]
        if not per_step:
            return
        step_compute = statistics.median(per_step)
        notes.append(
            "predicted speedups: compute per step = the baseline's wall time / steps on this "
            "machine (includes compilation and evaluation), the same for every variant; pass "
            "compute_s for your hardware."
        )
    else:
        step_compute = _validate.check_number("compute_s", compute_s, ge=0, finite=True)
    row["compute_s"] = step_compute
    for g, lk in links.items():
        times = {}
        for name, group in (("base", base), ("row", row)):
            ts = []
            for r in group["_done"]:
                colls, how = collectives_of(r)
                if colls is None:
                    notes.append(f"no prediction for {r.name}: {how}.")
                    break
                hows.setdefault(how, set()).add(r.variant)
                ts.append(_cost.step_time(step_compute, colls, lk))
            times[name] = statistics.fmean(ts) if ts and len(ts) == len(group["_done"]) else None
        if times["base"] and times["row"]:
            row[f"speedup_{g:g}gbit"] = _cost.speedup(times["base"], times["row"])
