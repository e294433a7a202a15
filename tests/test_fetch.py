"""fetch: host copies of whole values, whatever the layout (across processes:
tests/train/test_two_processes.py, whose AB-Training case fetches per-worker metrics sharded
over both processes)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _fetch
from jaxcomp import comm


def test_every_layout_comes_back_whole():
    mesh = comm.make_mesh([(comm.DATA, 4)], devices=jax.devices()[:4])
    per_worker = jax.device_put(np.arange(8.0).reshape(4, 2), NamedSharding(mesh, P(comm.DATA)))
    tree = {
        "sharded": per_worker,
        "replicated": jax.device_put(jnp.int32(3), NamedSharding(mesh, P())),
        "host": np.ones(2, np.float32),
        "scalar": 1.5,
    }
    assert all(_fetch.is_local(x) for x in jax.tree.leaves(tree))  # one process holds all
    out = _fetch.fetch(tree)
    assert all(type(x) is np.ndarray for x in jax.tree.leaves(out))
    np.testing.assert_array_equal(out["sharded"], np.arange(8.0).reshape(4, 2))
    assert out["replicated"] == 3 and out["replicated"].dtype == np.int32
    np.testing.assert_array_equal(out["host"], np.ones(2))
    assert out["scalar"] == 1.5
