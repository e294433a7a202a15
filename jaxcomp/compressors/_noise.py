"""Cheap counter-based uniform noise for stochastic rounding.

``jax.random.uniform`` over millions of elements costs 30-40x a memory copy on CPU
(JAX-NOTES §3). Stochastic rounding only needs decorrelated, uniform-looking bits, so we draw one
32-bit seed from the key and hash ``iota * golden + seed`` with the *lowbias32* integer mixer
(Wellons, "Prospecting for Hash Functions", 2018): a few integer multiplies per element, fused
by XLA into the quantizer's single pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _lowbias32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def uniform_noise(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``float32`` noise in ``[0, 1)`` of the given shape, determined by ``key``.

    Args:
      key: a JAX PRNG key.
      shape: output shape.

    Returns:
      ``float32`` array; 24 random mantissa bits per element.
    """
    seed = jax.random.bits(key, (), jnp.uint32)
    n = 1
    for d in shape:
        n *= d
    counter = jax.lax.iota(jnp.uint32, n)
    h = _lowbias32(counter * jnp.uint32(0x9E3779B9) + seed)
    return ((h >> 8).astype(jnp.float32) * (1.0 / (1 << 24))).reshape(shape)
