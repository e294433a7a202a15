"""Collectives that only move data carry 8- and 16-bit floats as their bit patterns.

The CPU backend widens the ``bfloat16`` and 8-bit float operands of collectives (a ``bfloat16``
``all_gather`` or ``ppermute`` runs in ``float32``, a ``float8`` one in ``float16``;
``jaxcomp._cpu`` [widened-collectives]): a payload then crosses with twice (or four times) its
bytes, and NaNs come back canonicalised (``bfloat16`` ``0x7f81`` arrives as ``0x7fc0``), so what a
worker receives is not bit for bit what its peer sent. A collective that only moves data
(``ppermute``, ``all_gather``, ``all_to_all``) does the same on the bit pattern, so
:func:`move_as_bits` hands it such leaves as unsigned integers of their width and views what arrives
as floats again: the bytes on the wire are the payload's on every backend, and the values are the
sent ones bit for bit. Reductions (``psum``) add values and cannot go through it. Pytrees of
different structures that must cross in one collective go as one ``uint8`` vector of their
bytes (:func:`to_bytes`, :func:`from_bytes`). The module imports
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


def _byte_view(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).reshape(-1)
    dtype = np.dtype(x.dtype)
    if (
        jnp.issubdtype(dtype, jnp.integer)
        and jnp.iinfo(dtype).bits < 8
        or (jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 8 * dtype.itemsize)
    ):
        raise TypeError(f"to_bytes: sub-byte dtype {dtype} has no byte view.")
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)  # wider: [..., itemsize]


def byte_size(tree: Any) -> int:
    """Bytes :func:`to_bytes` makes of ``tree`` (arrays or ``ShapeDtypeStruct``s): the sum of
    ``size * itemsize`` over its leaves."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def to_bytes(tree: Any, size: int | None = None) -> jax.Array:
    r"""Every leaf of ``tree`` as its bytes, concatenated in leaf order into one ``uint8``
    vector, zero-padded to ``size`` bytes.

    Moving pytrees of different structures in one collective (every device hands it one array
    of one shape): each goes as its bytes, padded to the largest; the padding crosses too.
    :func:`from_bytes` is the inverse, bit for bit (NaN payloads and signed zeros included).

    Args:
      tree: a pytree of arrays of whole-byte dtypes (``bool`` goes as one byte, 0 or 1).
      size: the vector's length, at least :func:`byte_size` of ``tree`` (``None``: exactly it).

    Returns:
      ``uint8[size]``.

    Raises:
      TypeError: a leaf of a sub-byte dtype (``int4``, ``float4_e2m1fn``).
      ValueError: ``size`` below the tree's bytes.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp._bits import to_bytes, from_bytes
      >>> tree = {"codes": jnp.arange(3, dtype=jnp.uint8), "scale": jnp.float32(2.0)}
      >>> v = to_bytes(tree, 8)
      >>> v.shape, float(from_bytes(v, tree)["scale"])
      ((8,), 2.0)
    """
    parts = [_byte_view(x) for x in jax.tree.leaves(tree)]
    n = sum(int(p.shape[0]) for p in parts)
    size = n if size is None else size
    if size < n:
        raise ValueError(f"to_bytes: size {size} is below the tree's {n} bytes.")
    if size > n:
        parts.append(jnp.zeros((size - n,), jnp.uint8))
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)


def from_bytes(vector: jax.Array, like: Any) -> Any:
    """The pytree shaped as ``like`` (arrays or ``ShapeDtypeStruct``s) whose bytes lead
    ``vector`` (a :func:`to_bytes` output; the padding after them is ignored)."""
    leaves, treedef = jax.tree.flatten(like)
    if byte_size(leaves) > vector.shape[0]:
        raise ValueError(f"from_bytes: {vector.shape[0]} bytes, the tree needs {byte_size(like)}.")
    out, at = [], 0
    for x in leaves:
        dtype, shape = np.dtype(x.dtype), tuple(x.shape)
        n = int(np.prod(shape)) * dtype.itemsize
        piece = vector[at : at + n]
        at += n
        if dtype == np.bool_:
            out.append(piece.reshape(shape) != 0)
        elif dtype.itemsize == 1:
            out.append(lax.bitcast_convert_type(piece, dtype).reshape(shape))
        else:
            out.append(lax.bitcast_convert_type(piece.reshape(*shape, dtype.itemsize), dtype))
    return jax.tree.unflatten(treedef, out)
