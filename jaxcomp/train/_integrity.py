"""Checksums and finiteness of a training state.

A checkpoint carries, for every leaf of its state, a 32-bit position-weighted sum of the
leaf's bits, and a SHA-256 of its JSON metadata; restoring recomputes both, so a flipped
byte in any file of a checkpoint is detected instead of loaded.

A leaf this process holds whole (every shard addressable here, or a full replica) is summed
on the host with numpy: no program to compile per state structure (the jitted pass was one
~0.75 s compile per distinct state). A leaf sharded across processes is summed on its devices
by one jitted pass, so that every process gets the same number. Both compute the same
integers (:func:`_leaf_sum`, :func:`_host_leaf_sum`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _fetch


def _check_whole_bytes(dtype: Any) -> None:
    if jax.dtypes.itemsize_bits(dtype) < 8:  # int4 & co: no per-element word
        raise TypeError(f"cannot checksum an array of dtype {dtype} (under 8 bits per element).")


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as ``uint32`` words (one per element; two for 8-byte dtypes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    _check_whole_bytes(x.dtype)
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


def _host_words(x: np.ndarray) -> np.ndarray:
    """:func:`_words` of a host array, with the same word order."""
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    _check_whole_bytes(x.dtype)
    if np.issubdtype(x.dtype, np.complexfloating):
        return np.stack([_host_words(x.real), _host_words(x.imag)], axis=-1)
    size, flat = x.dtype.itemsize, np.ascontiguousarray(x).reshape(-1)  # views need contiguity
    if size in (4, 8):
        return flat.view(np.uint32).reshape(x.shape + ((2,) if size == 8 else ()))
    if size == 2:
        return flat.view(np.uint16).astype(np.uint32).reshape(x.shape)
    if size == 1:
        return flat.view(np.uint8).astype(np.uint32).reshape(x.shape)
    raise TypeError(f"cannot checksum an array of dtype {x.dtype}.")


_CHUNK = 1 << 22  # words per host pass: bounds the temporaries (16 MiB each)


def _host_leaf_sum(x: np.ndarray) -> int:
    """:func:`_leaf_sum` on the host: the same wrap-around ``uint32`` arithmetic."""
    w = np.ascontiguousarray(_host_words(x)).reshape(-1)
    total = 0
    for start in range(0, w.size, _CHUNK):
        chunk = w[start : start + _CHUNK]
        index = np.arange(start, start + chunk.size, dtype=np.uint64)
        weight = ((index * 2 + 1) & 0xFFFFFFFF).astype(np.uint32)
        total += int(np.sum(chunk * weight, dtype=np.uint32))
    return total % 2**32


def _host_leaf_finite(x: np.ndarray) -> bool:
    if np.issubdtype(x.dtype, np.inexact):
        return bool(np.isfinite(x).all())
    return True


def _on_host(x: jax.Array | np.ndarray) -> bool:
    """Whether ``x`` is summed on the host: this process holds all of it."""
    if not isinstance(x, jax.Array):
        return True
    return x.is_fully_addressable or x.is_fully_replicated


def _as_leaf(x: Any) -> jax.Array | np.ndarray:
    """A ``jax.Array`` or host array as it is; anything else as ``jax.jit`` would take it
    (``jnp.asarray``: a Python scalar weakly typed, 64-bit types narrowed unless x64)."""
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray) and x.dtype == jax.dtypes.canonicalize_dtype(x.dtype):
        return x
    return jnp.asarray(x)


def _host_copies(leaves: list[jax.Array]) -> list[np.ndarray]:
    """The host values of host-summed leaves, fetched in one ``jax.device_get``; PRNG keys as
    their key data (as :func:`_words` reads them), a replicated leaf from one replica."""
    fetch = []
    for x in leaves:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            x = x.addressable_data(0)  # a full replica
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        fetch.append(x)
    return [np.asarray(h) for h in jax.device_get(fetch)]


@jax.jit
def _digest(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    if not leaves:
        return jnp.zeros((0,), jnp.uint32), jnp.zeros((0,), jnp.bool_)
    return (
        jnp.stack([_leaf_sum(x) for x in leaves]),
        jnp.stack([_leaf_finite(x) for x in leaves]),
    )


def leaf_paths(tree: Any) -> list[str]:
    """``jax.tree_util.keystr`` of every leaf, in leaf order."""
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def inspect_state(tree: Any) -> tuple[list[int], list[str]]:
    """``(checksum per leaf, paths of the leaves holding NaN or Inf)`` of a pytree of arrays.

    A leaf held whole by this process is summed on the host; the others (sharded across
    processes) in one jitted pass on their devices. Every process gets the same numbers, and
    a leaf gets the same number either way. A leaf that is not a ``jax.Array`` is taken as
    ``jax.jit`` would take it (``jnp.asarray``); a host ``np.ndarray`` of a canonical dtype
    as it is.

    Example:
      >>> sums, bad = inspect_state({"w": jnp.ones(3), "b": jnp.array([jnp.nan])})
      >>> len(sums), bad
      (2, ["['b']"])
    """
    leaves = [_as_leaf(x) for x in jax.tree.leaves(tree)]
    where = [_on_host(x) for x in leaves]
    on_host = [i for i, here in enumerate(where) if here]
    on_devices = [i for i, here in enumerate(where) if not here]
    sums, finite = [0] * len(leaves), [True] * len(leaves)
    for i, h in zip(on_host, _host_copies([leaves[i] for i in on_host])):
        sums[i], finite[i] = _host_leaf_sum(h), _host_leaf_finite(h)
    if on_devices:
        dev_sums, dev_finite = _digest([leaves[i] for i in on_devices])
        for i, s, ok in zip(on_devices, *_fetch.fetch((dev_sums, dev_finite))):
            sums[i], finite[i] = int(s), bool(ok)
    paths = leaf_paths(tree)
    return sums, [p for p, ok in zip(paths, finite) if not ok]


def json_digest(data: Any) -> str:
    """SHA-256 of ``data`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
