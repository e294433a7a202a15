"""Quantization and sign codecs: hand-worked outputs, error bounds, packing, bad input."""

import functools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example
from hypothesis import given
from hypothesis import strategies as st

from jaxcomp import compressors
from jaxcomp.compressors import _bitpack

pytestmark = pytest.mark.usefixtures("fast_compiles")

KEY = jax.random.key(0)


@functools.partial(jax.jit, static_argnums=0)
def roundtrip(codec, x, key=KEY):
    """``(payload, decoded)``, jitted: one program per codec and shape (eagerly, each of a round
    trip's 20-50 operations compiled on its own)."""
    payload, _ = codec.compress(x, codec.init(x), key)
    return payload, codec.decompress(payload, x)


def scales(payload):
    """The scales as float64, whatever their wire dtype (bfloat16 travels as uint16 bits)."""
    s = payload.scale
    if s.dtype == jnp.uint16:
        s = jax.lax.bitcast_convert_type(s, jnp.bfloat16)
    return np.asarray(s.astype(jnp.float32), np.float64)


def test_two_bit_tensor_scale_by_hand():
    x = jnp.array([1.0, -0.5, 0.25, 0.0])
    payload, y = roundtrip(compressors.quantize(2), x)
    # h = 2: q = clip(round(x / 1 * 2), -2, 1) = [1, -1, 0, 0]; codes q + 2 = [3, 1, 2, 2]
    np.testing.assert_array_equal(payload.codes, np.array([3 | 1 << 2 | 2 << 4 | 2 << 6], np.uint8))
    np.testing.assert_allclose(y, [0.5, -0.5, 0.0, 0.0])
    assert payload.scale.dtype == jnp.float32 and float(payload.scale) == 1.0


def test_two_bit_minmax_by_hand():
    x = jnp.array([0.0, 1.0, 2.0, 3.0])
    payload, y = roundtrip(compressors.quantize(2, scale="minmax"), x)
    np.testing.assert_array_equal(payload.codes, [0 | 1 << 2 | 2 << 4 | 3 << 6])
    np.testing.assert_array_equal(payload.scale, [0.0, 3.0])
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("scale_dtype", [None, jnp.float16, jnp.float32])
def test_feature_scale_by_hand_acsgd(scale_dtype):
    x = jnp.array([[1.0, -2.0, 0.5], [-4.0, 1.0, 0.25]])
    codec = compressors.quantize(8, scale="feature", axes=(0,), scale_dtype=scale_dtype)
    payload, y = roundtrip(codec, x)
    # bfloat16 by default, sent as its uint16 bits; float16 is AC-SGD's wire format
    wire = {None: jnp.uint16, jnp.float16: jnp.float16, jnp.float32: jnp.float32}[scale_dtype]
    assert payload.scale.dtype == wire
    np.testing.assert_array_equal(scales(payload), [4.0, 2.0, 0.5])
    # the top level clips to h - 1 = 127: 0.5 -> 127/128 * 0.5
    np.testing.assert_allclose(y, [[1.0, -2.0, 127 / 128 * 0.5], [-4.0, 1.0, 0.25]], rtol=1e-6)


def test_scales_are_rounded_outwards_so_nothing_clips_beyond_the_top_level():
    x = jnp.array([[1.0 + 2.0**-10, -3.0], [0.1, 3.0 + 2.0**-9]])  # not bfloat16-representable
    codec = compressors.quantize(8, scale="feature", axes=(0,))
    payload, y = roundtrip(codec, x)
    s = scales(payload)
    assert np.all(s >= np.abs(np.asarray(x)).max(0)) and np.all(s <= 1.01 * np.abs(x).max(0))
    assert np.all(np.abs(np.asarray(y) - np.asarray(x)) <= s / 128)
    payload, y = roundtrip(compressors.quantize(3, scale="minmax", scale_dtype=jnp.bfloat16), x)
    lo, hi = scales(payload)
    assert lo <= float(x.min()) and hi >= float(x.max())


# rows shorter than the fold threshold (the max reduction), odd leading rows folded (the last
# row folded into every row of the half), even rows, two leading axes folded as one, and
# axes that are not leading (the reduction)
FEATURE_PATHS = [((5, 255), (0,)), ((5, 256), (0,)), ((64, 1024), (0,)), ((2, 3, 300), (0, 1))]
FEATURE_PATHS += [((4, 300), (1,))]


@functools.cache
def _feature_round_trip(axes):
    """The jitted round trip of 4-bit feature scales over ``axes``: one function for every case
    of the axes, so that the cases of one shape run the program its first case compiled."""
    codec = compressors.quantize(4, scale="feature", axes=axes, scale_dtype=jnp.float32)
    return jax.jit(lambda x: roundtrip(codec, x))


