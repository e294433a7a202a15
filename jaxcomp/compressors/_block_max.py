"""TopK's per-block selection: the entry of largest magnitude of each block, in one pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

UNROLLED_BLOCK = 256  # one-per-block selection as elementwise steps up to this block length


def magnitude(x: jax.Array) -> jax.Array:
    """``|x|`` in ``float32`` with NaN as ``inf``: non-finite entries rank above every finite
    magnitude, so they are always sent."""
    a = jnp.abs(x.astype(jnp.float32))
    return jnp.where(jnp.isnan(a), jnp.inf, a)


def block_max(blocks: jax.Array) -> jax.Array:
    """Index of the largest magnitude of each block ``[..., nb, blk]`` (lowest index on ties).

    The CPU backend runs ``argmax`` over a short minor axis ~4x slower than a copy of the input
    (``jaxcomp._cpu`` [slow-ops]); for
    blocks up to ``UNROLLED_BLOCK`` long it is written as ``blk`` elementwise steps over the
    block columns, which fuse into one vectorised pass.
    """
    blk = blocks.shape[-1]
    if blk > UNROLLED_BLOCK:
        return jnp.argmax(magnitude(blocks), axis=-1).astype(jnp.int32)
    return column_max(lambda j: blocks[..., j], blk)[0]


def column_max(column, blk: int, with_value: bool = False):
    """``(index, value)`` of the largest magnitude over ``column(0..blk-1)`` (lowest index on
    ties), in elementwise steps; ``value`` (if asked) is the entry itself: sign, ``-0.0`` and
    NaN kept."""
    best = magnitude(column(0))
    idx = jnp.zeros(best.shape, jnp.int32)
    value = column(0) if with_value else None
    for j in range(1, blk):
        a = magnitude(column(j))
        up = a > best  # strict: the lowest index wins a tie
        best = jnp.where(up, a, best)
        idx = jnp.where(up, j, idx)
        if with_value:
            value = jnp.where(up, column(j), value)
    return idx, value


def max_per_block_short_tail(flat: jax.Array, nb: int, blk: int):
    """``(index, value)``, each ``[b, nb, 1]``, of the largest magnitude of each block of
    ``blk`` entries of the rows ``flat`` (``[b, d]``, ``(nb - 1) * blk < d < nb * blk``).

    The full blocks are read where they lie (column j is a strided slice of ``flat``) and
    their values gathered at the found positions afterwards: on the CPU backend the value was
    a second fusion that redid the whole selection pass (``jaxcomp._cpu`` [fusion]). Only the last
    block is padded (with zeros, which never win: the strict comparison keeps its first real
    entry). Padding the whole input was a full copy (a pass and a temporary the size of the
    input), and so was a reshaped slice of it or a second reader of one.
    """
    b, d = flat.shape
    full = nb - 1
    tail = jnp.pad(flat[:, full * blk :], ((0, 0), (0, nb * blk - d)))
    idx, _ = column_max(
        lambda j: lax.slice(flat, (0, j), (b, j + (full - 1) * blk + 1), (1, blk)), blk
    )
    pos = jnp.arange(full, dtype=jnp.int32) * blk + idx  # < full * blk <= d
    vals = jnp.take_along_axis(flat, pos, axis=1, mode="promise_in_bounds")
    tail_idx, tail_vals = column_max(lambda j: tail[:, j : j + 1], blk, True)
    return (
        jnp.concatenate([idx, tail_idx], axis=1)[..., None],
        jnp.concatenate([vals, tail_vals], axis=1)[..., None],
    )
