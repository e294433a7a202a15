"""``python -m jaxcomp.study``: a few smoke cells of the example study through the real CLI
(subprocess), every study's cell configs, one smoke cell per study, and the CLI's exits."""

import csv
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from jaxcomp import study
from jaxcomp import train
from jaxcomp.study import __main__ as cli
from jaxcomp.study import _grid
from jaxcomp.study import _runner

#: the in-process smoke cells check a status ("done"), no bit of XLA's optimised programs; the
#: CLI subprocesses compile as they always do (the flag is this process's JAX configuration)
pytestmark = pytest.mark.usefixtures("fast_compiles")

ROOT = pathlib.Path(__file__).parents[2]
STUDIES = sorted(p.stem for p in (ROOT / "configs" / "studies").glob("*.py"))
#: 2 of paper1_direction's 28 cells: dense and TopK both ways, Adam, seed 0 (every cell's config
#: is checked below; the report's mean over seeds, a diverged seed left out: test_study.py,
#: on a fake trainer writing a run's files)
CELLS = [
    "dense__optimizer=adam__seed0",
    "topk10-both__optimizer=adam__seed0",
]
#: the cells on 2 stages of 2 microbatches and one hidden layer of 64 (a stage each): the CLI's
#: cells, report and rerun, not the config's programs (configs/digits_pipeline.py's smoke
#: trains in tests/test_configs.py); TopK 10% of 64 features per sample: 7.3x fewer bytes
SMALL = [
    *("--set", "mesh=[('data',4),('stage',2)]"),
    *("--set", "model.hidden=(64,)"),
    *("--set", "model.cuts=('fc1',)"),
    *("--set", "pipeline.num_microbatches=2"),
]


def study_cli(*args, cwd=None):
    # unoptimised compiles, as this module's in-process runs (``fast_compiles``): the tests
    # read a report's bytes, counts and files, not the bits of an optimised program
    path = os.pathsep.join([str(ROOT), os.environ["PYTHONPATH"]])
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}  # fmt: skip
    env["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"  # tests/conftest.py: fast_compiles
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "jaxcomp.study", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd or ROOT,
        timeout=900,
    )


