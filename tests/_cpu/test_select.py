"""The sort-free exact selection (``jaxcomp._cpu._select``) against ``lax.top_k`` and numpy.

The bracket may fail on some rows (then ``lax.top_k`` decides every row): a test through
``top_k_indices`` alone would not see a wrong fast-path answer on a matrix holding one row that
falls back, so the short-row bracket is also checked row by row where it reports success.

The select is integer arithmetic on the magnitudes' bit patterns, the same at every XLA level:
these programs compile unoptimised (``fast_compiles``: docs/results/suite_tiers, suite13b).
The optimised select stays pinned to numpy's TopK where users run it:
test_reduction_bits.py (exact TopK per tensor on 131072 entries and per sample on rows of 512,
with NaN, infinities and signed zeros), test_select_long_rows.py (the strided sample).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp._cpu import _select

pytestmark = pytest.mark.usefixtures("fast_compiles")


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
#: one program per shape (seconds of compile each): the fast tier's shape, every shape in the slow
SHAPE_PARAMS = [s if s == (300, 30) else pytest.param(*s, marks=pytest.mark.slow) for s in SHAPES]


def _matrix(kinds, d, seed=0):
    rng = np.random.default_rng(seed)
    # two rows of each kind, and enough rows that b * d passes the small-input shortcut
    reps = max(2, -(-(_select._SMALL + 1) // (d * len(kinds))))
    return np.stack([_row(kind, d, rng) for kind in kinds for _ in range(reps)])


def _keys(x):
    d = x.shape[1]
    pad = -(-d // 32) * 32 - d
    return jnp.pad(_select.magnitude_keys(x), ((0, 0), (0, pad)), constant_values=-1)


NO_FALLBACK = ["normal", "edges", "quarters", "subnormal"]


@functools.cache
def _outputs(d: int, k: int) -> dict:
    """Both tests' outputs for one (d, k), from ONE compiled function (a compile costs more than
    the runs): the short bracket's ``(T, p, ok)``, ``lax.top_k``'s ``(T, p)`` and
    ``top_k_indices``, on a matrix of every row kind and on one of the kinds in ``NO_FALLBACK``
    (cycled to the same number of rows)."""

    def f(x):
        t, p, ok = _select._short_bracketed(_keys(x), d, k)
        t_ref, p_ref = _select._reference_cut(_select.magnitude_keys(x), k)
        return t, p, ok, t_ref, p_ref, _select.top_k_indices(x, k)

    f = jax.jit(f)
    out = {}
    for name, kinds in (("all", KINDS), ("no_fallback", (NO_FALLBACK * 3)[: len(KINDS)])):
        x = _matrix(kinds, d, seed=1)
        out[name] = (x, *(np.asarray(a) for a in f(jnp.asarray(x))))
    return out


@pytest.mark.parametrize("d, k", SHAPE_PARAMS)
def test_short_bracket_agrees_with_lax_top_k_on_every_row_it_accepts(d, k):
    x, t, p, ok, t_ref, p_ref, _ = _outputs(d, k)["all"]
    np.testing.assert_array_equal(t[ok], t_ref[ok])
    np.testing.assert_array_equal(p[ok], p_ref[ok])
    reps = x.shape[0] // len(KINDS)
    normal = ok[: reps * KINDS.index("edges")]
    assert normal.all(), "the bracket fails on Gaussian rows: the fast path is never taken"


@pytest.mark.parametrize("d, k", SHAPE_PARAMS)
def test_top_k_indices_is_the_stable_top_k_with_and_without_fallback(d, k):
    for x, *_, idx in _outputs(d, k).values():
        np.testing.assert_array_equal(idx, _stable_top(x, k))


@pytest.mark.slow
@pytest.mark.parametrize("n_bad", [0, 1, _select._FEW_ROWS, _select._FEW_ROWS + 1, 40])
def test_rows_whose_bracket_fails_fall_back_alone_or_all_together(n_bad):
    # Gaussian rows with n_bad dead ones (all zero, all equal, subnormal: the bracket fails):
    # up to _FEW_ROWS are redone alone, more and every row is; one compiled function for all
    d, k = 512, 51
    rng = np.random.default_rng(2)
    x = np.stack([_row("normal", d, rng) for _ in range(40)])
    dead = rng.permutation(40)[:n_bad]
    for j, r in enumerate(dead):
        x[r] = _row(["all_zero", "all_equal", "subnormal"][j % 3], d, rng)
    idx, ok = _TOP_51(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(idx), _stable_top(x, k))
    assert set(np.flatnonzero(~np.asarray(ok))) == set(dead)  # the rows that fall back


_TOP_51 = jax.jit(  # top_k_indices and which rows' bracket fails, compiled once for every case
    lambda x: (_select.top_k_indices(x, 51), _select._short_bracketed(_keys(x), 512, 51)[2])
)


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
