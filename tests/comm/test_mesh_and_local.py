"""Mesh construction and per-worker gradients without the hidden all-reduce."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm


def test_make_mesh_fills_minus_one():
    mesh = comm.make_mesh([(comm.STAGE, 4), (comm.DATA, -1)])
    assert dict(mesh.shape) == {comm.STAGE: 4, comm.DATA: 2}


@pytest.mark.parametrize(
    "axes, match",
    [
        ([("a", 3), ("b", -1)], "multiple"),
        ([("a", 16)], "needs 16"),
        ([("a", 2), ("a", 2)], "distinct"),
        ([("a", -1), ("b", -1)], "at most one"),
    ],
)
def test_make_mesh_errors_name_the_problem(axes, match):
    with pytest.raises(ValueError, match=match):
        comm.make_mesh(axes)


def _loss(w, x):
    return jnp.mean((x @ w) ** 2)


def test_local_grads_have_no_all_reduce_and_are_per_worker():
    mesh = comm.make_mesh([(comm.DATA, 4)], devices=jax.devices()[:4])
    w = jax.device_put(jnp.full((6, 3), 0.1), NamedSharding(mesh, P()))
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (8, 6)), NamedSharding(mesh, P(comm.DATA))
    )

    def hidden(w, x):
        return jax.grad(_loss)(w, x)

    def local(w, x):
        return comm.local_value_and_grad(_loss, comm.DATA)(w, x)[1][None]

    f_hidden = jax.shard_map(hidden, mesh=mesh, in_specs=(P(), P(comm.DATA)), out_specs=P())
    assert comm.measure_collectives(f_hidden, w, x).bytes_by_kind().get("all-reduce", 0) > 0

    f_local = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(comm.DATA)), out_specs=P(comm.DATA))
    assert comm.measure_collectives(f_local, w, x).total_bytes == 0
    grads = np.asarray(jax.jit(f_local)(w, x))
    xs = np.asarray(x).reshape(4, 2, 6)
    for i in range(4):
        np.testing.assert_allclose(grads[i], jax.grad(_loss)(np.asarray(w), xs[i]), rtol=1e-5)


def test_to_varying_keeps_already_varying_leaves():
    mesh = comm.make_mesh([(comm.STAGE, 2), (comm.DATA, 2)], devices=jax.devices()[:4])

    def body(a, b):
        out = comm.to_varying({"a": a, "b": b}, (comm.STAGE, comm.DATA))
        assert comm.varying_axes(out["a"]) == {comm.STAGE, comm.DATA}
        assert comm.varying_axes(out["b"]) == {comm.STAGE, comm.DATA}
        return out["a"] + out["b"]

    a = jax.device_put(jnp.ones((2, 3)), NamedSharding(mesh, P(comm.STAGE)))
    b = jax.device_put(jnp.ones((1, 3)), NamedSharding(mesh, P()))
    jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(comm.STAGE), P()), out_specs=P(comm.STAGE, comm.DATA)
        )
    )(a, b)
