"""Resume on another split of processes and devices (issue 37, item 4): supported when the
mesh comes out the same, refused when it does not (another device count: a ``-1`` mesh axis
would get other sizes, a fixed one cannot be formed), with one line naming both. The check's
cases here; the runs (2 processes x 2 devices <-> 1 x 4: the same numbers as an uninterrupted
run, and 1 x 8 refused before anything compiles) are tests/train/test_two_processes.py's
dense case, which shares its launch.
"""

import pytest

from jaxcomp import train
from jaxcomp.train import _workdir


def _saved(processes, per_process, mesh=None, step=4):
    topology = {"processes": processes, "devices_per_process": per_process, "platform": "cpu"}
    if mesh is not None:
        topology["mesh"] = mesh
    return step, {"topology": topology}


def _now(processes, per_process):
    return {"processes": processes, "devices_per_process": per_process, "platform": "cpu"}


def test_mesh_sizes_fill_the_free_axis_or_say_none():
    assert _workdir.mesh_sizes([("data", -1)], 8) == {"data": 8}
    assert _workdir.mesh_sizes([("data", 2), ("stage", -1)], 8) == {"data": 2, "stage": 4}
    assert _workdir.mesh_sizes([("data", 4)], 8) == {"data": 4}  # the first 4 devices
    assert _workdir.mesh_sizes([("data", 8)], 4) is None
    assert _workdir.mesh_sizes([("data", 3), ("stage", -1)], 8) is None
    assert _workdir.mesh_sizes([("data", 0)], 8) is None  # make_mesh names it


@pytest.mark.parametrize(
    "axes, saved, now, refused",
    [
        ([("data", -1)], _saved(2, 4, {"data": 8}), _now(1, 8), None),
        ([("data", 8)], _saved(1, 8, {"data": 8}), _now(2, 4), None),
        ([("data", 4)], _saved(1, 8, {"data": 4}), _now(1, 4), None),  # the same 4 used
        ([("data", -1)], _saved(2, 4, {"data": 8}), _now(1, 4), "give config.mesh"),
        ([("data", 8)], _saved(2, 4, {"data": 8}), _now(1, 4), "cannot form config.mesh"),
        ([("data", -1)], _saved(2, 4), _now(2, 2), "give config.mesh"),  # no mesh recorded
        ([("data", -1)], (4, {}), _now(1, 4), None),  # no topology recorded: nothing to say
    ],
)
def test_another_mesh_is_refused_in_one_line_naming_both(axes, saved, now, refused, tmp_path):
    if refused is None:
        _workdir.check_topology(str(tmp_path), saved, axes, now)
        return
    with pytest.raises(train.SetupError) as e:
        _workdir.check_topology(str(tmp_path), saved, axes, now)
    line = str(e.value)
    assert "\n" not in line and refused in line, line
    assert f"checkpoint step 4 in {tmp_path} was computed on mesh {{'data': 8}} by 2 " in line
    assert f"this run's {now['processes']} process(es) x {now['devices_per_process']} cpu" in line
    assert "Resume on 8 devices, or use a new --workdir." in line
<<<<<<< HEAD
=======


def _config():
    return train.apply_overrides(cli.load_config(CONFIG), train.parse_overrides(SETS))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pair:
    """The CLI as 2 processes x 4 devices on ``workdir`` (``--stop_after`` if given)."""

    def __init__(self, workdir, logs, stop_after=None):
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
        env.update(JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1", PYTHONUNBUFFERED="1")
        env["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false"  # conftest: fast_compiles
        argv = [sys.executable, "-m", "jaxcomp.main", "--config", CONFIG, "--workdir",
                str(workdir), "--cpu_devices", "4", "--num_processes", "2",
                "--coordinator_address", f"127.0.0.1:{_port()}",
                *sum((["--set", s] for s in SETS), [])]  # fmt: skip
        argv += [] if stop_after is None else ["--stop_after", str(stop_after)]
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"{len(list(logs.iterdir()))}.{i}.log" for i in range(2)]
        self.procs = []
        for i, log in enumerate(self.logs):
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(
                    [*argv, "--process_id", str(i)], env=env, cwd=ROOT, stdout=out,
                    stderr=subprocess.STDOUT))  # fmt: skip

    def wait(self) -> str:
        """Process 0's output, once both exited 0."""
        try:
            codes = [p.wait(timeout=300) for p in self.procs]
        finally:
            for p in self.procs:
                p.kill()
        outs = [log.read_text() for log in self.logs]
        assert codes == [0, 0], f"exit {codes}\n{outs[0][-3000:]}\n{outs[1][-2000:]}"
        return outs[0]


