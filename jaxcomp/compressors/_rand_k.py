"""RandK: K entries at positions drawn from a shared key, summable with ``psum``."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compressors import _base
from jaxcomp.compressors import _checks
from jaxcomp.compressors import _sparse


class RandKPayload(NamedTuple):
    """RandK values and the 32-bit seed that regenerates their positions.

    Attributes:
      values: ``[k]`` kept values.
      seed: ``uint32[2]`` raw key data; every worker that used the same key holds the same seed,
        so payloads can be summed value-wise.
    """

    values: jax.Array
    seed: jax.Array


def rand_k(
    fraction: float | None = None, *, count: int | None = None, unbiased: bool = False
) -> _base.Codec:
    r"""Keeps K entries at random positions drawn from a shared key; sends values + a seed.

    Positions are stratified: the flat range is cut into K nearly equal strata and one position
    is drawn uniformly in each, so every entry is kept with probability ``1/|stratum|`` (about
    K/n) and no position repeats. Workers that pass the **same key** choose the same positions,
    so their payloads can be summed value-wise with ``psum`` (``Reduction.SUM``).

    .. math::
      C(x)_i = w_i x_i \ \text{for the K drawn}\ i, \quad w_i = |\mathrm{stratum}(i)|\
      \text{if unbiased else}\ 1

    A NaN or Inf anywhere in ``x`` makes every kept value NaN, so a non-finite input is never
    silently turned into a finite one by not being drawn. Kept values are sent exactly (the
    result does not depend on the input's magnitude). A zero-size input (with ``fraction``)
    gives an empty payload and an empty result.

    Args:
      fraction: fraction of entries kept, in (0, 1].
      count: number kept (instead of ``fraction``).
      unbiased: scale kept values by their stratum size so that ``E[C(x)] = x``. Leave off
        with error feedback.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with :class:`RandKPayload` payloads (K values and
      8 bytes of seed).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.rand_k(count=2)
      >>> x = jnp.arange(8.0)
      >>> payload, _ = codec.compress(x, codec.init(x), jax.random.key(0))
      >>> payload.values.shape
      (2,)

    References:
      Stich et al., `Sparsified SGD with Memory <https://arxiv.org/abs/1809.07599>`_, 2018.
    """
    _sparse.check_k_args(fraction, count)
    what = f"{fraction:g}" if fraction is not None else f"count={count}"
    name = f"rand_k({what}{', unbiased' if unbiased else ''})"

    def positions(seed, n, k):
        # K strata covering [0, n): the first n % k hold q + 1 entries, the rest q = n // k
        q, r = divmod(n, k)
        i = jnp.arange(k, dtype=jnp.int32)
        starts = i * q + jnp.minimum(i, r)
        sizes = q + (i < r).astype(jnp.int32)
        u = jax.random.uniform(jax.random.wrap_key_data(seed, impl="threefry2x32"), (k,))
        offs = jnp.minimum((u * sizes).astype(jnp.int32), sizes - 1)
        return starts + offs, sizes

    def init(x):
        _base.check_float(x, name)
        _checks.check_int32_positions(name, x, math.prod(x.shape))
        _checks.kept_or_raise(name, x, _sparse.kept_count, math.prod(x.shape), fraction, count)
        return _base.EmptyState()

    def compress(x, state, key=None):
        _base.check_float(x, name)
        _base.check_key(key, name)
        n = math.prod(x.shape)
        _checks.check_int32_positions(name, x, n)
        k = _checks.kept_or_raise(name, x, _sparse.kept_count, n, fraction, count)
        seed = jax.random.bits(key, (2,), jnp.uint32)
        if k == 0:  # zero-size input: nothing to keep
            return RandKPayload(jnp.zeros((0,), x.dtype), seed), state
        pos, sizes = positions(seed, n, k)
        vals = x.reshape(-1)[pos]
        # a non-finite entry anywhere poisons every kept value: never silently finite
        vals = vals + jnp.where(jnp.all(jnp.isfinite(x)), 0.0, jnp.nan).astype(vals.dtype)
        if unbiased:
            vals = vals * sizes.astype(vals.dtype)
        return RandKPayload(vals, seed), state

    def decompress(payload, like):
        n = math.prod(like.shape)
        k = _checks.kept_or_raise(name, like, _sparse.kept_count, n, fraction, count)
        _checks.check_fits(
            name,
            like,
            [("values", payload.values, (k,), None), ("seed", payload.seed, (2,), jnp.uint32)],
        )
        if k == 0:
            return jnp.zeros(like.shape, like.dtype)
        pos, _ = positions(payload.seed, n, k)
        dense = (
            jnp.zeros((n,), like.dtype)
            .at[pos]
            .set(payload.values.astype(like.dtype), unique_indices=True)
        )
        return dense.reshape(like.shape)

    def psum(payload, axis_name):
        return RandKPayload(jax.lax.psum(payload.values, axis_name), payload.seed)

    return _base.Codec(init, compress, decompress, name, _base.Reduction.SUM, True, psum)
