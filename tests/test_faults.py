"""Fault injection: damaged checkpoints, signals, restarts (issue 9, items 7, 9-11).

Each fault must give the right answer or a clear error, never a silent wrong result: a byte
flipped in any checkpoint file is detected (or harmless), a non-finite state is never saved,
SIGTERM/SIGINT save and exit cleanly, a run aborted by a second signal (as a killed one:
tests/test_multihost_faults.py) loses only what its last checkpoint does not hold, and the
resumed run is bit-identical to an uninterrupted one, and a restarted or finished workdir keeps
its metrics and summary exact. Non-finite steps in every mode: tests/train/test_nonfinite.py; a
resume in every mode, from a damaged newest checkpoint too: tests/train/test_resume.py.
"""

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxcomp import main
from jaxcomp import train
from jaxcomp.train import _integrity
from jaxcomp.train import _signals
from jaxcomp.train import _trainer

ROOT = pathlib.Path(__file__).parents[1]


CONFIG = str(ROOT / "configs" / "digits_dense.py") + ":smoke"
TINY = {
    "model.hidden": (32, 32, 32),
    "batch_size": 64,
    "eval_batch_size": 120,
    "total_steps": 12,
    "lr": 3e-3,
    "log_every": 4,
    "checkpoint_every": 4,
}


def tiny(**overrides) -> ml_collections.ConfigDict:
    """digits_dense with a small MLP: compiles in ~2 s, a step takes milliseconds."""
    return train.apply_overrides(main.load_config(CONFIG), {**TINY, **overrides})


def _argv(workdir, **overrides) -> list[str]:
    """The CLI arguments that give ``tiny(**overrides)``."""
    sets = [["--set", f"{k}={v!r}"] for k, v in {**TINY, **overrides}.items()]
    return ["--config", CONFIG, "--workdir", str(workdir), *sum(sets, [])]


