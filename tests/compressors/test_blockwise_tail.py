"""Blockwise TopK (one per block) with a short last block: the same payload as a padded argmax.

The full blocks are selected where they lie in the input and only the last block is padded
(no padded copy of the whole input). The payload must be what the padded form gives, bit for
bit: each block's entry of largest magnitude, the lowest index on ties, NaN above every finite
magnitude (and above inf), the value itself with its sign (``-0.0`` too), and a padding entry
never chosen, even when every real entry of the last block is ``-0.0`` or ``0``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors

pytestmark = pytest.mark.user_numerics


def _reference(flat, blk, nb):
    """Payload of one-per-block TopK by padding and an argmax, in numpy (rows ``[b, d]``)."""
    b, d = flat.shape
    padded = np.zeros((b, nb * blk), np.float32)
    padded[:, :d] = flat
    blocks = padded.reshape(b, nb, blk)
    mag = np.abs(blocks)
    mag = np.where(np.isnan(mag), np.inf, mag)  # NaN ranks with inf; the first of them wins
    idx = np.argmax(mag, axis=-1)  # the lowest index on ties
    vals = np.take_along_axis(blocks, idx[..., None], axis=-1)[..., 0]
    return vals, idx


def _bits(a):
    a = np.asarray(a, np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32)


# (shape, count, per_sample): d entries per row, blocks of ceil(d / count), a short last block
CASES = [
    ((1000,), 30, False),  # blk 34, nb 30: last block 14 long
    ((1001,), 10, False),  # blk 101, nb 10: last block 92 long
    ((4, 250), 9, True),  # per sample: blk 28, nb 9, last block 26 long
    ((3, 7, 45), 16, False),  # d 945: blk 60, nb 16, last block 45 long
    ((641,), 64, False),  # blk 11, nb 59 (< count), last block 3 long
    ((37,), 6, False),  # blk 7, nb 6: last block 2 long
]


def _input(shape, per_sample, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(shape[0], -1) if per_sample else x.reshape(1, -1)
    d = flat.shape[1]
    pos = rng.permutation(d)
    flat[:, pos[:3]] = [np.nan, np.inf, -np.inf]
    flat[:, pos[3:6]] = [-1e6, 1e-10, -0.0]
    flat[:, pos[6 : 6 + d // 4]] = 2.0  # ties, larger than most entries
    flat[:, pos[6 + d // 4 : 6 + d // 3]] = -2.0  # ties of the other sign
    return x


@functools.cache
def _compress(codec):
    """The codec's jitted compress from a fresh state (one per codec object: a test that checks
    several inputs of one shape with one codec compiles once)."""
    return jax.jit(lambda v: codec.compress(v, codec.init(v), None))


def _check(codec, x, per_sample):
    payload, _ = _compress(codec)(jnp.asarray(x))
    flat = x.reshape(x.shape[0], -1) if per_sample else x.reshape(1, -1)
    d = flat.shape[1]
    kept = payload.values.shape[-1]
    blk = -(-d // kept)
    assert kept == -(-d // blk) and kept * blk != d  # the short last block is exercised
    vals, idx = _reference(flat, blk, kept)
    got_v = np.asarray(payload.values).reshape(vals.shape)
    got_i = np.asarray(payload.indices).reshape(idx.shape)
    np.testing.assert_array_equal(got_i, idx)
    np.testing.assert_array_equal(_bits(got_v), _bits(vals))
    assert (idx[:, -1] < d - (kept - 1) * blk).all()  # a real entry, never the padding
    # jitted: eagerly, each of the decode's ~20 operations compiled on its own, per shape
    decoded = np.asarray(jax.jit(codec.decompress)(payload, jnp.asarray(x)))
    np.testing.assert_array_equal(
        _bits(decoded.reshape(flat.shape)), _bits(_dense(vals, idx, blk, d))
    )


def _dense(vals, idx, blk, d):
    out = np.zeros((vals.shape[0], vals.shape[1] * blk), np.float32)
    np.put_along_axis(out.reshape(*vals.shape, blk), idx[..., None], vals[..., None], axis=-1)
    return out[:, :d]


@pytest.mark.slow
@pytest.mark.parametrize("shape,count,per_sample", CASES, ids=str)
def test_one_per_block_with_a_short_last_block_is_the_padded_argmax(shape, count, per_sample):
    codec = compressors.top_k(count=count, per_sample=per_sample, method="blockwise")
    _check(codec, _input(shape, per_sample, 1), per_sample)


TAIL = compressors.top_k(count=30, method="blockwise")


@pytest.mark.parametrize("fill", [-0.0, 0.0, np.nan, 1.0])
def test_last_block_of_zeros_nans_or_ties_keeps_its_first_real_entry(fill):
    x = _input((1000,), False, 2)
    x[-14:] = fill  # the whole last block (14 long; padded to 34 with zeros)
    x[33] = np.nan if fill != fill else x[33]  # a NaN in a full block too
    _check(TAIL, x, False)


def test_nan_beats_inf_only_by_position_and_both_beat_finite():
    x = np.ones(99, np.float32)  # count 10: blocks of 10, the last one 9 long
    x[95], x[97] = np.inf, np.nan  # in the last block: inf comes first, so inf wins
    x[12], x[11] = np.nan, -np.inf  # -inf first in its block
    _check(compressors.top_k(count=10, method="blockwise"), x, False)
