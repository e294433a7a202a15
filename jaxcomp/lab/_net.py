r"""The lab's network: Linux network namespaces joined by rate-limited links, built with ``ip``
and ``tc`` and torn down again.

Two topologies (JAX-NOTES §10):

* ``"per_host"``: one namespace per host, each with one NIC (``eth0``, a veth) plugged into a
  bridge in a hub namespace; a ``tbf`` qdisc limits the NIC's egress and the bridge port's
  egress towards it, so each host sends and receives at the rate (a full-duplex NIC behind a
  switch: the per-link model of the cost model). Traffic between the devices of one host stays
  on that namespace's own loopback.
* ``"shared"``: every host in one namespace, talking over its loopback, whose egress is limited:
  both directions of every flow and a host's own devices' traffic cross one shared link.

Each host's process gets its own UTS namespace whose hostname is its link address: gloo
advertises the address the hostname resolves to. Addresses (``10.64-127.x.y/24``) exist only
inside the namespaces the lab makes. Every object a lab makes is named
``jxlab-<pid>-<start>-<nonce>-...``: the owner's process id and its start time (clock ticks
since boot, so a reused pid does not look alive), which :func:`stale_namespaces` reads to find
what a killed lab left behind.

The token bucket: ``burst`` is 1 ms of traffic at the rate, at least two full Ethernet frames
(3028 bytes), so an idle link lets at most that much through at the veth's speed (a smaller
burst cost 1 Gbit/s links 10% of their rate here, 2026-12-05); ``latency 400ms`` bounds the
queue. The
loopback of a shared link runs at MTU 1500 (with loopback's 65536 a packet can exceed the
burst and is dropped).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
from typing import NamedTuple

PREFIX = "jxlab"
_NETNS_DIR = "/run/netns"  # where `ip netns add` mounts a named namespace
TOPOLOGIES = ("per_host", "shared")
#: the rates the lab accepts, bit/s (and ``None``: unlimited)
MIN_RATE, MAX_RATE = 10e6, 10e9
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
BURST_S = 1e-3
MIN_BURST_BYTES = 2 * 1514
QUEUE_LATENCY = "400ms"
SHARED_MTU = 1500
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-([0-9a-f]+)-")


class LabError(RuntimeError):
    """The lab cannot build or run its network (a missing tool, no privilege, a failed host)."""


class LabTimeout(LabError):
    """A lab run passed its time limit (its hosts were stopped)."""


class NetworkSpec(NamedTuple):
    """What network to build.

    Attributes:
      hosts: the number of hosts (processes).
      rate_bit_s: each link's rate in bit/s, ``None`` for no limit.
      topology: ``"per_host"`` or ``"shared"``.
      slow_start_after_idle: TCP's congestion window restarts from its initial size after an
        idle period (Linux's default, ``net.ipv4.tcp_slow_start_after_idle=1``); ``False``
        keeps it (set in the lab's namespaces only).
    """

    hosts: int
    rate_bit_s: float | None
    topology: str = "per_host"
    slow_start_after_idle: bool = True


class Network(NamedTuple):
    """A built network: its namespaces, each host's namespace and link address."""

    lab_id: str
    spec: NetworkSpec
    namespaces: tuple[str, ...]  # every namespace made, hub included
    host_namespaces: tuple[str, ...]  # host i runs in host_namespaces[i]
    addresses: tuple[str, ...]  # host i's link address (what its hostname is set to)
    tbf: dict | None  # the qdisc parameters, None when unlimited


def parse_rate(text) -> float | None:
    """A rate such as ``"100mbit"``, ``"1gbit"`` or ``"unlimited"`` in bit/s (``None``: no limit).

    Raises:
      ValueError: for a malformed rate or one outside 10 Mbit/s ... 10 Gbit/s.

    Example:
      >>> parse_rate("100mbit"), parse_rate("2.5gbit"), parse_rate("unlimited")
      (100000000.0, 2500000000.0, None)
    """
    if text is None or str(text).strip().lower() in ("unlimited", "none", "inf"):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(kbit|mbit|gbit)\s*", str(text).lower())
    if not m:
        raise ValueError(f"rate must look like '100mbit', '1gbit' or 'unlimited'; got {text!r}.")
    rate = float(m.group(1)) * UNITS[m.group(2)]
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"rate must be within 10mbit ... 10gbit (or unlimited); got {text!r}.")
    return rate


def rate_name(rate_bit_s: float | None) -> str:
    """``1e8 -> '100mbit'``, ``None -> 'unlimited'`` (the inverse of :func:`parse_rate`)."""
    if rate_bit_s is None:
        return "unlimited"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6)):
        if rate_bit_s >= scale:
            return f"{rate_bit_s / scale:g}{unit}"
    return f"{rate_bit_s / 1e3:g}kbit"


