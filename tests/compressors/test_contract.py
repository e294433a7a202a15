"""The contract every codec must keep: static payloads whose bytes on the wire are exactly
``wire_bytes(payload)`` when sent through a collective, jit-ability, zeros stay zeros.

The sender's echo at the edges (NaN, Inf, magnitudes) is checked at the default compile in
``test_contract_echo.py``, over this file's :data:`CODECS`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors

# payload shapes, zeros and HLO collective bytes (the compiled HLO after XLA's passes is the same
# text with optimisations off): XLA optimisations off for the module (suite speed)
pytestmark = pytest.mark.usefixtures("fast_compiles")

CODECS = [
    compressors.identity(),
    compressors.cast("float16"),
    compressors.cast("bfloat16"),
    *(compressors.quantize(b) for b in (1, 2, 3, 4, 5, 8)),
    compressors.quantize(4, scale="feature", axes=(0,)),
    compressors.quantize(2, scale="minmax"),
    compressors.quantize(8, rounding="stochastic"),
    compressors.sign(),
    compressors.top_k(0.1),
    compressors.top_k(0.25, per_sample=True),
    compressors.top_k(0.1, method="blockwise", block_size=64),
    compressors.top_k(count=8, method="blockwise", block_size=64),
    compressors.rand_k(0.1),
    compressors.power_sgd(2),
    compressors.compose(compressors.top_k(0.1), compressors.quantize(8)),
]
SHAPE = (16, 48)  # per device


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([("x", 2)], devices=jax.devices()[:2])


def _send(codec):
    def f(x):
        payload, _ = codec.compress(x, codec.init(x), jax.random.key(0))
        payload = jax.tree.map(lambda a: lax.ppermute(a, "x", [(0, 1), (1, 0)]), payload)
        return codec.decompress(payload, x)

    return f


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_hlo_bytes_equal_wire_bytes(codec, mesh):
    x = jax.random.normal(jax.random.key(1), (2 * SHAPE[0], SHAPE[1]))
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    f = jax.shard_map(_send(codec), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    report = comm.measure_collectives(f, x)
    like = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    expected = compressors.wire_bytes(compressors.payload_shape(codec, like))
    assert report.total_bytes == expected, report.table()
    if codec.name != "identity":
        assert expected < compressors.dense_bytes(like)
        assert "f32" not in report.dtypes() or expected < compressors.dense_bytes(like) / 2


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_jit_payload_shapes_and_zeros(codec):
    x = jnp.zeros(SHAPE)

    @jax.jit
    def roundtrip(x, key):
        payload, state = codec.compress(x, codec.init(x), key)
        return payload, state, codec.decompress(payload, x)

    payload, state, y = roundtrip(x, jax.random.key(0))
    shapes = compressors.payload_shape(codec, x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), payload) == jax.tree.map(
        lambda a: (a.shape, a.dtype), shapes
    )
    assert jax.tree.structure(state) == jax.tree.structure(codec.init(x))
    np.testing.assert_array_equal(y, np.zeros(SHAPE))
    assert y.dtype == x.dtype


@pytest.mark.parametrize("codec", CODECS[1:], ids=lambda c: c.name)
def test_non_float_input_is_a_type_error(codec):
    with pytest.raises(TypeError, match="floating"):
        codec.init(jnp.zeros(SHAPE, jnp.int32))
