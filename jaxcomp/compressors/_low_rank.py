"""PowerSGD: rank-r compression by one step of subspace iteration with a warm-started Q."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compressors import _base


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
      p: ``float32[rows, r]`` with orthonormal columns.
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
    """``m.T @ p`` for a large ``m`` and a skinny ``p`` (``[rows, r]``, small r).

    The XLA CPU backend runs this dot (contraction over the rows of ``m``) about 10x slower
    than ``m @ q``; as a fused multiply-and-reduce it runs at memory speed, except for r = 1
    where that reduce is slow too and ``(pᵀ m)ᵀ``, a matrix-vector product, is ~20x faster.
    Other backends use the dot.
    """
    if jax.default_backend() == "cpu":
        if p.shape[1] == 1:
            return (p.T @ m).T
        return jnp.sum(m[:, :, None] * p[:, None, :], axis=0)
    return m.T @ p


def orthogonalize(p: jax.Array, epsilon: float = 1e-8) -> jax.Array:
    r"""Gram-Schmidt on the columns of ``p`` (in ``float32``), as the PowerSGD reference.

    Each column is divided by :math:`\|c\|_2 + \epsilon` and then projected out of the columns
    that follow; an all-zero column stays zero instead of becoming NaN.

    Args:
      p: ``[n, r]`` matrix.
      epsilon: added to each column norm.

    Returns:
      ``float32[n, r]`` with orthonormal (or zero) columns.
    """
    p = p.astype(jnp.float32)
    cols = []
    for i in range(p.shape[1]):
        col = p[:, i]
        for prev in cols:
            col = col - jnp.dot(prev, col) * prev
        col = col / (jnp.sqrt(jnp.dot(col, col)) + epsilon)
        cols.append(col)
    return jnp.stack(cols, axis=1)


def power_sgd(
    rank: int = 1, *, epsilon: float = 1e-8, seed: int = 0, warm_start: bool = True
) -> _base.Codec:
    r"""PowerSGD low-rank compression of one tensor (the single-worker codec).

    With :math:`M` the matrix view of ``x`` and :math:`Q` the state:

    .. math::
      P = \mathrm{orth}(M Q), \quad Q' = M^\top P, \quad \hat x = P Q'^\top

    :math:`P P^\top M` is the projection of :math:`M` onto the span of :math:`MQ`, so a matrix of
    rank at most r is recovered exactly. ``Q'`` is kept as the next step's Q (warm start), which
    makes repeated compression of slowly changing tensors a power iteration. Tensors with fewer
    than 2 dimensions pass through uncompressed. If a column of ``Q'`` comes out all zero (e.g.
    for an all-zero input) the previous column is kept so the iteration can recover.

    For the multi-worker protocol (all-reduce of P, then of Q) see
    :func:`jaxcomp.comm.compressed_pmean`; it reuses :func:`orthogonalize`, the same state and
    the arguments below (from ``Codec.options``).

    Args:
      rank: target rank r >= 1 (capped at ``min(rows, cols)``).
      epsilon: added to column norms in :func:`orthogonalize`.
      seed: seed of the initial Q ~ N(0, 1), identical on every worker (the reference draws it
        from ``RandomState(42)``); the initial Q is not orthogonalised, as in the reference.
      warm_start: keep Q across calls (``reuse_query=True`` in the reference). If ``False`` a
        fresh Q is drawn from the key at every call.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with :class:`LowRankPayload` payloads of
      ``(rows + cols) * r`` floats, and :class:`PowerSGDState` state.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.power_sgd(rank=1)
      >>> x = jnp.outer(jnp.arange(1.0, 4.0), jnp.arange(1.0, 3.0))   # rank 1
      >>> payload, state = codec.compress(x, codec.init(x), None)
      >>> bool(jnp.allclose(codec.decompress(payload, x), x, atol=1e-5))
      True

    References:
      Vogels et al., `PowerSGD: Practical Low-Rank Gradient Compression for Distributed
      Optimization <https://arxiv.org/abs/1905.13727>`_, 2019.
    """
    _base.check_int_range("rank", rank, 1)
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0):
        raise ValueError(f"epsilon must be a float >= 0; got {epsilon!r}.")
    name = f"power_sgd(rank={rank})"

    def initial_q(cols: int, r: int, key) -> jax.Array:
        return jax.random.normal(key, (cols, r), jnp.float32)

    def init(x):
        _base.check_float(x, name)
        r = effective_rank(tuple(x.shape), rank)
        if r == 0:
            return PowerSGDState(jnp.zeros((0, 0), jnp.float32))
        _, cols = matrix_shape(tuple(x.shape))
        return PowerSGDState(initial_q(cols, r, jax.random.key(seed)))

    def compress(x, state, key=None):
        _base.check_float(x, name)
        r = effective_rank(tuple(x.shape), rank)
        if r == 0:
            return x, state
        rows, cols = matrix_shape(tuple(x.shape))
        m = x.reshape(rows, cols).astype(jnp.float32)
        q_old = state.q
        if not warm_start:
            _base.check_key(key, name)
            q_old = initial_q(cols, r, key)
        p = orthogonalize(m @ q_old, epsilon)
        q = transposed_matmul(m, p)
        alive = jnp.sum(q * q, axis=0, keepdims=True) > 0
        return LowRankPayload(p, q), PowerSGDState(jnp.where(alive, q, q_old))

    def decompress(payload, like):
        if effective_rank(tuple(like.shape), rank) == 0:
            return payload.astype(like.dtype)
        return (payload.p @ payload.q.T).reshape(like.shape).astype(like.dtype)

    options = _base.Options(rank=rank, epsilon=epsilon, seed=seed, warm_start=warm_start)
    return _base.Codec(
        init, compress, decompress, name, _base.Reduction.LOW_RANK, not warm_start,
        options=options,
    )  # fmt: skip
