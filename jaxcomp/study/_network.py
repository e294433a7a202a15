r"""Runs measured on a real network (the lab), beside the cost model's prediction.

A run the network lab (:mod:`jaxcomp.lab`) made holds ``lab.json`` in its workdir: the network
(topology, hosts, devices per host, rate), the lab's calibration of it (the cost model's
:math:`\alpha` and :math:`\beta` fitted per collective kind on those links) and the machine's
load before and after. This module reads what the trainer wrote beside it and compares:

* **step time**: the trainer's per-step wall time (``timing.jsonl``: from fetching a batch to
  the step's metrics on the host), median and quartiles over the steps after the first
  :data:`WARMUP_STEPS`, leaving out each step that follows an evaluation or a checkpoint (an
  idle gap: cold caches, TCP slow start);
* **time to accuracy** (or **to loss**, a language model's): the training time (the sum of
  step times) and the wall time since the run started at the first evaluation reaching each
  target accuracy (at or above) or validation loss (at or below);
* **the prediction**: :math:`T(r) = C + \mathrm{comm}(r)`, :math:`\mathrm{comm}(r)` the cost
  model's time of the step's collectives (``summary.json``'s ``collectives``, as the study
  report reads them) on the links fitted at rate :math:`r`, and the compute :math:`C = T_{meas}
  (\infty) - \mathrm{comm}(\infty)`: the same config and layout measured at unlimited rate, less
  the model's communication there. So every prediction at a finite rate is a prediction of how
  much the link adds, checked against the measurement; at unlimited rate it is exact by
  construction. A pipeline on per-host links is predicted as the larger of the unlimited
  step and its compute without contention plus its sends
  (:func:`jaxcomp.study._pipeline_model.step_s`: a host waiting for its boundary leaves the
  shared cores to the others).

Where the communication is priced: the calibration's fits, :mod:`jaxcomp.study._fits`; which
collectives of a data-parallel step reach the link, :mod:`jaxcomp.study._dp_model`; a
pipeline's boundary permutes on per-host links, played in program order,
:mod:`jaxcomp.study._pipeline_model`.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from jaxcomp.study import _cost
from jaxcomp.study import _dp_model
from jaxcomp.study import _fits
from jaxcomp.study import _pipeline_model
from jaxcomp.study import _report

LAB_FILE = "lab.json"
TIMING = "timing.jsonl"  # as jaxcomp.train._metrics.TIMING
WARMUP_STEPS = 2


def _jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file, or of its gzip copy ``path.gz`` (results kept in git)."""
    if os.path.isfile(path):
        opened = open(path)
    elif os.path.isfile(path + ".gz"):
        opened = gzip.open(path + ".gz", "rt")
    else:
        return []
    out = []
    with opened as f:
        lines = [ln for ln in f if ln.strip()]
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # cut by a kill
            raise ValueError(f"{path} line {i + 1} is damaged ({e}).") from e
    return out


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    v = sorted(values)
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return {"median_s": statistics.median(v), "q25_s": q[0], "q75_s": q[2],
            "mean_s": statistics.fmean(v), "min_s": v[0], "n": len(v)}  # fmt: skip


def step_times(workdir: str, checkpoint_every: int = 0) -> dict[str, Any] | None:
    """The median, quartiles and mean of the run's step times (see the module docstring), and
    which steps were left out; ``None`` if the run wrote no ``timing.jsonl``."""
    timing = _jsonl(os.path.join(workdir, TIMING))
    if not timing:
        return None
    evals = {int(r["step"]) for r in _jsonl(os.path.join(workdir, "metrics.jsonl"))
             if r.get("split") == "eval"}  # fmt: skip
    after_gap = {s + 1 for s in evals}
    if checkpoint_every:
        last = max(int(r["step"]) for r in timing)
        after_gap |= {s + 1 for s in range(checkpoint_every, last + 1, checkpoint_every)}
    kept = [r for r in timing if r["step"] > WARMUP_STEPS and r["step"] not in after_gap]
    if not kept:
        kept = timing
    out = _quantiles([r["step_s"] for r in kept])
    out["left_out"] = sorted({r["step"] for r in timing} - {r["step"] for r in kept})
    return out


