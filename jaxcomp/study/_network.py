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
  construction.

The pipeline's boundary sends on per-host links are priced as the compiled tick program runs
them (:func:`pipeline_send_s`): each host runs its sends in program order, and a send
starts only when its receiver has reached it too (gloo's send waits for the posted receive).
With one ``ppermute`` per boundary (runs before 2026-12-05), a stage that receives and sends in
one tick relayed its boundaries one after another: the lab's 4-stage GPipe step took ~20 sends'
time, not the 12 of its ticks nor the 24 of one wire; with one ``ppermute`` per tick and
direction the model plays 12, and a send whose receiver also sends in the same move (a chain)
starts later by the calibration's chain fit (:func:`chain_delay_s`: the receiver's go-ahead
waits behind its own outgoing data; docs/results/network/pipeline_model.md). A move whose
boundaries carry payloads of different sizes is as many permutes as it has distinct sizes
(:mod:`jaxcomp.study._moves`, the engine's own cut); a run that records its step's permutes
(summary ``boundary_permutes``) is played with each boundary's payloads read from them, checked
against the permutes the model plays (no prediction where they differ), an older run with every
send at the mean.

On a hierarchical mesh (``[("slow", hosts), ("fast", devices)]``) each collective is placed by
its group (:func:`nic_share`): one inside a host never reaches the link (its time is in the
compute), one over the slow axis runs as ``D`` concurrent rings of ``W`` ranks (one per device
of a host), all through the host's NIC: :math:`2 (W - 1) \alpha + 2 \frac{W - 1}{W} D n / \beta`.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from jaxcomp import pipeline
from jaxcomp.study import _cost
from jaxcomp.study import _moves
from jaxcomp.study import _report

LAB_FILE = "lab.json"
TIMING = "timing.jsonl"  # as jaxcomp.train._metrics.TIMING
WARMUP_STEPS = 2
#: kinds priced with the ping-pong's fit; every other kind with the all-reduce's (ring hops)
POINT_TO_POINT = ("collective-permute",)


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
            "mean_s": statistics.fmean(v), "n": len(v)}  # fmt: skip


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


#: kinds whose group is a set of mesh axes (placed by :func:`nic_share`); permutes keep theirs
GROUP_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def nic_share(group_size: int, mesh: Sequence, hosts: int, devices_per_host: int) -> int | None:
    """How many of a collective's groups send through one host's NIC at once: 0 for a group
    inside a host (it never reaches the link), ``devices_per_host`` for a group over the axes
    between hosts only (each device of a host is in its own group), 1 for the whole mesh (the
    calibrated ring); ``None`` where the group size does not say which axes it spans.

    The devices are laid out host-major (:func:`jaxcomp.comm.make_mesh`): the trailing axes whose
    sizes multiply to ``devices_per_host`` lie inside a host, the leading ones between hosts. A
    mesh with no such split (one ``data`` axis over every device) or one device per host puts
    every collective on the calibrated ring (share 1), as the calibration measured it.

    Example:
      >>> mesh = [("slow", 2), ("fast", 4)]
      >>> [nic_share(g, mesh, 2, 4) for g in (4, 2, 8)]
      [0, 4, 1]
      >>> nic_share(8, [("data", 8)], 2, 4)
      1
    """
    sizes = [int(n) for _, n in mesh]
    total = math.prod(sizes)
    inner, split = 1, len(sizes)
    while split > 0 and inner < devices_per_host:
        split -= 1
        inner *= sizes[split]
    if devices_per_host == 1 or inner != devices_per_host or split == 0:
        return 1
    if group_size == total:
        return 1
    shares = set()
    for mask in range(1, 1 << len(sizes)):
        axes = [i for i in range(len(sizes)) if mask >> i & 1]
        if math.prod(sizes[i] for i in axes) != group_size:
            continue
        if all(i >= split for i in axes):
            shares.add(0)
        elif all(i < split for i in axes):
            shares.add(devices_per_host)
        else:
            shares.add(None)  # partly inside, partly between hosts: not modelled
    return shares.pop() if len(shares) == 1 else None


