"""Operand layouts and matrix-product forms XLA:CPU runs faster; each is the plain operation's
value (up to float summation order where said). Called through the door's hook
(:func:`jaxcomp._cpu.kernel`), so other backends run the plain operation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def own_layout(w: jax.Array) -> jax.Array:
    """``w`` as the result of a product of its own, ``w @ I`` (each entry ``w_ij * 1`` plus
    zeros; a ``-0`` may come out ``+0``).

    XLA:CPU lays out a dot's result row-major: an SVD's operand (LAPACK wants it column-major)
    taken from ``w @ I`` gets a copy of its own instead of imposing that layout on whatever
    computed ``w``. In a branch of a ``cond``/``switch`` that returns other state, the branch
    with the most instructions (the re-factorisation) sets the layout of every result: without
    this every other branch copied the state it passes through into column-major and back, on
    every step.
    """
    return w @ jnp.eye(w.shape[-1], dtype=w.dtype)


def written_transpose(a: jax.Array) -> jax.Array:
    """``a.T`` written out (behind an ``optimization_barrier``, so that XLA does not fold the
    transpose back into the product that reads it).

    XLA:CPU hands a product that contracts its left operand's first axis (``A.T @ G``) to Eigen
    instead of its faster YNNPACK kernels; ``written_transpose(a) @ g`` takes the fast kernel.
    The sums run in another order: equal up to rounding.
    """
    return lax.optimization_barrier(a.T)


def transposed_matmul(m: jax.Array, p: jax.Array) -> jax.Array:
    """``m.T @ p`` for a large ``m`` and a skinny ``p`` (``[rows, r]``, small r).

    XLA:CPU runs this dot (contraction over the rows of ``m``) about 10x slower than ``m @ q``;
    as a fused multiply-and-reduce it runs at memory speed, except for r = 1 where that reduce
    is slow too and ``(pᵀ m)ᵀ``, a matrix-vector product, is ~20x faster.
    """
    if p.shape[1] == 1:
        return (p.T @ m).T
    return jnp.sum(m[:, :, None] * p[:, None, :], axis=0)