@pytest.fixture(scope="module")
def smoke_study(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("paper1_direction_smoke")
    cells = [a for c in CELLS for a in ("--cells", c)]
    args = ["run", "paper1_direction", "--workdir", str(workdir), "--smoke", *SMALL, *cells]
    result = study_cli(*args)
    return workdir, result


@pytest.mark.slow  # a study CLI process of 2 cells
def test_paper1_direction_smoke_runs_the_chosen_cells_and_reports(smoke_study):
    workdir, result = smoke_study
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[28/28] quant2-both__optimizer=sgdm__seed1" not in result.stdout
    assert "[13/28] topk10-both__optimizer=adam__seed0: done" in result.stdout
    assert result.stdout.count(": running") == 2
    md = (workdir / "report.md").read_text()
    assert "2 of 28 runs done, 0 diverged" in md
    with open(workdir / "report.csv") as f:
        rows = {(r["variant"], r["optimizer"]): r for r in csv.DictReader(f)}
    dense, both = rows[("dense", "adam")], rows[("topk10 both", "adam")]
    assert float(dense["x_fewer_than_dense"]) == pytest.approx(1.0)
    assert float(both["x_fewer_than_baseline"]) > 5  # TopK 10% of values + indices, both ways
    assert (float(both["seeds"]), float(both["of_seeds"])) == (1, 2)
    for png in ("accuracy_vs_bytes.png", "curves.png"):
        assert (workdir / png).read_bytes()[:4] == b"\x89PNG"
    assert not (workdir / ".jax_cache").exists()  # no cache on CPU (docs/results/accbug)


@pytest.mark.slow
def test_a_rerun_skips_the_finished_cells_and_report_writes_elsewhere(
    smoke_study, tmp_path, capsys
):
    workdir, _ = smoke_study
    cells = [a for c in CELLS for a in ("--cells", c)]
    # the rerun, `report` and `list` run the CLI's main in this process: the subprocess above
    # checks the `python -m` entry point, and a subprocess would pay JAX's import again (~2.5 s)
    args = ["run", "paper1_direction", "--workdir", str(workdir), "--smoke", *SMALL, *cells]
    assert cli.main(args) == 0
    again = capsys.readouterr().out
    assert again.count("done already") == 2 and "running" not in again, again
    out = tmp_path / "report"
    code = cli.main(["report", str(workdir), "--out", str(out), "--compute_s", "0.001"])
    assert code == 0
    assert (out / "report.md").is_file() and (out / "cells.csv").is_file()


def test_cli_errors_are_one_line(capsys, tmp_path):
    # the CLI's main in this process (the `python -m` entry point and its exit status: the
    # subprocesses above; a subprocess here paid JAX's import again)
    assert cli.main(["run", "no_such_study", "--workdir", str(tmp_path / "unused")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown study 'no_such_study'") and err.count("\n") == 1, err
    assert not (tmp_path / "unused").exists()
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(f"{name}: " in listed for name in STUDIES)
    for name in STUDIES:  # each description whole: its first paragraph, to its last word
        first = " ".join(study.load_study(name).doc.strip().split("\n\n")[0].split())
        assert first.split()[-1] in listed and first.endswith((".", ":", ")")), name


# --- every study file (in-process) ------------------------------------------------------------


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_documents_itself_and_its_cells_are_valid_configs(name):
    s = study.load_study(name)
    assert f"python -m jaxcomp.study run {name} --workdir" in s.doc
    assert "Expected runtime" in s.doc and "Finding" in s.doc
    assert len(s.seeds) >= 2 and set(s.axes.get("optimizer", {})) >= {"adam", "sgdm"}
    base = _grid.base_config(s)
    for cell in study.cells(s):
        study.cell_config(s, cell, base)  # raises naming the cell if an override is wrong


#: the studies whose mode no other test runs: the pipeline ones run through the CLI above, and
#: accordion_powersgd's last variant ("accordion 2/1", sgdm, seed 0) is configs/digits_accordion
#: with its own smoke overrides on a narrower MLP, which tests/test_configs.py runs
RUN_IN_TESTS = ["accordion_batch_size"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN_IN_TESTS)
def test_a_study_of_each_mode_runs_a_smoke_cell(name, tmp_path):
    s = study.load_study(name)
    last = list(s.variants)[-1]  # the most involved variant (Accordion, EF21, AQ-SGD, ...)
    cell = next(c for c in study.cells(s) if c.variant == last)
    # on the digits smoke's MLP (configs/digits_accordion.py): the mode's wiring, not its width
    small = {"model.hidden": (32,)}
    statuses = study.run_study(
        s, str(tmp_path), smoke=True, extra=small, only=[cell.name], log=lambda *_: None
    )
    assert statuses == {cell.name: "done"}


def test_the_accordion_powersgd_cell_left_out_is_the_digits_accordion_smoke():
    s = study.load_study("accordion_powersgd")
    cell = next(c for c in study.cells(s, _grid.SMOKE) if c.variant == list(s.variants)[-1])
    smoke = train.with_defaults(_grid.base_config(s._replace(config=f"{s.config}:smoke")))
    got = study.cell_config(s, cell).to_dict()
    # but for the model's width: the smoke's MLP has one hidden layer (the codecs per kernel)
    assert (got.pop("model"), smoke.model.to_dict()) == (
        {"hidden": (256, 256, 256)},
        {"hidden": (32,)},
    )
    assert got == {k: v for k, v in smoke.to_dict().items() if k != "model"}


# --- the CLI as a function: signals and process-wide settings ----------------------------------


def test_an_interrupted_study_exits_75_and_the_function_leaves_jax_config_alone(
    monkeypatch, tmp_path
):
    def interrupted(*args, **kwargs):
        raise train.Interrupted(15, 3, "stopped by SIGTERM after step 3; checkpoint saved.")

    monkeypatch.setattr(_runner, "run_study", interrupted)
    before = jax.config.jax_compilation_cache_dir
    code = cli.main(["run", "paper1_direction", "--workdir", str(tmp_path / "w")])
    assert code == cli.EXIT_INTERRUPTED == 75
    assert jax.config.jax_compilation_cache_dir == before  # only the CLI process sets it
    assert not (tmp_path / "w" / ".jax_cache").exists()
