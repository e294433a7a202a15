"""Exact top-K selection without a sort: a sampled bracket, a bit-pattern count, a compaction.

For non-negative ``float32`` magnitudes the ``int32`` bit pattern is order-preserving, so the
K-th largest magnitude ``T`` of a row can be found on integer keys. On the CPU ``lax.top_k`` of
4M entries costs 30-90 copies of the tensor; here a row of ``d`` keys is selected with a few
passes:

1. **Bracket.** A strided sample of ``s`` keys gives, from its order statistics, thresholds
   ``u_0 > u_1 > ...`` around ``T`` that hold unless the sample is unrepresentative (checked in
   step 2). Long rows (one tensor) read two off ``lax.top_k`` of a large sample; short rows (per
   sample, ``d <= 65536``), where ``lax.top_k`` of thousands of small samples is itself slow,
   bisect a sample of ~512 keys on a grid of ``2**15`` key units for four pivots, stopping
   within a few sample ranks of each (:func:`_sample_cells`).
2. **Count** (one pass, :func:`_refine`): ``#{key > u_j}`` for every threshold, packed 32 per
   ``uint32`` word; ``T`` lies in ``(u_{a+1}, u_a]`` where ``#{key > u_a} < K <= #{key >
   u_{a+1}}``, and the candidates are the words ``W_{a+1} & ~W_a`` (no second pass).
3. **Refine**: the candidates (a few hundred per sample, ~24K for 4M entries) are compacted in
   index order; ``T`` is the ``(K - n_a)``-th largest of them, by a bisection on their packed
   count that stops at the first exact count (:func:`_kth_key`), and the cut ``p`` that keeps
   the lowest-index entries equal to ``T`` is read off the same list.
4. **Select** (one pass): ``key > T or (key == T and i < p)`` as words; a population count, a
   prefix sum over the ``d / 32`` words, a scatter of each word's first output slot and a
   running maximum give the K indices in increasing order (:func:`_compact`; the running sums
   and maxima go column by column for many rows, :func:`_running`).

Where a row's bracket fails (an adversarial sample, or more tied candidates than the buffer
holds: all-equal, all-zero or subnormal rows), its ``T`` and ``p`` come from ``lax.top_k``
instead, for those rows alone when they are few (:func:`_fall_back`): the selected set is the
same either way, only the time differs. Ties at ``T``
keep the lowest indices, which is ``lax.top_k``'s own rule, so the selected set equals
``lax.top_k``'s bit for bit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._cpu._topk_words import _NO_KEY
from jaxcomp._cpu._topk_words import _WORD
from jaxcomp._cpu._topk_words import _compact
from jaxcomp._cpu._topk_words import _count_small
from jaxcomp._cpu._topk_words import _count_words
from jaxcomp._cpu._topk_words import _kth_key
from jaxcomp._cpu._topk_words import _nth_set
from jaxcomp._cpu._topk_words import _padded
from jaxcomp._cpu._topk_words import _words
from jaxcomp._cpu._topk_words import _words_many
from jaxcomp._vma import to_varying
from jaxcomp._vma import varying_axes

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


def _plan(d: int, k: int) -> tuple[int, int, int, int, int]:
    """(sample stride, sample ranks of the top and bottom pivots, pivots, candidate buffer) for
    long rows (one tensor, ``d > 65536``): a large sample and two pivots."""
    stride, pivots = max(1, d // 131072), 2
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
    return _refine(kp, jnp.stack(u, axis=1), d, k, cand)


def _refine(kp: jax.Array, u: jax.Array, d: int, k: int, cand: int):
    """``(T, p, ok)`` per row from thresholds ``u_0 > u_1 > ...`` ``[b, P]`` (``u_0`` may be
    ``int32`` max: no bound), in one pass over the keys and a few over the candidates.

    One counting pass gives ``#{key > u_j}`` as words ``W_j``; ``T`` lies in ``(u_{a+1}, u_a]``
    where ``#{key > u_a} < K <= #{key > u_{a+1}}``, and ``ok`` iff such an ``a`` exists and its
    candidates (``W_{a+1} & ~W_a``: no second pass) fit ``cand`` slots. The candidates are
    compacted (:func:`_compact`), ``T`` is their ``(K - n_a)``-th largest key
    (:func:`_kth_key`) and ``p`` one past the index of the candidate equal to ``T`` that
    completes ``K``.
    """
    b, pivots = u.shape
    big = jnp.iinfo(jnp.int32).max
    above = _words_many(kp, u)  # [b, P, w]: key > u_j
    n = _count_words(above)
    a = jnp.clip(jnp.sum(n < k, axis=1) - 1, 0, pivots - 2)
    u_a = jnp.take_along_axis(u, a[:, None], 1)[:, 0]
    u_b = jnp.take_along_axis(u, a[:, None] + 1, 1)[:, 0]
    n_a = jnp.take_along_axis(n, a[:, None], 1)[:, 0]
    n_b = jnp.take_along_axis(n, a[:, None] + 1, 1)[:, 0]
    # every condition checked explicitly: nothing assumes the pivots came out ordered
    ok = (n_a < k) & (n_b >= k) & (u_b < u_a) & (n_b - n_a <= cand)
    w_a = jnp.take_along_axis(above, a[:, None, None], 1)[:, 0]
    w_b = jnp.take_along_axis(above, a[:, None, None] + 1, 1)[:, 0]
    cidx, n_cand = _compact(w_b & ~w_a, cand)  # u_b < key <= u_a
    valid = lax.broadcasted_iota(jnp.int32, (b, cand), 1) < n_cand[:, None]
    gathered = jnp.take_along_axis(kp, jnp.clip(cidx, 0, d - 1), -1, mode="promise_in_bounds")
    ckeys = _padded(jnp.where(valid, gathered, _NO_KEY))
    need = k - n_a  # entries to take from the candidates, largest first
    lo = u_b + 1
    hi = jnp.maximum(jnp.where(u_a == big, big, u_a + 1), lo + 1)
    t = _kth_key(ckeys, need, lo, hi)
    need_eq = need - _count_words(_words(ckeys > t[:, None]))  # >= 1
    q = _nth_set(_words(ckeys == t[:, None]), need_eq - 1)  # the need_eq-th equal candidate
    p = jnp.take_along_axis(cidx, jnp.minimum(q, cand - 1)[:, None], -1)[:, 0] + 1
    return t, p, ok


_CELL = 15  # the short-row bracket's thresholds are multiples of 2**15 in key space


def _short_plan(d: int, k: int, pivots: int) -> tuple[int, list[int], int, int]:
    """(sample stride, the pivots' sample ranks, candidate buffer, rank tolerance) for rows of
    ``d``."""
    stride = max(1, d // 512)
    s = -(-d // stride)
    r = k * s / d  # expected sample rank of T
    margin = 5.0 * math.sqrt(r + 1.0) + 2.0
    top = int(math.floor(r - margin))
    bottom = min(s - 1, int(math.ceil(r + margin)))
    ranks = [round(top + (bottom - top) * j / (pivots - 1)) for j in range(pivots)]
    gap = -(-(bottom - max(top, 0)) // (pivots - 1)) + 1  # sample ranks between pivots
    tol = gap // 4  # a pivot's sample rank may fall short of its target by this much
    cand = 2 * (gap + tol) * stride + 2 * (d >> (31 - _CELL - 8)) + 64
    return stride, ranks, min(-(-d // _WORD) * _WORD, -(-cand // _WORD) * _WORD), tol


def _sample_cells(real: jax.Array, want: list[int], tol: int) -> jax.Array:
    """Per row of sample cells ``real`` ``[b, s]`` (``0 <= cell < 2**16``) and target ranks
    ``want`` ``[P]``: a cell ``m_j`` with ``want_j - tol <= #{cell >= m_j} <= want_j`` (the
    smallest such cell when ``tol == 0``), by a bisection that stops as soon as every pivot of
    a row is within ``tol`` (:func:`_count_small` per step).

    The bisection starts from the minimum of the maxima of ``g``-sample groups (at least
    ``s / g`` samples lie above it, more than every target) rather than the sample's minimum:
    for Gaussian rows 2-3 counting steps fewer.
    """
    b, s = real.shape
    pivots, top_want = len(want), max(want)
    want = jnp.array(want, jnp.int32)
    g = 1
    while -(-s // (2 * g)) > top_want + 1 and 2 * g <= s:
        g *= 2
    # read once (strided out of the input): every consumer would otherwise re-read it
    real = lax.optimization_barrier(real.astype(jnp.uint16))
    # padding 0 is never counted: every threshold mid - 1 is >= lo >= 0
    cells = jnp.pad(real, ((0, 0), (0, -(-s // 8) * 8 - s)))
    if g > 1:  # groups {i, i + G, ...}: a max over a major axis, elementwise on XLA:CPU
        groups = jnp.pad(real, ((0, 0), (0, -(-s // g) * g - s)))
        lo0 = jnp.min(jnp.max(groups.reshape(b, g, -1), axis=1), axis=1, keepdims=True)
    else:
        lo0 = jnp.min(real, axis=1, keepdims=True)
    lo0 = jnp.broadcast_to(lo0.astype(jnp.int32), (b, pivots))
    hi0 = jnp.max(real, axis=1, keepdims=True).astype(jnp.int32) + 1
    hi0 = jnp.broadcast_to(hi0, (b, pivots))
    c_hi0 = lo0 * 0  # zeros from the data: per-device (varying) under shard_map, like c_mid

    def live(lo, hi, c_hi):
        return (hi - lo > 1) & (c_hi < want - tol)

    def step(c):  # invariant: #{cell >= lo} > want >= #{cell >= hi} = c_hi
        lo, hi, c_hi = c
        mid = (lo + hi) // 2
        c_mid = _count_small(cells, mid - 1)
        go = live(lo, hi, c_hi)
        small = c_mid <= want
        lo = jnp.where(go & ~small, mid, lo)
        hi = jnp.where(go & small, mid, hi)
        return lo, hi, jnp.where(go & small, c_mid, c_hi)

    _, m, _ = lax.while_loop(lambda c: jnp.any(live(*c)), step, (lo0, hi0, c_hi0))
    return m


def _short_bracketed(kp: jax.Array, d: int, k: int, pivots: int = 4):
    """``(T, p, ok)`` per row for short rows (per sample), without ``lax.top_k``.

    1. The sample's cells (keys ``>> 15``) at ``pivots`` sample ranks around ``K``'s, within a
       few ranks (:func:`_sample_cells`: ~6-10 counting steps on the in-cache sample, as words);
    2. one counting pass over the rows: ``#{key > u_j}`` for the pivots' thresholds ``u_j``,
       as words; ``T`` lies in ``(u_{a+1}, u_a]`` where ``#{key > u_a} < K <= #{key >
       u_{a+1}}``, and ``ok`` iff such an ``a`` exists and its candidates fit the buffer;
    3. the candidates (the words of step 2, ``W_{a+1} & ~W_a``: no second pass) compacted
       (:func:`_compact`) and ``T`` their ``(K - n_a)``-th largest key (:func:`_kth_key`);
       ``p`` from the candidates equal to ``T`` (:func:`_refine`, shared with long rows).
    """
    stride, ranks, cand, tol = _short_plan(d, k, pivots)
    # thresholds u_0 > u_1 > ...: u_j = (m_j << 15) - 1 with m_j a cell such that
    # rank_j - tol <= #{sample cell >= m_j} <= rank_j, and the last one a cell lower
    # (its target raised by tol + 1: #{sample > u} > bottom)
    want = [max(r, 0) for r in ranks[:-1]] + [ranks[-1] + tol + 1]
    m = _sample_cells(kp[:, :d:stride] >> _CELL, want, tol)
    m = m.at[:, -1].add(-1)
    big = jnp.iinfo(jnp.int32).max
    u = (m << _CELL) - 1
    if ranks[0] < 0:
        u = u.at[:, 0].set(big)
    return _refine(kp, u, d, k, cand)


def _reference_cut(keys: jax.Array, k: int):
    """``(T, p)`` from ``lax.top_k`` (the fallback)."""
    vals, idx = lax.top_k(_as_float(keys), k)
    vals = lax.bitcast_convert_type(vals, jnp.int32)
    t = vals[:, -1]
    p = jnp.max(jnp.where(vals == t[:, None], idx, -1), axis=-1) + 1
    return t, p


_FEW_ROWS = 16  # up to this many rows whose bracket failed are redone alone by lax.top_k


def _fall_back(x: jax.Array, t: jax.Array, p: jax.Array, ok: jax.Array, k: int):
    """``(T, p)`` with every row whose bracket failed (``~ok``) taken from ``lax.top_k``.

    Up to ``_FEW_ROWS`` failed rows (a dead activation: all zero, all equal, subnormal) are
    gathered and redone alone; more, and every row is redone. The fallback recomputes the
    keys from ``x``: a branch holding the padded keys themselves costs ~0.7x of the whole
    selection on XLA:CPU (they are then materialised for the branch, not fused).
    """
    b = x.shape[0]
    n_bad = jnp.sum(~ok)

    def keep(x, t, p):
        return t, p

    def every_row(x, t, p):
        return _reference_cut(magnitude_keys(x), k)

    if b <= _FEW_ROWS:
        return lax.cond(n_bad == 0, keep, every_row, x, t, p)

    def few_rows(x, t, p):
        # unused slots name row 0, whose reference (T, p) is right whether it failed or not
        (bad,) = jnp.nonzero(~ok, size=_FEW_ROWS, fill_value=0)
        t_bad, p_bad = _reference_cut(magnitude_keys(x[bad]), k)
        return t.at[bad].set(t_bad), p.at[bad].set(p_bad)

    branch = jnp.where(n_bad == 0, 0, jnp.where(n_bad <= _FEW_ROWS, 1, 2))
    return lax.switch(branch, [keep, few_rows, every_row], x, t, p)


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
    if k == d:  # every entry, typed as varying as x is (a constant broke shard_map's switch)
        every = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32), (b, d))
        return to_varying(every, varying_axes(x))
    if b * d <= _SMALL or d < 256:
        return reference_indices(magnitude_keys(x), k)
    pad = -(-d // _WORD) * _WORD - d
    kp = jnp.pad(magnitude_keys(x), ((0, 0), (0, pad)), constant_values=_NO_KEY)
    t, p, ok = _bracketed(kp, d, k) if d > 65536 else _short_bracketed(kp, d, k)
    t, p = _fall_back(x, t, p, ok, k)
    i = lax.broadcasted_iota(jnp.int32, kp.shape, 1)
    sel = (kp > t[:, None]) | ((kp == t[:, None]) & (i < p[:, None]))
    idx, _ = _compact(_words(sel), k)
    return idx
