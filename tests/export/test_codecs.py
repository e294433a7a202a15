"""Every codec's payload crosses a collective in its own dtypes in the cuda and tpu programs."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors as C

CODECS = [
    C.identity(),
    C.cast("float16"),
    C.cast("bfloat16"),
    *(C.quantize(b) for b in (1, 2, 4, 8)),
    C.quantize(4, scale="feature", axes=(0,)),
    C.quantize(2, scale="minmax"),
    C.quantize(8, rounding="stochastic"),
    C.sign(),
    C.top_k(0.1),
    C.top_k(0.25, per_sample=True),
    C.top_k(0.1, method="blockwise", block_size=64),
    C.rand_k(0.1),
    C.power_sgd(2),
    C.compose(C.top_k(0.1), C.quantize(8)),
]
SHAPE = (16, 48)  # per device


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([("x", 2)], devices=jax.devices()[:2])


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_codec_payload_dtypes_on_the_exported_collective(codec, mesh, lowering):
    def send(x):  # compress, send to the other device, decode
        payload, _ = codec.compress(x, codec.init(x), jax.random.key(0))
        payload = jax.tree.map(lambda a: lax.ppermute(a, "x", [(0, 1), (1, 0)]), payload)
        return codec.decompress(payload, x)

    f = jax.shard_map(send, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
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
