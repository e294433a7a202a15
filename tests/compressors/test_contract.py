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


def test_payloads_cross_with_their_bytes_and_decode_to_their_dtype(codec_case, mesh):
    """float32, bfloat16 and float16 inputs, in one program (a compile per row): the payloads'
    bytes on the collectives are exactly ``wire_bytes`` of them, and each decodes to its own
    dtype, zeros to zeros. The float32 payload crosses as it is (a ``ppermute`` per leaf: a
    codec's float32 payload holds only leaves that cross at their width); the 16-bit ones as the
    library sends a payload (``_bits.move_as_bits``: XLA:CPU widens a bfloat16 ``ppermute`` to
    float32). Each input has its own key, as each leaf of a transform: two payloads made with
    one key hold the same RandK seed, which XLA sends once (420 bytes for 428, until
    2026-12-05)."""
    codec, dtypes = codec_case.codec, (jnp.float32, jnp.bfloat16, jnp.float16)

    def send(x, i):
        payload, _ = codec.compress(x, codec.init(x), jax.random.key(i))
        move = lambda t: lax.ppermute(t, "x", [(0, 1), (1, 0)])  # noqa: E731
        if x.dtype == jnp.float32:
            return codec.decompress(jax.tree.map(move, payload), x)
        return codec.decompress(_bits.move_as_bits(move, payload), x)

    spec = (P("x"),) * len(dtypes)
    f = jax.jit(jax.shard_map(lambda *xs: tuple(map(send, xs, range(len(xs)))), mesh=mesh,
                              in_specs=spec, out_specs=spec))  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2 * SHAPE[0], SHAPE[1]))
    xs = [jax.device_put(x.astype(d), NamedSharding(mesh, P("x"))) for d in dtypes]
    report = comm.measure_collectives(f, *xs)
    like = [jax.ShapeDtypeStruct(SHAPE, d) for d in dtypes]
    expected = [compressors.wire_bytes(compressors.payload_shape(codec, a)) for a in like]
    assert report.total_bytes == sum(expected), report.table()
    if codec.name != "identity":  # the float32 input's payload is smaller than its input
        dense = compressors.dense_bytes(like[0])
        assert expected[0] < dense
        assert "f32" not in report.dtypes() or expected[0] < dense / 2
    assert [y.dtype for y in f(*xs)] == [jnp.dtype(d) for d in dtypes]
    for y in f(*[jnp.zeros_like(a) for a in xs]):
        np.testing.assert_array_equal(np.asarray(y, np.float32), 0.0)


def test_jit_payload_shapes_and_state_structure(codec_case):
    """The jitted round trip's payload has ``payload_shape``'s shapes and dtypes, its state
    ``init``'s structure: traced abstractly, as ``jit`` fixes them before compiling (the
    compiled programs, and zeros decoded to zeros in the input's dtype: the test above)."""
    codec = codec_case.codec
    x = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    payload, state, y = jax.eval_shape(codec_case.round_trip(), x, jax.random.key(0))
    shapes = compressors.payload_shape(codec, x)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), payload) == jax.tree.map(
        lambda a: (a.shape, a.dtype), shapes
    )
    assert jax.tree.structure(state) == jax.tree.structure(jax.eval_shape(codec.init, x))
    assert (y.shape, y.dtype) == (x.shape, x.dtype)


@pytest.mark.codec_rows(lambda case: case.name != "identity")
def test_non_float_input_is_a_type_error(codec_case):
    with pytest.raises(TypeError, match="floating"):
        codec_case.codec.init(jnp.zeros(SHAPE, jnp.int32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8_e4m3fn"])
def test_reduced_bytes_are_what_a_psum_sends(dtype, mesh):
    """``reduced_bytes`` (the meter of every reduction) is what a ``psum`` of the dtype holds
    in the compiled program: the CPU backend widens bfloat16 to float32 and 8-bit floats to
    float16, inside the program as outside."""
    from jaxcomp.compressors import _protocol

    like = jax.ShapeDtypeStruct((16,), jnp.dtype(dtype))

    def body(x):
        return lax.psum(x, "x"), jnp.asarray(_protocol.reduced_bytes(like), jnp.float32)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P(), P())))
    x = jnp.ones((32,), dtype)
    report = comm.measure_collectives(f, x)
    assert report.total_bytes == float(f(x)[1]) == float(_protocol.reduced_bytes(like))
    assert float(f(x)[1]) == 16 * {"bfloat16": 4, "float8_e4m3fn": 2}.get(
        dtype, like.dtype.itemsize
    )
