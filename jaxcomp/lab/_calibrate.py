r"""Calibration: the lab measures its own network and fits the cost model's alpha and beta.

Three measurements, each a run of the lab's hosts:

* the achieved rate: one bulk TCP transfer from host 0 to host 1 (:mod:`jaxcomp.lab._xfer`);
* an all-reduce sweep over message sizes and a ping-pong (``collective-permute`` there and
  back) through JAX collectives across the processes (:mod:`jaxcomp.lab._probe`).

For each collective kind the times are fitted to the cost model's formula for that kind
(:func:`jaxcomp.study.collective_time`), linear in :math:`\alpha` and :math:`1/\beta`: for
the all-reduce over :math:`W` devices
:math:`t(n) = 2(W-1)\,\alpha + \tfrac{2(W-1)}{W}\, n / \beta`, for a permute
:math:`t(n) = \alpha + n/\beta`. The fit is least squares on the *relative* error (each row
divided by its measured time), so the small messages, where :math:`\alpha` shows, weigh as much
as the large ones, where :math:`\beta` does; :math:`\alpha \ge 0` and :math:`\beta > 0` are
enforced (an unlimited link can fit no measurable :math:`1/\beta`: it is then capped at
:data:`MAX_BANDWIDTH`). :math:`\beta` is the bandwidth the collective achieves (gloo's ring
over every device-rank, TCP, headers), not the configured rate; both are recorded.

The ping-pong is fitted with the link's token bucket (:func:`point_to_point`): an idle ``tbf``
lets its ``burst`` :math:`b` through at the veth's speed, so one message costs
:math:`t(n) = \alpha + \max(n - b, 0)/\beta`, fitted on the probes larger than the burst
(those within it time the veth and the stack, not the link). The affine fit over every probe
put a 10 Mbit/s link at 15.6 Mbit/s (45% error: its 1 and 4 KiB probes pass within the burst);
with the bucket, 9.8 Mbit/s and 2% (docs/results/network/pipeline_model.md).

The chain probe (three hosts or more) times one ``ppermute`` whose middle host receives and
sends against one with a single pair. gloo sends a message once its receiver has posted the
receive (a go-ahead on the same TCP connection); a host that sends and receives in one
permute posts its receive's go-ahead after its own send has started, so the go-ahead waits in
its ``tbf`` queue behind its outgoing data, and the upstream send starts that much later
(:func:`chain`: :math:`d(n) = \min(\max(n - o, 0), c)/\beta`, :math:`o` what has left the
queue before the go-ahead is posted, :math:`c` the most the queue holds ahead of it).
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from jaxcomp.lab import _lab
from jaxcomp.lab import _probe
from jaxcomp.lab import _xfer
from jaxcomp.study import _cost
from jaxcomp.study import _fits

#: the largest all-reduce / ping-pong message, bytes per device
MAX_BYTES = 4 << 20
MIN_BYTES = 1 << 10
#: the longest one collective of the sweep may take at the nominal rate, seconds
SWEEP_SECONDS = 0.25
#: bytes/s standing for "no measurable limit" (100 GB/s)
MAX_BANDWIDTH = 1e11


def sweep_sizes(rate_bit_s: float | None, factor: float) -> list[int]:
    """Message sizes 1 KiB, 4 KiB, ... up to 4 MiB or what takes :data:`SWEEP_SECONDS` at the
    rate when ``factor * n`` bytes cross the link.

    Example:
      >>> sweep_sizes(None, 1.75)[-1], sweep_sizes(10e6, 1.75)
      (4194304, [1024, 4096, 16384, 65536])
    """
    cap = MAX_BYTES
    if rate_bit_s is not None:
        cap = min(cap, SWEEP_SECONDS * rate_bit_s / 8 / factor)
    sizes, n = [], MIN_BYTES
    while n <= cap:
        sizes.append(n)
        n *= 4
    return sizes


def _design(kind: str, nbytes: np.ndarray, group_size: int, burst: float = 0.0) -> np.ndarray:
    """The columns multiplying ``(alpha, 1/beta)`` in the cost model's formula for ``kind``
    (for a message, its bytes beyond the token bucket's ``burst``)."""
    unit = _cost.NetworkLink(bandwidth=1.0, latency=0.0)
    per_byte = np.array([_cost.collective_time(kind, float(n), group_size, unit) for n in nbytes])
    if burst:
        per_byte = np.maximum(per_byte - burst, 0.0)
    latency = _cost.collective_time(kind, 1.0, group_size, _cost.NetworkLink(1e300, 1.0))
    return np.stack([np.full(len(nbytes), latency), per_byte], axis=1)


def fit(kind: str, points: list[dict], group_size: int, burst_bytes: float = 0.0) -> dict:
    r"""Least-squares ``alpha`` (s) and ``beta`` (bytes/s) of the cost model for ``kind``.

    Args:
      kind: ``"all-reduce"`` or ``"collective-permute"`` (any of the cost model's kinds).
      points: ``[{"bytes": n, "median_s": t}, ...]`` (at least two sizes).
      group_size: ``W`` of the collective (2 for the ping-pong).
      burst_bytes: the link's token bucket; a message's first ``burst_bytes`` are free
        (:math:`t(n) = \alpha + \max(n - b, 0)/\beta`); ``collective-permute`` only.

    Returns:
      A dict with ``alpha_s``, ``beta_bytes_s``, ``beta_bit_s``, ``burst_bytes``,
      ``max_rel_error`` and ``points`` (the input points, each with ``predicted_s``).

    Example:
      >>> pts = [{"bytes": n, "median_s": 1e-3 + n / 1e6} for n in (1e3, 1e4, 1e5)]
      >>> f = fit("collective-permute", pts, 2)
      >>> round(f["alpha_s"], 6), round(f["beta_bytes_s"])
      (0.001, 1000000)
    """
    if len(points) < 2:
        raise ValueError(f"fitting {kind} needs at least two message sizes; got {len(points)}.")
    if burst_bytes and kind != "collective-permute":
        raise ValueError(f"a token bucket's burst is modelled for collective-permute only, not "
                         f"{kind}.")  # fmt: skip
    if not (math.isfinite(burst_bytes) and burst_bytes >= 0):
        raise ValueError(f"burst_bytes must be finite and >= 0; got {burst_bytes}.")
    n = np.array([p["bytes"] for p in points], float)
    t = np.array([p["median_s"] for p in points], float)
    if not np.all(t > 0):
        raise ValueError(f"{kind} times must be positive; got {t.tolist()}.")
    a = _design(kind, n, group_size, burst_bytes)
    rows = a / t[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    if alpha < 0:  # refit the bandwidth alone
        alpha = 0.0
        inv_beta = float(rows[:, 1] @ np.ones_like(t) / (rows[:, 1] @ rows[:, 1]))
    if inv_beta <= 1 / MAX_BANDWIDTH:  # no measurable bandwidth term: refit the latency alone
        inv_beta = 1 / MAX_BANDWIDTH
        alpha = float(max(rows[:, 0] @ (1 - rows[:, 1] * inv_beta) / (rows[:, 0] @ rows[:, 0]),
                          0.0))  # fmt: skip
    predicted = a @ np.array([alpha, inv_beta])
    return {
        "kind": kind,
        "group_size": group_size,
        "alpha_s": float(alpha),
        "beta_bytes_s": float(1 / inv_beta),
        "beta_bit_s": float(8 / inv_beta),
        "burst_bytes": float(burst_bytes),
        "max_rel_error": float(np.max(np.abs(predicted - t) / t)),
        "points": [{**p, "predicted_s": float(q)} for p, q in zip(points, predicted, strict=True)],
    }


def point_to_point(points: list[dict], network: dict) -> dict:
    """The ping-pong's fit on ``network``'s links (module docstring): with its ``tbf`` burst,
    on the probes larger than it; the plain affine fit on every probe where the link has no
    bucket or fewer than two probes exceed it (a 10 Gbit/s link's 1.25 MB burst).

    Example:
      >>> net = {"tbf": {"rate": "8000000bit", "burst": "3000"}}
      >>> pts = [{"bytes": n, "median_s": 1e-3 + max(n - 3000, 0) / 1e6}
      ...        for n in (1024, 4096, 16384, 65536)]
      >>> f = point_to_point(pts, net)
      >>> round(f["alpha_s"], 6), round(f["beta_bytes_s"]), f["burst_bytes"]
      (0.001, 1000000, 3000.0)
    """
    burst = float((network.get("tbf") or {}).get("burst", 0))
    above = [p for p in points if p["bytes"] > burst]
    if burst and len(above) >= 2:
        return fit("collective-permute", above, 2, burst)
    return fit("collective-permute", points, 2)


def chain_sizes(rate_bit_s: float | None) -> list[int]:
    """The chain probe's message sizes: 4 KiB, 8 KiB, ... doubling up to 4 MiB or what two
    sends take :data:`SWEEP_SECONDS` for at the rate (the delay bends where the queue ahead
    fills).

    Example:
      >>> chain_sizes(10e6)
      [4096, 8192, 16384, 32768, 65536, 131072]
    """
    cap = MAX_BYTES if rate_bit_s is None else min(MAX_BYTES, SWEEP_SECONDS * rate_bit_s / 16)
    sizes, n = [], 4 << 10
    while n <= cap:
        sizes.append(n)
        n *= 2
    return sizes


def chain(points: list[dict], beta_bytes_s: float) -> dict:
    r"""Fits the chain probe's extra time per send (module docstring):
    :math:`d(n) = \min(\max(n - o, 0), c)/eta`, ``d`` the chained permute's median less the
    single pair's at each size, :math:`eta` the ping-pong's (the queue drains at the link's
    rate); least squares in seconds over a grid of :math:`o` (with the best :math:`c` for each).

    Args:
      points: ``[{"bytes": n, "one_s": t1, "chain_s": t2}, ...]`` (at least two sizes).
      beta_bytes_s: the link's bandwidth, bytes/s.

    Returns:
      A dict with ``offset_bytes``, ``cap_bytes`` (``inf``: no cap seen), ``beta_bytes_s``,
      ``max_abs_error_s`` and ``points`` (each with ``delay_s`` and ``predicted_delay_s``).

    Example:
      >>> pts = [{"bytes": n, "one_s": n / 1e6, "chain_s": n / 1e6 + min(max(n - 4e3, 0), 5e4)
      ...         / 1e6} for n in (4096, 8192, 16384, 32768, 65536, 131072)]
      >>> f = chain(pts, 1e6)
      >>> round(f["offset_bytes"], -2), round(f["cap_bytes"], -2)
      (4000.0, 50000.0)
    """
    if len(points) < 2:
        raise ValueError(f"fitting the chain needs at least two message sizes; got {len(points)}.")
    if not (math.isfinite(beta_bytes_s) and beta_bytes_s > 0):
        raise ValueError(f"beta_bytes_s must be finite and > 0; got {beta_bytes_s}.")
    n = np.array([p["bytes"] for p in points], float)
    d = np.array([p["chain_s"] - p["one_s"] for p in points], float)
    if not np.all(np.isfinite(d)):
        raise ValueError(f"chain probe times must be finite; got {points}.")
    ahead = d * beta_bytes_s  # bytes the go-ahead waited behind
    weight = 1.0 / np.array([p["one_s"] for p in points], float)
    best = (math.inf, 0.0, math.inf)
    for o in np.linspace(0.0, float(n.max()), 1025):
        for c in [math.inf, *np.maximum(ahead, 0.0)]:
            miss = (np.minimum(np.maximum(n - o, 0.0), c) - ahead) * weight
            sse = float(np.sum(miss**2))
            if sse < best[0] - 1e-9:
                best = (sse, float(o), float(c))
    _, offset, cap = best
    fitted = {"offset_bytes": offset, "cap_bytes": cap, "beta_bytes_s": float(beta_bytes_s)}
    predicted = [_fits.chain_delay_s(fitted, x) for x in n]
    return {
        **fitted,
        "max_abs_error_s": float(np.max(np.abs(np.array(predicted) - d))),
        "points": [
            {**p, "delay_s": float(x), "predicted_delay_s": q}
            for p, x, q in zip(points, d, predicted, strict=True)
        ],  # fmt: skip
    }


def refit(calibration: dict) -> dict:
    """``calibration`` with its ping-pong fitted by :func:`point_to_point` from the probes it
    stored, where its fit predates the token bucket (no ``"burst_bytes"``); else unchanged.
    The measured points are kept as they are."""
    f = (calibration.get("fits") or {}).get("collective-permute")
    if f is None or "burst_bytes" in f:
        return calibration
    points = [{k: v for k, v in p.items() if k != "predicted_s"} for p in f["points"]]
    fits = dict(calibration["fits"])
    fits["collective-permute"] = point_to_point(points, calibration["network"])
    return {**calibration, "fits": fits}


def link_of(calibration: dict, kind: str = "all-reduce") -> _cost.NetworkLink:
    """The cost model's :class:`~jaxcomp.study.NetworkLink` fitted for ``kind`` in a calibration."""
    f = calibration["fits"][kind]
    return _cost.NetworkLink(bandwidth=f["beta_bytes_s"], latency=f["alpha_s"])


def measure_rate(lab: _lab.Lab, out_dir: str, nbytes: int | None = None) -> dict:
    """One bulk TCP transfer from host 0 to host 1 of ``nbytes`` (default: ~0.5 s at the rate,
    200 MB unlimited); ``{"bytes", "seconds", "bit_s"}``.

    Raises:
      LabError: if the transfer fails (the hosts' logs are named).
    """
    rate = lab.spec.rate_bit_s
    nbytes = nbytes or (200_000_000 if rate is None else int(rate / 8 * 0.5))
    out = os.path.join(out_dir, "xfer.json")
    result = lab.run([sys.executable, _xfer.__file__, str(nbytes), out], out_dir, timeout_s=120)
    if not result.ok:
        raise _lab_error("the rate probe", result)
    with open(out) as f:
        return json.load(f)


def _lab_error(what: str, result) -> Exception:
    from jaxcomp.lab import _net

    tail = ""
    for log in result.logs:
        with open(log) as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        if lines:
            tail = lines[-1]
    how = "timed out" if result.timed_out else f"exited {list(result.returncodes)}"
    error = _net.LabTimeout if result.timed_out else _net.LabError
    return error(f"{what} {how}; logs {list(result.logs)}; last line: {tail}")


def calibrate(lab: _lab.Lab, out_dir: str, *, reps: int = 7, timeout_s: float = 300.0) -> dict:
    """Measures the open ``lab``'s network and fits alpha and beta (module docstring).

    Args:
      lab: an open :class:`~jaxcomp.lab.Lab` of at least 2 hosts.
      out_dir: where the probes write their logs and results.
      reps: timed calls per size.
      timeout_s: the probe run's limit.

    Returns:
      A JSON-able dict with ``network``, ``achieved``, ``sweeps``, ``fits`` (``all-reduce``
      and ``collective-permute``: :func:`fit`'s dicts), ``chain`` (:func:`chain`'s fit; on 3
      hosts or more), ``load_before`` and ``load_after``.
    """
    if lab.spec.hosts < 2:
        raise ValueError("calibration needs at least 2 hosts (a link between them).")
    os.makedirs(out_dir, exist_ok=True)
    before = _lab.load()
    achieved = measure_rate(lab, out_dir)
    world = lab.spec.hosts * lab.devices
    rate = lab.spec.rate_bit_s
    sizes = sweep_sizes(rate, 2 * (world - 1) / world)
    pings = sweep_sizes(rate, 2.0)
    out = os.path.join(out_dir, "probe.json")
    argv = [sys.executable, "-m", _probe.__name__, out, "--sizes", ",".join(map(str, sizes)),
            "--pingpong_sizes", ",".join(map(str, pings)), "--reps", str(reps),
            "--chain_sizes", ",".join(map(str, chain_sizes(rate)))]  # fmt: skip
    result = lab.run(argv, out_dir, timeout_s=timeout_s)
    if not result.ok:
        raise _lab_error("the calibration probe", result)
    with open(out) as f:
        sweeps = json.load(f)
    fits = {"all-reduce": fit("all-reduce", sweeps["all-reduce"], world)}
    if len(sweeps["collective-permute"]) >= 2:
        fits["collective-permute"] = point_to_point(sweeps["collective-permute"], lab.describe())
    extra = {}
    if len(sweeps.get("chain", ())) >= 2:
        beta = fits.get("collective-permute", fits["all-reduce"])["beta_bytes_s"]
        extra["chain"] = chain(sweeps["chain"], beta)
    return {
        "network": lab.describe(),
        "achieved": achieved,
        "sweeps": sweeps,
        "fits": fits,
        **extra,
        "load_before": before,
        "load_after": _lab.load(),
    }
