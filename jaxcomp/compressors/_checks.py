"""Input checks shared by the codecs: payloads that do not fit ``like``, and NaN-safe maxima."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def describe(like: Any) -> str:
    """``"float32[4, 6]"`` for an array or ``ShapeDtypeStruct``."""
    return f"{np.dtype(like.dtype).name}{list(like.shape)}"


def check_fits(name: str, like: Any, fields: Sequence[tuple[str, Any, tuple, Any]]) -> None:
    """Raises ``ValueError`` unless every payload field has the shape (and dtype) ``like`` implies.

    Args:
      name: the codec's name, for the message.
      like: the array or ``ShapeDtypeStruct`` the payload is decoded to.
      fields: ``(field name, payload leaf, expected shape, expected dtype or None)``.
    """
    for field, leaf, shape, dtype in fields:
        got_shape = tuple(getattr(leaf, "shape", ()))
        got_dtype = np.dtype(getattr(leaf, "dtype", type(leaf)))
        if got_shape != tuple(shape) or (dtype is not None and got_dtype != np.dtype(dtype)):
            want = f"{np.dtype(dtype).name if dtype is not None else ''}{list(shape)}"
            raise ValueError(
                f"{name}: the payload does not fit an array of {describe(like)}: its '{field}' "
                f"is {got_dtype.name}{list(got_shape)}, but an array of {describe(like)} needs "
                f"{want}. Decode into the shape and dtype the payload was compressed from."
            )


def nan_as_inf(a: jax.Array) -> jax.Array:
    """``a`` with NaN replaced by ``+inf``.

    The CPU backend's vectorised ``max``/``min`` reductions drop NaN on arrays above a few
    thousand elements (``jaxcomp._cpu`` [nan-max]: ``jnp.max`` of a ``(16, 256)`` array holding
    one NaN returns a finite value, of a ``(4,)`` one NaN), so a scale taken with them makes a
    NaN input finite depending on its size.
    Mapping NaN to ``+inf`` first makes every reduction see a non-finite value.
    """
    return jnp.where(jnp.isnan(a), jnp.inf, a)


def has_nan(x: jax.Array) -> jax.Array:
    """Whether ``x`` holds a NaN, from ``isnan(sum(x))``: a sum keeps NaN, unlike the CPU
    backend's vectorised max (``jaxcomp._cpu`` [nan-max]).

    Cheaper than :func:`nan_as_inf` inside a max: on the CPU backend a reduction of the raw input
    is one vectorised kernel, while a select in front of it is materialised first (timings:
    ``docs/performance.md``). Also true for +inf and
    -inf together, and for a finite ``x`` whose float32 sum overflows both ways (magnitudes
    near 1e38 / size); never false for a NaN. ``has_nan(abs(x))`` is exact (a sum of
    magnitudes overflows to ``+inf`` at worst) but made quantize(8) slower.
    """
    return jnp.isnan(jnp.sum(x))


FOLD_MIN_FEATURES = 256  # leading_absmax folds when a row has at least this many entries


def leading_absmax(a: jax.Array) -> jax.Array:
    """``max(a, axis=0)`` of a non-negative ``[R, F]`` array as halving folds, NaN kept.

    ``a[:h]`` and ``a[h:2h]`` are combined by an elementwise ``maximum`` until one row is
    left (an odd row is folded into every row of the half). On the CPU backend a ``max``
    reduction over the major axis runs strided (``jaxcomp._cpu`` [slow-ops]): 1.4x a copy for
    ``[1024, 4096]`` and 10x for ``[64, 65536]``,
    against 0.85x and 0.7x for the folds, which fuse into one vectorised pass. The elementwise
    ``maximum`` propagates NaN (unlike the vectorised reduction), so a NaN entry leaves a NaN
    in its column. Slower than the reduction for short rows (``F < FOLD_MIN_FEATURES``).
    """
    while a.shape[0] > 1:
        rows, h = a.shape[0], a.shape[0] // 2
        folded = jnp.maximum(a[:h], a[h : 2 * h])
        a = jnp.maximum(folded, a[2 * h :]) if rows % 2 else folded
    return a[0]


TENSOR_FOLD_ROWS = 8  # tensor_absmax's rows (CPU: jaxcomp._cpu [fusion]: 3 folds fuse, 4 do not)


def tensor_absmax(x: jax.Array) -> jax.Array:
    """``max(|x|)`` over every entry, ``+inf`` if ``x`` holds a NaN; one read of a large ``x``.

    The entries are folded as ``TENSOR_FOLD_ROWS`` rows (:func:`leading_absmax`: one fused,
    vectorised pass that keeps NaN in its column; the few entries past the last full row are
    reduced apart), and the max and the NaN test read the folded row only. A max reduction and
    :func:`has_nan`'s sum read ``x`` twice, and a variadic max-and-sum reduce is not vectorised
    (timings: ``docs/performance.md``). Exact: a sum of magnitudes
    overflows to ``+inf`` at worst, never to NaN, so a finite ``x`` gets its absmax however
    large (``has_nan(x)`` is true for a finite ``x`` whose sum overflows both ways).
    """
    a = jnp.abs(x).reshape(-1)
    m = a.size // TENSOR_FOLD_ROWS
    if m < FOLD_MIN_FEATURES:
        return jnp.where(has_nan(a), jnp.inf, jnp.max(a, initial=0.0))
    folded = leading_absmax(a[: TENSOR_FOLD_ROWS * m].reshape(TENSOR_FOLD_ROWS, m))
    tail = a[TENSOR_FOLD_ROWS * m :]
    top = jnp.maximum(jnp.max(folded), jnp.max(tail, initial=0.0))
    return jnp.where(has_nan(folded) | has_nan(tail), jnp.inf, top)


def kept_or_raise(name: str, like: Any, kept: Any, *args: Any) -> int:
    """``kept(*args)`` (a kept-count rule), its ``ValueError`` prefixed with the codec and input."""
    try:
        return kept(*args)
    except ValueError as e:
        raise ValueError(f"{name}: {e} (input {describe(like)})") from None


#: positions a sparse codec computes in ``int32`` (JAX's default index dtype) stay below this
INT32_POSITIONS = 2**31


def check_int32_positions(name: str, like: Any, positions: int) -> None:
    """Raises ``ValueError`` when a sparse codec would address ``positions`` entries (padding
    included) of ``like`` with ``int32`` arithmetic: a position of 2**31 or more wraps around
    and would scatter a kept value to a wrong entry."""
    if positions >= INT32_POSITIONS:
        raise ValueError(
            f"{name}: an input of {positions:,} positions (input {describe(like)}) is beyond "
            f"int32 indexing (< 2**31 = {INT32_POSITIONS:,}); split the tensor into smaller "
            "leaves, or compress it per sample (rows of fewer than 2**31 entries)."
        )
