"""One run per workdir: a lock file that names the run holding it, and goes stale when that
run is gone.

``workdir/run.lock`` is created with ``O_EXCL`` (one run wins) and holds JSON: the holder's
pid, host, boot id, the kernel's start time of that pid, when the run started and its command
line. While the run lives, a thread touches the file every ``heartbeat_s`` seconds (through
the descriptor the run created it with, so never a file that replaced it); the run removes it
when it ends. A run that finds the file decides whether its holder is alive:

* **on the same host** (same hostname and boot id): alive iff a process with that pid exists
  and started when the recorded one did (a reused pid is not the holder). Exact: a run killed
  with ``kill -9`` leaves a lock that the next run takes over at once, and a stopped
  (``SIGSTOP``) run still holds its workdir.
* **on another host**: alive iff the file was touched within ``stale_after_s`` seconds. The
  age is read on the file server's clock (the lock's mtime against the mtime of a file
  written now, both read through a fresh ``open``, which revalidates NFS's cached
  attributes), so the hosts' clocks need not agree. A live run touches it every
  ``heartbeat_s`` (10 s) and is taken for dead after ``stale_after_s`` (60 s: six missed
  heartbeats). A run stalled longer than that on another host loses its workdir: when it
  comes back, :meth:`RunLock.check` finds the lock replaced and the run stops.

A stale lock is taken over with a warning that names the dead run: it is renamed aside
(``rename`` succeeds for one taker only) and a new one created with ``O_EXCL``.

During the run :meth:`RunLock.check` (a few ``stat`` calls) tells whether the workdir is still
the one the run started in: a workdir deleted or replaced mid-run, or a lock taken over, stops
the run instead of letting it write into a recreated directory.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Collection
from typing import Any

from jaxcomp.train import _errors

LOCK = "run.lock"
HEARTBEAT_S = 10.0  #: how often a run touches its lock
STALE_AFTER_S = 60.0  #: a lock of another host untouched this long belongs to a dead run
#: how long a recreated workdir must stay removed while writes of a failed save may still land
SETTLE_S = 0.25
_PARTIAL = ".orbax-checkpoint-tmp"  # in the name of a save's folder until it is complete


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), ``None`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def this_process() -> dict[str, Any]:
    """The record a lock holds: who runs, where, since when, with which command."""
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid_start": _start_ticks(pid),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:300],
    }


def describe(record: dict[str, Any]) -> str:
    """``pid 123 on host h, started 2026-12-05T10:11:12+00:00 (python -m jaxcomp.main ...)``."""
    command = f" ({record['command']})" if record.get("command") else ""
    return (
        f"pid {record.get('pid')} on host {record.get('host')}, started "
        f"{record.get('started')}{command}"
    )


def _read(path: str) -> tuple[dict[str, Any], float] | None:
    """The lock's record and mtime (``None`` if it vanished); an unreadable record is ``{}``."""
    try:
        with open(path) as f:
            text, mtime = f.read(), os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = {}
    return (record if isinstance(record, dict) else {}), mtime


def _fs_now(directory: str) -> float:
    """The file server's clock: the mtime of a file written now in ``directory``."""
    probe = os.path.join(directory, f".clock.{os.getpid()}.{threading.get_ident()}")
    with open(probe, "w") as f:
        f.write("now")
        f.flush()
        now = os.fstat(f.fileno()).st_mtime
    os.remove(probe)
    return now


def holder_alive(record: dict[str, Any], mtime: float, directory: str, stale_after_s: float):
    """``(alive, why)`` for the run a lock names (``why`` says how it was decided)."""
    here = record.get("host") == socket.gethostname() and record.get("boot_id") == _boot_id()
    if here:
        pid = record.get("pid")
        if not isinstance(pid, int) or not _pid_exists(pid):
            return False, "its process is gone"
        ticks, saved = _start_ticks(pid), record.get("pid_start")
        if ticks is not None and saved is not None and ticks != saved:
            return False, "its process is gone (the pid now belongs to another process)"
        return True, "its process is running on this host"
    age = _fs_now(directory) - mtime
    if age > stale_after_s:
        return False, f"its heartbeat stopped {age:.0f} s ago (another host; stale after " \
            f"{stale_after_s:.0f} s)"  # fmt: skip
    return True, f"its heartbeat is {max(age, 0):.0f} s old (another host)"