def _time_to(workdir: str, targets: Sequence[float], key: str, reached) -> dict[str, Any]:
    """``{target: {"step", key, "train_s", "elapsed_s"} | None}`` at the first evaluation
    whose finite ``key`` satisfies ``reached(value, target)``."""
    timing = {int(r["step"]): r for r in _jsonl(os.path.join(workdir, TIMING))}
    evals = [r for r in _jsonl(os.path.join(workdir, "metrics.jsonl")) if r.get("split") == "eval"]
    out: dict[str, Any] = {}
    for target in targets:
        hit = next((r for r in evals if isinstance(r.get(key), (int, float))
                    and math.isfinite(r[key]) and reached(r[key], target)), None)  # fmt: skip
        if hit is None or int(hit["step"]) not in timing:
            out[f"{target:g}"] = None
            continue
        step = int(hit["step"])
        out[f"{target:g}"] = {
            "step": step,
            key: hit[key],
            "train_s": sum(r["step_s"] for s, r in timing.items() if s <= step),
            "elapsed_s": timing[step]["elapsed_s"],
        }
    return out


def time_to_accuracy(workdir: str, targets: Sequence[float]) -> dict[str, Any]:
    """``{target: {"step", "train_s", "elapsed_s", "accuracy"} | None}``: the first evaluation
    at or above each target (with compression on where the mode evaluates both ways)."""
    return _time_to(workdir, targets, "accuracy", lambda v, t: v >= t)


def time_to_loss(workdir: str, targets: Sequence[float]) -> dict[str, Any]:
    """``{target: {"step", "train_s", "elapsed_s", "loss"} | None}``: the first evaluation
    whose loss (validation loss; a NaN never counts) is at or below each target, as
    :func:`time_to_accuracy` (a language model's measure: its accuracy is the next token's)."""
    return _time_to(workdir, targets, "loss", lambda v, t: v <= t)


def accuracy_curve(workdir: str) -> list[tuple[float, float]]:
    """``[(train seconds, test accuracy)]`` at each evaluation (for the time plots)."""
    timing = {int(r["step"]): r["step_s"] for r in _jsonl(os.path.join(workdir, TIMING))}
    out = []
    for r in _jsonl(os.path.join(workdir, "metrics.jsonl")):
        if r.get("split") == "eval" and "accuracy" in r:
            out.append((sum(t for s, t in timing.items() if s <= r["step"]), r["accuracy"]))
    return out


def measure(
    workdir: str,
    targets: Sequence[float] = (),
    checkpoint_every: int = 0,
    network: Mapping[str, Any] | None = None,
    loss_targets: Sequence[float] = (),
) -> dict[str, Any]:
    """What a lab run measured, from its workdir: step times, time to each target accuracy
    and each target (validation) loss, bytes and collectives per step (and how many
    collectives a step issues)."""
    summary = _report._load_json(os.path.join(workdir, "summary.json"), {})
    colls, how = _dp_model.collectives(workdir, network)
    return {
        "step_time": step_times(workdir, checkpoint_every),
        "time_to_accuracy": time_to_accuracy(workdir, targets),
        "time_to_loss": time_to_loss(workdir, loss_targets),
        "final_accuracy": summary.get("final_accuracy"),
        "steps": summary.get("steps"),
        "mode": summary.get("mode"),
        "wire_bytes_per_step": summary.get("wire_bytes_per_step"),
        "collectives_per_step": None if colls is None else sum(c["executions"] for c in colls),
        "collectives": colls,
        "collectives_how": how,
        "pipeline": _pipeline_model.record(summary) if summary.get("mode") == "pipeline" else None,
    }


def read_lab_run(workdir: str) -> dict[str, Any] | None:
    """A lab run's ``lab.json`` with its measurement (``None`` if the run was not in a lab)."""
    record = _report._load_json(os.path.join(workdir, LAB_FILE), None)
    if record is None:
        return None
    record = dict(record)
    record.setdefault("workdir", workdir)
    record["measured"] = measure(
        workdir,
        record.get("targets", ()),
        int(record.get("checkpoint_every") or 0),
        record.get("network"),
        record.get("loss_targets", ()),
    )
    return record


def _group(record: Mapping[str, Any]) -> tuple:
    """What a run shares with its compute reference: the variant (or, unnamed, the config and
    its overrides), the other axes, the topology and the layout."""
    net = record["network"]
    what = record.get("variant") or (record.get("config"), tuple(record.get("overrides") or ()))
    return (what, net["topology"], net["hosts"], net["devices_per_host"],
            tuple(sorted((record.get("axes") or {}).items())))  # fmt: skip