#: one compiled setup per config for the module's in-process runs (setup is pure)
pytestmark = pytest.mark.usefixtures("shared_setups")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_same(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


def _final_state(workdir):
    path = pathlib.Path(workdir) / "checkpoints"
    step = max(int(p.name) for p in path.iterdir() if p.name.isdigit())
    with ocp.StandardCheckpointer() as ckpt:
        return step, ckpt.restore(path / str(step) / "state")


def _records(workdir):
    return train.read_metrics(str(workdir))


# --- item 7: damaged checkpoints -------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """An 8-step run with checkpoints at 4 and 8, the verified states of both, and a target."""
    base = tmp_path_factory.mktemp("saved") / "run"
    train.train_and_evaluate(tiny(total_steps=8), str(base))
    s = _trainer.setup(tiny(total_steps=8))
    target = _trainer.RunState(
        s.mode.init(jax.random.key(0)),
        _trainer._replicated(np.zeros(2, np.uint32), s.mesh),
    )
    ckpt = train.Checkpointer(str(base))
    step8, state8, _ = ckpt.restore_latest(target)
    ckpt.close()
    only4 = base.parent / "only4"
    shutil.copytree(base, only4)
    shutil.rmtree(only4 / "checkpoints" / "8")
    ckpt = train.Checkpointer(str(only4))
    step4, state4, _ = ckpt.restore_latest(target)
    ckpt.close()
    assert (step8, step4) == (8, 4)
    return base, target, {8: state8, 4: state4}


def _flip(path: pathlib.Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_flipped_byte_in_any_checkpoint_file_is_detected_or_harmless(saved_run, tmp_path, capsys):
    base, target, states = saved_run
    files = sorted(p.relative_to(base) for p in (base / "checkpoints" / "8").rglob("*"))
    files = [f for f in files if (base / f).is_file()]
    assert len(files) >= 10, files  # every file orbax writes: metadata, JSON, arrays
    outcomes = {}
    for rel in files:
        size = (base / rel).stat().st_size
        for pos in sorted({0, size // 2, size - 1}):
            work = tmp_path / "w"
            shutil.copytree(base, work)
            _flip(work / rel, pos)
            capsys.readouterr()
            ckpt = train.Checkpointer(str(work))
            step, state, _ = ckpt.restore_latest(target)
            ckpt.close()
            out = capsys.readouterr().out
            _assert_same(state, states[step])  # never a silently different state
            if step == 4:
                assert "checkpoint step 8" in out and "damaged" in out, out
                assert (work / "checkpoints.damaged" / "8").is_dir()
                assert sorted(os.listdir(work / "checkpoints")) == ["4"]
            outcomes[f"{rel}@{pos}"] = step
            shutil.rmtree(work)
    # the files a restore reads (arrays, their index and metadata, meta) detect every flip;
    # the others (commit markers, orbax's own metadata) are not read, so a flip there restores
    # the same bits. The state is handed to orbax as host arrays: the merged database state/d
    # keeps part of the array data in the per-process one (ocdbt.process_0/d), which is read
    read = ("state/d/", "state/manifest.ocdbt", "state/_METADATA", "meta/meta")
    per_process = "state/ocdbt.process_0/d/"
    detected = {k for k, v in outcomes.items() if v == 4}
    assert {k for k in outcomes if any(r in k for r in read) and per_process not in k} == {
        k for k in detected if per_process not in k
    }, outcomes
    assert any("state/d/" in k for k in detected)
    assert any(per_process in k for k in detected)  # the data read from it


def test_arrays_that_read_back_with_other_values_fail_their_checksums(saved_run, tmp_path, capsys):
    """The issue's case: damage that still decodes (a NaN in a parameter) was loaded."""
    base, target, states = saved_run
    work = tmp_path / "w"
    shutil.copytree(base, work)
    leaves, treedef = jax.tree.flatten(states[8])
    kernel = np.asarray(leaves[0]).copy()
    kernel.flat[7] = np.nan
    leaves[0] = jax.device_put(kernel, leaves[0].sharding)
    item = work / "checkpoints" / "8" / "state"
    shutil.rmtree(item)
    with ocp.StandardCheckpointer() as c:
        c.save(item, jax.tree.unflatten(treedef, leaves))  # same layout, other values
    ckpt = train.Checkpointer(str(work))
    step, state, _ = ckpt.restore_latest(target)
    ckpt.close()
    out = capsys.readouterr().out
    path = _integrity.leaf_paths(states[8])[0]
    assert f"1 array(s) do not match their checksums: {path}" in out, out
    assert step == 4
    _assert_same(state, states[4])


def _mixed_state(x64: bool = False) -> dict:
    """Leaves of every kind a state may hold: dtypes, shardings, scalars, empty, NaN/Inf."""
    jnp = jax.numpy
    mesh = jax.make_mesh((8,), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    values = np.random.default_rng(0).normal(size=(16, 5)).astype(np.float32) * 1e3
    state = {
        "f32": jnp.asarray(values),
        "sharded": jax.device_put(values, sharded),
        "replicated": jax.device_put(values[:3], replicated),
        "bf16": jnp.asarray(values, jnp.bfloat16),
        "f16": jnp.asarray(values[:2], jnp.float16).at[0, 1].set(jnp.inf),
        "f8": jnp.asarray(values[:2] / 1e3, jnp.float8_e4m3fn),
        "i8": jnp.arange(-7, 9, dtype=jnp.int8),
        "u8": jnp.arange(250, 256, dtype=jnp.uint8),
        "i32": jnp.arange(-5, 100, 7, dtype=jnp.int32).reshape(3, 5),
        "u32": jnp.array([0, 1, 2**32 - 1], jnp.uint32),
        "bool": jnp.array([[True, False, True]]),
        "c64": jnp.asarray(values[:4, :2] + 1j * values[4:8, :2], jnp.complex64),
        "key": jax.random.key(7),
        "keys": jax.device_put(jax.random.split(jax.random.key(1), 8), sharded),
        "raw_key": jax.random.PRNGKey(3),
        "scalar": jnp.float32(np.nan),
        "empty": jnp.zeros((0, 3)),
        "python": [3, 2.5, True],
        "numpy": np.arange(6, dtype=np.int64),  # narrowed to int32 as jit takes it
    }
    if x64:
        state.update(
            f64=jnp.asarray(values, jnp.float64) / 7,
            i64=jnp.arange(-(2**40), 2**40, 2**37, dtype=jnp.int64),
            c128=jnp.asarray(values[:3, :2] - 1j * values[3:6, :2], jnp.complex128),
        )
    return state


@pytest.mark.parametrize("x64", [False, True])
def test_host_checksums_are_the_numbers_of_the_device_pass(x64, monkeypatch):
    """Leaves this process holds whole are summed with numpy, leaves sharded over processes
    by the jitted pass: both give every leaf the same checksum and finiteness (a checkpoint
    saved one way verifies the other way), also across the host pass's chunks."""
    with jax.enable_x64(x64):
        state = _mixed_state(x64)
        leaves = jax.tree.leaves(state)
        device_sums, device_finite = (np.asarray(a) for a in _integrity._digest(leaves))
        paths = _integrity.leaf_paths(state)
        want = ([int(s) for s in device_sums], [p for p, ok in zip(paths, device_finite) if not ok])
        assert sorted(want[1]) == ["['f16']", "['scalar']"], want[1]
        assert len(set(want[0])) > len(want[0]) - 4, want[0]  # distinct values, distinct sums
        assert _integrity.inspect_state(state) == want
        monkeypatch.setattr(_integrity, "_CHUNK", 7)  # several chunks, a partial last one
        assert _integrity.inspect_state(state) == want
        on_host = _integrity._on_host
        names = iter(range(10**6))
        monkeypatch.setattr(_integrity, "_on_host", lambda x: on_host(x) and next(names) % 2)
        assert _integrity.inspect_state(state) == want  # half on devices, as across processes


def test_a_leaf_under_8_bits_per_element_is_refused_by_both_passes():
    x = jax.numpy.arange(-4, 4, dtype=jax.numpy.int4)
    for summed in (_integrity.inspect_state, _integrity._digest):
        with pytest.raises(TypeError, match="cannot checksum an array of dtype int4"):
            summed([x])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint32", "complex64"])
def test_every_flipped_bit_of_a_leaf_changes_its_host_checksum(dtype):
    values = np.random.default_rng(1).normal(size=(3, 2)) * 100
    x = np.asarray(jax.numpy.asarray(values, dtype))
    (base,), _ = _integrity.inspect_state([x])
    raw = x.view(np.uint8).reshape(-1)
    for bit in range(raw.size * 8):
        flipped = raw.copy()
        flipped[bit // 8] ^= np.uint8(1 << (bit % 8))
        (other,), _ = _integrity.inspect_state([flipped.view(x.dtype).reshape(x.shape)])
        assert other != base, (dtype, bit)


def test_a_non_finite_state_is_never_saved(tmp_path, capsys):
    ckpt = train.Checkpointer(str(tmp_path))
    good = {"w": jax.numpy.ones(4), "n": jax.numpy.zeros((), jax.numpy.int32)}
    assert ckpt.save(1, good, {"step": 1})
    bad = {"w": jax.numpy.array([1.0, np.nan, 2.0, np.inf]), "n": good["n"]}
    assert not ckpt.save(2, bad, {"step": 2})
    ckpt.close()
    assert "holds NaN or Inf (in ['w'])" in capsys.readouterr().out
    assert os.listdir(tmp_path / "checkpoints") == ["1"]
    step, state, _ = train.Checkpointer(str(tmp_path)).restore_latest(good)
    assert step == 1
    _assert_same(state, good)


def test_retention_never_deletes_the_last_known_good_checkpoint(tmp_path, capsys):
    states = {s: {"w": jax.numpy.full((64,), float(s))} for s in (4, 8, 12)}
    ckpt = train.Checkpointer(str(tmp_path), keep=2)
    for s in (4, 8):
        assert ckpt.save(s, states[s], {"step": s})
        ckpt.wait()
    data = max((tmp_path / "checkpoints" / "8").rglob("d/*"), key=lambda p: p.stat().st_size)
    _flip(data, data.stat().st_size // 2)  # step 8 rots on disk after it was written
    assert ckpt.save(12, states[12], {"step": 12})  # keep=2 would drop 4 if 8 were good
    ckpt.close()
    assert "checkpoint step 8 reads back damaged" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "checkpoints"), key=int) == ["4", "12"]
    # without damage, retention keeps the newest two and drops the older
    other = tmp_path / "other"
    ckpt = train.Checkpointer(str(other), keep=2)
    for s in (4, 8, 12):
        ckpt.save(s, states[s], {"step": s})
    ckpt.close()
    assert sorted(os.listdir(other / "checkpoints"), key=int) == ["8", "12"]


def test_a_half_written_save_is_removed_on_restart(saved_run, tmp_path):
    base, target, states = saved_run
    work = tmp_path / "w"
    shutil.copytree(base, work)
    partial = work / "checkpoints" / "12.orbax-checkpoint-tmp-1234"
    shutil.copytree(work / "checkpoints" / "8", partial)
    ckpt = train.Checkpointer(str(work))
    assert not partial.exists()
    step, state, _ = ckpt.restore_latest(target)
    ckpt.close()
    assert step == 8
    _assert_same(state, states[8])


# --- item 10: metrics and summaries after a restart -----------------------------------------------
def _injected(monkeypatch, bad_steps=(2, 7)):
    """Every step reports wire bytes 100 * step and the steps in ``bad_steps`` are non-finite
    (state kept), so the summary's mean bytes and non-finite count depend on every step."""
    real = _trainer.setup  # the module's cached one

    def fake_setup(config, devices=None):
        s = real(config, devices=devices)

        def step_fn(state, batch, key, step):
            if step + 1 in bad_steps:  # as a mode reports a skipped step (state unchanged)
                return state, {"loss": np.float32(np.nan), "finite": np.int32(0)}
            new, metrics = s.mode.train_step(state, batch, key, step)
            return new, {**metrics, "wire_bytes": np.float32(100.0 * (step + 1))}

        return s._replace(mode=s.mode._replace(train_step=step_fn))

    monkeypatch.setattr(_trainer, "setup", fake_setup)


def test_a_resumed_run_has_the_uninterrupted_metrics_and_summary(tmp_path, monkeypatch):
    _injected(monkeypatch)
    config = tiny(checkpoint_every=3, eval_every=6)  # logs every 4: windows span checkpoints
    full = train.train_and_evaluate(config, str(tmp_path / "full"))
    assert train.train_and_evaluate(config, str(tmp_path / "part"), stop_after=5) == {
        "stopped_at": 5
    }
    part = train.train_and_evaluate(config, str(tmp_path / "part"))
    good = [s for s in range(1, 13) if s not in (2, 7)]
    assert full["nonfinite_steps"] == part["nonfinite_steps"] == 2
    assert full["wire_bytes_per_step"] == part["wire_bytes_per_step"]
    assert full["wire_bytes_per_step"] == pytest.approx(100 * np.mean(good), rel=1e-12)
    assert _records(tmp_path / "full") == _records(tmp_path / "part")
    steps = [(r["step"], r["split"]) for r in _records(tmp_path / "part")]
    assert len(steps) == len(set(steps))
    assert part["wall_time_s"] > 0


def test_a_restart_without_checkpoints_starts_the_metrics_over(saved_run, tmp_path):
    ref, work = saved_run[0], tmp_path / "work"
    shutil.copytree(ref, work)
    shutil.rmtree(work / "checkpoints")
    os.remove(work / "summary.json")
    train.train_and_evaluate(tiny(total_steps=8), str(work))
    assert _records(ref) == _records(work)  # no rows of the first attempt left


def _snapshot(workdir):
    return {
        str(p.relative_to(workdir)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(pathlib.Path(workdir).rglob("*"))
        if p.is_file()
    }


def test_rerunning_a_finished_workdir_says_so_and_changes_nothing(saved_run, tmp_path, capsys):
    base, _, _ = saved_run
    work = tmp_path / "w"
    shutil.copytree(base, work)
    before = _snapshot(work)
    capsys.readouterr()
    summary = train.train_and_evaluate(tiny(total_steps=8), str(work))
    out = capsys.readouterr().out
    assert "is finished (8 of 8 steps); nothing to do" in out
    assert summary == json.loads((work / "summary.json").read_text())
    code, err = _run_main(_argv(work, total_steps=8))
    assert code == 0, err
    assert _snapshot(work) == before


def test_every_shipped_config_checkpoints():
    for path in sorted((ROOT / "configs").glob("*.py")):
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = train.with_defaults(module.get_config(None))
        assert 0 < config.checkpoint_every <= config.total_steps, path.name


# --- item 9: signals (subprocesses) ----------------------------------------------------------
STEPS = 120
SIGNAL_SET = ["--set", "model.hidden=(32, 32, 32)", "--set", f"total_steps={STEPS}",
              "--set", "log_every=1", "--set", "checkpoint_every=40",
              "--set", "eval_every=60"]  # fmt: skip
#: the CLI's output pipe holds one page: a run blocks on its next line once it is that far
#: ahead of the line the test last read, so a signal sent on reading step n lands by step
#: n + AHEAD + 1 however loaded the machine is (a step's line is over 80 bytes)
PIPE_BYTES = 4096
AHEAD = PIPE_BYTES // 80


def _run_main(argv):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main.main(argv)
    return code, err.getvalue()


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    # every run compared here is a CLI process compiled the same way (bits between runs of one
    # program): unoptimised, with XLA:CPU's loop emitters (tests/conftest.py: fast_compiles)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    env["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false"
    return env


@dataclasses.dataclass
class Result:
    code: int
    out: str
    stopped: int | None  # the step the output showed when the signals were sent


def _launch(workdir, signals=(), at=None) -> Result:
    """Runs the CLI; after it prints step ``at`` (or the first step past it), sends
    ``signals`` back to back. The run is at most ``AHEAD`` lines past the one read."""
    import fcntl

    cmd = [sys.executable, "-m", "jaxcomp.main", "--config", CONFIG, "--workdir", str(workdir),
           *SIGNAL_SET]  # fmt: skip
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    try:
        proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=write,
                                stderr=subprocess.STDOUT)  # fmt: skip
    finally:
        os.close(write)
    lines, stopped = [], None
    with open(read, "rb", buffering=0) as out:  # unbuffered: a line is read byte by byte
        for raw in out:
            line = raw.decode()
            lines.append(line)
            m = re.match(r"step\s+(\d+)/", line)
            if signals and stopped is None and m and int(m.group(1)) >= at:
                stopped = int(m.group(1))
                for sig in signals:
                    proc.send_signal(sig)
    proc.wait(timeout=300)
    return Result(proc.returncode, "".join(lines), stopped)


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT),
                                           (signal.SIGINT, signal.SIGINT)],
                         ids=["term-then-int", "int-then-int"])  # fmt: skip
def test_the_first_signal_asks_to_stop_and_the_second_aborts(first, second):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with train.StopOnSignal() as stop:
        assert not stop.should_stop()
        os.kill(os.getpid(), first)
        assert stop.should_stop() and stop.signum == first
        with pytest.raises(train.Aborted, match="aborted by a second signal") as info:
            os.kill(os.getpid(), second)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
        assert info.value.signum == second
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_while_compiling_stops_the_run_at_once(tmp_path, monkeypatch):
    """A first signal during the setup's compiles stops the run before they end (it waited
    for every compile: 5.85 s): the setup here is a wait that only ends after 60 s."""
    import threading

    ended = []

    def compiling(config, devices=None):
        os.kill(os.getpid(), signal.SIGINT)
        threading.Event().wait(60)  # as the main thread waits for a compile's result
        ended.append(True)

    monkeypatch.setattr(_trainer, "setup", compiling)
    with pytest.raises(train.Interrupted, match="by SIGINT while compiling, before step 1"):
        train.train_and_evaluate(tiny(), str(tmp_path))
    assert not ended
    assert not (tmp_path / "checkpoints").exists()


def test_a_signal_that_lands_in_a_gc_callback_while_compiling_still_stops_the_block(monkeypatch):
    """A first signal handled while the main thread runs a garbage-collector callback (JAX
    registers one) or a ``__del__``, where Python prints an exception and drops it, ends the
    block at its end, without a traceback: it was dropped ("Exception ignored in: <function
    _xla_gc_callback ...>"), and the run compiled on and said "before step 1" (2 of 8 Ctrl-C
    1.5-1.6 s after the CLI started, 2026-12-05)."""
    import gc

    sent, after, dropped = [], [], []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))

    def callback(phase, info):
        if phase == "start" and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs here, inside the callback
                pass

    with train.StopOnSignal() as stop:
        with pytest.raises(_signals.StopNow):
            with stop.at_once():
                gc.callbacks.append(callback)
                try:
                    gc.collect()
                finally:
                    gc.callbacks.remove(callback)
                after.append(True)
    assert sent and after and stop.signum == signal.SIGINT
    assert not dropped


