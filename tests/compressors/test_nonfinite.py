"""Non-finite inputs (issue 9 item 2): every codec decodes a NaN or +-Inf input to a non-finite
output, in the exact pattern its docstring states, for small and large inputs, eager and jitted.

XLA:CPU's vectorised ``max`` drops NaN above a few thousand elements, so a scale taken with it
made a NaN input finite on a ``(16, 256)`` tensor but not on a ``(4,)`` one; the large size
here is above that threshold, and above the sizes the codecs branch on: the sort-free exact
top-K select (``b * d > 2**14``, ``d >= 256``; more than 16 rows per sample, so failed brackets
are redone row by row) and the per-feature scale's elementwise folds (rows of at least 256
entries); not the select's long-row bracket (one row longer than ``2**16``).

Eagerly, every operation of the sort-free select is compiled alone (~500 of them per layout,
~15 s): the eager large cases of the codecs that run it are one test per layout, so that a
pytest-xdist run compiles each layout once, on one worker."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors as C
from jaxcomp.compressors import _low_rank

SIZES = {"small": ((4, 8), (1, 3)), "large": ((24, 1024), (17, 777))}  # shape, bad position
BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}

# what the decoded output holds, per codec (see each codec's docstring):
#   same     the bad entry decodes to itself (NaN stays NaN, +-Inf stays +-Inf), the rest finite
#   all      every entry is non-finite
#   feature  for +-Inf, every entry of the bad entry's feature column (scale over axis 0) is
#            non-finite and every other entry finite; for NaN, every entry is non-finite
#   kept     the bad entry is kept as itself, every other entry finite
#   kept_all every kept entry is non-finite, the dropped ones are zero
CODECS = {
    "identity": (C.identity(), "same"),
    "cast_fp16": (C.cast("float16"), "same"),
    "cast_bf16": (C.cast("bfloat16"), "same"),
    "quantize8": (C.quantize(8), "all"),
    "quantize1": (C.quantize(1), "all"),
    "quantize4_stochastic": (C.quantize(4, rounding="stochastic"), "all"),
    "quantize8_feature": (C.quantize(8, scale="feature"), "feature"),
    "quantize4_feature_stochastic": (
        C.quantize(4, scale="feature", rounding="stochastic"),
        "feature",
    ),
    "quantize8_feature_fp16": (C.quantize(8, scale="feature", scale_dtype=jnp.float16), "feature"),
    "quantize2_minmax": (C.quantize(2, scale="minmax"), "all"),
    "quantize3_minmax_stochastic": (C.quantize(3, scale="minmax", rounding="stochastic"), "all"),
    "sign": (C.sign(), "all"),
    "sign_rms": (C.sign(scale="rms"), "all"),
    "top_k_exact": (C.top_k(0.1), "kept"),
    "top_k_blockwise": (C.top_k(0.1, method="blockwise"), "kept"),
    "top_k_blockwise_16": (C.top_k(0.1, method="blockwise", block_size=16), "kept"),
    "top_k_per_sample": (C.top_k(0.25, per_sample=True), "kept"),
    "top_k_per_sample_blockwise": (C.top_k(0.25, per_sample=True, method="blockwise"), "kept"),
    "rand_k": (C.rand_k(0.1), "kept_all"),
    "rand_k_unbiased": (C.rand_k(0.1, unbiased=True), "kept_all"),
    "power_sgd": (C.power_sgd(2), "all"),
    "power_sgd_cold": (C.power_sgd(2, warm_start=False), "all"),
    "top_k+quantize8": (C.compose(C.top_k(0.1), C.quantize(8)), "kept_all"),
    "rand_k+quantize4_stochastic": (
        C.compose(C.rand_k(0.1), C.quantize(4, rounding="stochastic")),
        "kept_all",
    ),
}


def _roundtrip(codec):
    def f(x, key):
        payload, _ = codec.compress(x, codec.init(x), key)
        return codec.decompress(payload, x)

    return f


@pytest.fixture(scope="module")
def jitted():
    return {name: jax.jit(_roundtrip(codec)) for name, (codec, _) in CODECS.items()}


# the codecs whose large input runs the sort-free select, by layout (rows of the select)
EAGER_SELECT = {
    "one_row": ("top_k_exact", "top_k+quantize8"),
    "per_sample": ("top_k_per_sample",),
}
_EAGER_SELECT = {name for names in EAGER_SELECT.values() for name in names}


def _check(name, size, mode, bad, jitted):
    codec, pattern = CODECS[name]
    shape, pos = SIZES[size]
    x = np.array(jax.random.normal(jax.random.key(0), shape))
    x[pos] = BAD[bad]
    f = jitted[name] if mode == "jit" else _roundtrip(codec)
    y = np.asarray(f(jnp.asarray(x), jax.random.key(1)))
    finite = np.isfinite(y)
    assert not finite.all()  # the issue: a NaN decoded to finite values
    if pattern == "same":
        assert np.isnan(y[pos]) if bad == "nan" else y[pos] == BAD[bad]
        assert finite.sum() == y.size - 1
    elif pattern == "all" or (pattern == "feature" and bad == "nan"):
        assert not finite.any()
    elif pattern == "feature":
        assert not finite[:, pos[1]].any()
        assert np.delete(finite, pos[1], axis=1).all()
    elif pattern == "kept":
        assert np.isnan(y[pos]) if bad == "nan" else y[pos] == BAD[bad]
        assert finite.sum() == y.size - 1
    else:  # kept_all: every kept value is non-finite, the dropped entries exactly zero
        assert np.all(finite == (y == 0))
        assert (~finite).sum() == C.kept_count(y.size, 0.1, None)  # every such codec keeps 10%


_CASES = [
    pytest.param(name, size, mode, bad, id=f"{name}-{size}-{mode}-{bad}")
    for name in sorted(CODECS)
    for size in sorted(SIZES)
    for mode in ["eager", "jit"]
    for bad in sorted(BAD)
    if not (name in _EAGER_SELECT and size == "large" and mode == "eager")
]


@pytest.mark.parametrize("name, size, mode, bad", _CASES)
def test_non_finite_input_decodes_non_finite(name, size, mode, bad, jitted):
    _check(name, size, mode, bad, jitted)


@pytest.mark.parametrize("layout", sorted(EAGER_SELECT))
def test_non_finite_large_input_decodes_non_finite_eagerly_through_the_select(layout, jitted):
    for name in EAGER_SELECT[layout]:
        for bad in sorted(BAD):
            _check(name, "large", "eager", bad, jitted)


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
