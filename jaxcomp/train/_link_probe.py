r"""A periodic probe of the hosts' links: which host of a multi-process run is slow.

A synchronous step makes every host's step time that of the slowest link, so step times
cannot name a straggler. The probe times each host in turn sending a fixed payload to its
ring neighbour:

.. math::
  t_K = \mathrm{time}(\text{host } K \to \text{host } (K + 1) \bmod H), \quad K = 0 \dots H-1

one small program per ``K`` (a ``ppermute`` over the ``hosts`` axis with the single pair
``(K, K+1)``: each of ``K``'s ``L`` devices sends ``payload / L`` bytes to its counterpart),
run on every process after a barrier and timed to ``block_until_ready``; ``t_K`` is the
longest of the processes' times (the receiver's: it waits for the data), the best of
``repeats`` rounds (delays on a busy machine only add).

Naming (:func:`slow_hosts`): ``t_K`` is *slow* when ``t_K >= factor * m_K``, ``m_K`` the lower
median of the other hosts' times. A slow send is ``K``'s egress or ``K+1``'s ingress; a host
whose link is slow both ways slows two consecutive sends (``K-1``'s into it and its own), and
the host they share is named: host ``K`` is named when ``t_K`` is slow and either ``t_{K-1}``
is slow too or ``t_{K+1}`` is not. With 2 hosts the two sends are the two directions of one
path: a host that sends slowly is named, but a link slow both ways slows both sends alike and
cannot be told from the other host's (no measurement between the two can: every byte crosses
both links); 3 hosts or more tell it.

Why not NIC counters: they count bytes, not how long a given transfer took, are not per
direction and peer on every platform (TPU ICI, containers), and a synchronous step waits for
the slowest link whichever host it belongs to; the probe measures exactly the quantity that
names the host, with the run's own collectives.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _bits
from jaxcomp.train import _processes

AXES = ("hosts", "local")
FACTOR = 3.0  #: a send this many times the others' lower median is slow
REPEATS = 2  #: rounds per probe; each host's best is kept


def lower_median(values: Sequence[float]) -> float:
    """The lower of the two middle values (the middle one for an odd count)."""
    s = sorted(values)
    return float(s[(len(s) - 1) // 2])


def slow_hosts(times: Sequence[float], factor: float = FACTOR) -> list[int]:
    """The hosts named slow from each host's send time ``times[K]`` (see the module).

    Args:
      times: ``t_K``, host ``K``'s time to send the payload to host ``(K+1) % H``, ``H >= 2``.
      factor: how many times the others' lower median makes a send slow (``>= 1``).

    Returns:
      The indices of the named hosts, ascending (empty when none stands out).

    Raises:
      ValueError: fewer than 2 times, a time that is negative or not finite, or ``factor < 1``.

    Example:
      >>> slow_hosts([5.1, 52.0])  # host 1 sends at a tenth of host 0's rate
      [1]
      >>> slow_hosts([50.0, 51.0, 5.0, 5.2])  # host 1's link slow both ways
      [1]
    """
    t = np.asarray(times, np.float64)
    if t.ndim != 1 or t.size < 2:
        raise ValueError(f"times must hold one send time per host, >= 2 hosts; got {times!r}.")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"times must be finite and >= 0; got {times!r}.")
    if not factor >= 1:
        raise ValueError(f"factor must be >= 1; got {factor!r}.")
    h = t.size
    slow = [t[k] > 0 and t[k] >= factor * lower_median(np.delete(t, k)) for k in range(h)]
    return [k for k in range(h) if slow[k] and (slow[k - 1] or not slow[(k + 1) % h])]


def metrics(times: Sequence[float]) -> dict[str, float]:
    """``{"link_probe_ms/host_K": t_K in milliseconds}`` for every host."""
    return {f"link_probe_ms/host_{k}": round(float(t) * 1e3, 3) for k, t in enumerate(times)}


def describe(step: int, times: Sequence[float], named: Sequence[int], team=None) -> str:
    """The line that names the slow hosts (``team``: each process's description, by index;
    a host is its process here)."""
    parts = []
    for k in named:
        others = lower_median(np.delete(np.asarray(times, np.float64), k))
        who = str(team[k]) if team is not None else f"process {k}"
        parts.append(
            f"host {k} ({who}) sends to host {(k + 1) % len(times)} in "
            f"{times[k] * 1e3:.1f} ms, {times[k] / max(others, 1e-9):.1f}x the others' "
            f"{others * 1e3:.1f} ms"
        )
    return f"link probe @ {step}: slow link: " + "; ".join(parts) + "."


def hosts_of(devices: Sequence[jax.Device] | None = None) -> np.ndarray:
    """The devices as ``[host, local device]``: one row per process, by process index."""
    devices = list(jax.devices() if devices is None else devices)
    by = {}
    for d in devices:
        by.setdefault(d.process_index, []).append(d)
    rows = [sorted(by[p], key=lambda d: d.id) for p in sorted(by)]
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"every process needs as many devices; got {[len(r) for r in rows]}.")
    return np.array(rows, dtype=object)


class LinkProbe:
    """Times each host sending ``payload_bytes`` to its ring neighbour (see the module).

    Args:
      hosts: the devices as ``[host, local device]`` (:func:`hosts_of`; a test may group one
        process's devices into fake hosts), at least 2 hosts.
      payload_bytes: what each host sends per probe, split over its devices (at least 4 bytes
        per device). Pick it so that a transfer takes several times the link's latency.
      repeats: rounds per probe (each host's best is kept).

    Example:
      >>> probe = LinkProbe(hosts_of(), 1 << 20)  # doctest: +SKIP
      >>> times = probe.measure()  # doctest: +SKIP
      >>> # times: seconds, one per host
      >>> slow_hosts(times)  # doctest: +SKIP
    """

    def __init__(self, hosts: np.ndarray, payload_bytes: int, repeats: int = REPEATS):
        hosts = np.asarray(hosts, dtype=object)
        if hosts.ndim != 2 or hosts.shape[0] < 2:
            raise ValueError(f"hosts must be [host, device] with >= 2 hosts; got {hosts.shape}.")
        h, local = hosts.shape
        if not isinstance(payload_bytes, int) or payload_bytes < 4 * local:
            raise ValueError(
                f"payload_bytes must be an int >= {4 * local} (4 per device); "
                f"got {payload_bytes!r}."
            )
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1; got {repeats!r}.")
        self.hosts, self.repeats = h, repeats
        self.mesh = jax.sharding.Mesh(hosts, AXES)
        spec = P(*AXES)
        sharding = NamedSharding(self.mesh, spec)
        words = payload_bytes // (4 * local)
        self.payload_bytes = words * 4 * local
        self.payload = jax.jit(
            lambda: jnp.ones((h, local, words), jnp.uint32), out_shardings=sharding
        )()
        self.token = jax.jit(lambda: jnp.ones((h, local), jnp.int32), out_shardings=sharding)()

        def shard(body):
            return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=spec, out_specs=spec))

        def send(k):
            pair = [(k, (k + 1) % h)]
            return shard(lambda x: _bits.move_as_bits(lambda t: lax.ppermute(t, AXES[0], pair), x))

        self.barrier = shard(lambda x: lax.psum(x, AXES)).lower(self.token).compile()
        self.sends = [send(k).lower(self.payload).compile() for k in range(h)]

    def measure(self) -> np.ndarray:
        """Every host's send time in seconds, ``[host]`` (the same on every process).

        Every process of the run must call it at the same point (it runs collectives).
        """
        best = np.full(self.hosts, np.inf)
        for _ in range(self.repeats):
            for k, send in enumerate(self.sends):
                self.barrier(self.token).block_until_ready()
                t0 = time.perf_counter()
                send(self.payload).block_until_ready()
                best[k] = min(best[k], time.perf_counter() - t0)
        us = _processes.gather_ints([min(round(t * 1e6), 2**31 - 1) for t in best])
        return us.max(axis=0) / 1e6


def for_run(every: int, payload_bytes: int, devices, say) -> LinkProbe | None:
    """The run's probe (``every`` steps; ``0``: none), over the processes of ``devices`` (the
    mesh's), compiled now; ``None`` in a single process (no link between hosts), said once."""
    if not every:
        return None
    hosts = hosts_of(devices)
    if hosts.shape[0] < 2:
        say("  link probe: off (one process: no link between hosts to time)")
        return None
    probe = LinkProbe(hosts, payload_bytes)
    say(
        f"  link probe: every {every} steps, each of {hosts.shape[0]} hosts sends "
        f"{probe.payload_bytes} bytes to the next (metrics split 'links')"
    )
    return probe


def record(probe: LinkProbe, step: int, team=None) -> tuple[dict[str, float], str | None]:
    """Runs ``probe``: its metrics and the line naming the slow hosts (``None``: none)."""
    times = probe.measure()
    named = slow_hosts(times)
    return metrics(times), (describe(step, times, named, team) if named else None)
