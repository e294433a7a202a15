"""``python -m jaxcomp.study``: the example study runs in smoke mode and reports (subprocess)."""

import csv
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def study_cli(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
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
    result = study_cli("run", "paper1_direction", "--workdir", str(workdir), "--smoke")
    return workdir, result


def test_paper1_direction_smoke_runs_every_cell_and_reports(smoke_study):
    workdir, result = smoke_study
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[28/28] quant2-both__optimizer=sgdm__seed1: done" in result.stdout
    md = (workdir / "report.md").read_text()
    assert "28 of 28 runs done, 0 diverged" in md
    table = [line for line in md.splitlines() if line.startswith("| ") and "variant" not in line]
    assert len(table) == 14  # 7 variants x 2 optimizers, seeds aggregated
    with open(workdir / "report.csv") as f:
        rows = {(r["variant"], r["optimizer"]): r for r in csv.DictReader(f)}
    dense, both = rows[("dense", "adam")], rows[("topk10 both", "adam")]
    assert float(dense["x_fewer_than_dense"]) == pytest.approx(1.0)
    assert float(both["x_fewer_than_baseline"]) > 5  # TopK 10% of values + indices, both ways
    assert float(rows[("quant2 forward-only", "sgdm")]["seeds"]) == 2
    for png in ("accuracy_vs_bytes.png", "curves.png"):
        assert (workdir / png).read_bytes()[:4] == b"\x89PNG"


def test_a_rerun_skips_the_finished_cells_and_report_writes_elsewhere(smoke_study, tmp_path):
    workdir, _ = smoke_study
    again = study_cli("run", "paper1_direction", "--workdir", str(workdir), "--smoke")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("done already") == 28 and "running" not in again.stdout
    out = tmp_path / "report"
    result = study_cli("report", str(workdir), "--out", str(out), "--compute_s", "0.001")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "report.md").is_file() and (out / "cells.csv").is_file()


def test_cli_errors_are_one_line():
    result = study_cli("run", "no_such_study", "--workdir", "/tmp/unused_study_dir")
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown study 'no_such_study'")
    assert result.stderr.count("\n") == 1
    listed = study_cli("list")
    assert listed.returncode == 0 and "paper1_direction" in listed.stdout
