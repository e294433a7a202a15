r"""Factorisation W = A·B by SVD, factor gradients, and rank-capacity surgery.

For a tall 2-D view :math:`W \in \mathbb{R}^{m \times n}` (:mod:`._ab_layout`) with SVD
:math:`W = U \Sigma V^\top`, AB-Training keeps

.. math::
  A = U_{:, :r} \Sigma_{:r}^{1/2}, \qquad B = \Sigma_{:r}^{1/2} V_{:, :r}^\top
  \qquad (\texttt{split\_sigma=True})

or, with ``split_sigma=False``, :math:`\Sigma` on the factor the worker trains
(:math:`A = U\Sigma, B = V^\top` for A-trainers, :math:`A = U, B = \Sigma V^\top` for B-trainers).

Factors are stored at a static *capacity* ``c >= r`` (``A: [m, c]``, ``B: [c, n]``) with the
columns of ``A`` and rows of ``B`` beyond the rank ``r`` held at zero, so the rank can change
under ``jit``; :func:`resize_rank_axis` changes the capacity itself (between compiled steps).

The gradients of the factors follow from the dense gradient :math:`G = \partial L/\partial W`:

.. math::
  \frac{\partial L}{\partial A} = G B^\top, \qquad \frac{\partial L}{\partial B} = A^\top G.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp.transforms._ab_layout import FactorSpec


def to_matrix(x: jax.Array, spec: FactorSpec) -> jax.Array:
    """The tall ``[m, n]`` view of a parameter (or of its gradient)."""
    w = x.reshape(-1, spec.shape[-1])
    return w.T if spec.transposed else w


def from_matrix(w: jax.Array, spec: FactorSpec) -> jax.Array:
    """Inverse of :func:`to_matrix`."""
    return (w.T if spec.transposed else w).reshape(spec.shape)


def rank_mask(rank: jax.Array, capacity: int, dtype: Any = jnp.float32) -> jax.Array:
    """``[capacity]`` vector with ones at positions ``< rank`` and zeros elsewhere."""
    return (jnp.arange(capacity) < rank).astype(dtype)


def cutoff_rank(s: jax.Array, cutoff: float) -> jax.Array:
    r"""Number of singular values above ``cutoff * s[0]`` (at least one).

    The reference's ``1 + last index i with s[i] > cutoff * s[0]``; singular values are sorted,
    so this is a count. A zero matrix gets rank 1 (the reference indexes an empty array there).
    """
    return jnp.maximum(jnp.sum(s > cutoff * s[0]), 1).astype(jnp.int32)


def svd(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Thin SVD in ``float32`` (as the reference), ``(u [m, n], s [n], vh [n, n])``."""
    return jnp.linalg.svd(w.astype(jnp.float32), full_matrices=False)


def factors_from_svd(
    u: jax.Array,
    s: jax.Array,
    vh: jax.Array,
    rank: jax.Array,
    capacity: int,
    *,
    split_sigma: bool,
    sigma_on_a: jax.Array | bool,
    dtype: Any,
) -> tuple[jax.Array, jax.Array]:
    """``(A [m, capacity], B [capacity, n])`` of rank ``rank`` from an SVD.

    Args:
      u, s, vh: the thin SVD of the tall view.
      rank: kept rank (``<= capacity``), may be traced.
      capacity: static number of stored columns of ``A`` / rows of ``B``.
      split_sigma: put :math:`\\sqrt{\\Sigma}` on both factors.
      sigma_on_a: if not ``split_sigma``: whether :math:`\\Sigma` goes to ``A`` (A-trainers)
        or ``B`` (B-trainers); may be traced.
      dtype: dtype of the returned factors.
    """
    keep = rank_mask(rank, capacity)
    s = s[:capacity] * keep
    u, vh = u[:, :capacity] * keep, vh[:capacity] * keep[:, None]
    if split_sigma:
        root = jnp.sqrt(s)
        a, b = u * root, root[:, None] * vh
    else:
        a = jnp.where(sigma_on_a, u * s, u)
        b = jnp.where(sigma_on_a, vh, s[:, None] * vh)
    return a.astype(dtype), b.astype(dtype)


def factor_grad(role: str, g: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``dL/dA = G Bᵀ`` (``role="a"``) or ``dL/dB = Aᵀ G`` (``"b"``), ``G`` the tall gradient."""
    return g @ b.T if role == "a" else a.T @ g


def reconstruct(a: jax.Array, b: jax.Array, spec: FactorSpec) -> jax.Array:
    """The dense parameter ``A·B`` in its original shape."""
    return from_matrix(a @ b, spec)


def resize_rank_axis(x: jax.Array, capacity: int, axis: int) -> jax.Array:
    """Truncates or zero-pads ``x`` along ``axis`` to ``capacity`` entries.

    The reference's ``pad_or_truncate_tensor`` for optimizer moments when ranks change.
    """
    size = x.shape[axis]
    if capacity <= size:
        return jax.lax.slice_in_dim(x, 0, capacity, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, capacity - size)
    return jnp.pad(x, pad)


def map_like(tree: Any, like: Sequence[jax.Array], fn: Callable[[int, jax.Array], Any]) -> Any:
    """Applies ``fn(i, leaf)`` to every subtree of ``tree`` shaped like the tuple ``like``.

    Optimizer states (``optax.scale_by_adam``'s ``mu`` and ``nu``, momentum traces, ...) hold
    one subtree per parameter tree; for the tuple of factors those subtrees have the tuple's
    structure and shapes. Counters and other leaves are left alone. This is the generic form
    of the reference's ``change_adam_shapes`` (which knows Adam's and SGD's buffers by name).

    Args:
      tree: an optimizer state.
      like: the factor tuple the state was initialised for.
      fn: called as ``fn(index_in_like, leaf)``.

    Returns:
      ``tree`` with the matching subtrees replaced.
    """
    like = tuple(like)
    if not like:
        return tree
    like_def = jax.tree.structure(like)
    shapes = [tuple(x.shape) for x in like]

    def matches(node: Any) -> bool:
        if not isinstance(node, tuple) or len(node) != len(like):
            return False
        leaves, treedef = jax.tree.flatten(node)
        return treedef == like_def and [tuple(getattr(x, "shape", ())) for x in leaves] == shapes

    def apply(node: Any) -> Any:
        if matches(node):
            return tuple(fn(i, x) for i, x in enumerate(node))
        return node

    return jax.tree.map(apply, tree, is_leaf=matches)
