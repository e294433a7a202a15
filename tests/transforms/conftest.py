"""Fixtures of the transforms' (slow, fast) axis-pair tests."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm

SLOW, FAST = "slow", "fast"


@pytest.fixture(scope="module")
def pair_mesh():
    """A 2 x 4 ``(slow, fast)`` mesh: 2 hosts of 4 devices."""
    return comm.make_mesh([(SLOW, 2), (FAST, 4)])


@pytest.fixture(scope="session")
def pair_grads():
    """``pair_grads(shape)``: each of the 8 workers' gradient of a dense layer, ``{"w": [8,
    *shape], "b": [8, shape[1]]}`` float32 standard normal (seed 0, drawn ``w`` first)."""

    def make(shape):
        rng = np.random.default_rng(0)
        return {
            "w": rng.standard_normal((8, *shape)).astype(np.float32),
            "b": rng.standard_normal((8, shape[1])).astype(np.float32),
        }

    return make


@pytest.fixture(scope="session")
def pair_update():
    """``pair_update(tx, mesh, data_axes, state_axis, grads)``: the jitted ``shard_map``'d
    ``tx.update`` of each worker's gradient, its state placed over ``state_axis``, and the
    sharding of the ``[workers, ...]`` gradients over ``data_axes``."""

    def setup(tx, mesh, data_axes, state_axis, grads):
        with jax.set_mesh(mesh):
            state = comm.place_state(tx.init(jax.tree.map(lambda x: x[0], grads)), mesh, state_axis)
        specs = comm.state_specs(state, state_axis)

        def body(g, s):
            return tx.update(jax.tree.map(lambda x: x[0], g), s)

        step = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(data_axes), specs), out_specs=(P(), specs))
        )
        return step, state, NamedSharding(mesh, P(data_axes))

    return setup
