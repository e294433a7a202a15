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
    xs = np.random.default_rng(0).standard_normal((4, 2, 6)).astype(np.float32)  # per worker
    x = jax.device_put(xs.reshape(8, 6), NamedSharding(mesh, P(comm.DATA)))

    def hidden(w, x):
        return jax.grad(_loss)(w, x)

    def local(w, x):
        return comm.local_value_and_grad(_loss, comm.DATA)(w, x)[1][None]

    f_hidden = jax.shard_map(hidden, mesh=mesh, in_specs=(P(), P(comm.DATA)), out_specs=P())
    assert comm.measure_collectives(f_hidden, w, x).bytes_by_kind().get("all-reduce", 0) > 0

    # jitted once: measured and run as one compiled program
    f_local = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P(comm.DATA)), out_specs=P(comm.DATA))
    )
    assert comm.measure_collectives(f_local, w, x).total_bytes == 0
    grads = np.asarray(f_local(w, x))
    w_np = np.asarray(w, np.float64)
    for i in range(4):  # d/dw mean((x w)^2) over a worker's 2 x 3 outputs: 2 x^T (x w) / 6
        want = 2 * xs[i].T @ (xs[i] @ w_np) / 6
        np.testing.assert_allclose(grads[i], want, rtol=1e-5)


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


def _fake_devices(processes, per_process, slices=None, interleave=True):
    """Stand-ins for multi-host devices (``device_grid`` reads their process and slice)."""
    import types

    devs = [
        types.SimpleNamespace(
            id=i,
            process_index=i % processes if interleave else i // per_process,
            platform="cpu",
            device_kind="cpu",
            slice_index=None if slices is None else (i % processes) * slices // processes,
        )  # fmt: skip
        for i in range(processes * per_process)
    ]
    return devs


@pytest.mark.parametrize("sizes", [(2, 4), (4, 2), (2, 2, 2)], ids=str)
def test_hybrid_grid_puts_processes_on_the_first_axis(sizes):
    """Even when the device list interleaves the processes, each process's devices form one
    block of the first axis (what the trainer's (slow, fast) meshes rely on on many hosts)."""
    from jaxcomp.comm import _mesh

    grid = _mesh.device_grid(_fake_devices(2, 4), list(sizes))
    assert grid.shape == sizes
    procs = np.vectorize(lambda d: d.process_index)(grid)
    half = sizes[0] // 2
    assert (procs[:half] == 0).all() and (procs[half:] == 1).all(), procs
    assert sorted(d.id for d in grid.ravel()) == list(range(8))


def test_hybrid_grid_uses_tpu_slices_over_processes():
    """4 processes in 2 TPU slices: the first axis spans the slices (DCN), not the hosts."""
    from jaxcomp.comm import _mesh

    grid = _mesh.device_grid(_fake_devices(4, 2, slices=2), [2, 4])
    slices = np.vectorize(lambda d: d.slice_index)(grid)
    assert (slices[0] == 0).all() and (slices[1] == 1).all(), slices


@pytest.mark.parametrize(
    "devices, sizes",
    [
        (_fake_devices(1, 8), [2, 4]),  # one process: devices in order
        (_fake_devices(2, 4), [3, 2]),  # first axis not a multiple of the processes
        (_fake_devices(2, 4), [2, 2]),  # a mesh of part of the devices
    ],
    ids=["one_process", "first_axis_not_multiple", "part_of_the_devices"],
)
def test_hybrid_grid_falls_back_to_device_order(devices, sizes):
    from jaxcomp.comm import _mesh

    assert _mesh.device_grid(devices, sizes) is None


def test_make_mesh_on_one_process_keeps_device_order():
    mesh = comm.make_mesh([("slow", 2), ("fast", 4)])
    assert [d.id for d in mesh.devices.ravel()] == [d.id for d in jax.devices()]
