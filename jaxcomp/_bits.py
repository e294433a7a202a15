"""Collectives that only move data carry 8- and 16-bit floats as their bit patterns.

The CPU backend widens the ``bfloat16`` and 8-bit float operands of collectives (a ``bfloat16``
``all_gather`` or ``ppermute`` runs in ``float32``, a ``float8`` one in ``float16``;
``jaxcomp._cpu`` [widened-collectives]): a payload then crosses with twice (or four times) its
bytes, and NaNs come back canonicalised (``bfloat16`` ``0x7f81`` arrives as ``0x7fc0``), so what a
worker receives is not bit for bit what its peer sent. A collective that only moves data
(``ppermute``, ``all_gather``, ``all_to_all``) does the same on the bit pattern, so
:func:`move_as_bits` hands it such leaves as unsigned integers of their width and views what arrives
as floats again: the bytes on the wire are the payload's on every backend, and the values are the
sent ones bit for bit. Reductions (``psum``) add values and cannot go through it. The module imports
only JAX: every package (codecs to trainer) may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_UNSIGNED = {8: jnp.uint8, 16: jnp.uint16}


def _carrier(dtype) -> Any:
    """The unsigned dtype a float of ``dtype`` crosses as, or ``None`` (sent as it is)."""
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize >= 4:
        return None
    bits = jnp.finfo(dtype).bits
    return _UNSIGNED.get(bits) if bits == 8 * dtype.itemsize else None  # not sub-byte floats


def move_as_bits(move: Callable[[Any], Any], tree: Any) -> Any:
    r"""``move(tree)``, with every 8- or 16-bit float leaf carried as its bit pattern.

    .. math::
      \mathrm{move\_as\_bits}(m, x) = \mathrm{view}_{\mathrm{float}}\big(
      m(\mathrm{view}_{\mathrm{uint}}(x))\big)

    Args:
      move: a collective that moves its leaves without arithmetic (``lax.ppermute``,
        ``lax.all_gather``, ``lax.all_to_all`` over some axis, applied to a pytree), each
        output leaf the same dtype as its input leaf.
      tree: the pytree to move. ``float32``/``float64`` leaves, integers and sub-byte types
        go as they are.

    Returns:
      ``move``'s output, with the leaves that crossed as integers viewed as their floats again.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax import lax
      >>> from jaxcomp._bits import move_as_bits
      >>> x = jnp.ones((2, 3), jnp.bfloat16)
      >>> f = jax.vmap(lambda v: move_as_bits(lambda t: lax.all_gather(t, "i"), v),
      ...              axis_name="i")
      >>> f(x).dtype, f(x).shape
      (dtype(bfloat16), (2, 2, 3))
    """
    leaves, treedef = jax.tree.flatten(tree)
    carriers = [_carrier(x.dtype) for x in leaves]
    if not any(c is not None for c in carriers):
        return move(tree)
    sent = [x if c is None else lax.bitcast_convert_type(x, c) for x, c in zip(leaves, carriers)]
    got = jax.tree.leaves(move(jax.tree.unflatten(treedef, sent)))
    back = [
        g if c is None else lax.bitcast_convert_type(g, x.dtype)
        for g, x, c in zip(got, leaves, carriers)
    ]
    return jax.tree.unflatten(treedef, back)