def collectives(
    workdir: str, network: Mapping[str, Any] | None = None
) -> tuple[list[dict[str, Any]] | None, str]:
    """The collectives of the run's mean step, as the study report prices them
    (:func:`jaxcomp.study._report.collectives_of`), each a ``Collective``'s fields with
    ``"per_nic"`` (:func:`nic_share` on the lab's ``network``; 1 without one).

    On a hierarchical mesh the run's mean ``wire_bytes_per_step`` counts the slow axis only, so
    collectives in branches are scaled against the bytes of those that cross the link. A run
    whose mean is sharded over the fast axis (summary ``shard_fast``) runs each branched slow
    collective on one device of a host (the parameters' owner): one group through the NIC, not
    ``devices_per_host``; their latencies are summed, an upper bound where the owners' branches
    overlap.
    """
    summary = _report._load_json(os.path.join(workdir, "summary.json"), {})
    experiment = _report._load_json(os.path.join(workdir, "experiment.json"), {})
    recs, mesh = summary.get("collectives"), experiment.get("mesh")
    if network and isinstance(recs, list) and mesh:
        hosts, per_host = int(network["hosts"]), int(network["devices_per_host"])
        try:
            shares = [
                nic_share(int(r["group_size"]), mesh, hosts, per_host)
                if r["kind"] in GROUP_KINDS
                else 1
                for r in recs
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"summary.json collectives are damaged ({e!r}).") from e
        if summary.get("shard_fast"):
            shares = [
                1 if x == per_host and r.get("conditional") else x for r, x in zip(recs, shares)
            ]
        if None in shares:
            return None, (
                f"a collective's group size does not say which axes of the mesh {mesh} it "
                f"spans on {hosts} host(s) x {per_host} device(s)"
            )
        if any(x != 1 for x in shares):
            crossing = [(r, x) for r, x in zip(recs, shares) if x]
            colls, how = _report._measured(
                [r for r, _ in crossing], summary.get("wire_bytes_per_step")
            )
            if colls is None:
                return None, how
            fields = ("kind", "bytes_per_execution", "group_size", "executions")
            out = [c._asdict() | {"per_nic": x} for c, (_, x) in zip(colls, crossing)]
            out += [{k: r[k] for k in fields} | {"per_nic": 0}
                    for r, x in zip(recs, shares) if not x]  # fmt: skip
            return out, how + "; those inside a host off the link"
    run = _report.Run(os.path.basename(workdir), "", {}, 0, "done", summary, [], [], experiment)
    colls, how = _report.collectives_of(run)
    return (None if colls is None else [c._asdict() | {"per_nic": 1} for c in colls]), how


def links(fits: Mapping[str, Mapping[str, float]]) -> dict[str, _cost.NetworkLink]:
    """``{kind: NetworkLink}`` of a calibration's fits (``{"all-reduce": {"alpha_s",
    "beta_bytes_s"}, ...}``)."""
    return {
        k: _cost.NetworkLink(float(f["beta_bytes_s"]), float(f["alpha_s"])) for k, f in fits.items()
    }


def communication_s(colls: Sequence[_cost.Collective], fits: Mapping[str, Mapping]) -> float:
    """The cost model's seconds of a step's collectives on calibrated links: point-to-point
    kinds on the ping-pong's fit (the all-reduce's if there is none), the rest on the
    all-reduce's.

    Example:
      >>> fits = {"all-reduce": {"alpha_s": 1e-4, "beta_bytes_s": 1e7}}
      >>> round(communication_s([_cost.Collective("all-reduce", 1e5, 2)], fits), 6)
      0.0102
    """
    lk = links(fits)
    ring = lk["all-reduce"]
    total = 0.0
    for c in colls:
        link = lk.get(c.kind, ring) if c.kind in POINT_TO_POINT else ring
        total += _cost.communication_time([c], link)
    return total


