"""TopK and RandK: hand-worked outputs, exact-K property, blockwise semantics, shared seeds."""

import logging

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxcomp import compressors

KEY = jax.random.key(0)


def roundtrip(codec, x, key=KEY):
    payload, _ = codec.compress(x, codec.init(x), key)
    return payload, codec.decompress(payload, x)


#: :func:`roundtrip` as one jitted program (eagerly, each of its ~30 operations compiles a
#: program of its own per shape: ~0.6 s of CPU per test)
jitted_roundtrip = jax.jit(roundtrip, static_argnums=0)


def _normal(shape, seed=0):
    """Test data from numpy (an eager ``jax.random.normal`` compiles a program per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _exact_top_k(x, rows: int, k: int):
    """numpy's exact TopK of each of ``rows`` rows of ``x``: ``(values, indices)`` ``[rows, k]``,
    indices increasing (a reference that compiles nothing: the sort-free select's compile is
    seconds per program)."""
    x = np.asarray(x).reshape(rows, -1)
    idx = np.sort(np.argsort(-np.abs(x), axis=-1, kind="stable")[:, :k], axis=-1)
    return np.take_along_axis(x, idx, axis=-1), idx


def _stable_top(x2d: np.ndarray, k: int) -> np.ndarray:
    """numpy reference: the K largest |x| per row (NaN as +inf), lowest index first on ties."""
    mag = np.abs(x2d.astype(np.float32))
    mag[np.isnan(mag)] = np.inf
    return np.sort(np.argsort(-mag, axis=-1, kind="stable")[:, :k], axis=-1)


def _edge_vector(n: int, seed: int) -> np.ndarray:
    """Magnitudes 1e-10..1e6, ties, zeros, signed zeros, NaN and +-Inf in one vector."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-10, 6, n)
    x[rng.integers(0, n, n // 50)] = 0.0
    x[rng.integers(0, n, n // 50)] = -0.0
    x[rng.integers(0, n, n // 20)] = 1.5  # a tied block near the 1% threshold
    x[rng.integers(0, n, 5)] = np.nan
    x[rng.integers(0, n, 3)] = np.inf
    x[rng.integers(0, n, 3)] = -np.inf
    return x.astype(np.float32)


# inputs large enough for the sort-free select: one tensor of > 65536 entries (the long-row
# bracket, two pivots; all-equal and mostly-zero inputs make it fail: the fallback, the latter
# with K = 701 above its 71 nonzeros, so T = 0 and the 630 lowest-index zeros are kept, more
# than the bracket's 606 candidate slots: only the fallback's cut is right) at one K (one
# program); rows of 1024 (the short-row bracket, 24 rows: more than 16) through the codec
# table's ``top_k_per_sample`` round trip, the program test_nonfinite.py's large jitted case
# compiles (the select's compile is seconds per program)
TENSOR_FRACTION = 0.01
TENSOR_TOP_K = compressors.top_k(TENSOR_FRACTION)
SELECT_CASES = [
    ("tensor_edges", (70001,), None, _edge_vector(70001, 0)),
    ("tensor_all_equal", (70001,), None, np.full(70001, -2.0, np.float32)),
    ("tensor_mostly_zero", (70001,), None, np.where(np.arange(70001) % 1000 == 0, 1.0, 0.0)),
    ("rows_edges", (24, 1024), "top_k_per_sample", _edge_vector(24 * 1024, 1).reshape(24, 1024)),
    ("rows_quarters", (24, 1024), "top_k_per_sample", np.round(_edge_vector(24 * 1024, 2) * 4) / 4),
]


@pytest.mark.user_numerics
@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, row, x", [c[1:] for c in SELECT_CASES], ids=[c[0] for c in SELECT_CASES]
)
def test_exact_top_k_selects_lax_top_k_set_bit_for_bit(
    shape, row, x, codec_table, load_test_module
):
    x = np.asarray(x, np.float32).reshape(shape)
    if row is None:
        fraction = TENSOR_FRACTION  # the table's round trip for a codec of its own
        round_trip = load_test_module("codecs.py").CodecCase("", TENSOR_TOP_K, "").round_trip()
    else:
        case = next(case for case in codec_table if case.name == row)
        fraction, round_trip = 0.25, case.round_trip()  # the row's top_k(0.25, per_sample=True)
    x2d = x.reshape(shape[0], -1) if row else x.reshape(1, -1)
    k = compressors.kept_count(x2d.shape[1], fraction, None)
    expect = _stable_top(x2d, k)
    ref = np.sort(np.asarray(jax.lax.top_k(_top_k_magnitude(x2d), k)[1]), axis=-1)
    np.testing.assert_array_equal(ref, expect)  # lax.top_k's tie rule is the lowest index
    payload, _, y = round_trip(jnp.asarray(x), jax.random.key(1))
    idx = np.asarray(payload.indices).astype(np.int64).reshape(x2d.shape[0], k)
    np.testing.assert_array_equal(idx, expect)
    vals = np.asarray(payload.values).reshape(x2d.shape[0], k)
    np.testing.assert_array_equal(vals, np.take_along_axis(x2d, expect, -1))
    dense = np.zeros_like(x2d)
    np.put_along_axis(dense, expect, np.take_along_axis(x2d, expect, -1), -1)
    np.testing.assert_array_equal(np.asarray(y).reshape(x2d.shape), dense)


def _top_k_magnitude(x2d):
    a = jnp.abs(jnp.asarray(x2d))
    return jnp.where(jnp.isnan(a), jnp.inf, a)


def test_blockwise_one_per_block_keeps_lowest_index_on_ties_and_nan():
    # blocks of 4 (K = 3 of 12): a tie, a NaN after a larger finite entry, an Inf before a NaN
    x = jnp.array([1.0, -2.0, 2.0, 0.0, 5.0, jnp.nan, 1.0, 9.0, jnp.inf, 0.0, jnp.nan, 1.0])
    payload, y = jitted_roundtrip(compressors.top_k(count=3, method="blockwise"), x)
    np.testing.assert_array_equal(payload.indices, [1, 1, 0])
    assert payload.values[0] == -2.0 and np.isnan(payload.values[1])
    assert np.isposinf(payload.values[2])


def test_non_finite_entries_are_always_sent():
    x = jnp.array([1.0, jnp.nan, 5.0, -jnp.inf, 0.5])
    y = np.asarray(jitted_roundtrip(compressors.top_k(count=2), x)[1])
    assert np.isnan(y[1]) and np.isneginf(y[3])


def test_rand_k_non_finite_input_poisons_the_payload():
    codec = compressors.rand_k(count=2)
    x = np.zeros(100, np.float32)
    x[57] = np.inf
    assert np.all(np.isnan(jitted_roundtrip(codec, x)[0].values))


# The bit-for-bit test above and the non-finite inputs below compile optimised; every later
# test asks for ``fast_compiles`` (hand-worked selections, sets against numpy, RandK's
# strata and expectation, messages, a trace count: no bits of the optimised program), which
# stays on to the module's end once a test asks for it.
FAST = pytest.mark.usefixtures("fast_compiles")


@FAST
def test_top_k_by_hand():
    x = jnp.array([0.1, -3.0, 0.5, 2.0])
    payload, y = jitted_roundtrip(compressors.top_k(count=2), x)
    np.testing.assert_array_equal(payload.values, [-3.0, 2.0])
    np.testing.assert_array_equal(payload.indices, [1, 3])
    assert payload.indices.dtype == jnp.uint8
    np.testing.assert_array_equal(y, [0.0, -3.0, 0.0, 2.0])


@FAST
def test_top_k_per_sample_by_hand():
    x = jnp.array([[1.0, -5.0, 2.0, 0.0], [3.0, 0.0, -1.0, 4.0]])
    payload, y = jitted_roundtrip(compressors.top_k(0.5, per_sample=True), x)
    assert payload.values.shape == (2, 2)
    np.testing.assert_array_equal(y, [[0.0, -5.0, 2.0, 0.0], [3.0, 0.0, 0.0, 4.0]])


@FAST
def test_kept_count_follows_paper_rule():
    # Rudakov et al.: n_lowest = int(D * (1 - k)); kept = D - n_lowest
    assert compressors.kept_count(65536, 0.1, None) == 65536 - int(65536 * 0.9)
    assert compressors.kept_count(10, 0.05, None) == 1
    assert compressors.kept_count(10, 1.0, None) == 10


@FAST
def test_index_dtype_grows_with_range():
    # traced, not run: the dtype is the one compress returns and decompress accepts, without
    # compiling (or running op by op) the selection of 65537 entries
    for n, dt in [(256, jnp.uint8), (257, jnp.uint16), (65536, jnp.uint16), (65537, jnp.uint32)]:
        like = jax.ShapeDtypeStruct((n,), jnp.float32)
        payload, _ = jax.eval_shape(lambda x: roundtrip(compressors.top_k(count=1), x), like)
        assert payload.indices.dtype == dt, n


TOPK_EXACT = jax.jit(lambda x: roundtrip(compressors.top_k(count=7), x)[1])


@given(x=hnp.arrays(np.float32, (50,), elements=st.floats(-100, 100, width=32), unique=True))
@FAST
def test_top_k_keeps_exactly_the_k_largest_magnitudes(x):
    y = np.asarray(TOPK_EXACT(jnp.asarray(x)))
    kept = np.flatnonzero(y != 0)
    expected = np.argsort(-np.abs(x), kind="stable")[:7]
    expected = expected[x[expected] != 0]
    assert set(kept) == set(expected)
    np.testing.assert_array_equal(y[kept], x[kept])


@FAST
def test_blockwise_keeps_the_top_of_each_block():
    x = _normal((3, 100))
    codec = compressors.top_k(0.1, per_sample=True, method="blockwise", block_size=25)
    payload, y = jitted_roundtrip(codec, x)
    # 100 entries, K = 10, 4 blocks of 25 -> ceil(10 / 4) = 3 per block, block-local indices
    assert payload.values.shape == (3, 12) and payload.indices.dtype == jnp.uint8
    xb, yb = np.asarray(x).reshape(3, 4, 25), np.asarray(y).reshape(3, 4, 25)
    for r in range(3):
        for b in range(4):
            top = set(np.argsort(-np.abs(xb[r, b]))[:3])
            assert set(np.flatnonzero(yb[r, b])) == top


@FAST
def test_blockwise_decode_drops_an_index_past_its_block():
    # a damaged payload: block 0's index 25 + j >= block_size 25 must not land in block 1 at j
    # (the decode scatters at flat positions block * 25 + index); j not kept in block 1
    x = _normal((2, 100))
    codec = compressors.top_k(0.1, per_sample=True, method="blockwise", block_size=25)
    payload, y = jitted_roundtrip(codec, x)
    j = min(set(range(25)) - set(np.asarray(payload.indices[0, 3:6]).tolist()))
    bad = payload._replace(indices=payload.indices.at[0, 0].set(25 + j))
    z = np.asarray(codec.decompress(bad, x))
    expect = np.asarray(y).copy()
    expect[0, int(payload.indices[0, 0])] = 0.0  # the damaged entry is dropped
    np.testing.assert_array_equal(z, expect)


@FAST
def test_blockwise_with_one_per_block_is_blockwise_argmax_and_pads_the_tail():
    x = _normal((103,))
    codec = compressors.top_k(count=11, method="blockwise", block_size=10)
    payload, y = jitted_roundtrip(codec, x)
    assert payload.values.shape == (11,)
    xb = np.pad(np.asarray(x), (0, 7)).reshape(11, 10)
    expect = np.zeros_like(xb)
    arg = np.abs(xb).argmax(1)
    expect[np.arange(11), arg] = xb[np.arange(11), arg]
    np.testing.assert_array_equal(y, expect.reshape(-1)[:103])


@pytest.mark.slow
@FAST
def test_approx_method_is_the_exact_selection_off_tpu():
    x = jnp.asarray(_edge_vector(70001, 3))
    exact, approx = compressors.top_k(0.01), compressors.top_k(0.01, method="approx")
    p, q = jitted_roundtrip(exact, x)[0], jitted_roundtrip(approx, x)[0]
    np.testing.assert_array_equal(p.indices, q.indices)
    np.testing.assert_array_equal(p.values, q.values)


@FAST
def test_rand_k_shared_key_means_shared_positions_and_summable_payloads():
    codec = compressors.rand_k(count=5)
    a, b = jnp.arange(20.0), -2.0 * jnp.arange(20.0)
    pa, ya = jitted_roundtrip(codec, a)
    pb, yb = jitted_roundtrip(codec, b)
    np.testing.assert_array_equal(pa.seed, pb.seed)
    summed = compressors.RandKPayload(pa.values + pb.values, pa.seed)
    np.testing.assert_allclose(codec.decompress(summed, a), ya + yb)


@FAST
def test_rand_k_positions_are_one_per_stratum():
    codec = compressors.rand_k(count=4)
    x = jnp.arange(1.0, 11.0)  # strata of sizes 3, 3, 2, 2
    for seed in range(20):
        y = np.asarray(jitted_roundtrip(codec, x, jax.random.key(seed))[1])
        kept = np.flatnonzero(y)
        assert len(kept) == 4
        assert [int(i in kept) for i in range(10)].count(1) == 4
        for lo, hi in [(0, 3), (3, 6), (6, 8), (8, 10)]:
            assert np.sum((kept >= lo) & (kept < hi)) == 1
        np.testing.assert_array_equal(y[kept], np.asarray(x)[kept])


@FAST
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
        (compressors.top_k, dict(fraction=0.1, method="sorted"), "method"),
        (compressors.top_k, dict(fraction=0.1, method="approx", recall_target=0.0), "recall"),
        (compressors.top_k, dict(fraction=0.1, block_size=1), "block_size"),
        (compressors.rand_k, dict(fraction=-0.1), "fraction"),
    ],
)
@FAST
def test_bad_parameters_raise(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)


@FAST
def test_count_larger_than_tensor_raises():
    codec = compressors.top_k(count=10)
    with pytest.raises(ValueError, match="exceeds"):
        codec.init(jnp.ones(4))


@FAST
def test_per_sample_needs_a_batch_axis():
    codec = compressors.top_k(0.5, per_sample=True)
    with pytest.raises(ValueError, match="leading batch axis"):
        codec.init(jnp.ones(4))


@FAST
def test_rand_k_needs_a_key():
    codec = compressors.rand_k(0.5)
    with pytest.raises(ValueError, match="key"):
        codec.compress(jnp.ones(4), codec.init(jnp.ones(4)), None)


@pytest.mark.slow
@FAST
def test_exact_top_k_called_eagerly_traces_the_select_once(caplog):
    """Called eagerly (a notebook), the sort-free select ran its ~550 small ops one by one,
    each traced and compiled on its own (~13 s for a new shape); now one jitted program."""
    x = _normal((24, 1056), seed=5)  # a shape no other test uses
    codec = compressors.top_k(0.1, per_sample=True)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax._src.dispatch"):
        payload, _ = codec.compress(x, codec.init(x), None)
    traced = [r for r in caplog.records if "Finished tracing" in r.getMessage()]
    assert len(traced) <= 40, len(traced)
    values, indices = _exact_top_k(x, 24, compressors.kept_count(1056, 0.1, None))
    np.testing.assert_array_equal(payload.values, values)
    np.testing.assert_array_equal(payload.indices, indices)


@pytest.mark.parametrize(
    "codec, shape, rows, k",
    [  # past the lax.top_k shortcut: seconds of compile each, in the slow tier
        pytest.param(
            compressors.top_k(0.1, per_sample=True),
            (8, 4096),
            8,
            compressors.kept_count(4096, 0.1, None),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            compressors.top_k(0.01),
            (70016,),
            1,
            compressors.kept_count(70016, 0.01, None),
            marks=pytest.mark.slow,
        ),
        pytest.param(  # 64 blocks of 512, each keeping ceil(K / 64)
            compressors.top_k(0.05, method="blockwise", block_size=512),
            (32768,),
            64,
            -(-compressors.kept_count(32768, 0.05, None) // 64),
            marks=pytest.mark.slow,
        ),
        # K == every entry (a small leaf, e.g. a bias): the select's constant answer was not
        # typed as varying and shard_map's platform switch refused it (until session 16)
        (compressors.top_k(1.0), (64,), 1, 64),
        (compressors.top_k(1.0, per_sample=True), (4, 16), 4, 16),
        (compressors.top_k(1.0, method="blockwise", block_size=16), (64,), 1, 64),
    ],
    ids=["per_sample", "tensor", "blockwise_512", "k_all", "k_all_per_sample", "k_all_blocks"],
)
@FAST
def test_sort_free_select_runs_under_shard_map(codec, shape, rows, k):
    # shapes past the lax.top_k shortcut: the select's loops carry per-device (varying)
    # values, which shard_map's type check rejects if an initial carry is a constant; each
    # device's payload is numpy's exact TopK of its half (one compiled select, not two)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomp import comm

    mesh = comm.make_mesh([("x", 2)], devices=jax.devices()[:2])
    x = _normal((2 * shape[0], *shape[1:]))

    def encode(x):
        payload, _ = codec.compress(x, codec.init(x), None)
        return payload

    sharded = jax.jit(jax.shard_map(encode, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    got = sharded(jax.device_put(x, NamedSharding(mesh, P("x"))))
    got_values = np.asarray(got.values).reshape(2, rows, k)
    got_indices = np.asarray(got.indices).reshape(2, rows, k)
    for half, sl in enumerate([slice(0, shape[0]), slice(shape[0], None)]):
        values, indices = _exact_top_k(x[sl], rows, k)
        np.testing.assert_array_equal(got_values[half], values)
        np.testing.assert_array_equal(got_indices[half], indices)