@pytest.mark.parametrize("bad", ["none", "nan_last", "inf_both_signs"])
@pytest.mark.parametrize("shape, axes", FEATURE_PATHS)
def test_feature_scale_is_the_exact_absmax_on_every_path(shape, axes, bad):
    red = [shape[a] for a in axes]
    rest = [d for i, d in enumerate(shape) if i not in axes]
    rng = np.random.default_rng(0)
    g = rng.standard_normal((math.prod(red), math.prod(rest)))
    g = g * 10.0 ** rng.uniform(-30, 30, g.shape)
    g[-1, ::2] = 1e35 * np.arange(1, g[-1, ::2].size + 1)  # every other max in the last row
    x = np.moveaxis(g.reshape(red + rest), range(len(axes)), axes).copy()
    flat = x.reshape(-1)
    if bad == "nan_last":
        flat[-1] = np.nan
    elif bad == "inf_both_signs":  # two groups: +inf in one, -inf in another
        flat[0], flat[-1] = np.inf, -np.inf
    x = x.astype(np.float32)
    payload, y = _feature_round_trip(axes)(jnp.asarray(x))
    expect = np.abs(x).max(axis=axes)
    if np.isnan(x).any():  # a NaN anywhere: every scale inf
        expect = np.full(expect.shape, np.inf, np.float32)
    np.testing.assert_array_equal(scales(payload), expect)
    y, s = np.asarray(y, np.float64), np.expand_dims(expect, axes)
    ok = np.isfinite(np.broadcast_to(s, x.shape))
    assert np.all(np.abs(y[ok] - x[ok]) <= np.broadcast_to(s, x.shape)[ok] / 8 * (1 + 1e-6))
    assert not np.isfinite(y[~ok]).any()


# the per-tensor scale's paths: below the fold threshold, sizes that 8 rows do not divide (one
# max reduction and a NaN test), and leaves folded as 8 rows (the absmax and NaN in one pass)
TENSOR_PATHS = [(7,), (2047,), (3, 1001), (2048,), (24, 1024)]
_TENSOR_CODEC = compressors.quantize(8, scale_dtype=jnp.float32)
#: one jitted round trip for every case (one compile per shape)
_tensor_round_trip = jax.jit(lambda x: roundtrip(_TENSOR_CODEC, x))


@pytest.mark.parametrize(
    "bad", ["none", "zeros", "nan_first", "nan_last", "inf_both_signs", "huge_both_signs"]
)
@pytest.mark.parametrize("shape", TENSOR_PATHS, ids=str)
def test_tensor_scale_is_the_exact_absmax_on_every_path(shape, bad):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-30, 30, shape)
    flat = x.reshape(-1)
    flat[flat.size // 3] = 7e35  # the max neither first nor last
    if bad == "zeros":
        x[...] = 0.0
    elif bad == "nan_first":
        flat[0] = np.nan
    elif bad == "nan_last":
        flat[-1] = np.nan
    elif bad == "inf_both_signs":
        flat[0], flat[-1] = np.inf, -np.inf
    elif bad == "huge_both_signs":  # finite, but a float32 sum overflows to +inf and to -inf
        flat[: flat.size // 2] = 5e37  # (below 2**126: 1 / scale must stay a normal float)
        flat[flat.size // 2 :] = -5e37
    x = x.astype(np.float32)
    payload, y = _tensor_round_trip(jnp.asarray(x))
    expect = np.inf if np.isnan(x).any() else np.abs(x).max()
    np.testing.assert_array_equal(scales(payload), expect)
    y = np.asarray(y, np.float64)
    if np.isfinite(expect):
        assert np.all(np.abs(y - x) <= expect / 128 * (1 + 1e-6))
    else:  # a NaN or an Inf: every entry decodes non-finite
        assert not np.isfinite(y).any()


def test_feature_scale_over_batch_and_sequence():
    x = jax.random.normal(KEY, (2, 3, 5))
    payload, y = roundtrip(compressors.quantize(8, scale="feature", axes=(0, 1)), x)
    assert payload.scale.shape == (5,)
    s = scales(payload)
    assert np.all(s >= np.abs(np.asarray(x)).max((0, 1)))
    assert np.all(np.abs(np.asarray(y) - np.asarray(x)) <= s / 128 * (1 + 1e-6))


def test_sign_by_hand():
    x = jnp.array([2.0, -1.0, 3.0, -2.0])
    payload, y = roundtrip(compressors.sign(), x)
    np.testing.assert_array_equal(payload.codes, [0b0101])
    np.testing.assert_array_equal(y, [2.0, -2.0, 2.0, -2.0])


@functools.partial(jax.jit, static_argnums=1)
def _pack_unpack(codes, bits):
    """Pack, and unpack what was packed: one program per case (eagerly, ~4 op compiles each)."""
    packed = _bitpack.pack(codes, bits)
    return packed, _bitpack.unpack(packed, codes.shape[0], bits)


@pytest.mark.slow
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 37])
def test_bitpack_roundtrip_and_size(bits, n):
    codes = np.random.default_rng(bits * 64 + n).integers(0, 2**bits, n, np.uint8)
    packed, unpacked = _pack_unpack(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8
    assert packed.shape == (compressors.packed_size(n, bits),)
    assert packed.shape[0] <= math.ceil(n * bits / 8) + 3  # at most one pad byte per part
    np.testing.assert_array_equal(unpacked, codes)


def test_packed_size_is_exact_for_aligned_lengths():
    for bits in range(1, 9):
        assert compressors.packed_size(64, bits) == 64 * bits // 8


FLOATS = hnp.arrays(
    np.float32, (6, 5), elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False)
)


def _jitted(codec):
    return jax.jit(lambda x, k: roundtrip(codec, x, k))


QUANTIZERS = {
    (bits, scale, rounding): _jitted(compressors.quantize(bits, scale=scale, rounding=rounding))
    for bits in (1, 3, 4, 8)
    for scale in ("tensor", "feature", "minmax")
    for rounding in ("nearest", "stochastic")
}


@given(
    x=FLOATS,
    bits=st.sampled_from([1, 3, 4, 8]),
    scale=st.sampled_from(["tensor", "minmax"]),
    rounding=st.sampled_from(["nearest", "stochastic"]),
    seed=st.integers(0, 2**16),
)
def test_quantization_error_bound(x, bits, scale, rounding, seed):
    payload, y = QUANTIZERS[(bits, scale, rounding)](jnp.asarray(x), jax.random.key(seed))
    err = np.abs(np.asarray(y, np.float64) - x)
    if scale == "minmax":
        step = (x.max() - x.min()) / (2**bits - 1)
        bound = step / 2 if rounding == "nearest" else step
    else:
        # one step of s / h (the clipped top level costs a full step even when rounding to nearest)
        bound = float(payload.scale) / 2 ** (bits - 1)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-30)


