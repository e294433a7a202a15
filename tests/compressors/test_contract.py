"""The contract every codec must keep: static payloads whose bytes on the wire are exactly
``wire_bytes(payload)`` when sent through a collective, jit-ability, zeros stay zeros; for
float32, bfloat16 and float16 inputs, decoded in the input's dtype.

Every row of the codec table (``tests/codecs.py``). The sender's echo at the edges (NaN, Inf,
magnitudes) is checked at the default compile in ``test_contract_echo.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _bits
from jaxcomp import comm
from jaxcomp import compressors

# payload shapes, zeros and HLO collective bytes (the compiled HLO after XLA's passes is the same
# text with optimisations off): XLA optimisations off for the module (suite speed)
pytestmark = pytest.mark.usefixtures("fast_compiles")

SHAPE = (16, 64)  # per device (the codec-level tests' shape: programs shared)


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([("x", 2)], devices=jax.devices()[:2])


def test_hlo_bytes_equal_wire_bytes(codec_case, mesh):
    codec = codec_case.codec
    x = jax.random.normal(jax.random.key(1), (2 * SHAPE[0], SHAPE[1]))
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    f = jax.shard_map(codec_case.exchanged("x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    report = comm.measure_collectives(f, x)
    like = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    expected = compressors.wire_bytes(compressors.payload_shape(codec, like))
    assert report.total_bytes == expected, report.table()
    if codec.name != "identity":
        assert expected < compressors.dense_bytes(like)
        assert "f32" not in report.dtypes() or expected < compressors.dense_bytes(like) / 2


#: known bug this test found (open, issue 36): RandK's 16-bit payloads cross 8 bytes fewer than
#: ``wire_bytes(payload_shape(...))`` says (420 vs 428); strict: passes once fixed
RAND_K_16_BIT_BUGS = {"rand_k", "rand_k_unbiased", "rand_k+quantize4_stochastic"}


def test_16_bit_inputs_decode_to_their_dtype_with_their_payloads_bytes(codec_case, mesh, request):
    """bfloat16 and float16 inputs (float32: the tests above), sent as the library sends a
    payload (``_bits.move_as_bits``: XLA:CPU widens a bfloat16 ``ppermute`` to float32),
    decode to their own dtype, zeros to zeros, and cross with their payload's bytes."""
    if codec_case.name in RAND_K_16_BIT_BUGS:
        reason = "RandK 16-bit: payload_shape's wire bytes differ from what crosses"
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    codec, dtypes = codec_case.codec, (jnp.bfloat16, jnp.float16)

    def send(x):
        payload, _ = codec.compress(x, codec.init(x), jax.random.key(0))
        move = lambda t: lax.ppermute(t, "x", [(0, 1), (1, 0)])  # noqa: E731
        return codec.decompress(_bits.move_as_bits(move, payload), x)

    spec = (P("x"),) * len(dtypes)
    f = jax.jit(jax.shard_map(lambda *xs: tuple(map(send, xs)), mesh=mesh, in_specs=spec,
                              out_specs=spec))  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2 * SHAPE[0], SHAPE[1]))
    xs = [jax.device_put(x.astype(d), NamedSharding(mesh, P("x"))) for d in dtypes]
    report = comm.measure_collectives(f, *xs)
    like = [jax.ShapeDtypeStruct(SHAPE, d) for d in dtypes]
    expected = sum(compressors.wire_bytes(compressors.payload_shape(codec, a)) for a in like)
    assert report.total_bytes == expected, report.table()
    assert [y.dtype for y in f(*xs)] == [jnp.dtype(d) for d in dtypes]
    for y in f(*[jnp.zeros_like(a) for a in xs]):
        np.testing.assert_array_equal(np.asarray(y, np.float32), 0.0)


def test_jit_payload_shapes_and_zeros(codec_case):
    codec = codec_case.codec
    x = jnp.zeros(SHAPE)
    payload, state, y = codec_case.round_trip()(x, jax.random.key(0))
    shapes = compressors.payload_shape(codec, x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), payload) == jax.tree.map(
        lambda a: (a.shape, a.dtype), shapes
    )
    assert jax.tree.structure(state) == jax.tree.structure(codec.init(x))
    np.testing.assert_array_equal(y, np.zeros(SHAPE))
    assert y.dtype == x.dtype


@pytest.mark.codec_rows(lambda case: case.name != "identity")
def test_non_float_input_is_a_type_error(codec_case):
    with pytest.raises(TypeError, match="floating"):
        codec_case.codec.init(jnp.zeros(SHAPE, jnp.int32))