def tbf_params(rate_bit_s: float) -> dict:
    """The ``tc ... tbf`` parameters of a link of ``rate_bit_s`` (see the module docstring)."""
    burst = max(int(rate_bit_s / 8 * BURST_S), MIN_BURST_BYTES)
    return {"rate": f"{int(rate_bit_s)}bit", "burst": str(burst), "latency": QUEUE_LATENCY}


def _start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``None`` if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def new_lab_id() -> str:
    """A name prefix unique to this lab: ``jxlab-<pid>-<start ticks>-<nonce>``."""
    pid = os.getpid()
    return f"{PREFIX}-{pid}-{_start_ticks(pid) or 0}-{os.urandom(3).hex()}"


def _subnet(lab_id: str) -> str:
    h = int.from_bytes(hashlib.sha256(lab_id.encode()).digest()[:4], "big")
    return f"10.{64 + h % 64}.{(h >> 6) % 256}"


def _sh(*argv: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise LabError(f"`{argv[0]}` is not installed (the lab needs iproute2's ip and tc).") from e
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`{' '.join(argv)}` did not finish in 30 s.") from e
    if done.returncode:
        err = (done.stderr or done.stdout).strip().splitlines()
        raise LabError(f"`{' '.join(argv)}` failed: {err[-1] if err else done.returncode}")
    return done.stdout


def _sysctls(ns: str, spec: NetworkSpec) -> None:
    if not spec.slow_start_after_idle:
        _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")


def _limit(ns: str, dev: str, tbf: dict) -> None:
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
        "rate", tbf["rate"], "burst", tbf["burst"], "latency", tbf["latency"])  # fmt: skip


