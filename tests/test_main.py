"""The CLI: one-line errors and tracebacks (the CLI's kill-and-resume: tests/test_faults.py;
two processes == one process, every mode, the pipeline's included, each process set up by the
CLI's ``parse_args`` and ``setup_devices``: tests/train/test_two_processes.py; a real
2-process launch joining: tests/test_main_distributed.py; a workdir of another experiment and
an error in a training step, on a setup compiled once: tests/train/test_workdir_faults.py)."""

import contextlib
import io
import pathlib
import re

import pytest

from jaxcomp import main

#: the in-process runs check exit codes, one-line errors and tracebacks, no bit of XLA's
#: optimised programs: compiled unoptimised (each builds its setup: one checks the setup's
#: import error, so no ``shared_setups``)
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


def test_an_import_error_in_a_mode_surfaces_as_itself(monkeypatch, tmp_path):
    from jaxcomp.train import _trainer

    monkeypatch.setitem(_trainer.BUILDERS, "pipeline", ("_no_such_mode", "build"))
    with pytest.raises(ModuleNotFoundError, match="jaxcomp.train._no_such_mode"):
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
