"""Faults of the workdir during a single-host run (issue 37, item 5): a workdir deleted
mid-run, swapped step folders, a full disk, a signal during startup.

Each used to be silent or unhelpful: a deleted workdir was recreated (exit 0, metrics starting
mid-run, ``experiment.json`` gone); swapped folders resumed "from step 15" out of folder 20,
then retention deleted the real step-20 state; a full disk was noticed one checkpoint late in
592 lines and 31 tracebacks; a SIGINT in the first second was ignored in 3 of 7 tries.
"""

import asyncio
import contextlib
import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import pytest
from orbax.checkpoint._src.path import atomicity

from jaxcomp import main
from jaxcomp import train
from jaxcomp.train import _checkpoint
from jaxcomp.train import _lock
from jaxcomp.train import _trainer
from jaxcomp.train import _workdir

pytestmark = pytest.mark.usefixtures("fast_compiles")

ROOT = pathlib.Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "digits_dense.py") + ":smoke"
TINY = {"model.hidden": (32, 32, 32), "batch_size": 64, "eval_batch_size": 120, "lr": 3e-3}


def _argv(workdir, **overrides):
    sets = [["--set", f"{k}={v!r}"] for k, v in {**TINY, **overrides}.items()]
    return ["--config", CONFIG, "--workdir", str(workdir), *sum(sets, [])]


def _run_main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main.main(argv)
    return code, err.getvalue()


#: keys that change neither the compiled programs nor the data (the run's length and logging)
RUN_LENGTH = ("total_steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints")


@pytest.fixture(scope="module", autouse=True)
def _one_setup():
    """One compiled setup per experiment for the module (setup is pure), whatever the run's
    length: its config is the one given."""
    real, cache = _trainer.setup, {}

    def cached(config, devices=None):
        full = train.with_defaults(config)
        key = json.dumps({k: v for k, v in json.loads(full.to_json_best_effort()).items()
                          if k not in RUN_LENGTH}, sort_keys=True)  # fmt: skip
        if (key, devices) not in cache:
            cache[key, devices] = real(config, devices=devices)
        return cache[key, devices]._replace(config=full)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_trainer, "setup", cached)
        yield


def _at_step(monkeypatch, step, action):
    """Runs ``action()`` right after training step ``step`` (as a fault from outside)."""
    cached = _trainer.setup

    def setup(config, devices=None):
        s = cached(config, devices=devices)

        def train_step(state, batch, key, i):
            out = s.mode.train_step(state, batch, key, i)
            if i + 1 == step:
                action()
            return out

        return s._replace(mode=s.mode._replace(train_step=train_step))

    monkeypatch.setattr(_trainer, "setup", setup)


def _delete(path):
    """``rm -rf`` while a save may be writing into it: gone at once, emptied after."""
    trash = path.with_name(path.name + ".trash")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def test_a_workdir_deleted_mid_run_stops_the_run_and_is_not_recreated(
    make_config, tmp_path, monkeypatch
):
    work = tmp_path / "run"
    _at_step(monkeypatch, 6, lambda: _delete(work))
    # (orbax's checkpoint thread may have recreated it first: then it reads "replaced", or,
    # when the new directory reused the deleted one's inode, that the lock was removed)
    gone = (
        r"the workdir .*run was (deleted|replaced by another directory) during the run"
        r"|the workdir's lock .*run\.lock was removed or taken over \(found"
    )
    with pytest.raises(train.StorageError, match=gone):
        train.train_and_evaluate(make_config(total_steps=12), str(work))
    assert not work.exists(), sorted(str(p.relative_to(work)) for p in work.rglob("*"))


def test_a_deleted_workdir_exits_74_with_one_line(tmp_path, monkeypatch):
    work = tmp_path / "run"
    _at_step(monkeypatch, 3, lambda: _delete(work))
    code, err = _run_main(_argv(work, total_steps=8, checkpoint_every=2))
    assert code == main.EXIT_STORAGE, err
    assert err.count("\n") == 1 and err.startswith("error: the workdir"), err
    assert not work.exists(), [str(p) for p in work.rglob("*")]


