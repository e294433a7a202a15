"""Bad inputs at the codec level (issue 9 items 2, 3, 5 and 13), one row per case: each either
raises an error whose message names the problem, or gives the documented result.

Channel-level drift (EF/EF21 state) and AQ-SGD ids are tested in tests/feedback."""

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors as C

pytestmark = pytest.mark.usefixtures("fast_compiles")

KEY = jax.random.key(0)


class Case(NamedTuple):
    run: Callable[[], Any]
    error: type | None = None  # the exception expected, or None for a documented result
    match: str = ""  # regex the message must match (names the problem)
    expect: Callable[[Any], bool] | None = None  # the documented result


def compress(codec, x, key=KEY):
    return codec.compress(x, codec.init(x), key)[0]


def roundtrip(codec, x, key=KEY):
    return codec.decompress(compress(codec, x, key), x)


#: :func:`roundtrip` jitted, for the cases that check a result (eagerly, each of a round trip's
#: 7-41 operations compiled on its own, per shape)
jitted_roundtrip = jax.jit(roundtrip, static_argnums=0)


def payload_of(codec, made_from):
    """A payload of ``codec`` for an array shaped ``made_from``: zeros in the structure, shapes
    and dtypes its compress returns (traced abstractly: the cases below check the decode, and an
    eager compress compiled ~20 operations per case)."""
    abstract = C.payload_shape(codec, jax.ShapeDtypeStruct(made_from, jnp.float32))
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)


def decode_as(codec, made_from, like):
    """Decode (eagerly) a payload made from an array shaped ``made_from`` into ``like``."""
    return codec.decompress(payload_of(codec, made_from), like)


def compress_with_state_of(codec, init_shape, x):
    return codec.compress(x, codec.init(jnp.ones(init_shape)), KEY)


def empty_result(shape):
    """The documented result of a zero-size input: an empty array of the input's shape."""

    def check(y):
        return y.shape == shape and y.dtype == jnp.float32

    return check


def non_finite_everywhere(y):
    return not np.isfinite(np.asarray(y)).any()


def relative_error_below(x, bound):
    def check(y):  # numpy: jnp.max drops NaN on large arrays (the very bug of item 2)
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return np.max(np.abs(y64 - x64)) / np.max(np.abs(x64)) <= bound

    return check


Z = jnp.zeros((0, 4))
BIG_NP = np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)
BIG = jnp.asarray(BIG_NP)


def _with(a, pos, value):
    """A copy of the numpy array ``a`` with ``a[pos] = value``."""
    a = a.copy()
    a[pos] = value
    return a


q8, q4f, q2mm = C.quantize(8), C.quantize(4, scale="feature"), C.quantize(2, scale="minmax")
top, top_ps, top_bw = C.top_k(0.5), C.top_k(0.5, per_sample=True), C.top_k(0.25, method="blockwise")
psgd = C.power_sgd(2)

