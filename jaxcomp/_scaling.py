"""Exact power-of-two scaling, shared by the codecs and the transforms (below both packages)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pow2_inverse(amax: jax.Array) -> jax.Array:
    """``2**-e`` for ``amax = m * 2**e``, ``m`` in ``[0.5, 1)``: multiplying by it is exact.

    It brings values whose max-abs is ``amax`` to a max-abs in ``[0.5, 1)`` (for normal
    ``amax``; clipped to keep the factor a normal float32), so that squares and norms neither
    underflow nor overflow. A multiply by a factor computed on the few ``amax`` values is ~3x
    cheaper than ``jnp.ldexp`` on every entry. Zero and non-finite ``amax`` give 1.
    """
    _, exponent = jnp.frexp(amax)
    return jnp.ldexp(jnp.float32(1.0), jnp.clip(-exponent, -126, 127))