def test_a_save_under_way_when_the_workdir_is_deleted_does_not_bring_it_back(tmp_path, monkeypatch):
    """Step 4's save creates its folders only once the deletion at step 6 was noticed (held in
    orbax's background directory creation): it writes a complete ``checkpoints/4`` into a
    recreated workdir, which the stopping run removes. Step 2's save, seen ended before the
    workdir's check at step 5 passed, is not among the steps removed."""
    work = tmp_path / "run"
    noticed = threading.Event()
    ckpts, removing = [], []
    check, create = _lock.RunLock.check, atomicity._create_paths
    save, remove = _checkpoint.Checkpointer.save, _lock.RunLock.remove_recreated

    def check_noticing(self):
        problem = check(self)
        if problem is not None:
            noticed.set()
        return problem

    async def create_late(*args, **kwargs):
        if len(ckpts) > 1:  # all but the first save (the next starts once it ended)
            await asyncio.to_thread(noticed.wait, 60)
        return await create(*args, **kwargs)

    def save_recorded(self, *args):
        ckpts.append(self)
        return save(self, *args)

    def remove_recorded(self):
        removing.append(set(self.own_saves))
        return remove(self)

    monkeypatch.setattr(_lock.RunLock, "check", check_noticing)
    monkeypatch.setattr(atomicity, "_create_paths", create_late)
    monkeypatch.setattr(_checkpoint.Checkpointer, "save", save_recorded)
    monkeypatch.setattr(_lock.RunLock, "remove_recreated", remove_recorded)
    _at_step(monkeypatch, 4, lambda: ckpts[0].manager.wait_until_finished())  # step 2's save
    _at_step(monkeypatch, 6, lambda: _delete(work))
    code, err = _run_main(_argv(work, total_steps=8, checkpoint_every=2))
    assert noticed.is_set() and code == main.EXIT_STORAGE, err
    assert err.count("\n") == 1 and "was deleted during the run (found after step 6)" in err, err
    assert removing == [{4}]
    assert not work.exists(), [str(p) for p in work.rglob("*")]


def _held_commit(monkeypatch, step):
    """Holds the commit (the rename of its temporary folder) of checkpoint ``step``'s save
    until the returned event is set; ``written`` is set once its files are all written."""
    release, written = threading.Event(), threading.Event()
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def held(self, *args, **kwargs):
        if self.get_final().name == str(step):
            written.set()
            await asyncio.to_thread(release.wait, 60)
        return await finalize(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held)
    return release, written


@pytest.mark.parametrize(
    "stop",
    [
        pytest.param(lambda: train.PeerLost("process 1 is gone"), id="peer_lost"),
        pytest.param(lambda: train.Aborted(signal.SIGINT), id="aborted"),
        pytest.param(KeyboardInterrupt, id="keyboard_interrupt"),
    ],
)
def test_a_save_in_flight_when_the_run_stops_at_once_is_never_resumed_half_written(
    stop, tmp_path, monkeypatch, make_config
):
    """The run stops while step 4's save is written but not committed: it leaves at once (the
    save is not waited for: it may wait on a lost process); the workdir as a process dying
    then leaves it resumes from step 2, the half-written save removed, nothing set aside;
    the abandoned save, let go on in this process, commits a checkpoint that verifies."""
    work = tmp_path / "run"
    release, written = _held_commit(monkeypatch, 4)
    left = tmp_path / "left"

    def fault():
        assert written.wait(60)  # step 4's files written, its commit held
        shutil.copytree(work, left, symlinks=True)  # what a process killed now leaves,
        os.remove(left / _lock.LOCK)  # its lock stale (this live process holds this one)
        raise stop()

    _at_step(monkeypatch, 5, fault)
    config = make_config(total_steps=8, checkpoint_every=2)
    try:
        with pytest.raises((train.PeerLost, KeyboardInterrupt)) as info:
            train.train_and_evaluate(config, str(work))
        assert type(info.value) is type(stop())
        assert not release.is_set()  # left without waiting for the held save
    finally:
        release.set()
    assert [n for n in os.listdir(left / "checkpoints") if "tmp" in n], "no half-written save"
    monkeypatch.undo()  # a plain setup again: commits pass
    got = train.train_and_evaluate(config, str(left), stop_after=1)
    assert got == {"stopped_at": 3}  # resumed from step 2, not from the half-written 4
    assert sorted(os.listdir(left / "checkpoints"), key=int) == ["2", "3"]
    assert not (left / "checkpoints.damaged").exists()
    deadline = time.monotonic() + 60  # the abandoned save commits in the background
    while not (work / "checkpoints" / "4").is_dir():
        assert time.monotonic() < deadline, os.listdir(work / "checkpoints")
        time.sleep(0.05)
    assert train.train_and_evaluate(config, str(work), stop_after=1) == {"stopped_at": 5}
    assert not (work / "checkpoints.damaged").exists()