@given(x=FLOATS, bits=st.sampled_from([1, 3, 4, 8]))
@example(x=np.full((6, 5), np.finfo(np.float32).tiny, np.float32), bits=3)  # found in CI
def test_feature_quantization_error_bound(x, bits):
    """Error within half a quantization step of each feature's scale; a decoded value below
    float32's smallest normal (``tiny``) is flushed to zero by XLA:CPU, so the bound is up to
    ``tiny`` there (every entry ``tiny``, 3 bits: 0.75 * tiny decodes as 0)."""
    payload, y = QUANTIZERS[(bits, "feature", "nearest")](jnp.asarray(x), KEY)
    s = scales(payload)  # the bfloat16 scale that travelled, rounded up from the absmax
    amax = np.abs(x).max(0)
    assert np.all(s >= amax) and np.all(s <= amax * (1 + 2.0**-7))
    err = np.abs(np.asarray(y, np.float64) - x)
    tiny = float(np.finfo(np.float32).tiny)
    assert np.all(err <= s / 2 ** (bits - 1) * (1 + 1e-6) + tiny * (np.abs(y) < tiny))


def test_stochastic_rounding_is_unbiased():
    codec = compressors.quantize(2, rounding="stochastic")
    x = jnp.linspace(-0.9, 0.4, 64)
    f = jax.jit(jax.vmap(lambda k: roundtrip(codec, x, k)[1]))
    mean = f(jax.random.split(KEY, 4000)).mean(0)
    np.testing.assert_allclose(mean, x, atol=0.03)


def test_stochastic_needs_key():
    codec = compressors.quantize(4, rounding="stochastic")
    with pytest.raises(ValueError, match="key"):
        codec.compress(jnp.ones(4), codec.init(jnp.ones(4)), None)


@pytest.mark.parametrize(
    "codec",
    [compressors.quantize(b, scale=s) for b in (1, 4) for s in ("tensor", "feature", "minmax")]
    + [compressors.sign()],
    ids=lambda c: c.name,
)
def test_zeros_decode_to_exact_zeros(codec):
    x = jnp.zeros((4, 3))
    np.testing.assert_array_equal(roundtrip(codec, x)[1], np.zeros((4, 3)))


def test_constant_tensor_minmax_is_exact():
    x = jnp.full((5,), 2.5)
    np.testing.assert_array_equal(roundtrip(compressors.quantize(3, scale="minmax"), x)[1], x)


@pytest.mark.parametrize(
    "codec",
    [compressors.quantize(4), compressors.quantize(4, scale="minmax"), compressors.sign()],
    ids=lambda c: c.name,
)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_is_never_made_finite(codec, bad):
    x = jnp.array([1.0, bad, -2.0, 0.5])
    y = np.asarray(roundtrip(codec, x)[1])
    assert not np.all(np.isfinite(y))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=0), "bits"),
        (dict(bits=9), "bits"),
        (dict(bits=2.5), "bits"),
        (dict(scale="row"), "scale"),
        (dict(rounding="up"), "rounding"),
        (dict(scale_dtype=jnp.int8), "scale_dtype"),
        (dict(scale_dtype=jnp.float64), "scale_dtype"),
        (dict(scale_dtype="nonsense"), "scale_dtype"),
    ],
)
def test_bad_parameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compressors.quantize(**kwargs)


def test_sign_bad_scale():
    with pytest.raises(ValueError, match="scale"):
        compressors.sign(scale="max")


@pytest.mark.parametrize(
    "codec", [compressors.quantize(4), compressors.sign()], ids=lambda c: c.name
)
def test_integer_input_is_a_type_error(codec):
    with pytest.raises(TypeError, match="floating"):
        codec.compress(jnp.arange(4), codec.init(jnp.zeros(4)), None)
