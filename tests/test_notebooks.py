"""Notebooks: each .ipynb is the jupytext pair of its .py, all execute (one kernel), and the
committed .ipynb holds the outputs of one top-to-bottom run, figures included."""

import json
import os
import pathlib

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


#: a fresh namespace for each notebook; then what survives (the modules imported so far) is
#: moved out of the garbage collector's reach, binding no name: every later collection (each
#: reset's, and those during tracing) walked the whole heap of JAX, Flax and matplotlib
RESET = "%reset -f\n__import__('gc').freeze()"


@pytest.mark.slow  # the six notebooks
def test_every_notebook_runs(tmp_path):
    """Every notebook executes top to bottom at its smoke size, all in one Jupyter kernel: each
    after ``%reset -f`` (a fresh namespace, so a notebook that uses a name it does not define
    fails as in a kernel of its own); the kernel's start and the imports paid once, not six
    times."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    env = {**os.environ, "JAXCOMP_NOTEBOOK_SMOKE": "1", "MPLBACKEND": "Agg"}
    env["TMPDIR"] = str(tmp_path)  # the notebooks' workdirs (tempfile.mkdtemp)
    # the notebook's checks are tolerances and shapes (its committed outputs come from a
    # default-compiled run): its kernel compiles unoptimised, as tests/conftest.fast_compiles
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    # the notebook's own 8 devices (it sets them only where XLA_FLAGS is unset) and XLA:CPU's
    # loop emitters (tests/conftest.py, ``fast_compiles``)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
    cells, owners = [], []
    for path in NOTEBOOKS:
        nb = nbformat.read(path.with_suffix(".ipynb"), as_version=4)
        code = [nbformat.v4.new_code_cell(RESET)]
        code += [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
        cells += code
        owners += [path.stem] * len(code)
    combined = nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata)
    client = nbclient.NotebookClient(combined, timeout=600)
    try:
        client.execute(cwd=str(NOTEBOOKS[0].parent), env=env)
    except nbclient.exceptions.CellExecutionError as err:
        failed = [i for i, c in enumerate(cells) if any("ename" in o for o in c.outputs)]
        pytest.fail(f"{owners[failed[0]] if failed else '?'}: {str(err)[-6000:]}")
    assert client.code_cells_executed == len(cells)


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
