"""TopK by rows (``top_k(..., row_axis=a)``): the K largest magnitudes of every row along one
axis, so that no row holding a nonzero entry decodes to all zero (issue 35's blow-up). The
contract (bytes on the wire, zeros, non-finite entries, magnitudes) is the codec table's
``top_k_rows`` rows; here: the selection, the payload's layout and the edges of the row length."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors
from jaxcomp.compressors import _base

pytestmark = pytest.mark.usefixtures("fast_compiles")

X3 = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)


@functools.cache
def _round_trip(fraction, count, row_axis):
    codec = compressors.top_k(fraction, count=count, row_axis=row_axis)

    @jax.jit
    def f(x):
        payload, _ = codec.compress(x, codec.init(x), None)
        return payload, codec.decompress(payload, x)

    return codec, f


def _reference(x, axis, k):
    """numpy: each row along ``axis`` keeps its K largest magnitudes (lowest index on ties)."""
    rows = np.moveaxis(x, axis, -1)
    idx = np.sort(np.argsort(-np.abs(rows), axis=-1, kind="stable")[..., :k], axis=-1)
    dense = np.zeros_like(rows)
    np.put_along_axis(dense, idx, np.take_along_axis(rows, idx, -1), -1)
    return np.take_along_axis(rows, idx, -1), idx, np.moveaxis(dense, -1, axis)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_each_row_along_the_axis_keeps_its_k_largest(axis):
    _, f = _round_trip(None, 2, axis)
    payload, y = f(jnp.asarray(X3))
    values, idx, dense = _reference(X3, axis, 2)
    # the payload is the input's shape with the row axis replaced by K, moved last
    assert payload.values.shape == values.shape and payload.indices.dtype == jnp.uint8
    np.testing.assert_array_equal(payload.values, values)
    np.testing.assert_array_equal(payload.indices, idx)
    np.testing.assert_array_equal(y, dense)


def test_no_row_is_all_zero_where_per_sample_top_k_zeroes_it():
    # token rows of one sample at very different scales: per-sample TopK 10% spends every
    # kept entry on the large rows and zeroes the small ones (LayerNorm then divides by
    # sqrt(eps)); TopK by rows keeps ceil-ish 10% of each row (here 2 of 16)
    x = np.random.default_rng(1).standard_normal((1, 8, 16)).astype(np.float32)
    x[0, 4:] *= 1e-3
    per_sample = compressors.top_k(0.1, per_sample=True)
    zero_ps = np.all(np.asarray(jax.jit(lambda a: _decoded(per_sample, a))(x)) == 0, axis=-1)
    assert zero_ps[0, 4:].all()  # the premise: per-sample TopK leaves those rows all zero
    codec, f = _round_trip(0.1, None, -1)
    payload, y = f(jnp.asarray(x))
    assert payload.values.shape == (1, 8, 2)
    assert not np.any(np.all(np.asarray(y) == 0, axis=-1))
    np.testing.assert_array_equal(y, _reference(x, -1, 2)[2])


def _decoded(codec, x):
    return codec.decompress(codec.compress(x, codec.init(x), None)[0], x)


def test_a_fraction_that_rounds_to_zero_in_a_row_keeps_one():
    # 1% of a row of 8 is 0.08 entries: at least 1 per row, so every row stays nonzero
    _, f = _round_trip(0.01, None, -1)
    payload, y = f(jnp.asarray(X3))
    assert payload.values.shape == (2, 3, 1)
    np.testing.assert_array_equal(y, _reference(X3, -1, 1)[2])


def test_rows_of_length_one_are_sent_whole():
    x = X3.reshape(48, 1)
    _, f = _round_trip(0.1, None, -1)
    payload, y = f(jnp.asarray(x))
    assert payload.values.shape == (48, 1)
    np.testing.assert_array_equal(y, x)


def test_a_one_dimensional_input_is_one_row_the_global_top_k():
    x = X3.reshape(-1)
    _, f = _round_trip(None, 5, 0)
    payload, y = f(jnp.asarray(x))
    assert payload.values.shape == (5,)
    np.testing.assert_array_equal(y, _decoded(compressors.top_k(count=5), jnp.asarray(x)))


def test_zero_size_inputs_give_empty_payloads():
    codec = compressors.top_k(0.1, row_axis=-1)
    for shape, payload_shape in [((0, 8), (0, 1)), ((4, 0), (4, 0)), ((2, 0, 3), (2, 0, 1))]:
        x = jnp.zeros(shape)
        payload, _ = codec.compress(x, codec.init(x), None)
        assert payload.values.shape == payload_shape, shape
        assert codec.decompress(payload, x).shape == shape


def test_same_fraction_sends_fewer_bytes_than_per_sample_top_k_on_token_rows():
    # the GPT pipeline's boundary, one microbatch [8, 32, 64]: per sample K = 205 of 2048
    # with uint16 indices (1,230 B a sample), by rows 7 of 64 with uint8 ones (1,120 B)
    like = jax.ShapeDtypeStruct((8, 32, 64), jnp.float32)
    per_sample = compressors.top_k(0.1, per_sample=True)
    rows = compressors.top_k(0.1, row_axis=-1)
    sizes = [_base.wire_bytes(_base.payload_shape(c, like)) for c in (per_sample, rows)]
    assert sizes == [8 * 205 * 6, 8 * 32 * 7 * 5]


@pytest.mark.parametrize(
    "kwargs, shape, match",
    [
        (dict(count=9, row_axis=-1), (4, 8), "count=9 exceeds the 8 entries"),
        (dict(fraction=0.1, row_axis=2), (4, 8), "row_axis=2 is out of range for"),
        (dict(fraction=0.1, row_axis=-3), (4, 8), "row_axis=-3 is out of range for"),
        (dict(fraction=0.1, row_axis=0), (), "row_axis=0 is out of range for"),
    ],
)
def test_bad_row_lengths_and_axes_name_the_problem(kwargs, shape, match):
    codec = compressors.top_k(**kwargs)
    with pytest.raises(ValueError, match=match):
        codec.init(jnp.zeros(shape))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fraction=0.1, row_axis=-1, per_sample=True), "per_sample or row_axis"),
        (dict(fraction=0.1, row_axis=1.0), "row_axis must be None or an integer"),
        (dict(fraction=0.1, row_axis=True), "row_axis must be None or an integer"),
    ],
)
def test_bad_parameters_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compressors.top_k(**kwargs)


def test_a_damaged_index_past_its_row_is_dropped_not_written_into_the_next_row():
    codec, f = _round_trip(None, 2, -1)
    x = jnp.asarray(X3)
    payload, y = f(x)
    bad = payload._replace(indices=payload.indices.at[0, 0, 1].set(8 + 3))
    z = np.asarray(codec.decompress(bad, x))
    expect = np.asarray(y).copy()
    expect[0, 0, int(payload.indices[0, 0, 1])] = 0.0
    np.testing.assert_array_equal(z, expect)


@pytest.mark.parametrize("axis", [-1, 0])
def test_decode_sum_and_add_decoded_equal_the_dense_decode(axis):
    # the fast paths a receiver of gathered payloads and error feedback use scatter at flat
    # positions of the rows' layout: back in the input's layout for any axis
    codec, f = _round_trip(None, 2, axis)
    x, other = X3, np.ascontiguousarray(X3[::-1] * 2)
    (p, decoded), (q, decoded_other) = f(x), f(other)
    stacked = jax.tree.map(lambda a, b: np.stack([a, b]), p, q)

    @jax.jit  # as a training step runs them (eagerly, ~45 op compiles per axis)
    def fast_paths(stacked, p, base):
        return (
            _base.decode_sum(codec, stacked, base),
            _base.add_decoded(codec, base, p, -1),
            _base.add_decoded(codec, base, p, 1),
        )

    summed, minus, plus = fast_paths(stacked, p, other)
    total = np.asarray(decoded, np.float64) + np.asarray(decoded_other, np.float64)
    np.testing.assert_allclose(summed, total, rtol=1e-6)
    np.testing.assert_array_equal(minus, other - np.asarray(decoded))
    np.testing.assert_array_equal(plus, other + np.asarray(decoded))
