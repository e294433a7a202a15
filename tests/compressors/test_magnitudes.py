"""Magnitudes (issue 9 item 3): the relative error of every quantizing codec stays within its
theoretical bound from 1e-30 to 3e38 (1e-10 ... 1e6 is the range gradients and activations
span), and float16's documented limits (scales and casts) hold exactly as documented.

Before: ``quantize``'s ``+1e-6`` in the divisor gave relative error 0.2 at magnitude 1e-6 and
~1 at 1e-8, and float16 feature scales turned inputs above 65504 into NaN features."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors as C

pytestmark = pytest.mark.user_numerics

MAGNITUDES = (1e-30, 1e-10, 1e-8, 1e-6, 1e-3, 1.0, 1e3, 1e6, 1e30)
# near float32's largest, for the quantizers and TopK: 5e37 and 8e37 put |x| up to 2e38 and
# 3.1e38, scales above 2**126 (their float32 reciprocal is subnormal, flushed to 0 on XLA:CPU:
# every code was the midpoint) and a min-max span past the float32 range (+-3.1e38); 1e37: a
# sum that overflows both ways (was taken for a NaN: min-max decoded every entry as NaN).
# sign's mean_abs sum and PowerSGD's M Q and M^T P overflowed there until session 16 (now
# recomputed from M scaled by a power of two).
HUGE = (1e37, 5e37, 8e37)
# XLA:CPU reads and writes subnormals (below 2**-126 ~ 1.2e-38) as zero: at 1e-38 about half
# the entries of X * 1e-38 are subnormal, at 1e-40 all of them
TINY = (1e-38, 1e-40)
SHAPE = (16, 64)


def _base_input():
    x = np.random.default_rng(0).standard_normal(SHAPE)
    x[:, 5] *= 1e-3  # one small feature column: feature scales must follow it
    return x


X = _base_input()


def _jit_roundtrip(codec):
    @jax.jit
    def f(x, key):
        payload, _ = codec.compress(x, codec.init(x), key)
        return codec.decompress(payload, x)

    return f


def _scaled(magnitude):
    """``X * magnitude`` in float32, and that float32 array in float64 for the reference."""
    x = jnp.asarray(X * magnitude, jnp.float32)
    return x, np.asarray(x, np.float64)


@pytest.mark.codec_rows(lambda case: case.bound is not None)
@pytest.mark.parametrize("magnitude", MAGNITUDES + HUGE, ids=lambda m: f"{m:g}")
def test_quantizer_error_within_its_bound_at_every_magnitude(codec_case, magnitude):
    """Every row of the codec table with a per-entry bound (``tests/codecs.py``)."""
    bound = codec_case.bound
    x, x64 = _scaled(magnitude)
    y = np.asarray(codec_case.received()(x, jax.random.key(3)), np.float64)
    err = np.abs(y - x64)
    # plus float32 rounding of the decoded value (about 2**-24 of it)
    assert np.all(err <= bound(x64) + np.abs(x64) * 2.0**-22), np.max(err / bound(x64))
    # and the error is not trivially small: the codec really quantizes at this magnitude
    if not codec_case.name.startswith("cast"):
        assert np.max(err / np.abs(x64).max()) > 1e-4


@pytest.mark.parametrize("scale", ["mean_abs", "rms"])
def test_sign_relative_error_does_not_depend_on_magnitude(scale):
    codec = C.sign(scale=scale)
    f = _jit_roundtrip(codec)
    rel = []
    for magnitude in MAGNITUDES + HUGE:
        x, x64 = _scaled(magnitude)
        y = np.asarray(f(x, None), np.float64)
        s = np.abs(x64).mean() if scale == "mean_abs" else np.sqrt(np.mean(x64**2))
        np.testing.assert_allclose(y, s * np.where(x64 >= 0, 1.0, -1.0), rtol=1e-5)
        rel.append(np.linalg.norm(y - x64) / np.linalg.norm(x64))
    np.testing.assert_allclose(rel, rel[MAGNITUDES.index(1.0)], rtol=1e-5)
    for magnitude in TINY:  # a scale below 2**-126 is flushed: zeros, never garbage
        x, x64 = _scaled(magnitude)
        y = np.asarray(f(x, None), np.float64)
        s = np.abs(x64).mean() if scale == "mean_abs" else np.sqrt(np.mean(x64**2))
        assert s < 2.0**-126 and np.all(y == 0.0), (magnitude, s, np.abs(y).max())


def test_top_k_sends_kept_values_exactly_at_every_magnitude():
    f = _jit_roundtrip(C.top_k(0.1))
    kept_at_one = None
    for magnitude in MAGNITUDES + HUGE:
        x, x64 = _scaled(magnitude)
        y = np.asarray(f(x, None), np.float64)
        kept = y != 0
        np.testing.assert_array_equal(y[kept], x64[kept])
        if kept_at_one is None:
            kept_at_one = kept
        np.testing.assert_array_equal(kept, kept_at_one)


@pytest.mark.parametrize("rank", [1, 2])
def test_power_sgd_relative_error_does_not_depend_on_magnitude(rank):
    codec = C.power_sgd(rank)
    step = jax.jit(lambda x, s: codec.compress(x, s, None))
    rel = {}
    for magnitude in MAGNITUDES + HUGE + TINY:
        x, x64 = _scaled(magnitude)
        state = codec.init(x)
        for _ in range(3):  # the warm start must not square the magnitude
            payload, state = step(x, state)
            y = np.asarray(codec.decompress(payload, x), np.float64)
            rel.setdefault(magnitude, []).append(np.linalg.norm(y - x64) / np.linalg.norm(x64))
        assert np.isfinite(np.asarray(state.q)).all()
    want = rel[1.0]
    u, s, vt = np.linalg.svd(X)
    best = np.sqrt(np.sum(s[rank:] ** 2)) / np.linalg.norm(X)
    assert best <= min(want) and max(want) < 1.0
    for magnitude in MAGNITUDES + HUGE:
        np.testing.assert_allclose(rel[magnitude], want, rtol=1e-4, err_msg=f"{magnitude:g}")
    for magnitude in TINY:  # entries below 2**-126 read as zero: a projection of what is left
        assert max(rel[magnitude]) <= 1.0 + 1e-6, (magnitude, rel[magnitude])


# error feedback around sign and PowerSGD: c = x + e and c - x_hat at every magnitude where c
# fits float32 (x repeated: |c| grows to a few |x|; at 5e37 and above c overflows, an inf that
# the step's finiteness checks see)
FEEDBACK_MAGNITUDES = MAGNITUDES + (1e37,)
FEEDBACK_CODECS = {
    "sign_mean_abs": C.sign(),
    "sign_rms": C.sign(scale="rms"),
    "power_sgd1": C.power_sgd(1),
    "power_sgd2": C.power_sgd(2),
}


@functools.cache
def _jit_send(channel):
    """The channel's jitted send: one function per channel, so that every magnitude runs the
    program the first one compiled (the inputs' shapes and dtypes are the same)."""
    return jax.jit(lambda x, s: channel.send(x, s, None))


def _feedback_run(channel, magnitude, steps=3):
    """Decoded outputs and the final sender state over ``steps`` sends of ``X * magnitude``."""
    x, _ = _scaled(magnitude)
    send_state, recv_state = channel.init(x)
    send = _jit_send(channel)
    out = []
    for _ in range(steps):
        payload, send_state = send(x, send_state)
        y, recv_state = channel.receive(payload, recv_state, x)
        out.append(np.asarray(y, np.float64) / magnitude)
    return out, send_state


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["error_feedback", "ef21"])
@pytest.mark.parametrize("name", sorted(FEEDBACK_CODECS))
def test_feedback_around_sign_and_power_sgd_does_not_depend_on_magnitude(name, kind):
    from jaxcomp import feedback

    channel = getattr(feedback, kind)(FEEDBACK_CODECS[name])
    want, _ = _feedback_run(channel, 1.0)
    for magnitude in FEEDBACK_MAGNITUDES:
        got, state = _feedback_run(channel, magnitude)
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(state))
        for step, (g, w) in enumerate(zip(got, want)):
            err = np.linalg.norm(g - w) / np.linalg.norm(w)
            assert err < 1e-4, (magnitude, step, err)


