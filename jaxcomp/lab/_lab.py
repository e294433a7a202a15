"""``Lab``: a network of hosts built on entry and torn down on exit, whatever the exit."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from collections.abc import Sequence

from jaxcomp.lab import _hosts
from jaxcomp.lab import _net

TOOLS = ("ip", "tc", "unshare", "setpriv", "sh")


def check_privileges() -> None:
    """Raises :class:`~jaxcomp.lab.LabError` (one line) if this process cannot build a lab:
    a missing tool, or neither root nor root inside a user namespace of its own."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise _net.LabError(f"the network lab needs {missing} (iproute2, util-linux): not found.")
    if os.geteuid() != 0:
        raise _net.LabError(
            "the network lab needs root (network namespaces); as another user run it through "
            "`python -m jaxcomp.lab`, which enters a user namespace first."
        )


def load() -> tuple[float, float, float]:
    """The machine's 1, 5 and 15-minute load averages (recorded before and after each run)."""
    return tuple(round(x, 2) for x in os.getloadavg())


class Lab:
    """N hosts on a rate-limited network; each :meth:`run` starts one process per host in it.

    The network is built on ``__enter__`` and torn down on ``__exit__``, also on an exception,
    Ctrl-C (``KeyboardInterrupt``), SIGTERM or SIGHUP (which raise
    :class:`~jaxcomp.lab._hosts.Stopped` while the lab is open, in the main thread). Hosts that
    run when the lab closes are stopped (SIGTERM, then SIGKILL).

    Args:
      hosts: the number of hosts (processes).
      rate: each link's rate: ``"100mbit"``, ``"1gbit"``, ``"unlimited"`` (10 Mbit/s to
        10 Gbit/s), or bit/s as a number, ``None`` for unlimited.
      topology: ``"per_host"`` (a NIC per host into a switch) or ``"shared"`` (one loopback).
      devices: fake CPU devices per host.
      slow_start_after_idle: ``False`` turns TCP's slow start after idle off in the lab's
        namespaces (a diagnosis: what the idle gaps between a step's collectives cost).

    Example:
      >>> # with Lab(2, "100mbit", devices=4) as lab:
      >>> #     result = lab.run(["python", "-m", "jaxcomp.main", "--config", "c.py",
      >>> #                       "--workdir", "w", "--cpu_devices", "{devices}"], "w/logs")
    """

    def __init__(
        self,
        hosts: int,
        rate="unlimited",
        topology: str = "per_host",
        devices: int = 1,
        *,
        slow_start_after_idle: bool = True,
    ):
        rate_bit_s = rate if isinstance(rate, (int, float)) else _net.parse_rate(rate)
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices must be an integer >= 1; got {devices!r}.")
        rate_bit_s = None if rate_bit_s is None else float(rate_bit_s)
        self.spec = _net.NetworkSpec(hosts, rate_bit_s, topology, bool(slow_start_after_idle))
        self.devices = devices
        self.net: _net.Network | None = None
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Lab:
        check_privileges()
        stack = contextlib.ExitStack()
        stack.enter_context(_hosts.signals_raise())
        try:
            self.net = _net.build(self.spec)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.net is not None:
                with _hosts.signals_ignored():
                    _net.teardown(self.net)
        finally:
            self.net = None
            if self._stack is not None:
                self._stack.close()
                self._stack = None

    def run(
        self,
        argv: Sequence[str],
        log_dir: str,
        *,
        timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        fail_grace_s: float = 15.0,
    ) -> _hosts.HostsResult:
        """Runs ``argv`` on every host (see :func:`~jaxcomp.lab._hosts.run_hosts`)."""
        if self.net is None:
            raise RuntimeError("Lab.run needs an open lab: use it inside `with Lab(...) as lab:`.")
        return _hosts.run_hosts(self.net, argv, log_dir, devices=self.devices,
                                timeout_s=timeout_s, env=env, cwd=cwd,
                                fail_grace_s=fail_grace_s)  # fmt: skip

    def describe(self) -> dict:
        """The network as the results record it."""
        spec = self.spec
        return {
            "topology": spec.topology,
            "hosts": spec.hosts,
            "devices_per_host": self.devices,
            "rate": _net.rate_name(spec.rate_bit_s),
            "rate_bit_s": spec.rate_bit_s,
            "tbf": None if spec.rate_bit_s is None else _net.tbf_params(spec.rate_bit_s),
            "slow_start_after_idle": spec.slow_start_after_idle,
            "addresses": list(self.net.addresses) if self.net else None,
        }