def test_a_workdir_deleted_during_the_final_checkpoints_save_exits_74_in_one_line(
    tmp_path, monkeypatch
):
    """The final save writes into the workdir deleted before its commit (recreating it), or
    fails for it: either way the run stops with the workdir's line, no summary is written
    into a recreated workdir and none is left."""
    work = tmp_path / "run"
    release, written = _held_commit(monkeypatch, 8)
    close = _checkpoint.Checkpointer.close

    def close_deleted(self):  # the run's final close, step 8's save written, not committed
        if self._pending is not None and self._pending[0] == 8 and not release.is_set():
            assert written.wait(60)
            _delete(work)
            release.set()
        return close(self)

    monkeypatch.setattr(_checkpoint.Checkpointer, "close", close_deleted)
    try:
        code, err = _run_main(_argv(work, total_steps=8, checkpoint_every=4))
    finally:
        release.set()
    assert written.is_set()
    assert code == main.EXIT_STORAGE, err
    assert err.count("\n") == 1 and "was deleted during the run" in err, err
    assert "while saving the final checkpoint, step 8" in err, err
    assert not work.exists(), [str(p) for p in work.rglob("*")]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, make_config):
    """A stopped run with checkpoints at steps 4 and 8 (of 12)."""
    work = tmp_path_factory.mktemp("two") / "run"
    config = make_config(total_steps=12)
    assert train.train_and_evaluate(config, str(work), stop_after=8) == {"stopped_at": 8}
    assert sorted(os.listdir(work / "checkpoints"), key=int) == ["4", "8"]
    return work, config


def test_swapped_step_folders_are_refused_before_compiling_and_kept(
    two_checkpoints, tmp_path, monkeypatch
):
    base, config = two_checkpoints
    work = tmp_path / "w"
    shutil.copytree(base, work)
    ckpts = work / "checkpoints"
    os.rename(ckpts / "8", ckpts / "x")
    os.rename(ckpts / "4", ckpts / "8")
    os.rename(ckpts / "x", ckpts / "4")
    before = {p: p.stat().st_mtime_ns for p in ckpts.rglob("*")}

    def compile(self, *a, **k):
        raise AssertionError("compiled before refusing the swapped folders")

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)
    with pytest.raises(train.CheckpointError) as info:
        train.train_and_evaluate(config, str(work))
    text = str(info.value)
    assert f"checkpoint folder {ckpts / '8'} holds step 4" in text and "swapped" in text, text
    assert {p: p.stat().st_mtime_ns for p in ckpts.rglob("*")} == before  # nothing deleted


@pytest.fixture
def small_disk(tmp_path):
    """A 200 KiB tmpfs: room for one checkpoint of the tiny MLP (~128 KiB), not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)],
                       check=True, capture_output=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {e}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_stops_the_run_at_once_in_one_line(small_disk, tmp_path, capfd):
    work = small_disk / "run"
    code, err = _run_main(_argv(work, total_steps=40, checkpoint_every=4, log_every=4))
    out = capfd.readouterr()
    assert code == main.EXIT_STORAGE, err
    assert err.count("\n") == 1, err
    assert "Traceback" not in out.out + out.err + err
    assert f"checkpoint step 8 cannot be written to {work / 'checkpoints'}: no space left" in err
    assert "it needs about" in err and "free" in err
    assert "the last good checkpoint (step 4) is intact" in err
    assert sorted(os.listdir(work / "checkpoints")) == ["4"]
    # the last good checkpoint resumes elsewhere
    shutil.copytree(work, tmp_path / "moved")
    code, err = _run_main(_argv(tmp_path / "moved", total_steps=6, checkpoint_every=4))
    assert code == 0, err


def test_a_save_failing_in_the_background_stops_the_run_at_the_next_step(
    small_disk, monkeypatch, make_config
):
    """A disk that fills after the room was checked: the write fails in orbax's thread."""
    monkeypatch.setattr(_checkpoint.Checkpointer, "_room_for", lambda self, step, need: None)
    work = small_disk / "run"
    steps = []
    cached = _trainer.setup

    def setup(config, devices=None):
        s = cached(config, devices=devices)

        def train_step(state, batch, key, i):
            steps.append(i + 1)
            if i >= 8:
                time.sleep(0.1)  # steps slower than the save: its failure lands mid-interval
            return s.mode.train_step(state, batch, key, i)

        return s._replace(mode=s.mode._replace(train_step=train_step))

    monkeypatch.setattr(_trainer, "setup", setup)
    config = make_config(total_steps=40, checkpoint_every=4, log_every=4)
    with pytest.raises(train.StorageError) as info:
        train.train_and_evaluate(config, str(work))
    text = str(info.value)
    assert "checkpoint step 8 cannot be written" in text and "no space left" in text, text
    assert "the last good checkpoint (step 4) is intact" in text
    assert max(steps) < 12  # noticed by polling, not by the next save
    assert sorted(os.listdir(work / "checkpoints")) == ["4"]  # no half-written folder


