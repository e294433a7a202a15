"""Packed bit sets for the sort-free top-K (:mod:`jaxcomp._cpu._select`).

Masks are packed 32 entries per ``uint32`` word (entry ``32 j + i`` in bit ``i`` of word ``j``):
a count is a population count of the words, and :func:`_compact` lists the set positions of
each row in increasing order from the words alone. :func:`_kth_key` finds the ``n``-th largest
of a short list of keys by counting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_WORD = 32
_NO_KEY = -1  # padding: ranks below every magnitude (keys are >= 0)


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


_MANY_ROWS = 64  # from this many rows on, running sums/maxima go column by column


def _running(op, a: jax.Array) -> jax.Array:
    """Inclusive running ``op`` (``jnp.add``, ``jnp.maximum``) along axis 1 of ``a`` ``[b, n]``.

    For many rows a loop over the columns, each step one vectorised op on a column of ``b``
    entries updated in place: ~2x faster on XLA:CPU than ``lax.associative_scan``, whose
    ``log2(n)`` levels of strided slices, pads and concatenates each cost a pass. For few (long)
    rows, the associative scan.
    """
    b, n = a.shape
    if b < _MANY_ROWS or n < 2:
        return lax.associative_scan(op, a, axis=1)

    def body(j, a):
        prev = lax.dynamic_slice_in_dim(a, j - 1, 1, axis=1)
        cur = lax.dynamic_slice_in_dim(a, j, 1, axis=1)
        return lax.dynamic_update_slice_in_dim(a, op(prev, cur), j, axis=1)

    return lax.fori_loop(1, n, body, a)


def _compact(words: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """The first ``slots`` set positions of each row of ``words``, in increasing order.

    Word ``w`` holding ``c_w`` set bits fills the output slots ``[e_w, e_w + c_w)``, ``e_w`` the
    exclusive prefix sum of the counts. Each non-empty word writes ``(w, e_w)`` at slot ``e_w``
    (one scatter of ``d / 32`` entries per row, not of ``d``) and a running maximum along the
    slots hands every slot the word whose run it is in; the bit is then found inside that one
    word. No search: a binary search over the words costs ``log2(d / 32)`` gathers per slot,
    ~3x slower on XLA:CPU.

    Returns ``(idx int32[b, slots], count int32[b])``; slots past ``count`` hold junk indices.
    """
    b, nw = words.shape
    cnt = lax.population_count(words).astype(jnp.int32)
    incl = _running(jnp.add, cnt)
    start = incl - cnt
    w = lax.broadcasted_iota(jnp.int32, (b, nw), 1)
    rows = lax.broadcasted_iota(jnp.int32, (b, nw), 0)
    # (word, first slot) in one int32 when both fit, so that a single maximum carries both
    fits = nw <= (1 << 15) and slots < (1 << 16)
    key = (w << 16) | start if fits else w
    where = jnp.where(cnt > 0, start, slots)  # empty words write nothing
    tab = jnp.full((b, slots), -1, jnp.int32).at[rows, where].max(key, mode="drop")
    tab = _running(jnp.maximum, tab)
    if fits:
        wj, first = tab >> 16, tab & 0xFFFF
    else:
        wj = tab
        first = jnp.take_along_axis(start, jnp.maximum(wj, 0), axis=-1)
    wj = jnp.maximum(wj, 0)  # slots past the count (no run) point at word 0: junk
    j = lax.broadcasted_iota(jnp.int32, (b, slots), 1)
    word = jnp.take_along_axis(words, wj, axis=-1)
    bit = _select_bit(word, jnp.clip(j - first, 0, _WORD - 1))
    return wj * _WORD + bit, incl[:, -1]


def _words_many(keys: jax.Array, u: jax.Array) -> jax.Array:
    """:func:`_words` of ``keys > u_j`` for the thresholds ``u`` ``[b, P]``: ``uint32[b, P, w]``.

    One fusion for every threshold (P separate ones cost ~15% more on XLA:CPU).
    """
    b, d = keys.shape
    bits = (keys[:, None, :] > u[:, :, None]).reshape(b, u.shape[1], d // _WORD, _WORD)
    bits = bits.astype(jnp.uint32) << jnp.arange(_WORD, dtype=jnp.uint32)
    return lax.reduce(bits, jnp.uint32(0), lax.bitwise_or, (3,))


def _count_words(words: jax.Array) -> jax.Array:
    return jnp.sum(lax.population_count(words).astype(jnp.int32), axis=-1)


def _padded(a: jax.Array) -> jax.Array:
    """``a`` ``[b, n]`` padded with ``_NO_KEY`` to a multiple of 32 columns."""
    pad = -(-a.shape[1] // _WORD) * _WORD - a.shape[1]
    return jnp.pad(a, ((0, 0), (0, pad)), constant_values=_NO_KEY)


def _count_small(cells: jax.Array, u: jax.Array) -> jax.Array:
    """``#{cell > u_j}`` per row for ``uint16`` cells ``[b, 8 w]`` and thresholds ``[b, P]``.

    Packed 8 per ``uint8`` word: on XLA:CPU ~1.8x faster than ``int32`` keys packed 32 per
    word (:func:`_words_many`), which is what the sample bisection spends its time on.
    """
    b, s = cells.shape
    bits = cells[:, None, :] > u.astype(jnp.uint16)[:, :, None]
    bits = bits.reshape(b, u.shape[1], s // 8, 8).astype(jnp.uint8)
    words = lax.reduce(bits << jnp.arange(8, dtype=jnp.uint8), jnp.uint8(0), lax.bitwise_or, (3,))
    return jnp.sum(lax.population_count(words).astype(jnp.int32), axis=-1)


def _nth_set(words: jax.Array, r: jax.Array) -> jax.Array:
    """Position of the ``r``-th (0-based) set bit of each row of ``words`` (``r`` < the count)."""
    cnt = lax.population_count(words).astype(jnp.int32)
    incl = _running(jnp.add, cnt)
    w = jnp.sum((incl <= r[:, None]).astype(jnp.int32), axis=1)
    w = jnp.minimum(w, words.shape[1] - 1)
    before = jnp.take_along_axis(incl - cnt, w[:, None], -1)[:, 0]
    word = jnp.take_along_axis(words, w[:, None], -1)[:, 0]
    return w * _WORD + _select_bit(word, r - before)


def _kth_key(ckeys: jax.Array, need: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """The ``need``-th largest of each row of ``ckeys`` ``[b, n]`` (padding ``_NO_KEY``),
    known to lie in ``[lo, hi)``: the largest ``v`` with ``#{ckey >= v} >= need``.

    A bisection over ``[lo, hi)`` that stops a row as soon as its ``lo`` holds exactly
    ``need`` keys above it (then ``T`` is the smallest key ``>= lo``) or its ``hi`` exactly
    ``need - 1`` (the largest key ``< hi``): ~log2(n) counting steps instead of one per bit
    of the key range (22-30 for the bench's rows).
    """

    def count(v):
        return _count_words(_words(ckeys >= v[:, None]))

    def live(lo, hi, c_lo, c_hi):
        return (hi - lo > 1) & (c_lo != need) & (c_hi != need - 1)

    def step(c):  # invariant: c_lo = #{ckey >= lo} >= need > #{ckey >= hi} = c_hi
        lo, hi, c_lo, c_hi = c
        mid = lo + (hi - lo) // 2
        c_mid = count(mid)
        go = live(lo, hi, c_lo, c_hi)
        up = go & (c_mid >= need)
        down = go & (c_mid < need)
        return (
            jnp.where(up, mid, lo),
            jnp.where(down, mid, hi),
            jnp.where(up, c_mid, c_lo),
            jnp.where(down, c_mid, c_hi),
        )

    init = (lo, hi, count(lo), count(hi))
    lo, hi, c_lo, c_hi = lax.while_loop(lambda c: jnp.any(live(*c)), step, init)
    above = jnp.min(jnp.where(ckeys >= lo[:, None], ckeys, jnp.iinfo(jnp.int32).max), axis=1)
    below = jnp.max(jnp.where(ckeys < hi[:, None], ckeys, _NO_KEY), axis=1)
    return jnp.where(hi - lo <= 1, lo, jnp.where(c_lo == need, above, below))