def build(spec: NetworkSpec, lab_id: str | None = None) -> Network:
    """Makes the namespaces, links and rate limits of ``spec``.

    Needs ``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN`` (root, or root inside a user namespace with a
    mount namespace of its own: ``python -m jaxcomp.lab`` runs itself so when it is not root).
    On any failure what was made is removed before the error propagates.

    Args:
      spec: hosts, rate and topology.
      lab_id: the name prefix (default :func:`new_lab_id`).

    Returns:
      The :class:`Network`; give it to :func:`teardown` when done.

    Raises:
      ValueError: a bad spec. LabError: a command failed (its message names it).
    """
    if spec.topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {list(TOPOLOGIES)}; got {spec.topology!r}.")
    if not isinstance(spec.hosts, int) or not 1 <= spec.hosts <= 64:
        raise ValueError(f"hosts must be an integer in [1, 64]; got {spec.hosts!r}.")
    if spec.rate_bit_s is not None and not MIN_RATE <= spec.rate_bit_s <= MAX_RATE:
        raise ValueError(f"rate must be within 10 Mbit/s ... 10 Gbit/s; got {spec.rate_bit_s}.")
    lab_id = lab_id or new_lab_id()
    tbf = None if spec.rate_bit_s is None else tbf_params(spec.rate_bit_s)
    made: list[str] = []
    try:
        if spec.topology == "shared":
            ns = f"{lab_id}-shared"
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "mtu", str(SHARED_MTU))
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sysctls(ns, spec)
            if tbf:
                _limit(ns, "lo", tbf)
            hosts = (ns,) * spec.hosts
            return Network(lab_id, spec, tuple(made), hosts, ("127.0.0.1",) * spec.hosts, tbf)
        net = _subnet(lab_id)
        hub = f"{lab_id}-hub"
        _sh("ip", "netns", "add", hub)
        made.append(hub)
        _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", hub, "link", "set", "br0", "up")
        hosts, addresses = [], []
        for i in range(spec.hosts):
            ns, port, addr = f"{lab_id}-h{i}", f"p{i}", f"{net}.{i + 1}"
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            # both ends are created inside the lab's namespaces: no name is ever taken in the
            # machine's own network namespace
            _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                "peer", "name", port, "netns", hub)  # fmt: skip
            _sh("ip", "-n", hub, "link", "set", port, "master", "br0")
            _sh("ip", "-n", hub, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sysctls(ns, spec)
            if tbf:
                _limit(ns, "eth0", tbf)  # what the host sends
                _limit(hub, port, tbf)  # what the host receives
            hosts.append(ns)
            addresses.append(addr)
        return Network(lab_id, spec, tuple(made), tuple(hosts), tuple(addresses), tbf)
    except BaseException:
        _delete(made)
        raise


def run_in(net: Network, host: int) -> list[str]:
    """The argv prefix that runs a command as ``host``: in its namespace, with a UTS namespace
    of its own whose hostname is its link address (``exec``: the command keeps the pid)."""
    return ["ip", "netns", "exec", net.host_namespaces[host], "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', net.addresses[host]]  # fmt: skip


def _pids(ns: str) -> list[int]:
    try:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                             timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_in(ns: str, pid: int) -> None:
    """SIGKILL to ``pid`` if it still runs in namespace ``ns``. ``ip netns pids`` listed it a
    moment ago: if it has exited since, its pid may already name a process elsewhere, so the
    process is pinned first (a pidfd) and its namespace checked before the signal."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        theirs = os.stat(f"/proc/{pid}/ns/net")
        mine = os.stat(os.path.join(_NETNS_DIR, ns))
        if (theirs.st_dev, theirs.st_ino) == (mine.st_dev, mine.st_ino):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except (ProcessLookupError, FileNotFoundError):
        pass
    finally:
        os.close(fd)


def _delete(namespaces) -> list[str]:
    """Kills every process left in ``namespaces`` and deletes them; the errors, if any."""
    errors = []
    for ns in namespaces:
        for pid in _pids(ns):
            _kill_in(ns, pid)
    for ns in reversed(list(namespaces)):
        done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
        if done.returncode and ns in list_namespaces():
            errors.append(f"{ns}: {done.stderr.strip()}")
    return errors


def teardown(net: Network) -> None:
    """Kills what still runs in the network's namespaces and deletes them (links go with them).

    Raises:
      LabError: naming a namespace that could not be deleted.
    """
    errors = _delete(net.namespaces)
    if errors:
        raise LabError(f"could not delete the lab's namespaces: {errors}")


def list_namespaces() -> list[str]:
    """The names of the machine's named network namespaces (``ip netns list``)."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    except OSError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def lab_namespaces() -> list[str]:
    """Every namespace any lab made that still exists."""
    return [n for n in list_namespaces() if _NAME.match(n)]


def owner_alive(name: str) -> bool:
    """Whether the process that made the lab object ``name`` still runs (same pid and start)."""
    m = _NAME.match(name)
    if not m:
        return False
    return _start_ticks(int(m.group(1))) == int(m.group(2))


def stale_namespaces() -> list[str]:
    """The lab namespaces whose owner is gone (killed before it could tear them down)."""
    return [n for n in lab_namespaces() if not owner_alive(n)]


def cleanup(everything: bool = False) -> list[str]:
    """Removes what killed labs left behind: their processes and namespaces.

    Args:
      everything: also the namespaces of labs that still run (their owner is alive).

    Returns:
      The namespaces deleted.

    Raises:
      LabError: naming what could not be deleted.
    """
    names = lab_namespaces() if everything else stale_namespaces()
    errors = _delete(names)
    if errors:
        raise LabError(f"could not delete: {errors}")
    return names
