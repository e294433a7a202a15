"""One run per workdir (issue 37, item 3): a second run is refused at once, naming the run
that holds the workdir; a dead run's lock does not block the next one.

Two runs on one workdir used to interleave: one died with ``FileExistsError``, the other
exited 0 with duplicated metric rows and a stray checkpoint.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from jaxcomp import train
from jaxcomp.train import _lock

#: the one trainer run here checks the lock and the step count, no bits: unoptimised compiles
pytestmark = pytest.mark.usefixtures("fast_compiles")


def _record(**changes):
    return {**_lock.this_process(), **changes}


def _write(workdir, record, age_s=0.0):
    path = workdir / _lock.LOCK
    path.write_text(json.dumps(record))
    if age_s:
        t = time.time() - age_s
        os.utime(path, (t, t))
    return path


@pytest.fixture
def sleeper():
    """A live process on this host (not this one), killed afterwards."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_run_on_this_host_is_refused_by_name(tmp_path, sleeper):
    other = _record(pid=sleeper.pid, pid_start=_lock._start_ticks(sleeper.pid), command="run A")
    _write(tmp_path, other)
    with pytest.raises(train.WorkdirInUse) as info:
        _lock.RunLock(str(tmp_path)).acquire()
    text = str(info.value)
    assert f"pid {sleeper.pid} on host {socket.gethostname()}" in text, text
    assert other["started"] in text and "(run A)" in text and "running on this host" in text
    assert json.loads((tmp_path / _lock.LOCK).read_text()) == other  # left as it was
    # a stopped (SIGSTOP) run still holds it
    os.kill(sleeper.pid, signal.SIGSTOP)
    try:
        with pytest.raises(train.WorkdirInUse):
            _lock.RunLock(str(tmp_path)).acquire()
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)


