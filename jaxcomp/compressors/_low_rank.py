"""Low-rank factors for PowerSGD: the matrix view, orthogonalisation, the transposed product,
overflow-safe power-of-two scalings, and the payload and state types."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import _cpu
from jaxcomp import _scaling
from jaxcomp._cpu import _layouts
from jaxcomp.compressors import _checks


class PowerSGDState(NamedTuple):
    """Warm-start query matrix.

    Attributes:
      q: ``float32[cols, r]`` — the previous step's Q (``float32[0, 0]`` for 1-D inputs, which
        pass through uncompressed).
    """

    q: jax.Array


class LowRankPayload(NamedTuple):
    """The two factors of the rank-r approximation ``x ~= p @ q.T``.

    Attributes:
      p: ``float32[rows, r]`` with orthonormal columns (each times a power of two where the
        column of ``q`` would overflow float32, inputs near ``3e38``: :func:`unscaled`).
      q: ``float32[cols, r]``.
    """

    p: jax.Array
    q: jax.Array


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view PowerSGD uses: ``(prod(shape[:-1]), shape[-1])``.

    For Flax kernels (``Dense``: ``(in, out)``, ``Conv``: ``(kh, kw, in, out)``) this is the
    transpose of PyTorch's ``weight.view(out, -1)`` used by the reference, so the rank-r
    approximation is the same.
    """
    return math.prod(shape[:-1]), shape[-1]


def effective_rank(shape: tuple[int, ...], rank: int) -> int:
    """``min(rows, cols, rank)`` for the matrix view of ``shape``; 0 for 0-D and 1-D shapes."""
    if len(shape) < 2:
        return 0
    rows, cols = matrix_shape(shape)
    return min(rows, cols, rank)


def transposed_matmul(m: jax.Array, p: jax.Array) -> jax.Array:
    """``m.T @ p`` for a large ``m`` and a skinny ``p`` (``[rows, r]``, small r); on the CPU a
    fused multiply-and-reduce (:func:`jaxcomp._cpu._layouts.transposed_matmul`, through the
    door's hook: chosen when the program is lowered)."""
    return _cpu.kernel(m, p, cpu=_layouts.transposed_matmul, default=lambda m, p: m.T @ p)


def _pow2_normalized(q: jax.Array) -> jax.Array:
    """``q`` with each column scaled by a power of two to a max-abs in ``[0.5, 1)`` (if normal).

    Exact, and :func:`orthogonalize` does not depend on column scales. Used there (norms
    clear of overflow and underflow) and on the warm-start Q, which carries the magnitude of
    the previous M: unscaled, ``M @ Q`` grows as ``|M|**2`` and under/overflows float32 for
    tensors of magnitude below ~1e-19 or above ~1e19.
    """
    return q * _scaling.pow2_inverse(jnp.max(_checks.nan_as_inf(jnp.abs(q)), axis=0))


def unscaled(p: jax.Array, q: jax.Array, f: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The factors ``(p, q / f)`` of ``M`` from those of ``M f`` (``f`` a power of two).

    A column of ``q / f`` beyond float32's range (``|M|`` near ``3e38``: a column of ``M^T P``
    can exceed ``max|M|`` by ``sqrt(rows)``) is sent as ``(p c, q / (f c))`` instead, ``c`` the
    power of two that brings that column of ``q`` to a max-abs in ``[0.5, 1)``: the product
    ``p q^T`` is the same, and every later use of a Q rescales its columns anyway
    (:func:`_pow2_normalized`). Columns that fit are returned bit-identically.
    """
    amax = jnp.max(_checks.nan_as_inf(jnp.abs(q)), axis=0)
    c = jnp.where(jnp.isfinite(amax / f), 1.0, 1.0 / _scaling.pow2_inverse(amax))
    return p * c, q / c / f


def max_scale(m: jax.Array) -> jax.Array:
    """The power of two that brings ``m``'s max-abs into ``[0.5, 1)``; NaN or Inf give 1."""
    return _scaling.pow2_inverse(jnp.max(_checks.nan_as_inf(jnp.abs(m))))


DEFAULT_EPSILON = 1e-4


def orthogonalize(p: jax.Array, epsilon: float = DEFAULT_EPSILON) -> jax.Array:
    r"""Orthonormalises the columns of ``p`` (in ``float32``); dependent columns become zero.

    Column :math:`c_i` loses its projections on the earlier columns twice (Gram-Schmidt with
    re-orthogonalisation: one pass loses orthogonality when :math:`c_i` nearly lies in their
    span). What is left, :math:`r_i`, is normalised, unless

    .. math::
      \|r_i\|_2 \le \epsilon \, \|c_i\|_2,

    in which case :math:`c_i` is (numerically) a combination of the earlier columns and the
    column is set to exactly zero. The test is relative, so the result does not depend on the
    scale of ``p`` (each column is first rescaled by a power of two, which is exact and keeps
    the norms clear of overflow and underflow). The result :math:`P` has orthonormal non-zero
    columns, so :math:`P P^\top M` is the orthogonal projection of :math:`M` onto their span,
    and a matrix of rank below r is recovered exactly by PowerSGD.

    The PowerSGD reference divides each column by :math:`\|c\|_2 + 10^{-8}` after one pass:
    on a rank-deficient :math:`M Q` that normalises rounding noise into a column that is not
    orthogonal to the earlier ones (reconstructions off by ~100% of ``max|M|``), and the
    absolute :math:`10^{-8}` shrinks columns of tensors of magnitude 1e-8 and below.
    Non-finite columns give NaN columns (never zero ones).

    Args:
      p: ``[n, r]`` matrix.
      epsilon: relative tolerance in ``[0, 1]`` of the dependence test above. The default
        ``1e-4`` is above the float32 rounding noise of a dependent column of ``M @ Q`` (about
        ``1e-7 * sqrt(cols)``, times a small factor) and far below a real direction's share.

    Returns:
      ``float32[n, r]`` with orthonormal or zero columns.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.compressors import _low_rank
      >>> p = _low_rank.orthogonalize(jnp.array([[3.0, 6.0], [4.0, 8.0]]))  # rank 1
      >>> p.tolist()
      [[0.6000000238418579, 0.0], [0.800000011920929, 0.0]]

    References:
      Giraud, Langou, Rozloznik, `The loss of orthogonality in the Gram-Schmidt
      orthogonalization process <https://doi.org/10.1016/j.camwa.2005.08.009>`_, 2005
      ("twice is enough").
    """
    p = p.astype(jnp.float32)
    if p.shape[1] == 0 or p.shape[0] == 0:
        return p
    p = _pow2_normalized(p)
    basis = []
    for i in range(p.shape[1]):
        c = p[:, i]
        norm_c = jnp.sqrt(jnp.dot(c, c))
        v = c
        for _ in range(2):
            for b in basis:
                v = v - jnp.dot(b, v) * b
        norm_v = jnp.sqrt(jnp.dot(v, v))
        dead = (norm_v <= epsilon * norm_c) & jnp.isfinite(norm_c)
        basis.append(jnp.where(dead, 0.0, v / jnp.where(dead, 1.0, norm_v)))
    return jnp.stack(basis, axis=1)
