"""Every AB-Training program (the harness's three, on a rectangular and a flat layout, and the
optax transform's ``lax.switch`` program) takes each branch holding a collective on every
device of that collective's group (``comm.check_collective_uniformity``). Their cuda/tpu
export is tested in ``tests/transforms/test_ab_export.py``."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.ab import _programs

PARAMS = {
    "l1": {"kernel": jax.ShapeDtypeStruct((6, 5), jnp.float32)},
    "l2": {"kernel": jax.ShapeDtypeStruct((5, 8), jnp.float32),
           "bias": jax.ShapeDtypeStruct((8,), jnp.float32)},
}  # fmt: skip
LAYOUTS = {
    "rectangular": (lambda: parallel.ab_mesh(2, jax.devices()[:4]), {}),
    "flat": (lambda: comm.make_mesh([("data", 5)], jax.devices()[:5]),
             dict(axis_name="data", group_size=2)),
}  # fmt: skip


def _loss(p, x):
    h = jnp.tanh(x @ p["l1"]["kernel"])
    return jnp.mean((h @ p["l2"]["kernel"] + p["l2"]["bias"]) ** 2)


def _config(options):
    return transforms.ABConfig(1e-2, warmup_steps=2, sync_every=4, full_rank_steps=1,
                               max_rank=3, **options)  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_harness_program_is_uniform(layout):
    make_mesh, options = LAYOUTS[layout]
    mesh = make_mesh()
    config = _config(options)
    programs = _programs.Programs(config, _loss, mesh)
    state = _programs.abstract_train_state(config, PARAMS, mesh)
    batch = jax.ShapeDtypeStruct((2 * mesh.size, 6), jnp.float32,
                                 sharding=NamedSharding(mesh, P(config.axis_name)))  # fmt: skip
    flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=NamedSharding(mesh, P()))
    collectives = 0
    for name in _programs.PROGRAMS:
        args = {"dense": (state, batch), "ab": (state, batch, flag)}.get(name, (state, flag))
        with jax.set_mesh(mesh):
            report = comm.check_collective_uniformity(programs._sharded(name), *args)
        collectives += report.collectives
    assert collectives > 0


def test_the_optax_transforms_switch_is_uniform():
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    tx = transforms.ab_transform(_config({}))
    spec = P(_config({}).axis_name)

    def body(grads, state, params):
        grads, state, params = jax.tree.map(lambda x: x[0], (grads, state, params))
        return jax.tree.map(lambda x: x[None], tx.update(grads, state, params))

    sharding = NamedSharding(mesh, spec)
    lead = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct((mesh.size, *x.shape), x.dtype, sharding=sharding), t
    )
    state = jax.eval_shape(tx.init, PARAMS)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    with jax.set_mesh(mesh):
        report = comm.check_collective_uniformity(fn, lead(PARAMS), lead(state), lead(PARAMS))
    assert report.branches > 0  # the step-kind switch holds collectives: proven uniform
