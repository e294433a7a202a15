"""check_collective_uniformity: branches holding collectives decided uniformly over their axes."""

import inspect

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm

SPEC = P("slow", "fast")


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([("slow", 2), ("fast", 4)])


@pytest.fixture(scope="module")
def x(mesh):
    return jax.ShapeDtypeStruct((2, 8), jnp.float32, sharding=NamedSharding(mesh, SPEC))


def _sm(mesh, body, check_vma=True):
    return jax.shard_map(body, mesh=mesh, in_specs=SPEC, out_specs=SPEC, check_vma=check_vma)


def _varying(x, axes):
    return lax.pcast(x, axes, to="varying")


def _ring(x, axis, n):
    return lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


def test_a_predicate_varying_over_the_collectives_axis_is_reported(mesh, x):
    def body(x):
        pred = x.sum() > 0  # differs between devices along both axes
        line = inspect.currentframe().f_lineno + 1
        y = lax.cond(pred, lambda v: _ring(v, "slow", 2), lambda v: v, x)
        body.line = line
        return y

    report = comm.collective_uniformity(jax.jit(_sm(mesh, body)), x)
    assert report.branches == 1
    (v,) = report.violations
    assert (v.primitive, v.axes, v.reason) == ("cond", ("slow",), "varying")
    assert v.collectives == ("ppermute over slow",)
    assert f"test_uniformity.py:{body.line}:" in v.where
    with pytest.raises(comm.NonUniformCollectiveError, match=r"ppermute over slow"):
        comm.check_collective_uniformity(jax.jit(_sm(mesh, body)), x)


def test_a_predicate_uniform_over_the_collectives_axis_passes(mesh, x):
    def body(x):
        # varies over "fast" only; the collective is over "slow": every slow group agrees
        pred = lax.axis_index("fast") > 0
        y = lax.cond(pred, lambda v: _varying(lax.psum(v, "slow"), "slow"), lambda v: v, x)
        # decided from a psum over "fast": uniform over "fast"
        total = lax.psum(x.sum(), "fast") > 0
        return lax.cond(total, lambda v: _ring(v, "fast", 4), lambda v: v, y)

    report = comm.check_collective_uniformity(jax.jit(_sm(mesh, body)), x)
    assert (report.branches, report.violations) == (2, ())
    assert report.collectives == 3  # psum, psum, ppermute


def test_switch_index_while_loop_scan_custom_vjp_and_grad_are_searched(mesh, x):
    @jax.custom_vjp
    def send(v):
        return _ring(v, "fast", 4)

    send.defvjp(lambda v: (send(v), None), lambda _, g: (_ring(g, "fast", 4),))

    def body(x):
        idx = lax.axis_index("fast") % 3  # varying over "fast"
        y = lax.switch(idx, [lambda v: v, send, lambda v: 2 * v], x)

        def tick(c, _):
            return lax.cond(c.sum() > 0, send, lambda v: v, c), None

        y = lax.scan(tick, y, None, length=2)[0]
        return lax.while_loop(lambda c: c[0].sum() < 10.0, lambda c: (send(c[0]),), (y,))[0]

    report = comm.collective_uniformity(jax.jit(_sm(mesh, body)), x)
    kinds = sorted(v.primitive for v in report.violations)
    assert kinds == ["cond", "cond", "while"], report
    assert all(v.axes == ("fast",) for v in report.violations)

    def loss(x):
        return _sm(mesh, lambda v: lax.scan(lambda c, _: (send(c), None), v, None, length=2)[0])(
            x
        ).sum()

    def step(x):  # no branches: the transposed program's sends are counted, nothing reported
        return jax.grad(loss)(x)

    report = comm.check_collective_uniformity(jax.jit(step), x)
    assert (report.collectives, report.branches) == (2, 0)  # forward and transposed scan bodies

    def switched(v):
        return lax.switch(lax.axis_index("fast") % 3, [lambda v: v, send, lambda v: 2 * v], v)

    def branchy(x):  # the transposed switch is reported too
        return jax.grad(lambda v: _sm(mesh, switched)(v).sum())(x)

    with pytest.raises(comm.NonUniformCollectiveError, match="ppermute over fast"):
        comm.check_collective_uniformity(branchy, x)


def test_an_unchecked_shard_map_cannot_be_proven_uniform(mesh, x):
    def body(x):
        return lax.cond(lax.axis_index("slow") == 0, lambda v: lax.psum(v, "fast"), jnp.abs, x)

    report = comm.collective_uniformity(_sm(mesh, body, check_vma=False), x)
    (v,) = report.violations
    assert (v.reason, v.axes) == ("unchecked", ("fast",))
    assert "check_vma=False" in str(v)


def test_branches_outside_shard_map_and_without_collectives_are_ignored(mesh, x):
    inner = _sm(mesh, lambda v: lax.psum(v, "fast"))

    def f(x):  # a global predicate choosing whether to run a whole shard_map is fine
        return lax.cond(x.sum() > 0, inner, lambda v: v, x)

    def local(x):
        return lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)

    assert comm.check_collective_uniformity(jax.jit(f), x).branches == 0
    report = comm.check_collective_uniformity(jax.jit(_sm(mesh, local)), x)
    assert (report.branches, report.collectives) == (0, 0)


def test_the_set_mesh_option_wraps_tests_taking_a_mesh(mesh, request):
    """``pytest --set-mesh`` (tests/conftest.py) runs this body under ``jax.set_mesh(mesh)``;
    so does the ``[set_mesh]`` run of a test listed in ``ALSO_UNDER_SET_MESH`` (this one too)."""
    current = jax.sharding.get_abstract_mesh()
    callspec = getattr(request.node, "callspec", None)
    variant = callspec is not None and callspec.params.get("under_set_mesh", False)
    assert callspec is not None and "under_set_mesh" in callspec.params  # it is listed
    if request.config.getoption("--set-mesh") or variant:
        assert tuple(current.axis_names) == tuple(mesh.axis_names)
    else:
        assert current.empty