def pipeline_send_s(
    schedule: str,
    stages: int,
    microbatches: int,
    nbytes: float | Sequence[Sequence[float]],
    link: _cost.NetworkLink,
    burst_bytes: float = 0.0,
    moves: str = "tick",
    chain_s: float | Callable[[float], float] = 0.0,
) -> float:
    r"""Seconds the boundary sends of one step take on per-host links, played through the tick
    program's order of sends.

    ``moves="tick"`` (the tick program since 2026-12-05): per tick, the forward move (stage
    ``b`` to ``b + 1``, for each ``b`` that ran a forward), then the backward one (``b + 1`` to
    ``b``, for each ``b + 1`` that ran a backward), each the permutes the engine compiles it to
    (:func:`jaxcomp.study._moves.pipeline_moves`: one per distinct payload size, each carrying
    the next piece of every payload that long); the pairs of one permute run together, each
    starting when both its hosts have finished their earlier permutes. ``moves="boundary"``
    (before: one single-pair ``ppermute`` per boundary, boundary by boundary ``b = 0 .. S -
    2``, forward then backward, each with the boundary's whole payload): each host runs its
    sends in that order, a send starting when both its hosts have finished their earlier ones
    (a rendezvous: gloo sends once the receive is posted), so a middle stage relays a tick's
    boundaries one after another. A pair's send of ``n`` bytes takes :math:`\alpha + \max(n -
    k, 0)/\beta`, :math:`k` the tokens left in the sender's and the receiver's bucket (each
    refills at :math:`\beta` up to ``burst_bytes``; a send takes them all, or ``n``). In a
    permute whose receiver also sends (a chain: stage ``b`` receives from ``b - 1`` and sends
    to ``b + 1``) the send starts ``chain_s(n)`` later: the receiver's go-ahead waits in its
    link's queue behind its own outgoing ``n`` bytes (the calibration's chain probe,
    :func:`chain_delay_s`). The step's compute is not played (it is the unlimited run's, added
    by the caller); bubble ticks send nothing.

    Args:
      schedule, stages, microbatches: the pipeline (``"gpipe"`` or ``"1f1b"``, ``S``, ``M``).
      nbytes: one send's payload, bytes (every boundary and direction alike), or per boundary
        its ``(forward, backward)`` payload.
      link: the ping-pong's fit.
      burst_bytes: the links' token bucket (0: none).
      moves: ``"tick"`` or ``"boundary"``: the program whose sends are played (above).
      chain_s: the extra seconds of a send whose receiver sends in the same permute: a number,
        or a function of the permute's bytes per pair (0: none).

    Returns:
      The time at which the last host finished its last send, seconds.

    Example:
      >>> lk = _cost.NetworkLink(bandwidth=1e6, latency=0.0)
      >>> round(pipeline_send_s("gpipe", 4, 4, 1e4, lk) / 1e-2, 6)  # 2 (M + S - 2) moves
      12.0
      >>> round(pipeline_send_s("gpipe", 4, 4, 1e4, lk, moves="boundary") / 1e-2, 6)
      20.0
      >>> round(pipeline_send_s("gpipe", 2, 4, 1e4, lk) / 1e-2, 6)  # one boundary: 2 M
      8.0
      >>> round(pipeline_send_s("gpipe", 4, 4, 1e4, lk, chain_s=5e-3) / 1e-2, 6)
      16.0
    """
    if isinstance(nbytes, (int, float)):
        if not (nbytes >= 0 and math.isfinite(nbytes)):
            raise ValueError(f"nbytes must be finite and >= 0; got {nbytes}.")
        nbytes = [(nbytes, nbytes)] * (stages - 1)
    if not (burst_bytes >= 0 and math.isfinite(burst_bytes)):
        raise ValueError(f"burst_bytes must be finite and >= 0; got {burst_bytes}.")
    if moves not in ("tick", "boundary"):
        raise ValueError(f"moves must be 'tick' or 'boundary'; got {moves!r}.")
    if not callable(chain_s) and not (chain_s >= 0 and math.isfinite(chain_s)):
        raise ValueError(f"chain_s must be finite and >= 0; got {chain_s}.")
    played = _moves.pipeline_moves(schedule, stages, microbatches, nbytes)
    if moves == "boundary":  # one single-pair permute per boundary, boundary by boundary
        played = []
        for row in pipeline.ticks(schedule, stages, microbatches):
            for b in range(stages - 1):
                if row[b] is not None and row[b].kind == "F":
                    played.append((_moves.Permute(((b, b + 1),), nbytes[b][0]),))
                if row[b + 1] is not None and row[b + 1].kind == "B":
                    played.append((_moves.Permute(((b + 1, b),), nbytes[b][1]),))
    return play_permutes(played, stages, link, burst_bytes, chain_s)


def play_permutes(
    moves: Sequence[Sequence[_moves.Permute]],
    stages: int,
    link: _cost.NetworkLink,
    burst_bytes: float = 0.0,
    chain_s: float | Callable[[float], float] = 0.0,
) -> float:
    """Seconds ``moves`` (each a sequence of :class:`jaxcomp.study._moves.Permute`, run in
    order) take on per-host links, as :func:`pipeline_send_s` plays them: the pairs of one
    permute start together, each when both its hosts have finished their earlier permutes,
    ``chain_s`` later where its receiver also sends on to another host in the permute (a
    swap, both directions of one pair, pays no chain: both go-aheads leave before any data,
    docs/results/network/pipeline_model.md; the ACKs that slow a swap of 64 KiB or more at 10
    Mbit/s are not modelled).

    Example:
      >>> lk = _cost.NetworkLink(bandwidth=1e6, latency=0.0)
      >>> swap = _moves.Permute(((0, 1), (1, 0)), 1e4)  # both directions in one permute
      >>> one = lambda pair: (_moves.Permute((pair,), 1e4),)
      >>> play_permutes([(swap,)], 2, lk), play_permutes([one((0, 1)), one((1, 0))], 2, lk)
      (0.01, 0.02)
    """
    beta = link.bandwidth
    clock = [0.0] * stages
    # per host, (tokens, at when) of its outgoing and of its incoming bucket
    out_bucket = [(burst_bytes, 0.0)] * stages
    in_bucket = [(burst_bytes, 0.0)] * stages

    def tokens(bucket, t):
        return min(burst_bytes, bucket[0] + (t - bucket[1]) * beta)

    for move in moves:
        for p in move:  # sends that start together, from the hosts' clocks before the permute
            ends = []
            target = dict(p.pairs)
            delay = chain_s(p.nbytes) if callable(chain_s) else chain_s
            for src, dst in p.pairs:
                chained = target.get(dst, src) != src  # dst sends on, not back (a swap)
                start = max(clock[src], clock[dst]) + (delay if chained else 0.0)
                k = min(tokens(out_bucket[src], start), tokens(in_bucket[dst], start))
                end = start + link.latency + max(p.nbytes - k, 0.0) / beta
                ends.append((src, dst, end, max(k - p.nbytes, 0.0)))
            for src, dst, end, left in ends:
                out_bucket[src] = in_bucket[dst] = (left, end)
                clock[src], clock[dst] = max(clock[src], end), max(clock[dst], end)
    return max(clock)


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
    colls, how = collectives(workdir, network)
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
        "pipeline": _pipeline(summary) if summary.get("mode") == "pipeline" else None,
    }


