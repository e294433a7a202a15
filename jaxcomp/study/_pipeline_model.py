r"""The pipeline's cost model on per-host links: the step's boundary permutes played in order.

The compiled tick program's permutes (:mod:`jaxcomp.study._moves`, the engine's own cut) are
played on the links a calibration fitted (:mod:`jaxcomp.study._fits`): each host runs its sends
in program order, and a send starts only when its receiver has reached it too (gloo's send
waits for the posted receive). With one ``ppermute`` per boundary (runs before 2026-12-05), a
stage that receives and sends in one tick relayed its boundaries one after another: the lab's
4-stage GPipe step took ~20 sends' time, not the 12 of its ticks nor the 24 of one wire; with
one ``ppermute`` per tick and direction the model plays 12, and a send whose receiver also
sends in the same move (a chain) starts later by the calibration's chain fit
(:func:`jaxcomp.study._fits.chain_delay_s`: the receiver's go-ahead waits behind its own
outgoing data; docs/results/network/pipeline_model.md). A move whose boundaries carry payloads
of different sizes is as many permutes as it has distinct sizes; a run that records its step's
permutes (summary ``boundary_permutes``) is played with each boundary's payloads read from them,
checked against the permutes the model plays (no prediction where they differ), an older run
with every send at the mean.

The step (:func:`step_s`): :math:`T(r) = \max(T_\infty, C_0 + \mathrm{sends}(r))`, where
:math:`T_\infty` is the unlimited-rate run's median step and :math:`C_0` its *fastest* step
less the model's communication there: the compute without contention. The lab's hosts share
the machine's cores, so at unlimited rate a step's compute also waits for a core (the digits
pipeline's steps spread 11-37 ms around a 21 ms median); on per-host links a host that waits
for its boundary leaves the cores to the others, the link paces the step and that wait is
hidden behind it (the 100 Mbit/s steps spread 42-54 ms, the fastest 12 ms + the model's sends).
The sends are played with :math:`C_0` spread over the ticks, so the buckets refill between
moves as they do between the real ones (docs/results/network/README.md, "The pipeline at 100
Mbit/s: the contention the link hides"). A data-parallel step keeps :math:`C + \mathrm{comm}`:
its all-reduce holds every process at once, nothing computes behind it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from jaxcomp import pipeline
from jaxcomp.study import _cost
from jaxcomp.study import _fits
from jaxcomp.study import _moves


def record(summary: Mapping[str, Any]) -> dict[str, Any]:
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


def pipeline_send_s(
    schedule: str,
    stages: int,
    microbatches: int,
    nbytes: float | Sequence[Sequence[float]],
    link: _cost.NetworkLink,
    burst_bytes: float = 0.0,
    moves: str = "tick",
    chain_s: float | Callable[[float], float] = 0.0,
    tick_s: float = 0.0,
) -> float:
    r"""Seconds the boundary sends of one step take on per-host links, played through the tick
    program's order of sends.

    ``moves="tick"`` (the tick program since 2026-12-05): per tick, the forward move (stage
    ``b`` to ``b + 1``, for each ``b`` that ran a forward), then the backward one (``b + 1`` to
    ``b``, for each ``b + 1`` that ran a backward), or under 1F1B one move of both
    (:func:`jaxcomp.pipeline._ticks.tick_moves`), each the permutes the engine compiles it to
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
    :func:`jaxcomp.study._fits.chain_delay_s`). Each tick computes ``tick_s`` on every host
    before its moves: the links' buckets refill meanwhile, and a send that finds its bucket full
    again pays only the bytes beyond the burst; the compute itself is not in the returned time
    (the caller adds the step's). Bubble ticks send nothing.

    Args:
      schedule, stages, microbatches: the pipeline (``"gpipe"`` or ``"1f1b"``, ``S``, ``M``).
      nbytes: one send's payload, bytes (every boundary and direction alike), or per boundary
        its ``(forward, backward)`` payload.
      link: the ping-pong's fit.
      burst_bytes: the links' token bucket (0: none).
      moves: ``"tick"`` or ``"boundary"``: the program whose sends are played (above).
      chain_s: the extra seconds of a send whose receiver sends in the same permute: a number,
        or a function of the permute's bytes per pair (0: none).
      tick_s: the seconds each tick computes before its moves (0: the sends back to back).

    Returns:
      The sends' share of the step, seconds: when the last host finished its last send, less
      the ticks' compute played before it.

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
      >>> round(pipeline_send_s("gpipe", 4, 4, 1e4, lk, 1e4, tick_s=1e-2) / 1e-2, 6)  # refilled
      0.0
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
    if not (tick_s >= 0 and math.isfinite(tick_s)):
        raise ValueError(f"tick_s must be finite and >= 0; got {tick_s}.")
    played = _moves.pipeline_moves(schedule, stages, microbatches, nbytes)
    at = _moves.move_ticks(schedule, stages, microbatches)
    if moves == "boundary":  # one single-pair permute per boundary, boundary by boundary
        played, at = [], []
        for t, row in enumerate(pipeline.ticks(schedule, stages, microbatches)):
            for b in range(stages - 1):
                if row[b] is not None and row[b].kind == "F":
                    played.append((_moves.Permute(((b, b + 1),), nbytes[b][0]),))
                    at.append(t)
                if row[b + 1] is not None and row[b + 1].kind == "B":
                    played.append((_moves.Permute(((b + 1, b),), nbytes[b][1]),))
                    at.append(t)
    # the ticks computed since the move before (a tick's own first; none between its moves)
    compute = [tick_s * (t - prev) for t, prev in zip(at, [-1, *at])]
    return play_permutes(played, stages, link, burst_bytes, chain_s, compute)


def play_permutes(
    moves: Sequence[Sequence[_moves.Permute]],
    stages: int,
    link: _cost.NetworkLink,
    burst_bytes: float = 0.0,
    chain_s: float | Callable[[float], float] = 0.0,
    compute_s: Sequence[float] | None = None,
) -> float:
    """Seconds ``moves`` (each a sequence of :class:`jaxcomp.study._moves.Permute`, run in
    order) take on per-host links, as :func:`pipeline_send_s` plays them: the pairs of one
    permute start together, each when both its hosts have finished their earlier permutes,
    ``chain_s`` later where its receiver also sends on to another host in the permute (a
    swap, both directions of one pair, pays no chain: both go-aheads leave before any data,
    docs/results/network/pipeline_model.md; the ACKs that slow a swap of 64 KiB or more at 10
    Mbit/s are not modelled). Before move ``i`` every host computes ``compute_s[i]`` (the
    buckets refill meanwhile); the result leaves that compute out: every host's clock holds
    all of it, so the sends' share is the last clock less its sum.

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

    compute = [0.0] * len(moves) if compute_s is None else list(compute_s)
    if len(compute) != len(moves) or not all(c >= 0 and math.isfinite(c) for c in compute):
        raise ValueError(
            f"compute_s needs one finite entry >= 0 per move ({len(moves)}); got {compute_s}."
        )
    for move, c in zip(moves, compute):
        clock = [t + c for t in clock]
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
    return max(clock) - sum(compute)


def send_s(
    pipe: Mapping[str, Any],
    sends: Sequence[_cost.Collective],
    calibration: Mapping[str, Any],
    compute_s: float = 0.0,
) -> tuple[float | None, str]:
    """Seconds a pipeline run's boundary sends take on a calibration's per-host links
    (:func:`pipeline_send_s` with the calibration's ping-pong fit, bucket and chain fit), or
    ``None`` with the reason.

    Args:
      pipe: the run's :func:`record`.
      sends: the step's ``collective-permute`` collectives (their bytes give the mean send of a
        run that records no permutes).
      calibration: the lab's calibration (``fits``, optional ``chain``).
      compute_s: the step's compute, spread evenly over its ticks (the buckets refill in it).
    """
    fits = calibration["fits"]
    fit = fits.get("collective-permute", fits["all-reduce"])
    link = _fits.links({"p2p": fit})["p2p"]
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
    chain = calibration.get("chain")
    played = pipeline_send_s(
        *shape, nbytes, link, float(fit.get("burst_bytes", 0.0)),
        pipe.get("moves", "boundary"), lambda n: _fits.chain_delay_s(chain, n),
        compute_s / len(pipeline.ticks(*shape)),
    )  # fmt: skip
    return played, ""


def step_s(reference_s: float, free_compute_s: float, sends_s: float) -> tuple[float, str]:
    """The predicted step on per-host links (module docstring), and what bounds it.

    Args:
      reference_s: the unlimited-rate run's median step.
      free_compute_s: its fastest step less the model's communication there.
      sends_s: the sends' share at this rate (:func:`send_s` with that compute).

    Returns:
      ``(max(reference_s, free_compute_s + sends_s), "compute" | "link")``.

    Example:
      >>> step_s(0.020, 0.010, 0.040), step_s(0.020, 0.010, 0.004)
      ((0.05, 'link'), (0.02, 'compute'))
    """
    link = free_compute_s + sends_s
    return (link, "link") if link > reference_s else (reference_s, "compute")
