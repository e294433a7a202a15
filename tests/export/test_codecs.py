"""Every codec's payload (each row of ``tests/codecs.py``) crosses a collective in its own
dtypes in the cuda and tpu programs."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors as C

SHAPE = (16, 64)  # per device


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([("x", 2)], devices=jax.devices()[:2])


def test_codec_payload_dtypes_on_the_exported_collective(codec_case, mesh, lowering):
    codec = codec_case.codec
    f = jax.shard_map(codec_case.exchanged("x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = jax.ShapeDtypeStruct(
        (2 * SHAPE[0], SHAPE[1]), jnp.float32, sharding=NamedSharding(mesh, P("x"))
    )
    found = lowering.collectives(lowering.export(f, x, mesh=mesh))
    like = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    payload = C.payload_shape(codec, like)
    expected = sorted(lowering.tensor_type(a.shape, a.dtype) for a in jax.tree.leaves(payload))
    assert sorted(t for k, t in found if k == "collective_permute") == expected, found
    if codec.name != "identity":
        assert ("collective_permute", lowering.tensor_type(SHAPE, jnp.float32)) not in found
