r"""An alpha-beta cost model: predicted step time and speedup from measured compute and bytes.

Whether compression pays depends on the cluster: a 20x smaller payload saves nothing when the
step is compute-bound, and a lot on a 1 Gbit/s link. This module turns what jaxcomp measures,
compute time per stage and the bytes each collective moves (as
:func:`jaxcomp.comm.measure_collectives` reports them), into a step time on a link of given
bandwidth :math:`\beta` (bytes/s) and latency :math:`\alpha` (s per message).

Costs of one collective over a group of :math:`W` devices, with :math:`n` the bytes the meter
reports for one device (the operand; for ``all-gather`` one device's contribution; for
``reduce-scatter`` the full input):

.. math::

  \text{permute}: \alpha + n/\beta \qquad
  \text{all-reduce (ring)}: 2(W-1)\alpha + \tfrac{2(W-1)}{W}\, n/\beta \\
  \text{all-gather (ring)}: (W-1)\alpha + (W-1)\, n/\beta \qquad
  \text{reduce-scatter (ring)}: (W-1)\alpha + \tfrac{W-1}{W}\, n/\beta \\
  \text{all-to-all (pairwise)}: (W-1)\alpha + \tfrac{W-1}{W}\, n/\beta \qquad
  \text{broadcast (binomial tree)}: \lceil\log_2 W\rceil (\alpha + n/\beta)

A pipeline step is the critical path of its schedule over :math:`S` stages and :math:`M`
microbatches with per-stage forward/backward times :math:`f_s, b_s` per microbatch. In
*lockstep*, as jaxcomp's GPipe runs (one SPMD program: every tick waits for its slowest stage,
and every send is its own single-pair ``collective-permute``, one per boundary, direction and
microbatch, in sequence with the compute) the step is

.. math::

  T = (M+S-1)\,(\max_s f_s + \max_s b_s) + M \sum_{b=1}^{S-1} (c^{fwd}_b + c^{bwd}_b),

:math:`c_b` the permute time of boundary :math:`b`'s payload, i.e. compute plus the sum of the
step's permutes as the HLO meter lists them. Asynchronously (a stage starts an
operation as soon as its input has arrived, sends overlap compute, each boundary and direction
is one link that carries one message at a time) the step is the makespan of the schedule's
dependency graph, computed exactly by an event simulation; with uniform stages and free
communication both give the textbook :math:`(M+S-1)(f+b)`, bubble fraction
:math:`(S-1)/(M+S-1)`. Schedules: ``"gpipe"`` (all forwards, then all backwards in reverse
microbatch order, as autodiff of the forward scan runs them) and ``"1f1b"`` (PipeDream-flush:
:math:`S-s-1` warm-up forwards on stage :math:`s`, then one forward / one backward).

Assumptions, stated: links are full-duplex and homogeneous (one bandwidth and latency for every
pair); collectives use the ring / pairwise / tree algorithms above (NCCL's ring for large
messages; trees and in-network reduction can be faster for small ones); a data-parallel step does
not overlap its reduction with the backward pass (jaxcomp reduces after the whole gradient, so
the prediction is what it runs, and an upper bound for bucketed overlap); compute times do not
change with the link; a collective over one device, or of zero bytes, sends nothing and costs
nothing; congestion, stragglers and topology (NVLink inside a node, a slower network between
nodes) are not modelled: give the link each axis really uses.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH",
  IJHPCA 2005 (the alpha-beta costs). Huang et al., "GPipe", NeurIPS 2019; Narayanan et al.,
  "PipeDream" / "Efficient Large-Scale Language Model Training on GPU Clusters", SC 2021 (1F1B).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence
from typing import NamedTuple

from jaxcomp import _validate
from jaxcomp.comm._hlo import KINDS  # the kinds the HLO meter counts, each priced below
from jaxcomp.pipeline import SCHEDULES

#: the link speeds a report predicts for, in Gbit/s
GBIT_PER_S = (1.0, 10.0, 100.0)
#: latency assumed per message when none is given (a datacenter Ethernet/RoCE hop), seconds
DEFAULT_LATENCY_S = 10e-6


class NetworkLink(NamedTuple):
    """A network link: ``bandwidth`` in bytes per second, ``latency`` in seconds per message."""

    bandwidth: float
    latency: float


class Collective(NamedTuple):
    """One collective of a step, with the fields of a ``comm.CollectiveRecord``.

    Attributes:
      kind: one of :data:`KINDS`.
      bytes_per_execution: bytes one device moves per execution, as the HLO meter counts them.
      group_size: devices taking part (``W``).
      executions: times it runs per step (a mean over a run's steps may be fractional).
    """

    kind: str
    bytes_per_execution: float
    group_size: int
    executions: float = 1


def network_link(gbit_per_s: float, latency_s: float = DEFAULT_LATENCY_S) -> NetworkLink:
    """A :class:`NetworkLink` of ``gbit_per_s`` gigabits per second (``1e9 / 8`` bytes/s each).

    Example:
      >>> network_link(10, latency_s=0.0)
      NetworkLink(bandwidth=1250000000.0, latency=0.0)
    """
    gbit = _validate.check_number("gbit_per_s", gbit_per_s, gt=0, finite=True)
    return NetworkLink(
        gbit * 1e9 / 8, _validate.check_number("latency_s", latency_s, ge=0, finite=True)
    )


def _check_link(lk) -> NetworkLink:
    if not isinstance(lk, NetworkLink):
        raise ValueError(
            f"link must be a study.NetworkLink (see study.network_link(gbit_per_s)); got {lk!r}."
        )
    _validate.check_number("link.bandwidth", lk.bandwidth, gt=0, finite=True)
    _validate.check_number("link.latency", lk.latency, ge=0, finite=True)
    return lk


def collective_time(kind: str, nbytes: float, group_size: int, lk: NetworkLink) -> float:
    """Seconds one execution of a collective takes (formulas in the module docstring).

    Args:
      kind: one of :data:`KINDS` (``ragged-all-to-all`` is priced as ``all-to-all``).
      nbytes: bytes one device moves, as :func:`jaxcomp.comm.measure_collectives` counts them.
      group_size: ``W``, the devices in the group.
      lk: the link.

    Returns:
      The time in seconds; 0 for zero bytes or a group of one.

    Example:
      >>> lk = NetworkLink(bandwidth=1e3, latency=0.1)
      >>> round(collective_time("all-reduce", 100.0, 4, lk), 6)  # 6 * 0.1 + 1.5 * 0.1
      0.75
    """
    _validate.check_choice("kind", kind, KINDS)
    n = _validate.check_number("nbytes", nbytes, ge=0, finite=True)
    w = _validate.check_int("group_size", group_size, 1)
    alpha, beta = _check_link(lk).latency, lk.bandwidth
    if n == 0 or w == 1:
        return 0.0
    if kind == "collective-permute":
        return alpha + n / beta
    if kind == "all-reduce":
        return 2 * (w - 1) * alpha + 2 * (w - 1) / w * n / beta
    if kind == "all-gather":
        return (w - 1) * (alpha + n / beta)
    if kind == "collective-broadcast":
        return math.ceil(math.log2(w)) * (alpha + n / beta)
    return (w - 1) * alpha + (w - 1) / w * n / beta  # reduce-scatter, all-to-all


def communication_time(collectives, lk: NetworkLink) -> float:
    """Seconds of all collectives of one step, run one after another.

    Args:
      collectives: a ``comm.CollectiveReport`` (its ``records``) or an iterable of
        :class:`Collective` / ``comm.CollectiveRecord``.
      lk: the link.

    Example:
      >>> lk = NetworkLink(bandwidth=1e3, latency=0.0)
      >>> round(communication_time([Collective("all-gather", 100.0, 4, executions=2)], lk), 9)
      0.6
    """
    records = getattr(collectives, "records", collectives)
    total = 0.0
    for r in records:
        runs = _validate.check_number("executions", r.executions, ge=0, finite=True)
        total += runs * collective_time(r.kind, r.bytes_per_execution, r.group_size, lk)
    return total


def step_time(compute_s: float, collectives, lk: NetworkLink) -> float:
    """A data-parallel (or any non-pipelined) step: compute, then its collectives, no overlap.

    Example:
      >>> lk = NetworkLink(bandwidth=1e3, latency=0.0)
      >>> step_time(1.0, [Collective("all-reduce", 1000.0, 2)], lk)  # 1 + 2 * 1/2 * 1000/1e3
      2.0
    """
    return _validate.check_number("compute_s", compute_s, ge=0, finite=True) + communication_time(
        collectives, lk
    )


def speedup(baseline_s: float, candidate_s: float) -> float:
    """``baseline_s / candidate_s``: above 1 when the candidate (compressed) step is faster."""
    base = _validate.check_number("baseline_s", baseline_s, gt=0, finite=True)
    return base / _validate.check_number("candidate_s", candidate_s, gt=0, finite=True)


def _per_stage(name: str, values, count: int) -> list[float]:
    if isinstance(values, (int, float)):
        values = [values] * count
    values = list(values)
    if len(values) != count:
        raise ValueError(f"{name} needs {count} values (per stage or boundary); got {len(values)}.")
    return [
        _validate.check_number(f"{name}[{i}]", v, ge=0, finite=True) for i, v in enumerate(values)
    ]


def _schedule_order(schedule: str, s: int, num_stages: int, m: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]  # as the tick table
    if schedule != "1f1b":  # a schedule the pipeline gained and this model has no order for
        raise NotImplementedError(f"the cost model has no operation order for {schedule!r}.")
    warm = min(num_stages - s - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]


def pipeline_step_time(
    forward_s: Sequence[float] | float,
    backward_s: Sequence[float] | float,
    num_microbatches: int,
    forward_bytes: Sequence[float] | float,
    backward_bytes: Sequence[float] | float,
    lk: NetworkLink,
    *,
    num_stages: int | None = None,
    schedule: str = "gpipe",
    lockstep: bool = True,
) -> float:
    """Seconds of one pipeline step: the critical path of the schedule, bubble included.

    Args:
      forward_s, backward_s: compute time of one microbatch's forward / backward on each stage
        (a sequence of ``S``, or one number for every stage with ``num_stages``).
      num_microbatches: ``M``.
      forward_bytes, backward_bytes: bytes one microbatch sends across each boundary forward
        (activations) / backward (activation-gradients): ``S - 1`` values or one number.
      lk: the link between neighbouring stages.
      num_stages: ``S`` when every per-stage argument is a single number.
      schedule: ``"gpipe"`` or ``"1f1b"``.
      lockstep: jaxcomp's GPipe: ``M + S - 1`` ticks of the slowest stage each way, plus every
        send in sequence; ``False``: asynchronous operations over the schedule's dependency
        graph, sends overlapping compute.

    Returns:
      The step time in seconds (the pipeline alone; add a data-axis gradient reduction with
      :func:`communication_time`).

    Example:
      >>> lk = NetworkLink(bandwidth=1e3, latency=0.1)  # a 100-byte send takes 0.2 s
      >>> round(pipeline_step_time(1.0, 2.0, 2, 100.0, 100.0, lk, num_stages=2), 6)
      9.8
      >>> round(pipeline_step_time(1.0, 2.0, 2, 100.0, 100.0, lk, num_stages=2,
      ...                          lockstep=False), 6)  # 2 sends on the critical path
      9.4
    """
    _validate.check_choice("schedule", schedule, SCHEDULES)
    m = _validate.check_int("num_microbatches", num_microbatches, 1)
    if num_stages is None:
        if isinstance(forward_s, (int, float)):
            raise ValueError("num_stages is needed when forward_s is a single number.")
        num_stages = len(list(forward_s))
    s_n = _validate.check_int("num_stages", num_stages, 1)
    f = _per_stage("forward_s", forward_s, s_n)
    b = _per_stage("backward_s", backward_s, s_n)
    sf = [collective_time("collective-permute", n, 2, lk) for n in _per_stage(
        "forward_bytes", forward_bytes, s_n - 1)]  # fmt: skip
    sb = [collective_time("collective-permute", n, 2, lk) for n in _per_stage(
        "backward_bytes", backward_bytes, s_n - 1)]  # fmt: skip
    if lockstep:
        if schedule != "gpipe":
            raise ValueError("lockstep=True models jaxcomp's GPipe ticks; use lockstep=False.")
        return (m + s_n - 1) * (max(f) + max(b)) + m * (sum(sf) + sum(sb))
    return _simulate(f, b, m, sf, sb, lk, schedule)


def _simulate(f, b, m, sf, sb, lk, schedule) -> float:
    """Makespan of the schedule's dependency graph (event simulation, exact for fixed orders)."""
    s_n = len(f)
    orders = [_schedule_order(schedule, s, s_n, m) for s in range(s_n)]
    nxt = [0] * s_n
    free = [0.0] * s_n  # when each stage is idle
    arrive: dict[tuple[str, int, int], float] = {}  # (op, stage, microbatch) -> input ready
    done: dict[tuple[str, int, int], float] = {}
    link_free = {("F", i): 0.0 for i in range(s_n - 1)} | {("B", i): 0.0 for i in range(s_n - 1)}

    def send(direction, boundary, t_end, seconds):
        busy = seconds - (lk.latency if seconds else 0.0)  # the wire is busy for n / beta
        start = max(t_end, link_free[(direction, boundary)])
        link_free[(direction, boundary)] = start + busy
        return start + seconds

    progressed = True
    while progressed:
        progressed = False
        for s in range(s_n):
            while nxt[s] < len(orders[s]):
                op, i = orders[s][nxt[s]]
                if op == "F":
                    ready = 0.0 if s == 0 else arrive.get(("F", s, i))
                else:
                    ready = done.get(("F", s, i)) if s == s_n - 1 else arrive.get(("B", s, i))
                if ready is None:
                    break
                end = max(free[s], ready) + (f[s] if op == "F" else b[s])
                free[s] = done[(op, s, i)] = end
                if op == "F" and s < s_n - 1:
                    arrive[("F", s + 1, i)] = send("F", s, end, sf[s])
                if op == "B" and s > 0:
                    arrive[("B", s - 1, i)] = send("B", s - 1, end, sb[s - 1])
                nxt[s] += 1
                progressed = True
    if any(nxt[s] < len(orders[s]) for s in range(s_n)):  # cannot happen for these schedules
        raise RuntimeError(f"schedule {schedule!r} deadlocked at {nxt}.")
    return max(free)


def predicted_speedups(
    baseline: Iterable, candidate: Iterable, compute_s: float, *, base_compute_s=None, links=None
) -> dict[float, float]:
    """Speedup of ``candidate`` over ``baseline`` collectives at each link speed (Gbit/s).

    Both steps run :func:`step_time`: the candidate with ``compute_s`` and the baseline with
    ``base_compute_s`` (default the same), each followed by its collectives.

    Args:
      baseline, candidate: collectives of one step (see :func:`communication_time`).
      compute_s: the candidate's compute time per step, seconds.
      base_compute_s: the baseline's (compression costs compute); default ``compute_s``.
      links: ``{gbit_per_s: NetworkLink}``; default :data:`GBIT_PER_S` at :data:`DEFAULT_LATENCY_S`.

    Example:
      >>> dense = [Collective("all-reduce", 4e8, 4)]   # 400 MB of float32 gradients
      >>> topk = [Collective("all-gather", 8e6, 4)]    # 1% TopK: values + indices
      >>> {g: round(x, 1) for g, x in predicted_speedups(dense, topk, 0.1).items()}
      {1.0: 16.8, 10.0: 4.9, 100.0: 1.5}
    """
    base_compute_s = compute_s if base_compute_s is None else base_compute_s
    links = links or {g: network_link(g) for g in GBIT_PER_S}
    baseline, candidate = list(baseline), list(candidate)
    return {
        g: speedup(step_time(base_compute_s, baseline, lk), step_time(compute_s, candidate, lk))
        for g, lk in links.items()
    }