CASES = {
    # --- item 5: a payload decoded into an array it was not made from, a state of another shape
    "quantize_smaller_like": Case(
        lambda: decode_as(q8, (10,), jnp.ones(5)),
        ValueError,
        r"codes' is uint8\[10\].*float32\[5\]",
    ),
    "quantize_larger_like": Case(
        lambda: decode_as(q8, (10,), jnp.ones(20)),
        ValueError,
        r"codes' is uint8\[10\].*uint8\[20\]",
    ),
    "quantize_feature_other_features": Case(
        lambda: decode_as(q4f, (6, 4), jnp.ones((12, 2))), ValueError, r"scale' is uint16\[4\]"
    ),
    "quantize_minmax_other_size": Case(
        lambda: decode_as(q2mm, (4, 4), jnp.ones((4, 8))), ValueError, r"codes' is uint8\[4\]"
    ),
    "quantize_scale_of_another_dtype": Case(
        lambda: q4f.decompress(
            payload_of(C.quantize(4, scale="feature", scale_dtype=jnp.float16), (6, 4)),
            jnp.ones((6, 4)),
        ),
        ValueError,
        r"scale' is float16\[4\].*needs uint16\[4\]",
    ),
    "sign_other_size": Case(
        lambda: decode_as(C.sign(), (64,), jnp.ones(32)), ValueError, r"codes' is uint8\[8\]"
    ),
    "top_k_other_shape": Case(
        lambda: decode_as(top, (4, 6), jnp.ones((4, 5))), ValueError, r"values' is float32\[12\]"
    ),
    "top_k_per_sample_other_batch": Case(
        lambda: decode_as(top_ps, (4, 6), jnp.ones((2, 6))),
        ValueError,
        r"'values' is float32\[4, 3\].*needs \[2, 3\]",
    ),
    "top_k_blockwise_other_size": Case(
        lambda: decode_as(top_bw, (64,), jnp.ones(128)), ValueError, r"values' is float32\[16\]"
    ),
    "rand_k_other_size": Case(
        lambda: C.rand_k(count=3).decompress(payload_of(C.rand_k(count=3), (10,)), jnp.ones(2)),
        ValueError,
        r"rand_k\(count=3\): count=3 exceeds the 2 entries.*float32\[2\]",
    ),
    "rand_k_fraction_other_size": Case(
        lambda: decode_as(C.rand_k(0.5), (10,), jnp.ones(20)),
        ValueError,
        r"values' is float32\[5\]",
    ),
    "power_sgd_compress_other_cols": Case(
        lambda: compress_with_state_of(psgd, (4, 6), jnp.ones((4, 5))),
        ValueError,
        r"float32\[4, 5\].*Q of shape \[5, 2\].*state's Q is \[6, 2\]",
    ),
    "power_sgd_compress_1d_with_2d_state": Case(
        lambda: compress_with_state_of(psgd, (4, 6), jnp.ones(6)),
        ValueError,
        r"state's Q is \[6, 2\]",
    ),
    "power_sgd_decompress_other_rows": Case(
        lambda: decode_as(psgd, (4, 6), jnp.ones((5, 6))), ValueError, r"p' is float32\[4, 2\]"
    ),
    "cast_other_shape": Case(
        lambda: decode_as(C.cast("bfloat16"), (3, 4), jnp.ones((4, 3))),
        ValueError,
        r"payload' is uint16\[3, 4\].*float32\[4, 3\]",
    ),
    "identity_other_shape": Case(
        lambda: decode_as(C.identity(), (3, 4), jnp.ones(12)),
        ValueError,
        r"payload' is float32\[3, 4\]",
    ),
    "compose_other_shape": Case(
        lambda: decode_as(C.compose(top, q8), (8,), jnp.ones(16)),
        ValueError,
        r"codes' is uint8\[4\]",
    ),
    # --- item 13: zero-size inputs give an empty payload and an empty result (count: an error)
    **{
        f"zero_size_{name}": Case(
            lambda codec=codec: roundtrip(codec, Z), expect=empty_result((0, 4))
        )
        for name, codec in {
            "identity": C.identity(),
            "cast": C.cast("float16"),
            "quantize_tensor": q8,
            "quantize_feature": q4f,
            "quantize_minmax": q2mm,
            "quantize_stochastic": C.quantize(4, rounding="stochastic"),
            "sign": C.sign(),
            "sign_rms": C.sign(scale="rms"),
            "top_k": top,
            "top_k_blockwise": top_bw,
            "top_k_per_sample": top_ps,
            "rand_k": C.rand_k(0.1),
            "power_sgd": psgd,
            "compose": C.compose(top, q8),
        }.items()
    },
    "zero_size_per_sample_features": Case(
        lambda: roundtrip(top_ps, jnp.zeros((3, 0))), expect=empty_result((3, 0))
    ),
    "zero_size_feature_scales_are_zero": Case(
        lambda: compress(q4f, jnp.zeros((0, 4))).scale, expect=lambda s: np.all(np.asarray(s) == 0)
    ),
    "zero_size_top_k_count": Case(
        lambda: roundtrip(C.top_k(count=3), Z),
        ValueError,
        r"top_k\(count=3, exact\): count=3 exceeds the 0 entries.*float32\[0, 4\]",
    ),
    "zero_size_rand_k_count": Case(
        lambda: roundtrip(C.rand_k(count=2), Z),
        ValueError,
        r"rand_k\(count=2\): count=2 exceeds the 0 entries.*float32\[0, 4\]",
    ),
    # --- item 2: a NaN in a (16, 256) tensor (above XLA:CPU's NaN-dropping max threshold)
    "nan_quantize_jit_large": Case(
        lambda: jax.jit(lambda x: roundtrip(q8, x))(BIG.at[3, 7].set(jnp.nan)),
        expect=non_finite_everywhere,
    ),
    "nan_quantize_minmax_jit_large": Case(
        lambda: jax.jit(lambda x: roundtrip(q2mm, x))(BIG.at[3, 7].set(jnp.nan)),
        expect=non_finite_everywhere,
    ),
    "inf_power_sgd_jit": Case(  # eager runs the same operations (test_nonfinite.py)
        lambda: jax.jit(lambda x: roundtrip(psgd, x))(BIG.at[3, 7].set(jnp.inf)),
        expect=non_finite_everywhere,
    ),
    # --- item 3: magnitudes the old float16 scale / +1e-6 got wrong
    "quantize_feature_above_65504": Case(
        lambda: jitted_roundtrip(C.quantize(8, scale="feature"), BIG_NP * np.float32(1e5)),
        expect=relative_error_below(BIG_NP * np.float32(1e5), 2.0**-7 * 1.01),
    ),
    "quantize_feature_fp16_above_65504": Case(  # documented: that feature decodes non-finite
        lambda: jitted_roundtrip(
            C.quantize(8, scale="feature", scale_dtype=jnp.float16), _with(BIG_NP, (0, 9), 7e4)
        )[:, 9],
        expect=non_finite_everywhere,
    ),
    "quantize_magnitude_1e-8": Case(
        lambda: jitted_roundtrip(q8, BIG_NP * np.float32(1e-8)),
        expect=relative_error_below(BIG_NP * np.float32(1e-8), 2.0**-7 * 1.01),
    ),
    "sign_rms_magnitude_1e-25": Case(
        lambda: jitted_roundtrip(C.sign(scale="rms"), BIG_NP * np.float32(1e-25)),
        expect=lambda y: abs(np.max(np.abs(np.asarray(y))) / 1e-25 - 1.0) < 0.1,  # rms of N(0,1)
    ),
    # --- bad arguments at call time
    "integer_input": Case(lambda: roundtrip(q8, jnp.arange(4)), TypeError, "floating-point"),
    "stochastic_without_key": Case(
        lambda: roundtrip(C.quantize(4, rounding="stochastic"), jnp.ones(4), None),
        ValueError,
        "needs a PRNG key",
    ),
    "feature_axes_out_of_range": Case(
        lambda: roundtrip(C.quantize(4, scale="feature", axes=(2,)), jnp.ones((3, 4))),
        ValueError,
        r"axes \(2,\) out of range for a 2-D input",
    ),
    "per_sample_without_batch_axis": Case(
        lambda: roundtrip(top_ps, jnp.ones(4)), ValueError, "leading batch axis"
    ),
    "compose_unknown_field": Case(
        lambda: roundtrip(C.compose(q8, q8), jnp.ones(4)), ValueError, "no field 'values'"
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name):
    case = CASES[name]
    if case.error is not None:
        with pytest.raises(case.error, match=case.match):
            case.run()
    else:
        assert case.expect(case.run())


BEYOND_INT32 = [  # (codec, input shape): positions at or past 2**31, padding included
    (C.top_k(0.01), (2**31,)),
    (C.top_k(0.01, method="blockwise"), (2**16, 2**15)),
    (C.top_k(0.1, per_sample=True), (4, 2**29)),
    (C.top_k(0.01, method="blockwise", block_size=4096), (2**31 - 10,)),  # padded past it
    (C.rand_k(0.01), (2**31,)),
]


@pytest.mark.parametrize("codec,shape", BEYOND_INT32, ids=lambda v: getattr(v, "name", str(v)))
def test_sparse_positions_beyond_int32_are_refused_not_wrapped(codec, shape):
    """Sparse codecs compute positions in int32: an input of 2**31 entries or more (an 8 GiB
    float32 leaf, an embedding table on a large accelerator) would wrap a position around and
    scatter a kept value to a wrong entry. Refused at trace time, on abstract inputs (no
    memory), in init and in compress."""
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    with pytest.raises(ValueError, match=r"int32 indexing"):
        codec.init(x)
    with pytest.raises(ValueError, match=r"int32 indexing"):
        jax.eval_shape(lambda v: codec.compress(v, None, jax.random.key(0)), x)


def test_sparse_positions_just_below_int32_are_accepted():
    x = jax.ShapeDtypeStruct((2**31 - 1,), jnp.float32)
    for codec in (C.top_k(count=3), C.rand_k(count=3)):
        codec.init(x)
        out = jax.eval_shape(lambda v, c=codec: c.compress(v, c.init(v), jax.random.key(0)), x)
        assert jax.tree.leaves(out[0])[0].shape == (3,)
