"""Notebooks: each .ipynb is the jupytext pair of its .py, and each executes (nbmake)."""

import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_paired_and_runs(path, tmp_path):
    jupytext = pytest.importorskip("jupytext")
    pytest.importorskip("nbmake")
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `jupytext --to ipynb {path}`"
    from_py = [c.source for c in jupytext.read(path).cells]
    from_nb = [c.source for c in jupytext.read(ipynb).cells]
    assert from_py == from_nb, f"{ipynb.name} is out of sync with {path.name} (jupytext --sync)"
    env = {**os.environ, "JAXCOMP_NOTEBOOK_SMOKE": "1", "MPLBACKEND": "Agg"}
    env.pop("XLA_FLAGS", None)  # the notebook sets its own devices, in a fresh kernel
    cmd = [sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=600", "-q",
           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(ipynb)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
