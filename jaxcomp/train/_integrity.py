"""Checksums and finiteness of a training state, computed on its devices.

A checkpoint carries, for every leaf of its state, a 32-bit position-weighted sum of the
leaf's bits, and a SHA-256 of its JSON metadata; restoring recomputes both, so a flipped
byte in any file of a checkpoint is detected instead of loaded.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as ``uint32`` words (one per element; two for 8-byte dtypes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.stack([_words(jnp.real(x)), _words(jnp.imag(x))], axis=-1)
    if size in (4, 8):
        return lax.bitcast_convert_type(x, jnp.uint32)
    if size == 2:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if size == 1:
        return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    raise TypeError(f"cannot checksum an array of dtype {x.dtype}.")


def _leaf_sum(x: jax.Array) -> jax.Array:
    r"""``sum_i word_i * (2 i + 1) mod 2**32`` over the row-major positions ``i`` of the words.

    The weights are odd, so changing any one word changes the sum (an odd number times a
    non-zero difference is non-zero modulo :math:`2^{32}`); integer sums are exact in any
    reduction order, so the result does not depend on sharding or the device count.
    """
    w = _words(x)
    index = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        iota = lax.broadcasted_iota(jnp.uint32, w.shape, d)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= w.shape[d]
    return jnp.sum(w * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


def _leaf_finite(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.isfinite(x).all()
    return jnp.array(True)


@jax.jit
def _digest(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    if not leaves:
        return jnp.zeros((0,), jnp.uint32), jnp.zeros((0,), jnp.bool_)
    return (
        jnp.stack([_leaf_sum(x) for x in leaves]),
        jnp.stack([_leaf_finite(x) for x in leaves]),
    )


def _host(x: jax.Array) -> np.ndarray:
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def leaf_paths(tree: Any) -> list[str]:
    """``jax.tree_util.keystr`` of every leaf, in leaf order."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def inspect_state(tree: Any) -> tuple[list[int], list[str]]:
    """``(checksum per leaf, paths of the leaves holding NaN or Inf)`` of a pytree of arrays.

    Runs as one jitted pass on the arrays' devices (a sharded leaf is summed where it lives);
    every process gets the same numbers.

    Example:
      >>> sums, bad = inspect_state({"w": jnp.ones(3), "b": jnp.array([jnp.nan])})
      >>> len(sums), bad
      (2, ["['b']"])
    """
    leaves = jax.tree.leaves(tree)
    sums, finite = _digest(leaves)
    sums, finite = _host(sums), _host(finite)
    paths = leaf_paths(tree)
    return [int(s) for s in sums], [p for p, ok in zip(paths, finite) if not ok]


def json_digest(data: Any) -> str:
    """SHA-256 of ``data`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
