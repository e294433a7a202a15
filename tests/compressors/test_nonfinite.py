"""Non-finite inputs (issue 9 item 2): every codec decodes a NaN or +-Inf input to a non-finite
output, in the exact pattern its docstring states: small inputs and large inputs jitted (as a
training step runs a codec), the large inputs of the size-dependent paths eager too.

XLA:CPU's vectorised ``max`` drops NaN above a few thousand elements, so a scale taken with it
made a NaN input finite on a ``(16, 256)`` tensor but not on a ``(4,)`` one; the large size
here is above that threshold, and above the sizes the codecs branch on: the sort-free exact
top-K select (``b * d > 2**14``, ``d >= 256``; more than 16 rows per sample, so failed brackets
are redone row by row) and the per-tensor and per-feature scales' elementwise folds (rows of at
least 256 entries); not the select's long-row bracket (one row longer than ``2**16``).

Eager dispatch runs the jitted program's operations, each compiled on its own. That does not
change what a reduction makes of a NaN here (a ``max`` alone, fused with its producer ``abs``
or with a consumer, drops the NaN of a ``(24, 1024)`` input alike, eager or jitted), and taking
out any of the codecs' NaN guards (``nan_as_inf``, ``has_nan``, the folds' NaN-keeping
``maximum``) fails the jitted small or large check of every row whose eager large check it
fails (both measured: ``docs/results/suite_tiers``, suite15a). So only the large inputs whose path
depends on the size run eagerly as well (``EAGER_LARGE``: the folds, whose small inputs take a
plain ``max``); a row whose large path is its small one (the blockwise, RandK, sign, PowerSGD,
min-max rows) or another eager row's at another shape runs jitted only.

Eagerly, the sort-free select is one program of its own (``_sparse._exact_indices`` is jitted;
2-4 s per layout and ``k``), not inlined into its neighbours: its eager large cases are one
test per layout, so that a pytest-xdist run compiles each layout once, on one worker. A row
whose large input runs the same operations as another row's is left out of the large inputs
(``_LARGE_AS_ANOTHER``: the reason beside each)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors as C
from jaxcomp.compressors import _low_rank

pytestmark = pytest.mark.user_numerics

SIZES = {"small": ((16, 64), (1, 3)), "large": ((24, 1024), (17, 777))}  # shape, bad position
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def _roundtrip(codec):
    def f(x, key):
        payload, _ = codec.compress(x, codec.init(x), key)
        return codec.decompress(payload, x)

    return f


#: the rows whose large input runs the sort-free select, by layout (rows of the select): eager,
#: each layout is a test of its own (below); top_k+quantize8's select is top_k's, and what it
#: runs past it is quantize's tensor fold (quantize1's) and compose's glue, jitted
EAGER_SELECT = {"one_row": "top_k", "per_sample": "top_k_per_sample"}
#: the other rows whose large input runs eagerly too: a path the small input does not take
EAGER_LARGE = {
    "quantize1": "the per-tensor scale's folds (8 rows of 3072; a plain max at (16, 64))",
    "quantize4_feature_axis0": "the per-feature scale's folds (24 rows; a plain max at (16, 64))",
}
#: rows left out of the large inputs, whose operations there are another row's
_LARGE_AS_ANOTHER = {
    # by rows (row_axis=-1, a no-op moveaxis at 2-D): the select's rows are the input's 24 rows
    # of 1024, top_k_per_sample's (another k: the select branches on the shape only)
    "top_k_rows",
    # the cold start draws Q from the key where the warm one takes the state's: the same
    # operations on x as power_sgd's
    "power_sgd_cold",
}

#: rows whose large jitted round trips are one program: the same select, each row's part on
#: parameters of its own (nothing merged between them; XLA:CPU compiles the kernels the parts
#: share once: 4.0 s of compile for both, 3.3 and 3.8 s apart)
_LARGE_TOGETHER = ("top_k", "top_k+quantize8")


@functools.cache
def _round_trips_together(codecs):
    @jax.jit
    def program(inputs):
        return tuple(_roundtrip(codec)(x, key) for codec, (x, key) in zip(codecs, inputs))

    return program


def _check(case, size, mode, bad, jitted=None):
    """The row's documented pattern (``tests/codecs.py``: ``nonfinite``) for one input
    (``mode="jit"``: through ``jitted``, the row's jitted round trip)."""
    codec, pattern = case.codec, case.nonfinite
    shape, pos = SIZES[size]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x[pos] = BAD[bad]
    f = jitted if mode == "jit" else _roundtrip(codec)
    y = np.asarray(f(jnp.asarray(x), jax.random.key(1)))
    finite = np.isfinite(y)
    where = f"{case.name}-{size}-{mode}-{bad}"
    assert not finite.all(), where  # the issue: a NaN decoded to finite values
    if pattern in ("same", "kept"):
        assert np.isnan(y[pos]) if bad == "nan" else y[pos] == BAD[bad], where
        assert finite.sum() == y.size - 1, where
    elif pattern == "all" or (pattern == "feature" and bad == "nan"):
        assert not finite.any(), where
    elif pattern == "feature":
        assert not finite[:, pos[1]].any(), where
        assert np.delete(finite, pos[1], axis=1).all(), where
    else:  # kept_all: every kept value is non-finite, the dropped entries exactly zero
        assert pattern == "kept_all", where
        assert np.all(finite == (y == 0)), where
        assert (~finite).sum() == C.kept_count(y.size, 0.1, None), where  # every such row: 10%


def _check_size(case, size, modes, table=()):
    if size == "large" and case.name in _LARGE_TOGETHER:
        rows = {case.name: case for case in table}
        together = _round_trips_together(tuple(rows[name].codec for name in _LARGE_TOGETHER))
        part = _LARGE_TOGETHER.index(case.name)

        def jitted(x, key):
            return together(((x, key),) * len(_LARGE_TOGETHER))[part]
    elif size == "small":
        # the receiver's decode of compress's payload: the program test_contract_echo.py
        # compiles for the row at (16, 64), where it checks that the fused sender's echo
        # equals it at NaN and +-Inf (test_magnitudes.py runs it too)
        jitted = case.received()
    else:
        round_trip = case.round_trip()  # one program per row and size (test_sparse's too)

        def jitted(x, key):
            return round_trip(x, key)[2]

    for mode in modes:
        for bad in sorted(BAD):
            _check(case, size, mode, bad, jitted)


def test_the_rows_named_here_are_rows_of_the_table(codec_table):
    names = {case.name for case in codec_table}
    named = set(EAGER_LARGE) | _LARGE_AS_ANOTHER | set(EAGER_SELECT.values())
    assert named <= names, f"not rows of tests/codecs.py: {sorted(named - names)}"


def test_non_finite_input_decodes_non_finite(codec_case):
    """Small, jitted (as a training step runs it), NaN, Inf and -Inf."""
    _check_size(codec_case, "small", ("jit",))


@pytest.mark.slow  # the codecs' large-input paths: the select, the folds
@pytest.mark.codec_rows(lambda case: case.name not in _LARGE_AS_ANOTHER)
def test_non_finite_large_input_decodes_non_finite(codec_case, codec_table):
    """Large, jitted (and eager: ``EAGER_LARGE``), NaN, Inf and -Inf."""
    modes = ("eager", "jit") if codec_case.name in EAGER_LARGE else ("jit",)
    _check_size(codec_case, "large", modes, table=codec_table)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(EAGER_SELECT))