def _pipeline(summary: Mapping[str, Any]) -> dict[str, Any]:
    """A pipeline run's schedule, which tick program it ran and, where its summary records the
    step's permutes (runs since 2026-12-05 evening; not with adaptive links, whose payloads
    change), each boundary's payloads read from them (:func:`_moves.boundary_payloads`)."""
    out = {k: summary.get(k) for k in ("schedule", "stages", "microbatches")}
    # runs before one permute per tick (2026-12-05) record no permute count
    out["moves"] = "tick" if summary.get("permutes_per_step") is not None else "boundary"
    permutes = None if summary.get("adaptive") else summary.get("boundary_permutes")
    out["permutes"], out["payload_bytes"] = permutes, None
    if permutes is not None:
        try:
            out["payload_bytes"] = _moves.boundary_payloads(
                permutes, int(out["stages"]), int(out["microbatches"])
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"summary.json boundary_permutes are damaged ({e!r}).") from e
    return out


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


def _comm(record) -> tuple[float | None, str]:
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
        colls = [c for c in colls if c.kind != "collective-permute"]
        if sends:
            fits = cal["fits"]
            fit = fits.get("collective-permute", fits["all-reduce"])
            link = links({"p2p": fit})["p2p"]
            shape = pipe["schedule"], int(pipe["stages"]), int(pipe["microbatches"])
            nbytes = pipe.get("payload_bytes")
            if nbytes is None:  # not recorded: every send the mean one
                nbytes = sum(c.bytes_per_execution * c.executions for c in sends)
                nbytes /= 2 * shape[2] * (shape[1] - 1)
            elif not _moves.same_permutes(pipe["permutes"], _moves.pipeline_moves(*shape, nbytes)):
                return None, (
                    "the step's compiled permutes are not the moves the cost model plays for "
                    f"the boundaries' payloads {nbytes}"
                )
            chain = cal.get("chain")
            send_s = pipeline_send_s(
                *shape, nbytes, link, float(fit.get("burst_bytes", 0.0)),
                pipe.get("moves", "boundary"), lambda n: chain_delay_s(chain, n),
            )  # fmt: skip
            return send_s + communication_s(colls, fits), ""
    return communication_s(colls, cal["fits"]), ""


def chain_delay_s(chain_fit: Mapping[str, float] | None, nbytes: float) -> float:
    """The seconds a send of ``nbytes`` starts late when its receiver also sends ``nbytes``
    in the same permute, by a calibration's chain fit (:func:`jaxcomp.lab._calibrate.chain`:
    ``min(max(n - offset, 0), cap) / beta``); 0 without one (a calibration made before the
    chain probe keeps the prediction it gave).

    Example:
      >>> f = {"offset_bytes": 4e3, "cap_bytes": 5e4, "beta_bytes_s": 1e6}
      >>> [round(chain_delay_s(f, n), 6) for n in (1e3, 3.2e4, 1e6)], chain_delay_s(None, 1e6)
      ([0.0, 0.028, 0.05], 0.0)
    """
    if not chain_fit:
        return 0.0
    ahead = min(max(nbytes - chain_fit["offset_bytes"], 0.0), chain_fit["cap_bytes"])
    return ahead / chain_fit["beta_bytes_s"]


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
    compute = ref["measured"]["step_time"]["median_s"] - ref_comm
    measured = (record["measured"].get("step_time") or {}).get("median_s")
    step = compute + comm
    return {
        "step_s": step,
        "compute_s": compute,
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
