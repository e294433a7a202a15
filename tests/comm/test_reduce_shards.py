"""The owners of a sharded hierarchical mean (jaxcomp.comm._reduce_shards): balanced and
deterministic; a device that owns nothing, and leaves of several dtypes (one gather segment
per dtype), give the unsharded mean bit for bit. The codecs' cases: tests/transforms/
test_sharded_pair.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import transforms as T
from jaxcomp.comm import _reduce_shards

PAIR = ("slow", "fast")


def _likes(*shapes, dtype=jnp.float32):
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def test_owners_balance_bytes_largest_first():
    assert _reduce_shards.owners(_likes((4, 4), (16,), (2, 2), (8,)), 2) == (0, 1, 1, 0)
    # fewer arrays than devices: the others own nothing; bf16 counts half the bytes of f32
    assert _reduce_shards.owners(_likes((3,)), 4) == (0,)
    mixed = [*_likes((8,)), *_likes((12,), dtype=jnp.bfloat16)]
    assert _reduce_shards.owners(mixed, 2) == (0, 1)


@pytest.mark.user_numerics
@pytest.mark.parametrize(
    "tree",
    [
        {"w": ((6, 4), "float32")},  # one leaf: three of the four devices own nothing
        {"w": ((6, 4), "float32"), "h": ((4, 4), "bfloat16"), "b": ((4,), "float32")},
    ],
    ids=["one_leaf", "two_dtypes"],  # the second: a gather segment per dtype
)
def test_identity_sharded_equals_unsharded(tree):
    mesh = comm.make_mesh([("slow", 2), ("fast", 4)])
    rng = np.random.default_rng(0)
    grads = {k: jnp.asarray(rng.standard_normal((8, *s)), d) for k, (s, d) in tree.items()}
    g = jax.device_put(grads, NamedSharding(mesh, P(PAIR)))
    means = []
    for shard in (False, True):
        tx = T.compressed_mean(C.identity(), PAIR, shard_fast=shard, min_ndim=0)
        with jax.set_mesh(mesh):
            state = comm.place_state(tx.init(jax.tree.map(lambda x: x[0], grads)), mesh, PAIR)
        specs = comm.state_specs(state, PAIR)

        def body(g, s, tx=tx):
            return tx.update(jax.tree.map(lambda x: x[0], g), s)

        out = (P(), specs)
        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(PAIR), specs), out_specs=out))
        means.append(step(g, state)[0])
    for k in tree:
        assert means[1][k].dtype == grads[k].dtype
        np.testing.assert_array_equal(np.asarray(means[1][k]), np.asarray(means[0][k]), k)