def _interrupted_at(result: Result, name: str) -> int:
    m = re.search(rf"jaxcomp: interrupted by {name} after step (\d+) of {STEPS}; checkpoint saved",
                  result.out)  # fmt: skip
    assert m, result.out[-3000:]
    return int(m.group(1))


def _resumed_from(result: Result) -> int:
    m = re.search(r"resumed from step (\d+)", result.out)
    assert m, result.out[-3000:]
    return int(m.group(1))


@pytest.mark.slow  # four CLI processes
def test_the_cli_stopped_and_aborted_resumes_bit_identical(tmp_path):
    """The CLI's stop-and-resume test: SIGTERM saves and exits, SIGINT then SIGTERM aborts
    without saving and without waiting for a save under way (the workdir a killed process
    leaves: the next run resumes from the last finished checkpoint); the run then finishes
    bit-identical to an uninterrupted one, with the same metrics and summary. A save in flight
    at such a stop: tests/train/test_workdir_faults.py; ``kill -9`` of a process and the resume:
    tests/test_multihost_faults.py. In-process resumes of every mode:
    tests/train/test_resume.py."""
    ref, work = tmp_path / "ref", tmp_path / "work"
    # the reference runs as a CLI process too: an in-process run may compile differently
    # (other tests change the process's JAX settings), and bits are compared
    assert _launch(ref).code == 0

    first = _launch(work, [signal.SIGTERM], at=5)
    assert first.code == main.EXIT_INTERRUPTED, first.out[-3000:]
    step1 = _interrupted_at(first, "SIGTERM")
    # the step under way when the signal came is the last (the pipe bounds how far ahead)
    assert first.stopped <= step1 <= first.stopped + AHEAD + 2, (first.stopped, step1)
    assert "Traceback" not in first.out
    saved = [p.name for p in (work / "checkpoints").iterdir()]
    assert str(step1) in saved and all(n.isdigit() for n in saved), saved  # no tmp folder

    # SIGINT first (a stop request: an unhandled one is a KeyboardInterrupt traceback), then
    # SIGTERM aborts by step1 + 5 + AHEAD + 2 < STEPS; what a first SIGINT does alone is
    # test_the_first_signal_asks_to_stop's
    aborted = _launch(work, [signal.SIGINT, signal.SIGTERM], at=step1 + 5)
    assert aborted.code in (128 + signal.SIGTERM, 128 + signal.SIGINT), aborted.out[-3000:]
    assert _resumed_from(aborted) == step1
    assert "aborted by a second signal" in aborted.out and "Traceback" not in aborted.out
    # nothing saved at the abort: step1's and the every-40 saves that finished before it
    done = [int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit()]
    assert all(n == step1 or n % 40 == 0 for n in done), (done, aborted.stopped)

    last = _launch(work)
    assert last.code == 0, last.out[-3000:]
    assert _resumed_from(last) == max(done), (done, last.out[-3000:])

    (s1, a), (s2, b) = _final_state(ref), _final_state(work)
    assert s1 == s2 == STEPS
    _assert_same(a, b)
    assert _records(ref) == _records(work)  # no duplicate or missing rows
    j1 = json.loads((ref / "summary.json").read_text())
    j2 = json.loads((work / "summary.json").read_text())
    for k in ("final_loss", "final_accuracy", "wire_bytes_per_step", "nonfinite_steps"):
        assert j1[k] == j2[k], k


def test_the_clis_exit_waits_for_threads_left_behind_only_up_to_its_bound():
    """What a CLI process that stopped early waits for before ``os._exit`` (orbax's thread of
    a save abandoned when its workdir vanished waited 300 s at the interpreter's exit)."""
    import threading

    release = threading.Event()
    left = threading.Thread(target=release.wait, args=(60,), name="abandoned-save")
    left.start()
    try:
        assert "abandoned-save" in main.threads_left(0.1)
    finally:
        release.set()
    assert "abandoned-save" not in main.threads_left(5.0)