def _losses(workdir, after=0):
    rows = train.read_metrics(str(workdir))
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train" and r["step"] > after}


def _assert_same_run(got, want):
    """The steps after the resume and the summary: those of the uninterrupted run."""
    g, w = _losses(got, STOP), _losses(want, STOP)
    assert sorted(g) == sorted(w) == list(range(STOP + 4, STEPS + 1, 4)), (g, w)
    np.testing.assert_allclose([g[k] for k in w], list(w.values()), rtol=RTOL, atol=ATOL)
    sg, sw = (json.loads((pathlib.Path(d) / "summary.json").read_text()) for d in (got, want))
    assert sg["steps"] == sw["steps"] == STEPS
    np.testing.assert_allclose(sg["final_loss"], sw["final_loss"], rtol=RTOL, atol=ATOL)
    assert abs(sg["final_accuracy"] - sw["final_accuracy"]) <= 1 / 359  # one test example


@pytest.mark.slow  # 2 CLI launches of 2 processes, 4 runs in this process
@pytest.mark.usefixtures("fast_compiles", "shared_setups")  # unoptimised, as the CLI pairs
def test_resume_on_another_split_matches_an_uninterrupted_run_and_another_count_is_refused(
    tmp_path, capsys
):
    config, logs = _config(), tmp_path / "logs"
    two_first, one_first = tmp_path / "two_first", tmp_path / "one_first"
    pair = _Pair(two_first, logs, stop_after=STOP)  # 2 x 4, stopped at STOP
    try:  # meanwhile, here (1 x 8): the reference, and a run stopped at STOP
        train.train_and_evaluate(config, str(tmp_path / "uninterrupted"))
        assert train.train_and_evaluate(config, str(one_first), stop_after=STOP) == {
            "stopped_at": STOP
        }
    finally:
        pair.wait()
    shutil.copytree(one_first, tmp_path / "four")
    capsys.readouterr()

    # 2 x 4 -> 1 x 8 (here), and 1 x 8 -> 2 x 4 (the CLI pair)
    pair = _Pair(one_first, logs)
    try:
        train.train_and_evaluate(config, str(two_first))
        out = capsys.readouterr().out
    finally:
        pair_out = pair.wait()
    assert f"resumed from step {STOP}" in out
    assert "saved by 2 process(es) x 4 cpu device(s), this run has 1 process(es) x 8" in out
    assert f"resumed from step {STOP}" in pair_out
    assert "saved by 1 process(es) x 8 cpu device(s), this run has 2 process(es) x 4" in pair_out
    _assert_same_run(two_first, tmp_path / "uninterrupted")
    _assert_same_run(one_first, tmp_path / "uninterrupted")

    # 1 x 4: config.mesh's -1 would make 4 workers of 8: refused before compiling
    with pytest.raises(train.SetupError, match=r"give config.mesh \[\('data', -1\)\] the sizes "
                       r"\{'data': 4\}: another mesh changes what each step computes"):  # fmt: skip
        train.train_and_evaluate(config, str(tmp_path / "four"), devices=jax.devices()[:4])
    assert "compiling" not in capsys.readouterr().out
    assert train.Checkpointer(str(tmp_path / "four")).all_steps()[-1] == STOP  # untouched


def test_a_mesh_on_some_of_the_devices_saves_its_own_device_count():
    """A run on 4 of the process's 8 devices computed on 4: its checkpoint says so (it said 8,
    and a resume then named 8 devices, or, for a checkpoint without its mesh, refused a resume
    on the same 4)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    saved = _workdir.topology(mesh)
    assert saved["devices_per_process"] == 4 and saved["mesh"] == {"data": 4}
    legacy = {k: v for k, v in saved.items() if k != "mesh"}
    now = {"processes": 1, "devices_per_process": 4, "platform": "cpu"}
    _workdir.check_topology("w", (3, {"topology": legacy}), [("data", -1)], now)  # no error
>>>>>>> lead9
