"""TopK and RandK: hand-worked outputs, exact-K property, blockwise semantics, shared seeds."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from jaxcomp import compressors

KEY = jax.random.key(0)


def roundtrip(codec, x, key=KEY):
    payload, _ = codec.compress(x, codec.init(x), key)
    return payload, codec.decompress(payload, x)


def test_top_k_by_hand():
    x = jnp.array([0.1, -3.0, 0.5, 2.0])
    payload, y = roundtrip(compressors.top_k(count=2), x)
    np.testing.assert_array_equal(payload.values, [-3.0, 2.0])
    np.testing.assert_array_equal(payload.indices, [1, 3])
    assert payload.indices.dtype == jnp.uint8
    np.testing.assert_array_equal(y, [0.0, -3.0, 0.0, 2.0])


def test_top_k_per_sample_by_hand():
    x = jnp.array([[1.0, -5.0, 2.0, 0.0], [3.0, 0.0, -1.0, 4.0]])
    payload, y = roundtrip(compressors.top_k(0.5, per_sample=True), x)
    assert payload.values.shape == (2, 2)
    np.testing.assert_array_equal(y, [[0.0, -5.0, 2.0, 0.0], [3.0, 0.0, 0.0, 4.0]])


def test_kept_count_follows_paper_rule():
    # Rudakov et al.: n_lowest = int(D * (1 - k)); kept = D - n_lowest
    assert compressors.kept_count(65536, 0.1, None) == 65536 - int(65536 * 0.9)
    assert compressors.kept_count(10, 0.05, None) == 1
    assert compressors.kept_count(10, 1.0, None) == 10


def test_index_dtype_grows_with_range():
    for n, dt in [(256, jnp.uint8), (257, jnp.uint16), (65536, jnp.uint16), (65537, jnp.uint32)]:
        payload, _ = roundtrip(compressors.top_k(count=1), jnp.ones(n))
        assert payload.indices.dtype == dt, n


TOPK_EXACT = jax.jit(lambda x: roundtrip(compressors.top_k(count=7), x)[1])


@settings(max_examples=40, deadline=None)
@given(x=hnp.arrays(np.float32, (50,), elements=st.floats(-100, 100, width=32), unique=True))
def test_top_k_keeps_exactly_the_k_largest_magnitudes(x):
    y = np.asarray(TOPK_EXACT(jnp.asarray(x)))
    kept = np.flatnonzero(y != 0)
    expected = np.argsort(-np.abs(x), kind="stable")[:7]
    expected = expected[x[expected] != 0]
    assert set(kept) == set(expected)
    np.testing.assert_array_equal(y[kept], x[kept])


def test_blockwise_keeps_the_top_of_each_block():
    x = jax.random.normal(KEY, (3, 100))
    codec = compressors.top_k(0.1, per_sample=True, method="blockwise", block_size=25)
    payload, y = roundtrip(codec, x)
    # 100 entries, K = 10, 4 blocks of 25 -> ceil(10 / 4) = 3 per block, block-local indices
    assert payload.values.shape == (3, 12) and payload.indices.dtype == jnp.uint8
    xb, yb = np.asarray(x).reshape(3, 4, 25), np.asarray(y).reshape(3, 4, 25)
    for r in range(3):
        for b in range(4):
            top = set(np.argsort(-np.abs(xb[r, b]))[:3])
            assert set(np.flatnonzero(yb[r, b])) == top


def test_blockwise_with_one_per_block_is_blockwise_argmax_and_pads_the_tail():
    x = jax.random.normal(KEY, (103,))
    codec = compressors.top_k(count=11, method="blockwise", block_size=10)
    payload, y = roundtrip(codec, x)
    assert payload.values.shape == (11,)
    xb = np.pad(np.asarray(x), (0, 7)).reshape(11, 10)
    expect = np.zeros_like(xb)
    arg = np.abs(xb).argmax(1)
    expect[np.arange(11), arg] = xb[np.arange(11), arg]
    np.testing.assert_array_equal(y, expect.reshape(-1)[:103])


def test_non_finite_entries_are_always_sent():
    x = jnp.array([1.0, jnp.nan, 5.0, -jnp.inf, 0.5])
    y = np.asarray(roundtrip(compressors.top_k(count=2), x)[1])
    assert np.isnan(y[1]) and np.isneginf(y[3])


def test_rand_k_shared_key_means_shared_positions_and_summable_payloads():
    codec = compressors.rand_k(count=5)
    a, b = jnp.arange(20.0), -2.0 * jnp.arange(20.0)
    pa, ya = roundtrip(codec, a)
    pb, yb = roundtrip(codec, b)
    np.testing.assert_array_equal(pa.seed, pb.seed)
    summed = compressors.RandKPayload(pa.values + pb.values, pa.seed)
    np.testing.assert_allclose(codec.decompress(summed, a), ya + yb)


def test_rand_k_positions_are_one_per_stratum():
    codec = compressors.rand_k(count=4)
    x = jnp.arange(1.0, 11.0)  # strata of sizes 3, 3, 2, 2
    for seed in range(20):
        y = np.asarray(roundtrip(codec, x, jax.random.key(seed))[1])
        kept = np.flatnonzero(y)
        assert len(kept) == 4
        assert [int(i in kept) for i in range(10)].count(1) == 4
        for lo, hi in [(0, 3), (3, 6), (6, 8), (8, 10)]:
            assert np.sum((kept >= lo) & (kept < hi)) == 1
        np.testing.assert_array_equal(y[kept], np.asarray(x)[kept])


def test_rand_k_unbiased_expectation():
    codec = compressors.rand_k(count=3, unbiased=True)
    x = jnp.linspace(-1.0, 2.0, 10)
    f = jax.jit(jax.vmap(lambda k: roundtrip(codec, x, k)[1]))
    np.testing.assert_allclose(f(jax.random.split(KEY, 20000)).mean(0), x, atol=0.06)


@pytest.mark.parametrize(
    "factory, kwargs, match",
    [
        (compressors.top_k, dict(fraction=0.0), "fraction"),
        (compressors.top_k, dict(fraction=1.5), "fraction"),
        (compressors.top_k, dict(), "exactly one"),
        (compressors.top_k, dict(fraction=0.1, count=3), "exactly one"),
        (compressors.top_k, dict(count=0), "count"),
        (compressors.top_k, dict(fraction=0.1, method="approx"), "method"),
        (compressors.top_k, dict(fraction=0.1, block_size=1), "block_size"),
        (compressors.rand_k, dict(fraction=-0.1), "fraction"),
    ],
)
def test_bad_parameters_raise(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)


def test_count_larger_than_tensor_raises():
    codec = compressors.top_k(count=10)
    with pytest.raises(ValueError, match="exceeds"):
        codec.init(jnp.ones(4))


def test_per_sample_needs_a_batch_axis():
    codec = compressors.top_k(0.5, per_sample=True)
    with pytest.raises(ValueError, match="leading batch axis"):
        codec.init(jnp.ones(4))


def test_rand_k_needs_a_key():
    codec = compressors.rand_k(0.5)
    with pytest.raises(ValueError, match="key"):
        codec.compress(jnp.ones(4), codec.init(jnp.ones(4)), None)


def test_rand_k_non_finite_input_poisons_the_payload():
    codec = compressors.rand_k(count=2)
    x = jnp.zeros(100).at[57].set(jnp.inf)
    assert np.all(np.isnan(roundtrip(codec, x)[0].values))
