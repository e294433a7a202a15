"""PowerSGD: rank-r compression by one step of subspace iteration with a warm-started Q."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _scaling
from jaxcomp import _validate
from jaxcomp.compressors import _base
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


def _transposed_matmul_cpu(m: jax.Array, p: jax.Array) -> jax.Array:
    if p.shape[1] == 1:
        return (p.T @ m).T
    return jnp.sum(m[:, :, None] * p[:, None, :], axis=0)


def _transposed_matmul_dot(m: jax.Array, p: jax.Array) -> jax.Array:
    return m.T @ p


def transposed_matmul(m: jax.Array, p: jax.Array) -> jax.Array:
    """``m.T @ p`` for a large ``m`` and a skinny ``p`` (``[rows, r]``, small r).

    The XLA CPU backend runs this dot (contraction over the rows of ``m``) about 10x slower
    than ``m @ q``; as a fused multiply-and-reduce it runs at memory speed, except for r = 1
    where that reduce is slow too and ``(pᵀ m)ᵀ``, a matrix-vector product, is ~20x faster.
    Other backends use the dot. The choice is made when the program is lowered
    (``lax.platform_dependent``), so a program exported or cross-compiled for GPU or TPU on a
    CPU machine takes the dot.
    """
    return lax.platform_dependent(m, p, cpu=_transposed_matmul_cpu, default=_transposed_matmul_dot)


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
      >>> from jaxcomp import compressors
      >>> p = compressors.orthogonalize(jnp.array([[3.0, 6.0], [4.0, 8.0]]))  # rank 1
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


def power_sgd(
    rank: int = 1, *, epsilon: float = DEFAULT_EPSILON, seed: int = 0, warm_start: bool = True
) -> _base.Codec:
    r"""PowerSGD low-rank compression of one tensor (the single-worker codec).

    With :math:`M` the matrix view of ``x`` and :math:`Q` the state:

    .. math::
      P = \mathrm{orth}(M Q), \quad Q' = M^\top P, \quad \hat x = P Q'^\top

    :math:`P` has orthonormal (or zero) columns (:func:`orthogonalize`), so
    :math:`\hat x = P P^\top M` is the projection of :math:`M` onto the span of :math:`MQ`: a
    matrix of rank at most r (rank-deficient, zero blocks, all zero) is recovered exactly, at
    any magnitude (the warm-start Q is rescaled by powers of two before it multiplies
    :math:`M`, so nothing scales with :math:`|M|^2`; where :math:`MQ` or :math:`M^\top P`
    overflows, :math:`M` is rescaled by a power of two too, see :func:`unscaled`; 1e-30 to
    3.1e38 are tested, with and without error feedback; entries below ``2**-126`` are read
    as zero on XLA:CPU).

    ``Q'`` is kept as the next step's Q (warm start), which makes repeated compression of
    slowly changing tensors a power iteration. A column of :math:`P` that is zero (its column
    of :math:`MQ` depends on the earlier ones, e.g. when :math:`M` has rank below r) gives a
    zero column of :math:`Q'`; the state keeps the previous Q's column there instead, so that
    the iteration can pick up a new direction when one appears. A non-finite input gives a
    NaN payload (and reconstruction) and leaves the state unchanged. Tensors with fewer than
    2 dimensions, or with no entries, pass through uncompressed.

    The codec carries its multi-worker protocol (``codec.protocol``: all-reduce of P, then of
    Q, with the shared warm start), which the data-parallel transforms run.

    Args:
      rank: target rank r >= 1 (capped at ``min(rows, cols)``).
      epsilon: relative tolerance of :func:`orthogonalize`'s dependence test, in ``[0, 1]``
        (1 makes every column dependent: the codec then sends zeros).
        (The reference adds an absolute ``1e-8`` to column norms instead, which is not scale
        invariant; see :func:`orthogonalize`.)
      seed: seed of the initial Q ~ N(0, 1), identical on every worker (the reference draws it
        from ``RandomState(42)``); the initial Q is not orthogonalised, as in the reference.
      warm_start: keep Q across calls (``reuse_query=True`` in the reference). If ``False`` a
        fresh Q is drawn from the key at every call.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with :class:`LowRankPayload` payloads of
      ``(rows + cols) * r`` floats, and :class:`PowerSGDState` state. ``compress`` raises
      ``ValueError`` for an input whose matrix view does not match the state's Q, and
      ``decompress`` for a payload whose factors do not fit ``like``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.power_sgd(rank=4)
      >>> x = jnp.outer(jnp.arange(1.0, 4.0), jnp.arange(1.0, 7.0))   # rank 1 < 4
      >>> payload, state = codec.compress(x, codec.init(x), None)
      >>> bool(jnp.allclose(codec.decompress(payload, x), x, rtol=1e-5))
      True

    References:
      Vogels et al., `PowerSGD: Practical Low-Rank Gradient Compression for Distributed
      Optimization <https://arxiv.org/abs/1905.13727>`_, 2019.
    """
    _validate.check_int("rank", rank, 1)
    ok = isinstance(epsilon, (int, float)) and not isinstance(epsilon, bool)
    if not (ok and 0.0 <= epsilon <= 1.0):
        raise ValueError(f"epsilon must be a float in [0, 1]; got {epsilon!r}.")
    name = f"power_sgd(rank={rank})"

    def initial_q(cols: int, r: int, key) -> jax.Array:
        return jax.random.normal(key, (cols, r), jnp.float32)

    def q_shape(shape: tuple[int, ...]) -> tuple[int, int]:
        r = effective_rank(shape, rank)
        return (matrix_shape(shape)[1], r) if r else (0, 0)

    def init(x):
        _base.check_float(x, name)
        cols, r = q_shape(tuple(x.shape))
        if r == 0:
            return PowerSGDState(jnp.zeros((0, 0), jnp.float32))
        return PowerSGDState(initial_q(cols, r, jax.random.key(seed)))

    def compress(x, state, key=None):
        _base.check_float(x, name)
        shape = tuple(x.shape)
        if tuple(state.q.shape) != q_shape(shape):
            raise ValueError(
                f"{name}: compress got x of {_checks.describe(x)}, which needs a state Q of "
                f"shape {list(q_shape(shape))}, but the state's Q is {list(state.q.shape)}: "
                "the state was initialised for another shape (call init with this one)."
            )
        cols, r = q_shape(shape)
        if r == 0:
            return x, state
        rows = matrix_shape(shape)[0]
        m = x.reshape(rows, cols).astype(jnp.float32)
        q_old = state.q
        if not warm_start:
            _base.check_key(key, name)
            q_old = initial_q(cols, r, key)
        q_scaled = _pow2_normalized(q_old)

        def factors(m):
            p = orthogonalize(m @ q_scaled, epsilon)
            return p, transposed_matmul(m, p)

        def rescaled(m):  # |M| near 3e38: M Q or M^T P overflowed; exact, one more pass
            f = max_scale(m)
            return unscaled(*factors(m * f), f)

        p, q = factors(m)
        p, q = lax.cond(jnp.all(jnp.isfinite(q)), lambda m: (p, q), rescaled, m)
        # a zero column of P (dependent column of MQ) gives a zero column of Q: keep the old
        # one; a non-finite input leaves the whole state as it was
        alive = jnp.any(p != 0, axis=0, keepdims=True) & jnp.all(jnp.isfinite(q))
        return LowRankPayload(p, q), PowerSGDState(jnp.where(alive, q, q_old))

    def decompress(payload, like):
        shape = tuple(like.shape)
        cols, r = q_shape(shape)
        if r == 0:
            _checks.check_fits(name, like, [("payload", payload, shape, None)])
            return payload.astype(like.dtype)
        rows = matrix_shape(shape)[0]
        _checks.check_fits(
            name,
            like,
            [("p", payload.p, (rows, r), jnp.float32), ("q", payload.q, (cols, r), jnp.float32)],
        )
        return (payload.p @ payload.q.T).reshape(shape).astype(like.dtype)

    from jaxcomp.compressors import _power_sgd as _low_rank_reduce  # (moved next: no cycle)

    codec = _base.Codec(init, compress, decompress, name, _base.Reduction.GATHER, not warm_start)
    return codec._replace(
        protocol=_low_rank_reduce.power_sgd_protocol(codec, rank, epsilon, warm_start)
    )
