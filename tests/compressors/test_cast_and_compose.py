"""Identity, 16-bit casts, and codec composition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors

pytestmark = pytest.mark.usefixtures("fast_compiles")

KEY = jax.random.key(0)


def roundtrip(codec, x, key=KEY):
    payload, _ = codec.compress(x, codec.init(x), key)
    return payload, codec.decompress(payload, x)


#: :func:`roundtrip` as one program (eagerly, each of a composition's ~50 operations compiled
#: on its own: ~0.6 s of CPU per test)
jitted_roundtrip = jax.jit(roundtrip, static_argnums=0)


def test_identity_is_exact():
    x = jax.random.normal(KEY, (3, 4))
    payload, y = roundtrip(compressors.identity(), x)
    assert payload is x
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("name, dtype", [("float16", jnp.float16), ("bfloat16", jnp.bfloat16)])
def test_cast_sends_16_bit_words_and_rounds_like_astype(name, dtype):
    x = jax.random.normal(KEY, (64,)) * 100
    payload, y = roundtrip(compressors.cast(name), x)
    assert payload.dtype == jnp.uint16 and payload.shape == x.shape
    np.testing.assert_array_equal(y, x.astype(dtype).astype(jnp.float32))


def test_float16_overflow_becomes_inf_and_nan_stays_nan():
    y = roundtrip(compressors.cast("float16"), jnp.array([1e6, jnp.nan, 1.0]))[1]
    assert np.isinf(y[0]) and np.isnan(y[1]) and y[2] == 1.0


def test_cast_accepts_dtype_objects_and_rejects_others():
    assert compressors.cast(jnp.float16).name == "cast(float16)"
    with pytest.raises(ValueError, match="dtype"):
        compressors.cast("float8")


def test_compose_top_k_values_then_quantize():
    x = jnp.array([0.1, -3.0, 0.5, 2.0, 0.0, 1.0])
    codec = compressors.compose(compressors.top_k(count=3), compressors.quantize(8))
    payload, y = jitted_roundtrip(codec, x)
    assert isinstance(payload.values, compressors.QuantizedPayload)
    assert compressors.wire_bytes(payload) == 3 + 4 + 3  # codes, scale, uint8 indices
    # values [-3, 2, 1] quantized with scale 3: q = round(v / 3 * 128) clipped to [-128, 127]
    vals = np.clip(np.round(np.array([-3.0, 2.0, 1.0]) / 3 * 128), -128, 127) / 128 * 3
    np.testing.assert_allclose(y, [0, vals[0], 0, vals[1], 0, vals[2]], rtol=1e-5)


def test_compose_splits_the_key_for_stochastic_parts():
    codec = compressors.compose(
        compressors.rand_k(count=4), compressors.quantize(4, rounding="stochastic")
    )
    assert codec.stochastic
    x = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    _, y1 = jitted_roundtrip(codec, x, jax.random.key(1))
    _, y2 = jitted_roundtrip(codec, x, jax.random.key(1))
    np.testing.assert_array_equal(y1, y2)


def test_compose_unknown_field():
    codec = compressors.compose(compressors.quantize(4), compressors.quantize(8))
    with pytest.raises(ValueError, match="no field"):
        codec.init(jnp.ones(8))
