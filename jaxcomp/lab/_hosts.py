"""Runs one process per host inside a lab network, bounded in time, and stops them all.

Each host's process starts in a session (process group) of its own, under ``setpriv
--pdeathsig KILL``: if the lab process dies, even by SIGKILL, the kernel kills its hosts (only
their namespaces are left, for :func:`jaxcomp.lab.cleanup`). A host that fails stops the run:
the others would wait for it in their next collective until the timeout. Stopping a host sends
SIGTERM to its group (the trainer then finishes its step, saves and exits), and SIGKILL after a
grace period. :func:`signals_raise` turns SIGTERM (and SIGHUP) into an exception in the main
thread and makes sure SIGINT raises ``KeyboardInterrupt``, so a ``try/finally`` around a run
tears it down on those signals as on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import NamedTuple

from jaxcomp.lab import _net

#: the exit status of a run stopped by its timeout (as ``timeout(1)``)
EXIT_TIMEOUT = 124
COORDINATOR_PORT = 29517  # inside the lab's own namespaces: no other program can hold it


class Stopped(BaseException):
    """A signal (SIGTERM, SIGHUP) arrived while the lab ran; ``signum`` names it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class HostsResult(NamedTuple):
    """How a run ended: each host's exit status (``None``: killed by the lab), its log file,
    the seconds it took, whether the timeout stopped it, and when each host exited (seconds
    since the run started, 0.05 s resolution; ``None``: stopped by the lab)."""

    returncodes: tuple[int | None, ...]
    logs: tuple[str, ...]
    seconds: float
    timed_out: bool
    exited_s: tuple[float | None, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.returncodes)


@contextlib.contextmanager
def signals_raise():
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread while inside, SIGINT raises
    ``KeyboardInterrupt`` (installed here too: a process started with SIGINT ignored, as a
    background job or a test runner's worker is, would otherwise never see it); the previous
    handlers come back on exit. Outside the main thread (where Python cannot install handlers)
    it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Stopped(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)


@contextlib.contextmanager
def signals_ignored():
    """SIGINT, SIGTERM and SIGHUP are ignored while inside (in the main thread), so a second
    Ctrl-C cannot cut a teardown short; the previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}  # fmt: skip
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def host_env(net: _net.Network, host: int, devices: int, base: Mapping[str, str]) -> dict:
    """The environment of host ``host``: JAX's process variables (read by ``jaxcomp.main`` and
    by a script's ``jax.distributed.initialize``), CPU only, ``devices`` fake devices, and this
    ``jaxcomp`` first on ``PYTHONPATH`` (the hosts run the lab's own tree)."""
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COORDINATOR_ADDRESS=f"{net.addresses[0]}:{COORDINATOR_PORT}",
        JAX_NUM_PROCESSES=str(net.spec.hosts),
        JAX_PROCESS_ID=str(host),
        JAXCOMP_LAB_DEVICES=str(devices),
        JAXCOMP_LAB_ADDRESSES=",".join(net.addresses),
    )
    return env


def expand(argv: Sequence[str], net: _net.Network, host: int, devices: int) -> list[str]:
    """``argv`` with ``{process_id}``, ``{num_processes}``, ``{coordinator}``, ``{devices}`` and
    ``{address}`` replaced by host ``host``'s values."""
    values = {
        "process_id": host,
        "num_processes": net.spec.hosts,
        "coordinator": f"{net.addresses[0]}:{COORDINATOR_PORT}",
        "devices": devices,
        "address": net.addresses[host],
    }
    out = []
    for a in argv:
        for k, v in values.items():
            a = a.replace("{" + k + "}", str(v))
        out.append(a)
    return out


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to every running host's group, then SIGKILL to those still there after
    ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + wait
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)


def run_hosts(
    net: _net.Network,
    argv: Sequence[str],
    log_dir: str,
    *,
    devices: int = 1,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    grace_s: float = 10.0,
    fail_grace_s: float = 15.0,
) -> HostsResult:
    """Runs ``argv`` once per host, each inside its namespace, and waits for all of them.

    Args:
      net: a built network.
      argv: the command; ``{process_id}`` etc. are replaced per host (:func:`expand`).
      log_dir: where ``host<i>.log`` (stdout and stderr of host i) are written.
      devices: fake CPU devices per host.
      timeout_s: the run's wall-clock limit; past it every host is stopped.
      env: the base environment (default this process's).
      cwd: the hosts' working directory.
      grace_s: how long a stopped host may take to exit after SIGTERM before SIGKILL.
      fail_grace_s: after one host fails, how long the others may take to finish by themselves.

    Returns:
      A :class:`HostsResult`. Every host has exited when this returns or raises.
    """
    os.makedirs(log_dir, exist_ok=True)
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen] = []
    logs = []
    t0 = time.monotonic()
    timed_out = False
    exited: list[float | None] = [None] * net.spec.hosts
    try:
        for i in range(net.spec.hosts):
            path = os.path.join(log_dir, f"host{i}.log")
            logs.append(path)
            with open(path, "w") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            "setpriv",
                            "--pdeathsig",
                            "KILL",
                            "--",
                            *_net.run_in(net, i),
                            *expand(argv, net, i, devices),
                        ],  # fmt: skip
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=host_env(net, i, devices, base),
                        cwd=cwd,
                        start_new_session=True,
                    )
                )
        deadline = t0 + timeout_s
        failed_at = None

        def note_exits():
            for i, p in enumerate(procs):
                if exited[i] is None and p.poll() is not None:
                    exited[i] = time.monotonic() - t0

        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            note_exits()
            if now > deadline:
                timed_out = True
                break
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > fail_grace_s:
                break
            time.sleep(0.05)
        note_exits()
    finally:
        with signals_ignored():
            _stop(procs, grace_s)
    codes = tuple(p.returncode for p in procs)
    return HostsResult(codes, tuple(logs), time.monotonic() - t0, timed_out, tuple(exited))
