"""Exact power-of-two scaling, shared by the codecs and the transforms (below both packages)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def pow2_inverse(amax: jax.Array) -> jax.Array:
    """``2**-e`` for ``amax = m * 2**e``, ``m`` in ``[0.5, 1)``: multiplying by it is exact.

    It brings values whose max-abs is ``amax`` to a max-abs in ``[0.5, 1)`` (for normal
    ``amax``; clipped to keep the factor a normal float32), so that squares and norms neither
    underflow nor overflow. A multiply by a factor computed on the few ``amax`` values is ~3x
    cheaper than ``jnp.ldexp`` on every entry. Zero and non-finite ``amax`` give 1.
    """
    _, exponent = jnp.frexp(amax)
    return jnp.ldexp(jnp.float32(1.0), jnp.clip(-exponent, -126, 127))


def sum_exponent(n: int) -> int:
    """The least ``k >= 0`` with ``2**k >= n``: ``n`` terms each times ``2**-k`` sum without
    overflow (exact for terms above ``2**(k - 126)``: the CPU backend flushes subnormals,
    ``jaxcomp._cpu`` [subnormals])."""
    return max(n - 1, 0).bit_length()


def mean_of_sum(total: Array, num: int, k: int) -> Array:
    """``total * 2**k / num`` for ``total`` a sum of terms scaled by ``2**-k``: ``(total / num)
    * 2**k``, bit-identical to the unscaled ``sum / num`` for every ``num`` away from the edges."""
    return total / num * (2.0**k) if k else total / num