def predict(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record with ``"prediction"``: compute from the unlimited record of its group (same
    variant, axes, topology and layout), communication from its own calibration (module
    docstring); ``None`` with the reason where a piece is missing."""
    reference = {}
    for r in records:
        if r["network"]["rate_bit_s"] is None:
            reference[_group(r)] = r
    out = []
    for r in records:
        r = dict(r)
        r["prediction"] = _prediction(r, reference.get(_group(r)))
        out.append(r)
    return out


def _paced_by_link(record) -> bool:
    """Whether the run's step is predicted as the larger of its compute and its link's path
    (a pipeline on per-host links, :func:`jaxcomp.study._pipeline_model.step_s`)."""
    return bool(record["measured"].get("pipeline")) and record["network"]["topology"] == "per_host"


def _comm(record, compute_s: float = 0.0) -> tuple[float | None, str]:
    colls = record["measured"].get("collectives")
    if colls is None:
        return None, record["measured"].get("collectives_how", "no collectives")
    cal = record.get("calibration")
    if not cal:
        return None, "no calibration"
    colls = [
        _cost.Collective(c["kind"], c["bytes_per_execution"] * share, c["group_size"],
                         c["executions"])
        for c in colls
        if (share := c.get("per_nic", 1))
    ]  # fmt: skip
    pipe = record["measured"].get("pipeline")
    if pipe and record["network"]["topology"] == "per_host":
        sends = [c for c in colls if c.kind == "collective-permute"]
        if sends:
            send_s, why = _pipeline_model.send_s(pipe, sends, cal, compute_s)
            if send_s is None:
                return None, why
            rest = [c for c in colls if c.kind != "collective-permute"]
            return send_s + _fits.communication_s(rest, cal["fits"]), ""
    return _fits.communication_s(colls, cal["fits"]), ""


def _prediction(record, ref) -> dict[str, Any]:
    comm, why = _comm(record)
    if comm is None:
        return {"step_s": None, "why": why}
    if ref is None or not (ref["measured"].get("step_time") or {}).get("median_s"):
        return {"step_s": None, "communication_s": comm, "why": "no unlimited-rate run to "
                "take the compute from"}  # fmt: skip
    ref_comm, why = _comm(ref)
    if ref_comm is None:
        return {"step_s": None, "communication_s": comm, "why": f"unlimited run: {why}"}
    reference = ref["measured"]["step_time"]
    compute = reference["median_s"] - ref_comm
    measured = (record["measured"].get("step_time") or {}).get("median_s")
    out = {"compute_s": compute}
    if _paced_by_link(record):
        free = reference["min_s"] - ref_comm
        if free < 0:
            return {"step_s": None, "communication_s": comm, "why": "the unlimited run's "
                    "fastest step is shorter than the model's communication there"}  # fmt: skip
        comm, why = _comm(record, free)
        if comm is None:
            return {"step_s": None, "why": why}
        step, out["bound"] = _pipeline_model.step_s(reference["median_s"], free, comm)
        out["free_compute_s"] = free
    else:
        step = compute + comm
    return out | {
        "step_s": step,
        "communication_s": comm,
        "measured_over_predicted": measured / step if measured and step > 0 else None,
    }


def _ms(x) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{1e3 * x:.1f}"


def table(records: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per lab run, measured step time (median [q25, q75]) beside the
    prediction, bytes and collectives per step, time to the first target accuracy."""
    head = ["run", "topology", "hosts x devices", "rate", "achieved Mbit/s", "fit alpha us",
            "fit beta Mbit/s", "bytes/step", "collectives/step", "step ms (median [q25, q75])",
            "predicted ms", "measured/predicted", "time to target s (train / wall)",
            "load before / after"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        net, m, p = r["network"], r["measured"], r.get("prediction") or {}
        st = m.get("step_time") or {}
        cal = r.get("calibration") or {}
        fit = (cal.get("fits") or {}).get("all-reduce") or {}
        ach = (cal.get("achieved") or {}).get("bit_s")
        tta = list((m.get("time_to_accuracy") or {}).items())
        tta += [(f"loss {k}", v) for k, v in (m.get("time_to_loss") or {}).items()]
        tta_s = (
            "; ".join(
                f"{k}: {v['train_s']:.1f} / {v['elapsed_s']:.1f}" if v else f"{k}: not reached"
                for k, v in tta
            )
            or "—"
        )
        ratio = p.get("measured_over_predicted")
        lines.append("| " + " | ".join([
            r.get("name", os.path.basename(r.get("workdir", ""))),
            net["topology"],
            f"{net['hosts']} x {net['devices_per_host']}",
            net["rate"],
            "—" if ach is None else f"{ach / 1e6:.0f}",
            "—" if not fit else f"{1e6 * fit['alpha_s']:.0f}",
            "—" if not fit else f"{fit['beta_bit_s'] / 1e6:.0f}",
            "—" if m.get("wire_bytes_per_step") is None else f"{m['wire_bytes_per_step']:,.0f}",
            "—" if m.get("collectives_per_step") is None else f"{m['collectives_per_step']:g}",
            f"{_ms(st.get('median_s'))} [{_ms(st.get('q25_s'))}, {_ms(st.get('q75_s'))}]",
            _ms(p.get("step_s")),
            "—" if ratio is None else f"{ratio:.2f}",
            tta_s,
            f"{r.get('load_before', ['—'])[0]} / {r.get('load_after', ['—'])[0]}",
        ]) + " |")  # fmt: skip
    return "\n".join(lines)


TABLE_NOTE = (
    "Network (runs in the lab): step time per step from the trainer (median [quartiles] after "
    f"{WARMUP_STEPS} warm-up steps, without the steps after an evaluation or checkpoint); "
    "predicted = compute (the unlimited-rate run's median less the model's communication "
    "there) + the cost model's communication on the links fitted at that rate; time to "
    "target (an accuracy, or `loss X`: a validation loss at or below X): training time (sum of "
    "step times) / wall time since the run started."
)


def plots(records: Sequence[dict[str, Any]], out_dir: str) -> dict[str, str]:
    """Writes both network plots that have data into ``out_dir``; ``{name: path}``."""
    made = {
        "accuracy_vs_time": plot_accuracy_vs_time(
            records, os.path.join(out_dir, "accuracy_vs_time.png")
        ),
        "measured_vs_predicted": plot_measured_vs_predicted(
            records, os.path.join(out_dir, "measured_vs_predicted.png")
        ),
    }
    return {k: v for k, v in made.items() if v}


def plot_accuracy_vs_time(records: Sequence[dict[str, Any]], path: str) -> str | None:
    """Test accuracy against training time (sum of step times), one panel per rate, one line
    per run."""
    from jaxcomp.study import _plots

    curves = [(r, accuracy_curve(r["workdir"])) for r in records]
    curves = [(r, c) for r, c in curves if c]
    if not curves:
        return None
    rates = list(dict.fromkeys(r["network"]["rate"] for r, _ in curves))
    plt = _plots._pyplot()
    fig, axs = plt.subplots(1, len(rates), figsize=(4.5 * len(rates), 3.8), squeeze=False)
    names = list(dict.fromkeys(r.get("variant") or r.get("name") for r, _ in curves))
    for ax, rate in zip(axs[0], rates):
        for r, c in curves:
            if r["network"]["rate"] == rate:
                name = r.get("variant") or r.get("name")
                ax.plot(*zip(*c), "o-", ms=3, color=f"C{names.index(name) % 10}", label=name)
        ax.set_title(f"{rate}", fontsize=9)
        ax.set_xlabel("training time, s (sum of step times)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return _plots._save(fig, path)


def plot_measured_vs_predicted(records: Sequence[dict[str, Any]], path: str) -> str | None:
    """Measured median step time against the cost model's prediction (log-log, the diagonal
    and +-25% marked)."""
    from jaxcomp.study import _plots

    pts = [(r["prediction"]["step_s"], r["measured"]["step_time"]["median_s"], r)
           for r in records if (r.get("prediction") or {}).get("step_s")
           and (r["measured"].get("step_time") or {}).get("median_s")]  # fmt: skip
    if not pts:
        return None
    plt = _plots._pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    lo = min(min(p, m) for p, m, _ in pts) * 0.7
    hi = max(max(p, m) for p, m, _ in pts) * 1.4
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="measured = predicted")
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="gray",
                    alpha=0.15, label="+-25%")  # fmt: skip
    rates = list(dict.fromkeys(r["network"]["rate"] for _, _, r in pts))
    for p, m, r in pts:
        ax.plot(p, m, "o", color=f"C{rates.index(r['network']['rate']) % 10}")
        ax.annotate(r.get("variant") or r.get("name"), (p, m), fontsize=6,
                    textcoords="offset points", xytext=(3, 3))  # fmt: skip
    for i, rate in enumerate(rates):
        ax.plot([], [], "o", color=f"C{i % 10}", label=rate)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time, s")
    ax.set_ylabel("measured step time (median), s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _plots._save(fig, path)
