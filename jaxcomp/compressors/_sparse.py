"""Sparsifying codecs: TopK (exact, blockwise or approximate); RandK is in ``_rand_k``."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import _cpu
from jaxcomp import _validate
from jaxcomp._cpu import _select
from jaxcomp.compressors import _base
from jaxcomp.compressors import _block_max
from jaxcomp.compressors import _checks

TOPK_METHODS = ("exact", "blockwise", "approx")


class SparsePayload(NamedTuple):
    """Kept values and where they go.

    Attributes:
      values: ``[..., k]`` kept values, in the input dtype.
      indices: ``[..., k]`` positions, in the smallest unsigned dtype that can address the
        selection range (the tensor, a sample, or a block).
    """

    values: jax.Array
    indices: jax.Array


def kept_count(n: int, fraction: float | None, count: int | None) -> int:
    """Number of entries kept out of ``n``: ``count``, or ``n - int(n * (1 - fraction))``.

    The fraction rule is Rudakov et al.'s (``n_lowest = int(D * (1 - topk))``), at least 1
    when ``n > 0``, and 0 for ``n == 0`` (a zero-size input keeps nothing). A ``count`` above
    ``n`` is a ``ValueError``.
    """
    if count is not None:
        if count > n:
            raise ValueError(f"count={count} exceeds the {n} entries available.")
        return count
    if n == 0:
        return 0
    return max(1, n - int(n * (1.0 - fraction)))


def check_k_args(fraction, count):
    if (fraction is None) == (count is None):
        raise ValueError("give exactly one of fraction or count.")
    if fraction is not None:
        _validate.check_fraction("fraction", fraction)
    else:
        _validate.check_int("count", count, 1)


def _flat_positions(idx: jax.Array, b: int, d: int, nb: int, blk: int):
    """``(flat, valid)`` for block indices ``idx`` ``[..., b, nb, kb]``: each index's position in
    the unpadded ``[b * d]`` output, and whether it lies inside its block and its row (an index
    of a damaged payload may not: callers drop it, never write it into the next block)."""
    lead = (1,) * (idx.ndim - 3)
    pos = jnp.arange(nb, dtype=jnp.int32).reshape(*lead, 1, nb, 1) * blk + idx  # in its row
    flat = jnp.arange(b, dtype=jnp.int32).reshape(*lead, b, 1, 1) * d + pos
    return flat, (idx < blk) & (pos < d)


@functools.partial(jax.jit, static_argnums=1)
def _exact_indices(rows: jax.Array, k: int) -> jax.Array:
    """Exact top-K indices of each row (increasing): ``lax.top_k``'s; on the CPU the sort-free
    select (:mod:`jaxcomp._cpu._select`, the same set).

    Jitted: called eagerly (a notebook), the select's ~550 small ops were each compiled on
    their own, ~13 s for a new shape; under an outer ``jit`` this is inlined as before.
    """
    return _cpu.kernel(
        rows,
        cpu=lambda r: _select.top_k_indices(r, k),
        default=lambda r: jnp.sort(jax.lax.top_k(_block_max.magnitude(r), k)[1], axis=-1),
    )


def _approx_indices(rows: jax.Array, k: int, recall: float) -> jax.Array:
    """``lax.approx_max_k`` on TPU (its native fast path); the exact select elsewhere."""

    def tpu(r):
        _, idx = jax.lax.approx_max_k(_block_max.magnitude(r), k, recall_target=recall)
        return idx.astype(jnp.int32)

    return jax.lax.platform_dependent(rows, tpu=tpu, default=lambda r: _exact_indices(r, k))


def top_k(
    fraction: float | None = None,
    *,
    count: int | None = None,
    per_sample: bool = False,
    row_axis: int | None = None,
    method: str = "exact",
    block_size: int | None = None,
    recall_target: float = 0.95,
) -> _base.Codec:
    r"""Keeps the K entries of largest magnitude and sends (values, indices).

    .. math::
      C(x)_i = x_i \ \text{if}\ |x_i| \ \text{is among the K largest, else}\ 0

    ``method="exact"`` keeps exactly the K largest magnitudes of the selection range, the same set
    as ``lax.top_k`` bit for bit, with indices sent in increasing order. On the CPU it is found
    without a sort (``jaxcomp._cpu._select``: a sampled bracket around the K-th largest
    magnitude's bit pattern, one counting pass, a compaction of the candidates, one selecting pass),
    with ``lax.top_k`` as the fallback when the bracket misses; elsewhere ``lax.top_k`` (chosen with
    ``lax.platform_dependent``). ``method="approx"`` uses ``lax.approx_max_k`` (``recall_target``)
    on TPU, its native fast path, and is the exact selection on other backends (where
    ``approx_max_k`` is not faster). ``method="blockwise"`` is the fast mode. By default
    (``block_size=None``) the range is cut into blocks of ``ceil(n / K)`` entries and the largest
    entry of each block is kept: one pass, no sort, and ``uint8`` block-local indices for K >= 0.4%
    of n. It keeps ``ceil(n / ceil(n / K))`` <= K entries. The README's benchmark table gives the
    measured times of every mode. With an explicit ``block_size`` the top
    ``ceil(K * block_size / n)`` entries of each block are kept (the exact selection per block,
    the same set as ``lax.top_k``'s, indices increasing within a block; at least K in total). Every
    block is then a row of the per-sample select, so ``block_size=4096`` costs about what
    ``per_sample`` exact TopK of ``[n / 4096, 4096]`` does, more than the exact selection over
    the whole tensor (1.8x on the bench's 4M entries). Either way the kept set is the largest
    entries *of each block* rather than the global top K: an entry is dropped if a larger one
    shares its block. For the smooth, dense tensors these codecs see (activations, gradients) the
    captured energy is within a few percent of the exact top K.

    Ties are broken by position (lower index first, as ``lax.top_k``); Rudakov et al.'s
    ``kthvalue`` rule instead drops every entry tied with the pivot, so it may keep fewer than
    K. Non-finite entries rank above every finite magnitude and are always kept (K of them if
    there are more than K, per block for ``"blockwise"``), so a non-finite input always decodes
    to a non-finite output. Kept values are sent exactly, so the result does not depend on the
    input's magnitude. A zero-size input (with ``fraction``) gives an empty payload and an empty
    result; with ``count`` it is a ``ValueError`` (``count`` exceeds 0 entries).

    TopK by rows (``row_axis``) is a variant, not paper 1's TopK: it selects K among the
    entries along ``row_axis`` separately for every position of the other axes (``row_axis=-1``
    on ``[batch, tokens, features]``: each token's feature vector), K from the row's length
    (``count`` per row, or the fraction rule above on the row, at least 1). No row that holds a
    nonzero entry decodes to all zero: per-sample TopK 10% of a language model's activations
    zeroes whole token rows, and the next LayerNorm scales their gradient by
    ``1 / sqrt(eps)`` per boundary (docs/results/text_paper1_feedback, "The blow-up, traced").
    Indices address the row, so rows of up to 256 entries send ``uint8`` indices: at the same
    fraction it sends slightly more values in fewer bytes than per-sample TopK (``[32, 64]``
    samples at 10%: 224 values and 1,120 B per sample against 205 and 1,230 B). The payload is
    ``[*other axes, K]`` (the row axis replaced by K and moved last); ``method`` and
    ``block_size`` apply within each row.

    Args:
      fraction: fraction of entries kept, in (0, 1]; K is ``n - int(n * (1 - fraction))``.
      count: number of entries kept (instead of ``fraction``).
      per_sample: select K per sample along the leading axis (paper 1), not per tensor.
      row_axis: select K per row along this axis (a variant, see above), not per tensor or
        per sample; ``None`` (default): off. Not with ``per_sample``.
      method: ``"exact"``, ``"blockwise"`` or ``"approx"``.
      block_size: block length for ``"blockwise"`` (default: ``ceil(n / K)``, one per block).
      recall_target: for ``"approx"`` on TPU, ``lax.approx_max_k``'s expected recall.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with :class:`SparsePayload` payloads.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.top_k(count=2)
      >>> x = jnp.array([0.1, -3.0, 0.5, 2.0])
      >>> codec.decompress(codec.compress(x, codec.init(x), None)[0], x)
      Array([ 0., -3.,  0.,  2.], dtype=float32)

    Example, by rows (2 of the 4 features of every token)::

      >>> x = jnp.array([[[0.1, -3.0, 0.5, 2.0], [0.01, 0.0, -0.02, 0.005]]])
      >>> rows = compressors.top_k(0.5, row_axis=-1)
      >>> rows.decompress(rows.compress(x, rows.init(x), None)[0], x)
      Array([[[ 0.  , -3.  ,  0.  ,  2.  ],
              [ 0.01,  0.  , -0.02,  0.  ]]], dtype=float32)

    References:
      Rudakov et al., `Activations and Gradients Compression for Model-Parallel Training
      <https://arxiv.org/abs/2401.07788>`_, 2024 (per-sample TopK; TopK by rows is not theirs).
      Alistarh et al., `The Convergence of Sparsified Gradient Methods
      <https://arxiv.org/abs/1809.10505>`_, 2018.
    """
    check_k_args(fraction, count)
    _validate.check_int("row_axis", row_axis, optional=True)
    if per_sample and row_axis is not None:
        raise ValueError(f"give per_sample or row_axis, not both; got row_axis={row_axis}.")
    _validate.check_choice("method", method, TOPK_METHODS)
    if block_size is not None:
        _validate.check_int("block_size", block_size, 2)
    _validate.check_fraction("recall_target", recall_target)
    what = f"{fraction:g}" if fraction is not None else f"count={count}"
    scope = ", per_sample" if per_sample else ""
    scope = f", row_axis={row_axis}" if row_axis is not None else scope
    name = f"top_k({what}{scope}, {method})"

    def axis_of(shape) -> int:
        if not -len(shape) <= row_axis < len(shape):
            raise ValueError(
                f"{name}: row_axis={row_axis} is out of range for a {len(shape)}-D input "
                f"{list(shape)}."
            )
        return row_axis % len(shape)

    def moved(shape) -> tuple[int, ...]:
        """``shape`` with the row axis last (the layout the rows are selected in)."""
        if row_axis is None:
            return shape
        a = axis_of(shape)
        return (*shape[:a], *shape[a + 1 :], shape[a])

    def to_rows(x):
        return x if row_axis is None else jnp.moveaxis(x, axis_of(x.shape), -1)

    def from_rows(a, like):
        """``a`` (the entries of ``like`` with the row axis last, any shape) in ``like``'s."""
        a = a.reshape(moved(tuple(like.shape)))
        return a if row_axis is None else jnp.moveaxis(a, -1, axis_of(like.shape))

    def rows(like) -> tuple[int, int]:
        shape = tuple(like.shape)
        if row_axis is not None:
            d = shape[axis_of(shape)]
            return math.prod(moved(shape)[:-1]), d
        if per_sample:
            if len(shape) < 2:
                raise ValueError(f"{name}: per_sample needs a leading batch axis; got {shape}.")
            return shape[0], math.prod(shape[1:])
        return 1, math.prod(shape)

    def layout(like):
        """(rows, row length, kept per row, blocks per row, block len, kept per block)."""
        b, d = rows(like)
        _checks.check_int32_positions(name, like, b * d)
        k = _checks.kept_or_raise(name, like, kept_count, d, fraction, count)
        if k == 0:
            return b, d, 0, 0, 0, 0
        if method != "blockwise" or k == d:
            return b, d, k, 1, d, k
        if block_size is None:
            blk = -(-d // k)
            nb, kb = -(-d // blk), 1
        elif block_size >= d:
            return b, d, k, 1, d, k
        else:
            blk, nb = block_size, -(-d // block_size)
            kb = min(block_size, -(-k // nb))
        _checks.check_int32_positions(name, like, b * nb * blk)  # the padded rows
        return b, d, k, nb, blk, kb

    def init(x):
        _base.check_float(x, name)
        layout(x)
        return _base.EmptyState()

    def payload_shape(like) -> tuple[tuple[int, ...], jnp.dtype]:
        b, _, _, nb, blk, kb = layout(like)
        if row_axis is not None:
            shape = (*moved(tuple(like.shape))[:-1], nb * kb)
        else:
            shape = (b, nb * kb) if per_sample else (nb * kb,)
        return shape, _base.index_dtype(blk)

    def check_payload(payload, like, lead=()):
        shape, idt = payload_shape(like)
        _checks.check_fits(
            name,
            like,
            [
                ("values", payload.values, (*lead, *shape), None),
                ("indices", payload.indices, (*lead, *shape), idt),
            ],
        )

    def compress(x, state, key=None):
        del key
        _base.check_float(x, name)
        b, d, _, nb, blk, kb = layout(x)
        shape, idt = payload_shape(x)
        if b * nb * kb == 0:  # zero-size input: nothing to keep
            return SparsePayload(jnp.zeros(shape, x.dtype), jnp.zeros(shape, idt)), state
        flat = to_rows(x).reshape(b, d)
        if kb == 1 and nb > 1 and nb * blk != d and blk <= _block_max.UNROLLED_BLOCK:
            idx, vals = _block_max.max_per_block_short_tail(flat, nb, blk)
        else:
            if nb * blk != d:
                flat = jnp.pad(flat, ((0, 0), (0, nb * blk - d)))
            blocks = flat.reshape(b, nb, blk)
            if nb == 1 and method == "approx":
                idx = _approx_indices(flat, kb, recall_target)[:, None, :]
            elif nb == 1:
                idx = _exact_indices(flat, kb)[:, None, :]
            elif kb == 1:
                idx = _block_max.block_max(blocks)[..., None]
            else:  # the exact select per block (lax.top_k of many long blocks is ~10x slower)
                idx = _exact_indices(blocks.reshape(b * nb, blk), kb).reshape(b, nb, kb)
            vals = jnp.take_along_axis(blocks, idx, axis=-1, mode="promise_in_bounds")  # < blk
        return SparsePayload(vals.reshape(shape), idx.astype(idt).reshape(shape)), state

    def decompress(payload, like):
        check_payload(payload, like)
        b, d, _, nb, blk, kb = layout(like)
        if b * nb * kb == 0:
            return jnp.zeros(like.shape, like.dtype)
        vals = payload.values.reshape(b, nb, kb).astype(like.dtype)
        idx = payload.indices.reshape(b, nb, kb).astype(jnp.int32)
        if kb == 1 and nb * blk == d:
            # elementwise (not a scatter): error feedback fuses it into the residual's pass
            pos = jax.lax.broadcasted_iota(jnp.int32, (b, nb, blk), 2)
            dense = jnp.where(pos == idx, vals, jnp.zeros((), like.dtype))
            return from_rows(dense, like)
        # a scatter at flat positions of the unpadded output: with a padded tail the mask above
        # is sliced to d entries (CPU: jaxcomp._cpu [slow-ops], ~4x a copy; the scatter ~1x);
        # an index past its block or past the end
        # (a damaged payload) is dropped, never written into the next block
        size = b * d
        flat, valid = _flat_positions(idx, b, d, nb, blk)
        flat = jnp.where(valid, flat, size).reshape(-1)
        dense = jnp.zeros((size,), like.dtype).at[flat]
        dense = dense.set(vals.reshape(-1), unique_indices=True, mode="drop")
        return from_rows(dense, like)

    def decode_sum(stacked, like):
        # one scatter-add of every payload's values, instead of one scatter (or mask) each
        check_payload(stacked, like, lead=stacked.values.shape[:1])
        b, d, _, nb, blk, kb = layout(like)
        acc = jnp.promote_types(like.dtype, jnp.float32)
        if b * nb * kb == 0:
            return jnp.zeros(like.shape, acc)
        num = stacked.values.shape[0]
        vals = stacked.values.reshape(num, b, nb, kb).astype(like.dtype).astype(acc)
        idx = stacked.indices.reshape(num, b, nb, kb).astype(jnp.int32)
        flat, valid = _flat_positions(idx, b, d, nb, blk)
        flat = jnp.where(valid, flat, b * d).reshape(-1)  # as decompress: damaged ones dropped
        # zeros of its own, read from the payloads (CPU: jaxcomp._cpu [fusion]: a broadcast
        # that several scatters share is copied once per scatter)
        zero = _cpu.after(jnp.zeros((), acc), stacked)
        dense = jnp.broadcast_to(zero, (b * d,)).at[flat]
        dense = dense.add(vals.reshape(-1), mode="drop")  # flat positions: ~2x faster than 3-D
        return from_rows(dense, like)

    def add_decoded(base, payload, sign):
        # base +- decompress(payload): the kept values scattered into base (in place), not a
        # dense decode of zeros (blockwise too: its mask is a full pass and a temporary array)
        check_payload(payload, base)
        b, d, _, nb, blk, kb = layout(base)
        if b * nb * kb == 0:
            decoded = decompress(payload, base)
            return base + decoded if sign == 1 else base - decoded
        vals = payload.values.reshape(-1).astype(base.dtype)
        idx = payload.indices.reshape(b, nb, kb).astype(jnp.int32)
        flat, valid = _flat_positions(idx, b, d, nb, blk)
        # as decompress: padding and an index past its block (a damaged payload) are dropped
        flat = jnp.where(valid, flat, b * d + flat).reshape(-1)
        flat_base = to_rows(base).reshape(-1).at[flat]
        out = flat_base.add(vals if sign == 1 else -vals, mode="drop", unique_indices=True)
        return from_rows(out, base)

    return _base.Codec(
        init, compress, decompress, name, _base.Reduction.GATHER, False, None, None, decode_sum,
        add_decoded=add_decoded, echo_from_wire=method == "blockwise",
    )  # fmt: skip