def test_non_finite_large_input_decodes_non_finite_eagerly_through_the_select(layout, codec_table):
    case = next(case for case in codec_table if case.name == EAGER_SELECT[layout])
    for bad in sorted(BAD):
        _check(case, "large", "eager", bad)


# PowerSGD's own non-finite cases (moved from test_low_rank.py, which runs unoptimised)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_orthogonalize_keeps_non_finite_columns_non_finite(bad):
    p = np.random.default_rng(3).standard_normal((10, 3)).astype(np.float32)
    p[4, 1] = bad
    out = np.asarray(_low_rank.orthogonalize(jnp.asarray(p)))
    assert np.all(np.isfinite(out[:, 0]))
    assert np.all(np.isnan(out[:, 1:]))


def test_power_sgd_non_finite_input_gives_nan_and_keeps_the_state(load_test_module):
    rank4 = load_test_module("compressors/test_low_rank.py").CASES["rank4_exact"]
    codec = C.power_sgd(2)
    x = jnp.asarray(rank4, jnp.float32).at[3, 4].set(jnp.inf)
    state = codec.init(x)
    payload, new_state = jax.jit(lambda x, s: codec.compress(x, s, None))(x, state)
    assert np.all(np.isnan(np.asarray(codec.decompress(payload, x))))
    np.testing.assert_array_equal(new_state.q, state.q)