class RunLock:
    """The workdir's lock (held by process 0 of a run) and its identity, checked each step.

    Args:
      workdir: the run directory (exists).
      hold: take the lock (process 0); other processes only watch the directory's identity.
      heartbeat_s: how often the lock is touched.
      stale_after_s: the age past which another host's lock is stale.

    Example:
      >>> with RunLock(workdir) as lock:  # doctest: +SKIP
      ...     for step in range(10):
      ...         problem = lock.check()  # None while the workdir is ours
    """

    def __init__(
        self,
        workdir: str,
        hold: bool = True,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
    ):
        self.workdir = os.path.abspath(workdir)
        self.path = os.path.join(self.workdir, LOCK)
        self.hold, self.heartbeat_s, self.stale_after_s = hold, heartbeat_s, stale_after_s
        self.taken_over: str | None = None  #: the dead run whose lock was taken, if any
        self._identity: tuple[int, int] | None = None
        #: checkpoint steps whose saves may have written after the workdir's last good check
        #: (the run's checkpointer's, set by the trainer): :meth:`remove_recreated` removes
        #: their complete folders too
        self.own_saves: Collection[int] = ()
        self._lost = False  # check() found the workdir or its lock gone during the run
        self._inode: int | None = None
        self._fd: int | None = None  # the lock file this run created, kept open (read-only):
        # the heartbeat touches it through this descriptor, never a file that replaced it
        self._mtime_ns = 0  # the lock's mtime as this run last set it
        self._touch = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> RunLock:
        """Takes the lock (or only records the workdir's identity when not holding).

        Raises:
          WorkdirInUse: naming the live run that holds it.
        """
        st = os.stat(self.workdir)
        self._identity = (st.st_dev, st.st_ino)
        if not self.hold:
            return self
        record = this_process()
        for _ in range(20):  # each round: create, or judge the holder and maybe take over
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._judge()
                continue
            try:
                os.write(fd, json.dumps(record).encode())
                # kept open read-only (a file open for writing would stop a read-only remount)
                ro = os.open(self.path, os.O_RDONLY)
                if os.fstat(ro).st_ino != os.fstat(fd).st_ino:  # replaced in between
                    os.close(ro)
                    continue
            finally:
                os.close(fd)
            self._fd = ro
            self._inode = os.fstat(ro).st_ino
            self._beat_once()
            self._thread = threading.Thread(target=self._beat, name="jaxcomp-lock", daemon=True)
            self._thread.start()
            return self
        raise _errors.WorkdirInUse(f"workdir {self.workdir!r}: could not take {self.path}.")

    def _judge(self) -> None:
        """Refuses a live holder; renames a dead one's lock aside (one taker wins)."""
        seen = _read(self.path)
        if seen is None:
            return  # released meanwhile: try again
        record, mtime = seen
        alive, why = holder_alive(record, mtime, self.workdir, self.stale_after_s)
        if alive:
            raise _errors.WorkdirInUse(
                f"workdir {self.workdir!r} is in use by another run: {describe(record)}; "
                f"{why}. Wait for it to end, stop it, or use another --workdir."
            )
        aside = f"{self.path}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another run took it first
        moved = _read(aside)
        if moved is not None and moved[0] != record:  # a fresh lock, renamed by a race
            os.rename(aside, self.path)
            return
        os.remove(aside)
        self.taken_over = f"{describe(record)}; {why}" if record else f"unreadable ({why})"

    def _beat_once(self) -> None:
        with self._touch:
            now = time.time_ns()
            if os.utime in os.supports_fd:
                os.utime(self._fd, ns=(now, now))
            else:  # pragma: no cover (every POSIX platform JAX runs on touches by descriptor)
                os.utime(self.path, ns=(now, now))
            self._mtime_ns = os.fstat(self._fd).st_mtime_ns  # as the file system keeps it

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat_once()
            except OSError:
                pass  # check() reports a lost lock

    def check(self) -> str | None:
        """``None`` while the workdir is the one the run started in and the lock is its own;
        else what happened (one sentence)."""
        problem = self._check()
        self._lost = self._lost or problem is not None
        return problem

    def _check(self) -> str | None:
        if self._identity is None:
            return None
        try:
            st = os.stat(self.workdir)
        except FileNotFoundError:
            return f"the workdir {self.workdir} was deleted during the run"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"the workdir {self.workdir} was replaced by another directory during the run"
        if not self.hold:
            return None
        try:  # a file replacing the lock may reuse its inode, not its mtime
            with self._touch:
                st = os.stat(self.path)
                if (st.st_ino, st.st_mtime_ns) == (self._inode, self._mtime_ns):
                    return None
        except FileNotFoundError:
            pass
        seen = _read(self.path)
        other = f" by {describe(seen[0])}" if seen else ""
        return f"the workdir's lock {self.path} was removed or taken over{other}"

    def release(self) -> None:
        """Removes the lock if it is still this run's (stops the heartbeat)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.hold and self._inode is not None:
            if self.check() is None:
                try:
                    os.remove(self.path)
                except OSError:  # a read-only disk: the lock stays, stale once this pid is gone
                    pass
            self._inode = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove_recreated(self, settle_s: float = SETTLE_S) -> bool:
        """After the workdir was lost during the run: removes what the run's own saves recreated
        there once their writes resumed (orbax's half-written checkpoint folders, and the
        complete ``checkpoints/<step>`` folders of :attr:`own_saves`), so that a deleted workdir
        stays deleted. Call it once those saves ended. Anything else found there (a file at its
        root such as another run's ``run.lock``, another step's folder) is left alone.

        Orbax ends a save at its first failed write while other writes of it are still under
        way (tensorstore's, each recreating its folders), so while :attr:`own_saves` is not
        empty the removal is repeated until the workdir stayed gone for ``settle_s`` seconds
        (for at most ``20 * settle_s``).

        Returns:
          Whether a recreated workdir was removed.
        """
        if self._identity is None or not (self._lost or os.path.isdir(self.workdir)):
            return False
        removed, start = False, time.monotonic()
        quiet = start  # since when the workdir is absent
        while True:
            if os.path.isdir(self.workdir):
                if not self._only_own_saves():
                    return removed
                shutil.rmtree(self.workdir, ignore_errors=True)
                removed, quiet = True, time.monotonic()
            now = time.monotonic()
            if not self.own_saves or now - quiet >= settle_s or now - start >= 20 * settle_s:
                return removed and not os.path.isdir(self.workdir)
            time.sleep(settle_s / 10)

    def _only_own_saves(self) -> bool:
        """Whether the workdir is a recreated one that holds only what this run's saves wrote."""
        try:
            st = os.stat(self.workdir)
        except FileNotFoundError:
            return False
        if (st.st_dev, st.st_ino) == self._identity and not self._lost:
            return False  # (a recreated directory may reuse the deleted one's inode)
        own = {str(step) for step in self.own_saves}

        def ours(folder: str) -> bool:  # a folder of checkpoints/ that this run's saves write
            return _PARTIAL in folder or folder in own

        for root, dirs, files in os.walk(self.workdir):
            parts = os.path.relpath(root, self.workdir).split(os.sep)
            if files and not (parts[0] == "checkpoints" and len(parts) > 1 and ours(parts[1])):
                return False
            if parts == ["."] and set(dirs) - {"checkpoints"}:
                return False
            if parts == ["checkpoints"] and not all(ours(d) for d in dirs):
                return False
        return True

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
