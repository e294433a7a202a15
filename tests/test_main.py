"""The CLI: one-line errors, two processes == one process (the CLI's kill-and-resume:
tests/test_faults.py)."""

import contextlib
import io
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxcomp import main

#: the in-process runs check exit codes, one-line errors and tracebacks, no bit of XLA's
#: optimised programs; unoptimised, the smoke run's programs are those tests/test_configs.py
#: compiles for the same config (a hit in the test run's shared compilation cache). The CLI
#: processes below choose their own setting (``_env``).
pytestmark = pytest.mark.usefixtures("fast_compiles")

ROOT = pathlib.Path(__file__).parents[1]
CONFIG = str(ROOT / "configs" / "digits_pipeline.py")


def _run_main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main.main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--set", "mesh=[('data', 3), ('stage', 4)]"], "needs 12 devices; only 8 available"),
        (["--set", "model_name='mlpp'"], "unknown model 'mlpp'"),
        (["--set", "pipeline.forward={'name': 'top_j'}"], "unknown codec 'top_j'"),
        (["--set", "epochs=3"], r"unknown config key 'epochs'"),
        (["--set", "pipeline.num_microbatches=3"], "must be divisible by num_microbatches"),
    ],
)
def test_bad_input_is_a_one_line_error_before_training(tmp_path, extra, match):
    code, err = _run_main(["--config", f"{CONFIG}:smoke", "--workdir", str(tmp_path), *extra])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(match, lines[0]), err
    assert not (tmp_path / "checkpoints").exists()


def test_a_missing_extra_is_a_one_line_error_naming_it_and_leaves_no_workdir(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    gone = {"tensorflow_datasets", "tensorboardX"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in gone else real(n, *a)
    )
    for argv, extra in (
        (["--config", "resnet18_cifar10_pipeline:smoke"], "data"),
        (["--config", f"{CONFIG}:smoke", "--set", "writers=('tensorboard',)"], "tensorboard"),
    ):
        code, err = _run_main([*argv, "--workdir", str(tmp_path / "run")])
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith("error: config.") and f"pip install 'jaxcomp[{extra}]'" in err, err
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_workdir_of_another_experiment_is_a_one_line_error(tmp_path):
    args = ["--config", f"{CONFIG}:smoke", "--workdir", str(tmp_path)]
    assert _run_main(args)[0] == 0
    code, err = _run_main([*args, "--set", "lr=0.5"])
    assert code == 2 and "holds a checkpoint of another experiment" in err


def _env(devices):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    # two processes compared with one to a tolerance: compiled unoptimised (as the
    # module-scoped ``fast_compiles`` does in-process), each CLI process compiles faster
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    env["XLA_FLAGS"] = "--xla_cpu_use_fusion_emitters=false"  # tests/conftest.py: fast_compiles
    return env


def _cmd(workdir, *extra):
    return [sys.executable, "-m", "jaxcomp.main", "--config", f"{CONFIG}:smoke",
            "--workdir", str(workdir), "--set", "total_steps=8", "--set", "checkpoint_every=4",
            *extra]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The workdir of one uninterrupted 8-step CLI run on 8 devices: the two-process run's
    reference."""
    full = tmp_path_factory.mktemp("uninterrupted")
    subprocess.run(_cmd(full), check=True, env=_env(8), cwd=ROOT, capture_output=True, timeout=600)
    return full


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # three CLI processes
def test_two_processes_match_one_process(uninterrupted, tmp_path):
    one, two = uninterrupted, tmp_path / "two"  # 8 steps, checkpoints every 4, as `one`
    port = _free_port()
    procs = [
        subprocess.Popen(
            _cmd(
                two,
                "--cpu_devices",
                "4",
                "--num_processes",
                "2",
                "--process_id",
                str(i),
                "--coordinator_address",
                f"127.0.0.1:{port}",
            ),
            env=_env(4),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    j1 = json.loads((one / "summary.json").read_text())
    j2 = json.loads((two / "summary.json").read_text())
    np.testing.assert_allclose(j2["final_loss"], j1["final_loss"], rtol=1e-5)
    assert j1["final_accuracy"] == j2["final_accuracy"]
    np.testing.assert_allclose(
        j2["final_loss_uncompressed"], j1["final_loss_uncompressed"], rtol=1e-5
    )


def test_an_import_error_in_a_mode_surfaces_as_itself(monkeypatch, tmp_path):
    from jaxcomp.train import _trainer

    monkeypatch.setitem(_trainer.BUILDERS, "pipeline", ("_no_such_mode", "build"))
    with pytest.raises(ModuleNotFoundError, match="jaxcomp.train._no_such_mode"):
        main.main(["--config", f"{CONFIG}:smoke", "--workdir", str(tmp_path)])


@pytest.mark.slow
def test_an_error_during_training_keeps_its_traceback(monkeypatch, tmp_path):
    from jaxcomp.train import _trainer

    real = _trainer.setup

    def broken(config, devices=None):
        s = real(config, devices=devices)

        def step(state, batch, key, i):
            raise ValueError("a bug deep in a training step")

        return s._replace(mode=s.mode._replace(train_step=step))

    monkeypatch.setattr(_trainer, "setup", broken)
    with pytest.raises(ValueError, match="a bug deep in a training step"):
        main.main(["--config", f"{CONFIG}:smoke", "--workdir", str(tmp_path)])


def test_bench_help_lists_every_benchmark_and_its_flags(capsys):
    from jaxcomp.bench import __main__ as bench

    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in bench.BENCHMARKS:
        assert f"usage: python -m jaxcomp.bench {name} " in out, name
    assert "--microbatches" in out and "--rank-fractions" in out and "--json PATH" in out
    assert bench.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_every_benchmark_flag_has_help_and_every_description_is_whole(monkeypatch):
    import importlib

    from jaxcomp.bench import __main__ as bench
    from jaxcomp.bench import _common

    made, make = [], _common.parser
    monkeypatch.setattr(_common, "parser", lambda *a: made.append(make(*a)) or made[-1])
    for name, module in bench.BENCHMARKS.items():
        with pytest.raises(SystemExit):
            importlib.import_module(module).main(["--help"])
        p = made[-1]
        assert p.prog == f"python -m jaxcomp.bench {name}"
        assert p.description.endswith((".", ")")), (name, p.description)
        undocumented = [a.option_strings for a in p._actions if not a.help]
        assert not undocumented, (name, undocumented)
