"""The sort-free exact selection (``compressors._select``) against ``lax.top_k`` and numpy.

The bracket may fail on some rows (then ``lax.top_k`` decides every row): a test through
``top_k_indices`` alone would not see a wrong fast-path answer on a matrix holding one row that
falls back, so the short-row bracket is also checked row by row where it reports success.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.compressors import _select


def _stable_top(x2d: np.ndarray, k: int) -> np.ndarray:
    """numpy reference: the K largest |x| per row (NaN as +inf), lowest index first on ties."""
    mag = np.abs(x2d.astype(np.float32))
    mag[np.isnan(mag)] = np.inf
    return np.sort(np.argsort(-mag, axis=-1, kind="stable")[:, :k], axis=-1)


def _row(kind: str, d: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(d)
    if kind == "edges":  # magnitudes 1e-10..1e6, zeros, signed zeros, a tied value, NaN, Inf
        x = x * 10.0 ** rng.uniform(-10, 6, d)
        x[rng.integers(0, d, d // 50)] = 0.0
        x[rng.integers(0, d, d // 50)] = -0.0
        x[rng.integers(0, d, d // 20)] = 1.5
        x[rng.integers(0, d, 3)] = np.nan
        x[rng.integers(0, d, 2)] = -np.inf
    elif kind == "quarters":  # few distinct values: large tie groups at the threshold
        x = np.round(x * 4) / 4
    elif kind == "all_equal":
        x = np.full(d, -2.0)
    elif kind == "all_zero":
        x = np.zeros(d)
    elif kind == "nan_half":  # more NaN (ranked +inf) than most K
        x[rng.permutation(d)[: d // 2]] = np.nan
    elif kind == "one_cell":  # every key within one 2**15 cell of the bracket's grid
        x = 1.0 + rng.integers(0, 1 << 15, d) * 2.0**-23
    elif kind == "subnormal":
        x = x * 1e-41
    elif kind == "strided_spikes":  # large exactly where a strided sample looks
        x[:: max(1, d // 512)] *= 1e3
    elif kind == "ascending":
        x = np.arange(d) - d / 3
    return x.astype(np.float32)


KINDS = [
    "normal",
    "edges",
    "quarters",
    "all_equal",
    "all_zero",
    "nan_half",
    "one_cell",
    "subnormal",
    "strided_spikes",
    "ascending",
]
# (d, k): rows of 300 (stride 1, not a multiple of 32), 4096 (the bench's), 65536 (the largest
# short row) and 257; K from 1 to d - 1
SHAPES = [(300, 1), (300, 30), (300, 299), (4096, 41), (4096, 410), (65536, 6554), (257, 256)]


def _matrix(kinds, d, seed=0):
    rng = np.random.default_rng(seed)
    # two rows of each kind, and enough rows that b * d passes the small-input shortcut
    reps = max(2, -(-(_select._SMALL + 1) // (d * len(kinds))))
    return np.stack([_row(kind, d, rng) for kind in kinds for _ in range(reps)])


def _keys(x):
    d = x.shape[1]
    pad = -(-d // 32) * 32 - d
    return jnp.pad(_select.magnitude_keys(x), ((0, 0), (0, pad)), constant_values=-1)


@pytest.mark.parametrize("d, k", SHAPES)
def test_short_bracket_agrees_with_lax_top_k_on_every_row_it_accepts(d, k):
    x = jnp.asarray(_matrix(KINDS, d))
    t, p, ok = jax.jit(lambda x: _select._short_bracketed(_keys(x), d, k))(x)
    t_ref, p_ref = jax.jit(lambda x: _select._reference_cut(_select.magnitude_keys(x), k))(x)
    ok = np.asarray(ok)
    np.testing.assert_array_equal(np.asarray(t)[ok], np.asarray(t_ref)[ok])
    np.testing.assert_array_equal(np.asarray(p)[ok], np.asarray(p_ref)[ok])
    reps = x.shape[0] // len(KINDS)
    normal = ok[: reps * KINDS.index("edges")]
    assert normal.all(), "the bracket fails on Gaussian rows: the fast path is never taken"


@pytest.mark.parametrize("d, k", SHAPES)
def test_top_k_indices_is_the_stable_top_k_with_and_without_fallback(d, k):
    f = jax.jit(lambda x: _select.top_k_indices(x, k))
    for kinds in (["normal", "edges", "quarters", "subnormal"], KINDS):
        x = _matrix(kinds, d, seed=1)
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x))), _stable_top(x, k))


def test_compact_lists_set_positions_in_order_across_the_packed_key():
    # more than 2**15 words (the (word, slot) pair no longer fits one int32) and a sparse row
    rng = np.random.default_rng(0)
    d = (1 << 15) * 32 + 64
    mask = np.zeros((2, d), bool)
    mask[0, rng.choice(d, 500, replace=False)] = True
    mask[1, [0, 31, 32, d - 1]] = True
    idx, count = jax.jit(lambda m: _select._compact(_select._words(m), 512))(jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(count), [500, 4])
    np.testing.assert_array_equal(np.asarray(idx)[0, :500], np.flatnonzero(mask[0]))
    np.testing.assert_array_equal(np.asarray(idx)[1, :4], np.flatnonzero(mask[1]))
