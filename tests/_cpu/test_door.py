"""The CPU door: XLA:CPU is named only behind it, its hook lowers each platform's branch, its
wrappers give the plain values, and jax._src is read in one place that still works."""

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import _cpu
from jaxcomp import _jax_private
from jaxcomp import comm
from jaxcomp._vma import to_varying

ROOT = pathlib.Path(jaxcomp.__file__).parent
POINTER = "jaxcomp._cpu"


def test_xla_cpu_is_named_outside_the_door_only_in_comments_pointing_to_it():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.is_relative_to(ROOT / "_cpu"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"XLA[: ]CPU", line) and not (
                line.lstrip().startswith("#") and POINTER in line
            ):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_jax_private_modules_are_imported_in_one_place():
    importers = set()
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
                importers.add(str(path.relative_to(ROOT)))
    assert importers == {"_jax_private.py"}


def test_what_jaxcomp_reads_of_jax_private_is_still_there():
    """Fails when a JAX release moves it (the callers would fall back silently)."""
    states, unset = _jax_private.config_states()
    assert len(states) > 10 and all(hasattr(s, "get_local") for s in states)
    with jax.log_compiles(True):  # a value set in a with block is found, others are unset
        local = {s.name: s.get_local() for s in states if hasattr(s, "name")}
    assert local.get("jax_log_compiles") is True
    assert any(v is unset for v in local.values())
    closed = jax.make_jaxpr(lambda x: jnp.sin(x))(1.0)
    assert "test_door.py" in _jax_private.summarize_source(closed.jaxpr.eqns[0].source_info)
    assert _jax_private.distributed_client() is None  # this process never initialised one


def test_the_hook_lowers_each_platform_its_own_branch():
    def f(x):
        return _cpu.kernel(x, cpu=jnp.sin, default=jnp.cos)

    x = jnp.ones(4)
    assert "sine" in jax.jit(f).lower(x).compile().as_text()
    for platform in ("cuda", "tpu"):
        text = jax.export.export(jax.jit(f), platforms=[platform])(x).mlir_module()
        assert "stablehlo.cosine" in text and "stablehlo.sine" not in text, platform


@pytest.mark.user_numerics
def test_the_door_wrappers_give_the_plain_values_and_types_under_shard_map():
    mesh = comm.make_mesh([("data", 2)], jax.devices()[:2])
    x = jnp.array([[-0.0, jnp.nan, 3.0], [1.0, -jnp.inf, 2.0]])

    def body(x):
        ones = jnp.ones((), jnp.float32)  # invariant: after() types it as its deps vary
        flag = _cpu.after(ones, x) == 1
        c = _cpu.computed_once(lambda e, x: x + e, jnp.full_like(x, -0.0), x)  # x + -0 is x
        never = to_varying(jnp.zeros(()), ["data"])  # fn's types, varying axes included
        total = _cpu.as_written(lambda c: jnp.sum(c * 0), never, (c,), [c])
        return jnp.where(flag, c, 0.0), total[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    got, total = fn(x)
    assert np.asarray(got).tobytes() == np.asarray(x).tobytes()
    assert np.isnan(np.asarray(total)).all()  # the sum reads the NaN and -inf as written


def test_the_entry_points_switches_on_a_cpu_mesh():
    mesh = comm.make_mesh([("data", 2)], jax.devices()[:2])
    assert _cpu.rarely_run_options(mesh) == _cpu.RARELY_RUN_OPTIONS
    assert isinstance(_cpu.jit_init(jnp.sin), _cpu._init_program.SplitInit)
