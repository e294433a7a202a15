"""Every ```python block of README.md runs as written, on its own (8 fake CPU devices).

Each block is executed in a fresh namespace, in README order, so a block that leans on names
from an earlier block (or on a placeholder such as ``stage_fns``) fails with a ``NameError``.
"""

import contextlib
import io
import pathlib
import re

import pytest

#: the blocks must run as written (their own checks: payload dtypes); nothing compares the
#  bits of an optimised program, so they compile unoptimised
pytestmark = pytest.mark.usefixtures("fast_compiles")

README = pathlib.Path(__file__).parents[1] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def python_blocks() -> list[tuple[str, str]]:
    """``(id, source)`` of each python block: the section heading and line number as id."""
    text = README.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        headings = re.findall(r"^#+ (.+)$", text[: match.start()], re.M)
        section = re.sub(r"\W+", "_", headings[-1] if headings else "top").strip("_").lower()
        blocks.append((f"{section}-line{line}", match.group(1)))
    return blocks


BLOCKS = python_blocks()

#: what a block that builds a mesh runs first, so that it runs as written in a plain
#: ``python`` on a one-device CPU (the suite's process has 8 devices already)
CPU_DEVICES = 'jax.config.update("jax_num_cpu_devices", 8)'
USES_DEVICES = re.compile(r"jax\.devices\(|make_mesh\(|pipeline_mesh\(|ab_mesh\(")
MESH_BLOCKS = [(n, s) for n, s in BLOCKS if USES_DEVICES.search(s)]


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 8, [name for name, _ in BLOCKS]
    assert len(MESH_BLOCKS) >= 8, [name for name, _ in MESH_BLOCKS]


@pytest.mark.parametrize("source", [s for _, s in MESH_BLOCKS], ids=[n for n, _ in MESH_BLOCKS])
def test_a_block_that_needs_devices_asks_for_them_before_any_jax_call(source):
    lines = source.splitlines()
    assert any(line.startswith(CPU_DEVICES) for line in lines), "no jax_num_cpu_devices line"
    first = next(i for i, line in enumerate(lines) if line.startswith(CPU_DEVICES))
    before = [line for line in lines[:first] if line.strip()]
    assert all(line.startswith(("import ", "from ")) for line in before), before


@pytest.mark.slow
@pytest.mark.parametrize("source", [s for _, s in BLOCKS], ids=[n for n, _ in BLOCKS])
def test_readme_block_runs_alone(source, request):
    name = request.node.callspec.id
    namespace = {"__name__": f"readme_{name}"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, f"README.md:{name}", "exec"), namespace)  # noqa: S102
