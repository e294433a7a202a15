"""Notebooks: each .ipynb is the jupytext pair of its .py, each executes (nbmake), and the
committed .ipynb holds the outputs of one top-to-bottom run, figures included."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_paired(path):
    jupytext = pytest.importorskip("jupytext")
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `jupytext --to ipynb {path}`"
    from_py = [c.source for c in jupytext.read(path).cells]
    from_nb = [c.source for c in jupytext.read(ipynb).cells]
    assert from_py == from_nb, f"{ipynb.name} is out of sync with {path.name} (jupytext --sync)"


@pytest.mark.slow  # a kernel per notebook
def test_every_notebook_runs(tmp_path):
    """Every notebook executes (nbmake), all in one pytest process (a kernel each): one
    process's start and imports instead of one per notebook."""
    pytest.importorskip("nbmake")
    env = {**os.environ, "JAXCOMP_NOTEBOOK_SMOKE": "1", "MPLBACKEND": "Agg"}
    # the notebook's checks are tolerances and shapes (its committed outputs come from a
    # default-compiled run): its kernel compiles unoptimised, as tests/conftest.fast_compiles
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    # the notebook's own 8 devices (it sets them only where XLA_FLAGS is unset) and XLA:CPU's
    # loop emitters (tests/conftest.py, ``fast_compiles``)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
    ipynbs = [str(p.with_suffix(".ipynb")) for p in NOTEBOOKS]
    cmd = [sys.executable, "-m", "pytest", "--nbmake", "--nbmake-timeout=600", "-q", "-rf",
           "-p", "no:cacheprovider", "--rootdir", str(tmp_path), *ipynbs]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1800)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert f"{len(ipynbs)} passed" in out.stdout.strip().splitlines()[-1], out.stdout[-2000:]


#: what each committed notebook prints at the size its text describes (not the tests' smoke
#: size): a reader sees the full run's results
FULL_SIZE = {
    "01_compressors_and_error_feedback": "after 1000 steps",
    "02_compressed_pipeline": "step 600/600",
    "03_accordion": "297 steps, final loss",
    "04_ab_training": "step 300/300",
    "06_flax_nnx": "300 steps of batch 128",
}
#: a code cell that draws or shows a figure must hold its PNG
FIGURE_CALLS = ("plt.subplots(", "plt.figure(", "display(fig)", "Image(")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_shows_its_results(path):
    """A reader who does not run the notebook sees its results: every code cell was run once,
    in order, in one kernel, and every cell that shows a figure holds the PNG."""
    nb = json.loads(path.with_suffix(".ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.stem}: execution counts {counts}; execute it top to bottom: `jupytext --to "
        f"ipynb {path.name}` then `jupyter execute --inplace "
        f"{path.stem}.ipynb` in notebooks/"
    )
    printed = "".join("".join(o.get("text", "")) for c in code for o in c["outputs"])
    marker = FULL_SIZE.get(path.stem)
    assert marker is None or marker in printed, f"{path.stem}: committed at smoke size"
    errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, f"{path.stem}: committed with an error output: {errors[0].get('ename')}"
    for i, cell in enumerate(code):
        src = "".join(cell["source"])
        if any(call in src for call in FIGURE_CALLS):
            pngs = [o for o in cell["outputs"] if "image/png" in o.get("data", {})]
            assert pngs, f"{path.stem}: code cell {i + 1} shows a figure but holds no PNG"
