"""PowerSGD's multi-worker protocol: two all-reduces of small factors with a shared warm start."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _scaling
from jaxcomp.compressors import _base
from jaxcomp.compressors import _low_rank
from jaxcomp.compressors import _protocol


class LowRankReduce(NamedTuple):
    """State of PowerSGD's reduction of one array.

    Attributes:
      q: :class:`~jaxcomp.compressors.PowerSGDState`, the warm-start Q, replicated (every
        worker holds the same).
    """

    q: _low_rank.PowerSGDState


def outer_sum(p: jax.Array, q: jax.Array) -> jax.Array:
    """``p @ q.T`` for skinny factors, written as ``r`` broadcast products.

    XLA fuses this elementwise form with its consumers (e.g. an error-feedback residual
    ``m - p qᵀ``), so the reconstruction and the residual are produced in one pass over memory
    instead of a ``dot`` followed by a subtraction. Exact up to float summation order.
    """
    out = p[:, 0, None] * q[None, :, 0]
    for i in range(1, p.shape[1]):
        out = out + p[:, i, None] * q[None, :, i]
    return out


def power_sgd_protocol(
    codec: _base.Codec, rank: int, epsilon: float, warm_start: bool
) -> _protocol.ReduceProtocol:
    r"""PowerSGD's all-reduce of one array (Vogels et al., Algorithm 1), as a protocol.

    With :math:`M_w` the matrix view of worker w's array and :math:`Q` the shared warm start:

    .. math::
      P = \mathrm{orth}\Big(\sum_w M_w Q\Big), \quad Q' = \frac1W \sum_w M_w^\top P, \quad
      \bar x = P Q'^\top

    Only the factors cross the wire (``rows·r + cols·r`` floats per worker, in two
    ``psum``s). ``echo`` is :math:`\bar x` itself, so error feedback around this protocol
    keeps :math:`M_w - P Q'^\top`, the memory of the reference (against the *averaged*
    reconstruction). :math:`Q'` is the next warm start (a column that comes out all zero keeps
    its previous value, as the codec, and a non-finite mean keeps all of Q); with
    ``warm_start=False`` a fresh :math:`Q \sim N(0, 1)` is drawn from the step key, which every
    worker shares. Arrays with fewer than 2 dimensions are averaged uncompressed.

    Range: each worker's products are scaled by :math:`2^{-k}`, :math:`2^k \ge W`, before the
    ``psum``\ s, so the sums over workers cannot overflow; the mean is exact (bit-identical to
    the unscaled sums elsewhere) for means up to float32's largest, tested from 1e-30 to
    entries of 1e38 with 3 and 8 workers. A worker whose own :math:`M_w Q` or
    :math:`M_w^\top P` overflows (max :math:`|M_w|` near ``3e38 / cols``) gives a non-finite
    mean and keeps the warm start (loud, as any non-finite input).

    Args:
      codec: the :func:`~jaxcomp.compressors.power_sgd` codec (its ``init`` draws the first Q).
      rank: target rank.
      epsilon: of :func:`~jaxcomp.compressors.orthogonalize`.
      warm_start: keep Q across calls.

    Returns:
      A :class:`~jaxcomp.compressors.ReduceProtocol` with :class:`LowRankReduce` state.
    """
    name = f"{codec.name}/low_rank"

    def init(like, num_workers=None):
        del num_workers
        return LowRankReduce(codec.init(_base.as_like(like)))

    def all_reduce(x, state, key, axis_name):
        shape = tuple(x.shape)
        r = _low_rank.effective_rank(shape, rank)
        if r == 0:
            return _protocol.pmean(x, axis_name), x, state
        num = _protocol.axis_size(axis_name)
        rows, cols = _low_rank.matrix_shape(shape)
        mat = x.reshape(rows, cols).astype(jnp.float32)
        q_old = state.q.q
        if not warm_start:  # a fresh Q ~ N(0, 1) from the shared key
            _base.check_key(key, name)
            q_old = jax.random.normal(key, q_old.shape, jnp.float32)
        # each worker's products scaled by 2**-k, 2**k >= num, before the psums: a sum of num
        # of them cannot overflow (P does not depend on it; Q's mean is unscaled after)
        k = _protocol.prescale_exponent(num, jnp.float32)
        q_scaled = _low_rank._pow2_normalized(q_old)  # as the codec: exact, overflow-safe
        mq = _protocol.psum((mat @ q_scaled) * (2.0**-k), axis_name)
        p = _low_rank.orthogonalize(mq, epsilon)
        q_sum = _protocol.psum(_low_rank.transposed_matmul(mat, p) * (2.0**-k), axis_name)
        q = _scaling.mean_of_sum(q_sum, num, k)
        mean = outer_sum(p, q).reshape(shape).astype(x.dtype)
        # the echo is the same reconstruction, recomputed (bit-identical) behind a barrier so
        # that XLA fuses it into its consumer: error feedback's ``c - echo`` then reads c and
        # writes the residual in one pass instead of re-reading the mean. Unused, it is dropped.
        echo = outer_sum(*lax.optimization_barrier((p, q))).reshape(shape).astype(x.dtype)
        # as the codec: a dependent (zero) column of P keeps its old Q column, and a
        # non-finite mean leaves the whole warm start as it was
        alive = jnp.any(p != 0, axis=0, keepdims=True) & jnp.all(jnp.isfinite(q))
        return mean, echo, LowRankReduce(_low_rank.PowerSGDState(jnp.where(alive, q, q_old)))

    def wire_bytes(like, num_workers):
        del num_workers
        r = _low_rank.effective_rank(tuple(like.shape), rank)
        if r == 0:
            return _base.dense_bytes(like)
        rows, cols = _low_rank.matrix_shape(tuple(like.shape))
        return 4 * (rows + cols) * r

    return _protocol.ReduceProtocol(init, all_reduce, wire_bytes, name)