def test_a_dead_or_reused_pid_on_this_host_is_stale(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(done.stdout)
    for record in (
        _record(pid=dead, pid_start=12345),
        _record(pid_start=_lock._start_ticks(os.getpid()) + 1),  # this pid, another process
    ):
        _write(tmp_path, record)
        lock = _lock.RunLock(str(tmp_path)).acquire()
        assert "its process is gone" in lock.taken_over, lock.taken_over
        assert json.loads((tmp_path / _lock.LOCK).read_text())["pid"] == os.getpid()
        assert lock.check() is None
        lock.release()
        assert not (tmp_path / _lock.LOCK).exists()
    assert sorted(os.listdir(tmp_path)) == []  # nothing left aside


def test_another_hosts_lock_is_stale_after_its_heartbeat_stops(tmp_path):
    remote = _record(host="elsewhere", boot_id="other", pid=1, command="run B")
    _write(tmp_path, remote, age_s=5)
    with pytest.raises(train.WorkdirInUse, match=r"pid 1 on host elsewhere.*heartbeat is \d+ s"):
        _lock.RunLock(str(tmp_path)).acquire()
    _write(tmp_path, remote, age_s=_lock.STALE_AFTER_S + 30)
    lock = _lock.RunLock(str(tmp_path)).acquire()
    assert "heartbeat stopped" in lock.taken_over and "elsewhere" in lock.taken_over
    lock.release()


def test_the_heartbeat_keeps_the_lock_fresh_and_check_sees_a_lost_workdir(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    lock = _lock.RunLock(str(work), heartbeat_s=0.05).acquire()
    path = work / _lock.LOCK
    old = time.time() - 100
    os.utime(path, (old, old))
    time.sleep(0.3)
    assert path.stat().st_mtime > old + 50  # touched again
    # taken over (another run replaced the file)
    path.unlink()
    _write(work, _record(pid=4242, host="elsewhere"))
    assert "taken over by pid 4242 on host elsewhere" in lock.check()
    lock.release()
    assert path.exists()  # not ours: left alone
    # a non-holding process only watches the directory; deleted or replaced, it is told
    watch = _lock.RunLock(str(work), hold=False).acquire()
    os.rename(work, tmp_path / "moved")
    assert "was deleted during the run" in watch.check()
    work.mkdir()
    assert "replaced by another directory" in watch.check()


def test_a_heartbeat_after_a_takeover_touches_only_its_own_file(tmp_path):
    """The heartbeat firing between another run's replacement of the lock and this run's next
    check (the replacement may reuse the freed inode) must not adopt the other run's file:
    check() says taken over and release() leaves it (once seen under load: release() removed
    the other run's lock)."""
    work = tmp_path / "w"
    work.mkdir()
    lock = _lock.RunLock(str(work), heartbeat_s=3600).acquire()
    path = work / _lock.LOCK
    for _ in range(20):  # inode reuse is up to the file system: try until it happens or not
        path.unlink()
        _write(work, _record(pid=4242, host="elsewhere"))
        before = path.stat().st_mtime_ns
        lock._beat_once()  # the heartbeat at the worst moment
        assert path.stat().st_mtime_ns == before  # the other run's file is not touched
        assert "taken over by pid 4242 on host elsewhere" in lock.check()
    lock.release()
    assert path.exists()  # not ours: left alone


def test_a_recreated_workdir_is_removed_only_when_the_runs_own_saves_are_all_it_holds(tmp_path):
    """A deleted workdir that the run's saves under way recreated (a half-written folder, the
    complete folder of a step in flight) is removed; with anything else in it, it stays."""
    work = tmp_path / "w"
    cases = [  # (another file, the steps in flight, removed)
        (None, {2}, True),
        (None, set(), False),  # a complete step folder that no save of this run had under way
        ("run.lock", {2}, False),  # another run's
        ("checkpoints/4/x", {2}, False),
        ("checkpoints/x", {2}, False),
    ]
    for other, steps, removed in cases:
        work.mkdir()
        lock = _lock.RunLock(str(work), heartbeat_s=0.05).acquire()
        shutil.rmtree(work)
        for path in ["checkpoints/2/state/d", "checkpoints/6.orbax-checkpoint-tmp-1/meta/m", other]:
            if path:
                (work / path).parent.mkdir(parents=True, exist_ok=True)
                (work / path).write_text("")
        lock.own_saves = steps
        lock.release()
        assert lock.remove_recreated(settle_s=0) == removed and work.exists() != removed, other
        shutil.rmtree(work, ignore_errors=True)


def test_a_write_of_a_failed_save_landing_after_the_removal_is_removed_too(tmp_path, monkeypatch):
    """Orbax ends a failed save while tensorstore's writes of it still land: one that
    recreates the workdir right after its removal is removed in turn."""
    work = tmp_path / "w"
    work.mkdir()
    lock = _lock.RunLock(str(work), heartbeat_s=0.05).acquire()
    shutil.rmtree(work)
    straggler = work / "checkpoints/2.orbax-checkpoint-tmp-1/state/d/f"
    (work / "checkpoints/2/state").mkdir(parents=True)  # recreated by the save's first writes
    rmtree, calls = shutil.rmtree, []

    def rmtree_then_a_late_write(path, **kwargs):
        rmtree(path, **kwargs)
        calls.append(path)
        if len(calls) == 1:
            straggler.parent.mkdir(parents=True)
            straggler.write_text("")

    monkeypatch.setattr(_lock.shutil, "rmtree", rmtree_then_a_late_write)
    lock.own_saves = {2}
    lock.release()
    assert lock.remove_recreated(settle_s=0.05) and not work.exists() and len(calls) == 2


def test_a_second_run_is_refused_before_compiling_and_a_killed_one_does_not_block(
    make_config, tmp_path, monkeypatch
):
    """A real holder (a process that took the lock), then ``kill -9``: the run starts."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from jaxcomp.train import _lock; "
         f"_lock.RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); "
         "time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        compiled = []
        real = jax.stages.Lowered.compile
        monkeypatch.setattr(
            jax.stages.Lowered, "compile", lambda self, *a, **k: compiled.append(1) or real(self)
        )
        with pytest.raises(train.WorkdirInUse, match=f"in use by another run: pid {holder.pid}"):
            train.train_and_evaluate(make_config(total_steps=2), str(tmp_path))
        assert not compiled
        assert sorted(os.listdir(tmp_path)) == [_lock.LOCK]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    summary = train.train_and_evaluate(make_config(total_steps=2), str(tmp_path))
    assert summary["steps"] == 2
    assert not (tmp_path / _lock.LOCK).exists()  # released at the end