# ----------------------------------------------------------------------------------------------
# float16: what happens outside its range is documented; these tests hold the documentation


def test_float16_feature_scales_documented_range():
    codec = C.quantize(8, scale="feature", scale_dtype=jnp.float16)
    f = _jit_roundtrip(codec)
    for magnitude in (0.1, 1.0, 1e3):  # group maxima inside [6.1e-5, 65504]: the bound holds
        x, x64 = _scaled(magnitude)
        err = np.abs(np.asarray(f(x, None), np.float64) - x64)
        bound = np.abs(x64).max(0, keepdims=True) * (1 + 2.0**-10) / 2**7  # one step
        assert np.all(err <= bound * (1 + 1e-6))
    # a column whose max exceeds 65504: infinite scale, that column decodes non-finite
    x = jnp.asarray(X, jnp.float32).at[2, 7].set(7e4)
    y = np.asarray(f(x, None))
    assert not np.isfinite(y[:, 7]).any() and np.isfinite(np.delete(y, 7, axis=1)).all()
    # below 6.1e-5 the scale is subnormal, a multiple of 2**-24: absolute error up to 2**-24 / h
    x, x64 = _scaled(1e-10)
    y = np.asarray(f(x, None), np.float64)
    assert np.all(np.abs(y - x64) <= 2.0**-24 / 128 * (1 + 1e-6))
    assert np.max(np.abs(y - x64) / np.abs(x64).max()) > 0.1  # the documented loss


def test_float16_cast_documented_range():
    codec = C.cast("float16")
    f = _jit_roundtrip(codec)
    x, x64 = _scaled(1e3)  # normal range: relative error <= 2**-11 (round to nearest)
    y = np.asarray(f(x, None), np.float64)
    np.testing.assert_array_less(np.abs(y - x64), np.abs(x64) * 2.0**-11 * (1 + 1e-6) + 1e-30)
    big = jnp.array([65504.0, 65519.0, 65520.0, -1e6, 1e30])
    np.testing.assert_array_equal(f(big, None), [65504.0, 65504.0, np.inf, -np.inf, np.inf])
    tiny = jnp.array([1e-5, 1e-8, 2.9e-8, -1e-10])  # subnormal, then flushed to +-0
    y = np.asarray(f(tiny, None))
    assert abs(y[0] - 1e-5) <= 2.0**-25 and y[1] == 0.0 and y[2] == 0.0 and y[3] == 0.0
