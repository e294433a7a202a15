"""The timed data-parallel step of ``bench data_parallel``: ``tx.update`` inside ``shard_map``
over the workers, its state placed (and donated) as in a training step."""

from __future__ import annotations

from jaxcomp.bench import _common

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomp import comm  # noqa: E402


class _Step:
    """A jitted data-parallel ``tx.update`` with its initial state and per-worker gradients.

    ``optimizer=False`` times the reducer alone; ``donate=True`` threads the state through
    calls with its buffers donated, as a training step does (then call it with no arguments).
    """

    def __init__(self, reducer, params, mesh, *, optimizer=True, donate=False):
        self.tx = optax.chain(reducer, optax.sgd(0.1, momentum=0.9)) if optimizer else reducer
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
        with jax.set_mesh(mesh):  # the two-phase path sizes its state by the workers
            state = jax.jit(self.tx.init)(zeros)
        specs = comm.state_specs(state, comm.DATA)
        self.state = comm.place_state(state, mesh, comm.DATA)
        self.params = jax.device_put(zeros, NamedSharding(mesh, P()))

        def body(params, state, grads):
            local = jax.tree.map(lambda g: g[0], grads)
            updates, state = self.tx.update(local, state, params)
            return state, updates

        out = (specs, P())
        in_specs = (P(), specs, P(comm.DATA))
        sharded = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out)
        # JAX pairs each donated buffer with the first unpaired output of its shape and
        # sharding, in output order: the new state comes first, so each state leaf gets its
        # own buffer back. With the updates first (even with out_shardings) an update took a
        # state leaf's buffer of the same shape (EF21's mean, momentum's trace), and with the
        # optimizer EF21's leaves were crossed: the trace copied at entry, the mean copied
        # to the trace's buffer (two 8 MiB copies per leaf that a training step does not pay)
        shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, spec), out, is_leaf=lambda x: isinstance(x, P)
        )
        jitted = jax.jit(sharded, donate_argnums=(1,) if donate else (), out_shardings=shardings)

        def fn(params, state, grads):
            state, updates = jitted(params, state, grads)
            return updates, state

        self.fn = fn

    def args(self, grads):
        return self.params, self.state, grads

    def threaded(self, grads):
        """A no-argument call that runs one step and keeps the new (donated) state."""

        def call():
            updates, self.state = self.fn(self.params, self.state, grads)
            return updates

        return call


def worker_grads(params, mesh, seed=0):
    """Per-worker Gaussian gradients ``[W, *shape]``, sharded over the data axis."""
    w = mesh.shape[comm.DATA]
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    sharding = NamedSharding(mesh, P(comm.DATA))
    out = [
        jax.jit(
            lambda k, s=s: jax.random.normal(k, (w, *s.shape), s.dtype), out_shardings=sharding
        )(k)
        for k, s in zip(keys, leaves)
    ]
    return jax.tree.unflatten(treedef, out)