def test_a_disk_turned_read_only_mid_run_stops_it_in_one_line(small_disk, monkeypatch):
    """The disk turns read-only after step 6, once step 4's checkpoint is committed: the
    next write (step 8's metrics or checkpoint, whichever comes first) stops the run."""
    work = small_disk / "run"

    def remount():
        deadline = time.monotonic() + 60  # the background save of step 4 commits first
        while not (work / "checkpoints" / "4").is_dir():
            assert time.monotonic() < deadline, "checkpoint 4 was never committed"
            time.sleep(0.02)
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)

    _at_step(monkeypatch, 6, remount)
    code, err = _run_main(_argv(work, total_steps=40, checkpoint_every=4, log_every=4))
    subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    assert code == main.EXIT_STORAGE, err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(work) in err, err
    assert "read-only" in err.lower(), err
    assert sorted(os.listdir(work / "checkpoints")) == ["4"]


def test_resuming_with_another_mesh_mode_codec_or_model_is_refused_by_name(two_checkpoints):
    base, config = two_checkpoints
    for key, value in [
        ("mesh", [("data", 4)]),
        ("mode", "data_parallel"),
        ("data_parallel", {"codec": {"name": "top_k", "fraction": 0.1}}),
        ("model", {"hidden": (32, 32, 64)}),
    ]:
        other = config.copy_and_resolve_references()
        other[key] = value
        with pytest.raises(train.SetupError, match=rf"config differs in \[.*'{key}"):
            train.train_and_evaluate(other, str(base))
    assert sorted(os.listdir(base / "checkpoints"), key=int) == ["4", "8"]


def test_the_cli_on_a_workdir_of_another_experiment_is_a_one_line_error(two_checkpoints):
    base, _ = two_checkpoints
    code, err = _run_main(_argv(base, total_steps=12, lr=0.5))
    assert code == 2 and err.count("\n") == 1, err
    assert "holds a checkpoint of another experiment" in err and "'lr'" in err, err
    assert sorted(os.listdir(base / "checkpoints"), key=int) == ["4", "8"]


def test_an_error_during_training_keeps_its_traceback(tmp_path, monkeypatch):
    """An error raised in a training step leaves the CLI's ``main`` as itself (no one-line
    error, no exit code), its traceback whole."""

    def bug():
        raise ValueError("a bug deep in a training step")

    _at_step(monkeypatch, 2, bug)
    with pytest.raises(ValueError, match="a bug deep in a training step"):
        main.main(_argv(tmp_path / "run", total_steps=4))


def test_a_changed_mode_is_named_when_more_sub_keys_differ_than_the_line_shows(tmp_path):
    """digits_dense's workdir resumed with digits_accordion named 6 ``data_parallel.*`` keys
    and not ``mode`` (the list was cut at 6, sorted; 2026-12-05)."""
    old = {"lr": 0.001, "mode": "dense", "data_parallel": {}}
    new = {"lr": 0.001, "mode": "data_parallel", "data_parallel": dict.fromkeys("abcdefg", 1)}
    _workdir.write_experiment(str(tmp_path), old)
    with pytest.raises(train.SetupError, match=r"differs in \['mode', 'data_parallel.a', .*\] "
                       r"and 2 more\); use a new --workdir"):  # fmt: skip
        _workdir.check_experiment(str(tmp_path), new, None)


@pytest.mark.slow  # 4 CLI subprocesses
def test_a_signal_at_any_moment_of_startup_stops_the_run():
    """SIGINT sent 0.3-1.5 s after the start, and as the first program's compile starts:
    never ignored (the run stops before training or after its first steps with a
    checkpoint), a clear line, no traceback. One sent while compiling stops the run before
    its setup ends (it waited for every compile: 5.85 s): the line after the setup (the wire
    bytes) is never printed."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    results = []
    for when in (0.3, 0.8, 1.5, "compiling"):
        work = pathlib.Path(f"/tmp/jaxcomp-sigstart-{os.getpid()}-{when}")
        shutil.rmtree(work, ignore_errors=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxcomp.main", *_argv(work, total_steps=3000)],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        lines, sent = [], None
        if when != "compiling":
            time.sleep(when)
            proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            lines.append(line)
            if when == "compiling" and sent is None and line.startswith("  compiling "):
                proc.send_signal(signal.SIGINT)
                sent = time.monotonic()
        proc.wait(timeout=120)
        took = None if sent is None else time.monotonic() - sent
        shutil.rmtree(work, ignore_errors=True)
        results.append((when, proc.returncode, "".join(lines)[-600:], took))
    for when, code, out, _ in results:
        assert code in (main.EXIT_INTERRUPTED, 128 + signal.SIGINT), (when, code, out)
        assert "interrupted by SIGINT" in out and "Traceback" not in out, (when, out)
    when, code, out, took = results[-1]
    assert code == main.EXIT_INTERRUPTED, (code, out)
    assert "interrupted by SIGINT while compiling, before step 1" in out, out
    assert "wire bytes/step" not in out, (took, out)
    print(f"SIGINT while compiling: exited {took:.2f} s after the signal")
