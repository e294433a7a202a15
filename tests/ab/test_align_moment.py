"""``align_moment`` gathers a moment's rank entries one by one (``take_along_axis``) instead of
as slices (``take``), so that XLA:CPU keeps the A factors' moments row-major in the optax
transform's ``switch`` (tests/transforms/test_ab_switch_layout.py counts the copies). The
values must be the slice gather's bit for bit: NaN, +-inf, -0.0, repeated and reordered
indices, signs -1/0/+1, first and second moments, both axes, eager and jitted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.ab import _factor as F

pytestmark = pytest.mark.user_numerics


def _slice_gather(x, index, sign, axis, first_moment):
    """The formula before: ``take`` of whole slices along ``axis``."""
    moved = jnp.take(x, index, axis=axis)
    factor = sign if first_moment else jnp.abs(sign)
    shape = [1] * x.ndim
    shape[axis] = -1
    return (moved * factor.reshape(shape)).astype(x.dtype)


def _moment(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(1e3)
    flat = x.reshape(-1)
    specials = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-10, -1e-10, 1e6, np.float32(1e-45)]
    spots = rng.choice(flat.size, min(len(specials) * 3, flat.size), replace=False)
    for i, at in enumerate(spots):
        flat[at] = specials[i % len(specials)]
    return x


CASES = {
    # (moment shape, axis, index, sign)
    "a_permutation": ((12, 5), -1, [3, 0, 4, 1, 2], [1, -1, 1, 0, -1]),
    "a_repeats": ((12, 5), -1, [2, 2, 0, 4, 4], [-1, 1, 0, 0, 1]),
    "b_permutation": ((5, 9), -2, [4, 3, 2, 1, 0], [1, 1, -1, -1, 0]),
    "b_repeats": ((5, 9), -2, [0, 0, 0, 1, 3], [0, 1, -1, 1, 1]),
    "stacked_a": ((3, 7, 4), -1, [1, 3, 3, 0], [1, 0, -1, 1]),
    "one_column": ((6, 1), -1, [0], [-1]),
}


def _bits(a):
    return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_align_moment_is_the_slice_gather_bit_for_bit(name, first):
    shape, axis, index, sign = CASES[name]
    x = jnp.asarray(_moment(shape, len(name)))
    index, sign = jnp.asarray(index, jnp.int32), jnp.asarray(sign, jnp.float32)
    want = _slice_gather(x, index, sign, axis, first)
    for got in (
        F.align_moment(x, index, sign, axis, first),
        jax.jit(F.align_moment, static_argnums=(3, 4))(x, index, sign, axis, first),
    ):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(_bits(got), _bits(want))
        np.testing.assert_array_equal(
            _bits(got),
            _bits(jax.jit(_slice_gather, static_argnums=(3, 4))(x, index, sign, axis, first)),
        )


def test_align_moment_moves_entries_as_numpy_take_does():
    """Against numpy: entry ``j`` of the result is entry ``index[j]`` of ``x`` times the sign
    (``|sign|`` for a second moment); a NaN or inf times sign 0 stays NaN, -0.0 keeps its
    sign under +1 and flips under -1."""
    x = _moment((8, 4), 11)
    x[0, 2], x[1, 2], x[2, 3] = np.nan, -0.0, np.inf
    index, sign = np.array([2, 0, 3, 2], np.int32), np.array([-1, 1, 0, 1], np.float32)
    got = np.asarray(
        F.align_moment(jnp.asarray(x), jnp.asarray(index), jnp.asarray(sign), -1, True)
    )
    with np.errstate(invalid="ignore"):  # inf * 0
        want = np.take(x, index, axis=-1) * sign[None, :]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.isnan(got[0, 0]) and np.isnan(got[2, 2])  # NaN * -1, inf * 0
    assert np.signbit(got[1, 0]) == 0 and np.signbit(got[1, 3]) == 1
