"""Bounded failure of a multi-process run: when another process dies, stops or cannot be
reached, every other process exits within a bound, with one line naming it.

Without it, a process whose peer was killed waited in JAX's shutdown barrier until the
coordination service's heartbeat timeout (100 s), then aborted with exit 134 and a C++
"Check failure stack trace"; a peer stopped with ``SIGSTOP`` left the others blocked in a
collective until the same abort.

Three mechanisms, from fastest to slowest:

* a collective that fails (the peer's socket closed: ``kill -9``) raises at once; the trainer
  turns it into :class:`~jaxcomp.train.PeerLost` (``_processes.peer_failures_as_lost``);
* the :class:`Watchdog` of the training loop: a thread that exits the process when no step
  has finished for ``timeout_s`` seconds (a peer stopped, hung or cut off: the main thread is
  blocked inside a collective and cannot raise). A peer that comes back sooner (``SIGCONT``)
  does not stop the run;
* JAX's own heartbeat (``jax.distributed.initialize(heartbeat_timeout_seconds=...)``), set by
  the CLI a little longer than ``timeout_s``, as the last resort.

One line per failure: when the bound expires while the loop's own error leaves it (a process
SIGSTOPped past the bound, then continued, meets both at once), the first to claim the process's
exit reports it, with its exit code, and the other stays silent: the watchdog claims it before its
report, :meth:`Watchdog.stop` (the loop's way out, error or not) before returning.

Who is lost: each process publishes a heartbeat (its step) in the coordination service's
key-value store every second. A peer on this host is inspected directly (``/proc``: gone,
stopped, running); a peer on another host by the age of its heartbeat; a coordinator that no
longer answers is named as such.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import NamedTuple

import jax
import numpy as np

from jaxcomp import _jax_private

INTERVAL_S = 1.0  #: how often a process publishes its heartbeat and checks its progress
_KEY = "jaxcomp/beat/"


class Peer(NamedTuple):
    """A process of the run: its index, pid and host."""

    index: int
    pid: int
    host: str

    def __str__(self) -> str:
        return f"process {self.index} (pid {self.pid} on host {self.host})"


def peers() -> list[Peer]:
    """Every process's pid and host, by process index (one collective).

    Example:
      >>> [p.index for p in peers()]  # one process
      [0]
    """
    host = socket.gethostname().encode()[:64]
    row = np.zeros(65, np.int32)
    row[0] = os.getpid()
    row[1 : 1 + len(host)] = np.frombuffer(host, np.uint8)
    if jax.process_count() == 1:
        rows = row[None]
    else:
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, 65)
    return [
        Peer(i, int(r[0]), bytes(r[1:].astype(np.uint8)).rstrip(b"\0").decode(errors="replace"))
        for i, r in enumerate(rows)
    ]


def _local_state(pid: int) -> str:
    """``gone``, ``stopped`` or ``running``: a process of this host, seen in ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")


def _client():
    """JAX's coordination-service client (private API), or ``None``."""
    try:
        return _jax_private.distributed_client()
    except (ImportError, AttributeError):
        return None


def _seconds(t: float) -> str:
    """``t`` for a message: whole seconds, tenths under one (a bound of 0.4 s is not "0 s")."""
    return f"{t:.1f}" if t < 1 else f"{t:.0f}"


