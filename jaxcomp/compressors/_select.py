"""Exact top-K selection without a sort: a sampled bracket, a bit-pattern count, a compaction.

For non-negative ``float32`` magnitudes the ``int32`` bit pattern is order-preserving, so the
K-th largest magnitude ``T`` of a row can be found on integer keys. On the CPU ``lax.top_k`` of
4M entries costs 30-90 copies of the tensor; here a row of ``d`` keys is selected with a few
passes:

1. **Bracket.** A strided sample of ``s`` keys gives, from its order statistics, a pair
   ``lo <= T <= hi`` that holds unless the sample is unrepresentative (checked in step 2).
2. **Count** (one pass): ``n_hi = #{key > hi}`` and the candidate mask ``lo <= key <= hi``,
   packed 32 per ``uint32`` word; the bracket is right iff ``n_hi < K <= n_hi + #candidates``.
3. **Refine**: the candidates (a few thousand) are compacted in index order; ``T`` is the
   ``(K - n_hi)``-th largest of them, and the cut ``p`` that keeps the lowest-index entries equal
   to ``T`` is read off the same list.
4. **Select** (one pass): ``key > T or (key == T and i < p)`` as words; a population count, a
   prefix sum over the ``d / 32`` words and a binary search per output slot give the K indices
   in increasing order.

If any row's bracket fails (an adversarial sample, or more tied candidates than the buffer
holds), ``T`` and ``p`` come from ``lax.top_k`` instead (``lax.cond``): the selected set is
the same either way, only the time differs. Ties at ``T`` keep the lowest indices, which is
``lax.top_k``'s own rule, so the selected set equals ``lax.top_k``'s bit for bit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

_WORD = 32
_NO_KEY = -1  # padding: ranks below every magnitude (keys are >= 0)
_SMALL = 1 << 14  # inputs of at most this many entries use lax.top_k directly (same result)


def magnitude_keys(x: jax.Array) -> jax.Array:
    """``int32`` keys ordered as ``|x|``, with NaN ranked as ``+inf`` (so it is always kept)."""
    a = jnp.abs(x.astype(jnp.float32))
    a = jnp.where(jnp.isnan(a), jnp.inf, a)
    return lax.bitcast_convert_type(a, jnp.int32)


def reference_indices(keys: jax.Array, k: int) -> jax.Array:
    """``lax.top_k``'s K indices of each row of ``keys`` ``[b, d]``, in increasing order."""
    _, idx = lax.top_k(_as_float(keys), k)
    return jnp.sort(idx, axis=-1)


