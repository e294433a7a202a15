"""Faults of one host's link in an open lab: taken down (a partition) and back up, or slowed
(a straggler), while the hosts run.

Only the ``per_host`` topology has a link per host (its ``eth0`` and the switch's port to it);
the ``shared`` topology's one loopback cannot cut one host off.
"""

from __future__ import annotations

from jaxcomp.lab import _net


def _ends(net: _net.Network, host: int) -> list[tuple[str, str]]:
    """``(namespace, device)`` of both ends of host ``host``'s link."""
    if net.spec.topology != "per_host":
        raise _net.LabError(
            f"one host's link can be changed only in the per_host topology; this lab is "
            f"{net.spec.topology!r}."
        )
    if not 0 <= host < net.spec.hosts:
        raise ValueError(f"host must be in [0, {net.spec.hosts}); got {host!r}.")
    return [(net.host_namespaces[host], "eth0"), (f"{net.lab_id}-hub", f"p{host}")]


def set_link(net: _net.Network, host: int, up: bool) -> None:
    """Takes host ``host``'s link down (``up=False``: its packets are dropped both ways, as a
    pulled cable or a dead switch port; its processes keep running) or brings it back.

    Example:
      >>> # with Lab(2, "100mbit") as lb: ...; set_link(lb.net, 1, up=False)
    """
    for ns, dev in _ends(net, host):
        _net._sh("ip", "-n", ns, "link", "set", dev, "up" if up else "down")


#: which ends of a host's link :func:`set_rate` changes: what it sends (its NIC's egress), what it
#: receives (the switch port's egress towards it), or both
DIRECTIONS = ("both", "out", "in")


def set_rate(net: _net.Network, host: int, rate, direction: str = "both") -> None:
    """Changes host ``host``'s link rate to ``rate`` (as :class:`Lab`'s: ``"10mbit"``, bit/s,
    ``None`` for unlimited) in ``direction`` (:data:`DIRECTIONS`: ``"out"`` slows only what the
    host sends, as a NIC whose transmit side is throttled); the other hosts' links keep theirs.

    Example:
      >>> # with Lab(2, "1gbit") as lb: set_rate(lb.net, 1, "100mbit")  # a straggler
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}; got {direction!r}.")
    rate_bit_s = rate if isinstance(rate, (int, float)) or rate is None else _net.parse_rate(rate)
    ends = _ends(net, host)
    ends = {"both": ends, "out": ends[:1], "in": ends[1:]}[direction]
    for ns, dev in ends:
        if rate_bit_s is None:
            _net._sh("sh", "-c", f"ip netns exec {ns} tc qdisc del dev {dev} root || true")
            continue
        tbf = _net.tbf_params(float(rate_bit_s))
        _net._sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", tbf["rate"], "burst", tbf["burst"], "latency", tbf["latency"])  # fmt: skip