class Watchdog:
    """Exits this process when the training loop makes no progress for ``timeout_s``.

    Args:
      timeout_s: the bound: seconds without a finished step (a step, an evaluation, a
        checkpoint wait) before the process exits.
      exit_code: the process's exit status then.
      team: every process of the run (:func:`peers`).
      interval_s: how often it checks and publishes its heartbeat.
      on_exit: called (errors ignored) just before the process exits.

    Example:
      >>> with Watchdog(90.0, 69, peers()) as dog:  # doctest: +SKIP
      ...     for step in range(10):
      ...         dog.beat(step)
    """

    def __init__(
        self, timeout_s: float, exit_code: int, team: list[Peer], interval_s=None, on_exit=None
    ):
        self.timeout_s, self.exit_code, self.team = float(timeout_s), exit_code, team
        self.on_exit = on_exit  # e.g. releasing the workdir's lock, before the process exits
        self.me = team[jax.process_index()]
        self.interval_s = interval_s or min(INTERVAL_S, self.timeout_s / 10)
        self._client = _client()
        self._last = time.monotonic()  # the last progress of the loop
        self._step = 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (its beat, when it changed)
        self._answered = time.monotonic()  # the coordinator's last answer
        self._tick = time.monotonic()  # the watching thread's last turn
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._claim_lock = threading.Lock()
        self._owner: str | None = None  # who ends the process: "watchdog" or "loop"
        self._reported = threading.Event()  # the watchdog's line is written

    def beat(self, step: int) -> None:
        """The loop made progress (finished ``step``)."""
        self._last, self._step = time.monotonic(), step

    def start(self) -> Watchdog:
        self.beat(self._step)
        for target, name in ((self._watch, "watch"), (self._publish, "beat")):
            t = threading.Thread(target=target, name=f"jaxcomp-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stops watching: from its return on, the watchdog reports nothing and the caller owns
        the process's exit (its own error line and exit code, or none).

        If the watchdog claimed the exit first (the bound expired), it does not return: once
        the watchdog's line is written, it ends the process with the watchdog's exit code.
        """
        self._stop.set()  # the publisher may be blocked in an RPC: not joined
        if self._claim("loop") == "watchdog":
            self._reported.wait()
            os._exit(self.exit_code)

    def _claim(self, who: str) -> str:
        """The owner of the process's exit: ``who`` if nobody claimed it before."""
        with self._claim_lock:
            if self._owner is None:
                self._owner = who
            return self._owner

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _publish(self) -> None:
        if self._client is None:
            return
        while not self._stop.wait(self.interval_s):
            try:
                self._client.key_value_set(
                    f"{_KEY}{self.me.index}", f"{self._step} {time.time():.1f}", True
                )
                beats = self._client.key_value_dir_get(_KEY)
            except Exception:  # noqa: BLE001 - the coordinator is gone: _answered ages
                continue
            now = self._answered = time.monotonic()
            for key, value in beats:
                k = int(key.rsplit("/", 1)[1])
                if self._seen.get(k, (None,))[0] != value:
                    self._seen[k] = (value, now)

    def _watch(self) -> None:
        self._tick = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            away = now - self._tick  # this process itself did not run meanwhile
            idle = now - self._last
            if idle >= self.timeout_s:
                text = (
                    f"no progress for {_seconds(idle)} s after step {self._step} (the bound, "
                    f"--peer_timeout, is {_seconds(self.timeout_s)} s): {self.lost(away=away)}"
                )
                if self._claim("watchdog") == "watchdog":
                    self._exit(text)
                return  # the loop reports: its lost() still sees how long this one was away
            self._tick = now

    def lost(self, wait_s: float = 0.0, away: float | None = None) -> str:
        """Who is lost and how, as far as this process can tell (one clause).

        Args:
          wait_s: wait up to this long for a peer on another host to miss heartbeats (after
            a failed collective its last beat may still be fresh).
          away: how long this process itself did not run (default: since the watching
            thread last ran); said when it is a good part of the bound (``SIGSTOP``).
        """
        away = time.monotonic() - self._tick if away is None else away
        me = ""
        if away > max(self.timeout_s / 2, 3 * self.interval_s):
            me = f"this process did not run for {_seconds(away)} s (stopped or starved); "
        deadline = time.monotonic() + wait_s
        while True:
            found = self._judge()
            if found or time.monotonic() >= deadline:
                break
            time.sleep(self.interval_s / 2)
        if found:
            return me + "; ".join(found)
        now = time.monotonic()
        seen = [
            f"process {k}'s heartbeat last changed {_seconds(now - changed)} s ago"
            for k, (_, changed) in sorted(self._seen.items())
            if k != self.me.index
        ]
        answered = _seconds(now - self._answered)
        said = [f"this process's own heartbeat calls last answered {answered} s ago"]
        return (
            me
            + "another process of the run stopped answering (which one cannot be told: "
            + ", ".join(said + seen)
            + ")"
        )

    def _judge(self) -> list[str]:
        now, stale = time.monotonic(), 3 * self.interval_s
        out = []
        for p in self.team:
            if p.index == self.me.index:
                continue
            if p.host == self.me.host:
                state = _local_state(p.pid)
                if state != "running":
                    what = "exited or was killed" if state == "gone" else "is stopped (SIGSTOP)"
                    out.append(f"{p} {what}")
                continue
            # Stale while the coordinator still answered this process: it stopped first, even
            # if the coordinator's answers stopped since (they may, before the bound fires).
            value, changed = self._seen.get(p.index, (None, self._answered))
            if self._answered - changed > stale:
                out.append(f"{p} stopped sending heartbeats {_seconds(now - changed)} s ago")
        coordinator = self.team[0]
        if not out and self._client is not None and now - self._answered > stale:
            if coordinator.index != self.me.index:
                out.append(
                    f"{coordinator}, the coordinator, has not answered for "
                    f"{_seconds(now - self._answered)} s"
                )
        return out

    def _exit(self, text: str) -> None:
        line = (
            f"error: {text}. The last good checkpoint stays: run the same command on every "
            "host to resume.\n"
        )
        for cleanup in (sys.stdout.flush, self.on_exit):
            try:
                if cleanup is not None:
                    cleanup()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        try:
            os.write(2, line.encode())
        except OSError:  # stderr closed: the exit code still says it
            pass
        self._reported.set()
        os._exit(self.exit_code)