def _words(mask: jax.Array) -> jax.Array:
    """``bool[b, 32 w]`` -> ``uint32[b, w]``, entry ``32 j + i`` in bit ``i`` of word ``j``."""
    b, d = mask.shape
    bits = mask.reshape(b, d // _WORD, _WORD).astype(jnp.uint32)
    bits = bits << jnp.arange(_WORD, dtype=jnp.uint32)
    return lax.reduce(bits, jnp.uint32(0), lax.bitwise_or, (2,))


def _select_bit(word: jax.Array, rank: jax.Array) -> jax.Array:
    """Position of the ``rank``-th (0-based) set bit of each ``uint32`` ``word``."""
    pos = jnp.zeros(word.shape, jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = word & jnp.uint32((1 << width) - 1)
        c = lax.population_count(low).astype(jnp.int32)
        up = rank >= c
        rank = jnp.where(up, rank - c, rank)
        word = jnp.where(up, word >> jnp.uint32(width), low)
        pos = pos + jnp.where(up, width, 0)
    return pos


def _compact(words: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """The first ``slots`` set positions of each row of ``words``, in increasing order.

    Returns ``(idx int32[b, slots], count int32[b])``; slots past ``count`` hold junk indices.
    """
    cnt = lax.population_count(words).astype(jnp.int32)
    incl = jnp.cumsum(cnt, axis=-1)
    j = jnp.arange(slots, dtype=jnp.int32)
    w = jax.vmap(lambda c: jnp.searchsorted(c, j, side="right"))(incl)
    w = jnp.minimum(w, words.shape[-1] - 1)
    before = jnp.take_along_axis(incl - cnt, w, axis=-1)
    word = jnp.take_along_axis(words, w, axis=-1)
    bit = _select_bit(word, jnp.maximum(j - before, 0))
    return w * _WORD + bit, incl[:, -1]


def _plan(d: int, k: int) -> tuple[int, int, int, int, int]:
    """(sample stride, sample ranks of the top and bottom pivots, pivots, candidate buffer).

    Long rows (one tensor) take a large sample and two pivots; short rows (per sample) a
    small one and eight pivots, which narrow the bracket in the same counting pass.
    """
    if d > 65536:
        stride, pivots = max(1, d // 131072), 2
    else:
        stride, pivots = max(1, d // 512), 8
    s = -(-d // stride)
    r = k * s / d  # expected sample rank of T
    margin = 5.0 * math.sqrt(r + 1.0) + 2.0
    top = int(math.floor(r - margin))
    bottom = min(s - 1, int(math.ceil(r + margin)))
    gap = -(-(bottom - max(top, 0)) // (pivots - 1)) + 1  # sample ranks between pivots
    return stride, top, bottom, pivots, min(d, 2 * gap * stride + 64)


def _as_float(keys: jax.Array) -> jax.Array:
    # lax.top_k of int32 is ~20x slower than of float32 on XLA:CPU; keys >= 0 map back exactly
    return lax.bitcast_convert_type(keys, jnp.float32)


def _count_above(kp: jax.Array, u: jax.Array) -> jax.Array:
    """``#{key > u_j}`` per row for thresholds ``u`` ``[b, P]`` (one pass, counted as words)."""
    counts = [
        jnp.sum(lax.population_count(_words(kp > u[:, j : j + 1])).astype(jnp.int32), axis=-1)
        for j in range(u.shape[1])
    ]
    return jnp.stack(counts, axis=1)


def _bracketed(kp: jax.Array, d: int, k: int):
    """``(T, p, ok)`` per row from sampled pivots; ``ok`` is False where the bracket failed."""
    b = kp.shape[0]
    stride, top, bottom, pivots, cand = _plan(d, k)
    sample, _ = lax.top_k(_as_float(kp[:, :d:stride]), bottom + 1)
    sample = lax.bitcast_convert_type(sample, jnp.int32)
    ranks = [round(top + (bottom - top) * j / (pivots - 1)) for j in range(pivots)]
    big = jnp.full((b,), jnp.iinfo(jnp.int32).max, jnp.int32)
    # thresholds u_0 > ... : T lies in (u_{a+1}, u_a] where #{key > u_a} < K <= #{key > u_{a+1}}
    u = [big if r < 0 else sample[:, r] for r in ranks[:-1]] + [sample[:, bottom] - 1]
    u = jnp.stack(u, axis=1)
    above = _count_above(kp, u)
    a = jnp.clip(jnp.sum(above < k, axis=1) - 1, 0, pivots - 2)
    u_a = jnp.take_along_axis(u, a[:, None], 1)[:, 0]
    u_b = jnp.take_along_axis(u, a[:, None] + 1, 1)[:, 0]
    n_a = jnp.take_along_axis(above, a[:, None], 1)[:, 0]
    ok = (above[:, 0] < k) & (above[:, -1] >= k)
    in_bracket = (kp > u_b[:, None]) & (kp <= u_a[:, None])
    cidx, n_cand = _compact(_words(in_bracket), cand)
    ok = ok & (n_cand <= cand)
    need = k - n_a  # entries to take from the candidates, largest first
    valid = jnp.arange(cand)[None, :] < n_cand[:, None]
    ckeys = jnp.where(valid, jnp.take_along_axis(kp, jnp.minimum(cidx, d - 1), -1), _NO_KEY)
    cf = jnp.where(valid, _as_float(ckeys), -1.0)
    kk = min(k, cand)
    topv, _ = lax.top_k(cf, kk)
    t = jnp.take_along_axis(topv, jnp.clip(need - 1, 0, kk - 1)[:, None], -1)[:, 0]
    t = lax.bitcast_convert_type(jnp.maximum(t, 0.0), jnp.int32)
    p = _cut(ckeys, cidx, t, need - jnp.sum(ckeys > t[:, None], axis=-1))
    return t, p, ok


def _cut(keys: jax.Array, idx: jax.Array, t: jax.Array, need_eq: jax.Array) -> jax.Array:
    """One past the index of the ``need_eq``-th entry equal to ``t`` (entries in index order)."""
    eq = keys == t[:, None]
    q = jnp.argmax(jnp.cumsum(eq, axis=-1) >= need_eq[:, None], axis=-1)
    return jnp.take_along_axis(idx, q[:, None], -1)[:, 0] + 1


def _reference_cut(keys: jax.Array, k: int):
    """``(T, p)`` from ``lax.top_k`` (the fallback)."""
    vals, idx = lax.top_k(_as_float(keys), k)
    vals = lax.bitcast_convert_type(vals, jnp.int32)
    t = vals[:, -1]
    p = jnp.max(jnp.where(vals == t[:, None], idx, -1), axis=-1) + 1
    return t, p


def top_k_indices(x: jax.Array, k: int) -> jax.Array:
    """Indices of the K largest magnitudes of each row of ``x`` ``[b, d]``, increasing.

    Ties keep the lowest indices and NaN ranks as ``+inf``: the set equals
    ``lax.top_k(magnitude, k)``'s (:func:`reference_indices`).

    Args:
      x: a floating ``[b, d]`` array.
      k: entries kept per row, ``1 <= k <= d``.

    Returns:
      ``int32[b, k]`` indices, increasing along each row.

    Example:
      >>> import jax.numpy as jnp
      >>> top_k_indices(jnp.array([[0.5, -3.0, 1.0, 3.0]]), 2)
      Array([[1, 3]], dtype=int32)
    """
    b, d = x.shape
    if k == d:
        return jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32), (b, d))
    if b * d <= _SMALL or d < 256:
        return reference_indices(magnitude_keys(x), k)
    pad = -(-d // _WORD) * _WORD - d
    kp = jnp.pad(magnitude_keys(x), ((0, 0), (0, pad)), constant_values=_NO_KEY)
    t, p, ok = _bracketed(kp, d, k)
    # the fallback recomputes the keys from x: a cond holding kp itself costs ~0.7x of the
    # whole selection on XLA:CPU (kp is then materialised for the branch, not fused)
    t, p = lax.cond(
        jnp.all(ok),
        lambda x, t, p: (t, p),
        lambda x, t, p: _reference_cut(magnitude_keys(x), k),
        x,
        t,
        p,
    )
    i = lax.broadcasted_iota(jnp.int32, kp.shape, 1)
    sel = (kp > t[:, None]) | ((kp == t[:, None]) & (i < p[:, None]))
    idx, _ = _compact(_words(sel), k)
    return idx
