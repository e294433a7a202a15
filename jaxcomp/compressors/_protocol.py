"""The reduction-protocol contract: how a codec (or anyone) averages one array over workers.

A :class:`ReduceProtocol` is what :mod:`jaxcomp.comm` runs to average one array over a
data-parallel mesh axis; a codec may bring its own (``Codec.protocol``, e.g. PowerSGD's two
all-reduces with a warm-started Q), otherwise ``comm`` builds a generic one from the codec
(``psum``, ``all_gather``, two-phase)::

  state = protocol.init(like, num_workers)                       # outside shard_map is fine
  mean, echo, state = protocol.all_reduce(x, state, key, axis_name)   # inside shard_map
  protocol.wire_bytes(like, num_workers)                         # bytes one worker sends

``echo`` is this worker's own share as the others will see it (its decoded payload; PowerSGD's
averaged reconstruction; ``x`` itself on a dense path): error feedback keeps ``x - echo``.

**State layout.** A protocol's state is a pytree of arrays that every worker holds. What one
worker owns (an error-feedback residual, its codec's state) is wrapped in :class:`PerWorker`,
whose leaves carry a leading axis of size 1: ``init`` returns them so (the per-device view), the
body of ``shard_map`` sees them so (varying over the axis), and
:func:`jaxcomp.comm.place_state` stacks them to ``[W, ...]`` sharded over the axis. Everything
else is replicated (identical on every worker).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _cpu
from jaxcomp import _scaling
from jaxcomp._bits import move_as_bits
from jaxcomp._vma import to_varying as to_varying
from jaxcomp._vma import varying_axes as varying_axes

Array = jax.Array
Like = Any  # an array or a jax.ShapeDtypeStruct


class PerWorker(NamedTuple):
    """A part of a state owned by one worker (declared layout; see the module docstring).

    Attributes:
      value: a pytree whose leaves have a leading worker axis: size 1 from ``init`` and inside
        ``shard_map``, size W once placed on a mesh.
    """

    value: Any


class ReduceProtocol(NamedTuple):
    """A multi-worker averaging protocol for one array.

    Attributes:
      init: ``init(like, num_workers) -> state``; ``num_workers`` may be ``None`` (outside any
        mesh) for protocols whose state does not depend on it. Runs outside ``shard_map``.
      all_reduce: ``all_reduce(x, state, key, axis_name) -> (mean, echo, state)`` inside
        ``shard_map`` (``axis_name=None``: one worker). ``key`` is the same on every worker
        (decorrelate with :func:`worker_key` where the method wants independence).
      wire_bytes: ``wire_bytes(like, num_workers) -> int``: bytes one worker puts into
        collectives per call (what :func:`jaxcomp.comm.measure_collectives` reads); a scalar
        array where a reduction's bytes depend on the backend (:func:`reduced_bytes`).
      name: description, e.g. ``"power_sgd(rank=2)/low_rank"``.
      dense: optional ``dense(x, mean, state, axis_name) -> state``: how the state follows a
        round averaged uncompressed (warm-up); ``None`` leaves it unchanged.
      exact_mean: whether ``mean`` is exactly the mean over workers of their ``echo`` (up to
        rounding). EF21 needs it; a two-phase reduction that re-compresses on a server is not.
      all_reduce_into: optional ``all_reduce_into(x, state, key, axis_name, base, sign) ->
        (mean, echo, base + sign * echo, state)``: ``all_reduce`` that also adds its echo into
        ``base`` (what error feedback and EF21 keep) the fastest way it knows, e.g. a scatter of
        TopK's values into ``base`` in place (``Codec.add_decoded``). Give it only for such
        an in-place sum: error feedback takes its presence to mean that no dense echo is
        formed. ``None``: the sum is formed from ``echo``. Call it through
        :func:`all_reduce_into`.
    """

    init: Callable[[Like, int | None], Any]
    all_reduce: Callable[[Array, Any, Array | None, str | None], tuple[Array, Array, Any]]
    wire_bytes: Callable[[Like, int], int]
    name: str
    dense: Callable[[Array, Array, Any, str | None], Any] | None = None
    exact_mean: bool = True
    all_reduce_into: Callable[..., tuple[Array, Array, Array, Any]] | None = None


def all_reduce_into(
    protocol: ReduceProtocol,
    x: Array,
    state: Any,
    key: Array | None,
    axis_name: str | None,
    base: Array,
    sign: int,
) -> tuple[Array, Array, Array, Any]:
    """``protocol.all_reduce`` plus ``base + sign * echo`` (``sign``: 1 or -1).

    Uses the protocol's ``all_reduce_into`` where it has one (``echo`` is then computed only if
    the caller uses it), else adds the echo, which XLA fuses with the echo's decoding where
    that is elementwise.

    Returns:
      ``(mean, echo, base + sign * echo, state)``.
    """
    if sign not in (1, -1):
        raise ValueError(f"sign must be 1 or -1; got {sign!r}.")
    if protocol.all_reduce_into is not None:
        return protocol.all_reduce_into(x, state, key, axis_name, base, sign)
    mean, echo, state = protocol.all_reduce(x, state, key, axis_name)
    return mean, echo, base + echo if sign == 1 else base - echo, state


# ----------------------------------------------------------------------------------------------
# Helpers for protocol writers


def manual_axes() -> tuple[str, ...]:
    """Names of the manual (``shard_map``) axes at this point of tracing; ``()`` outside."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(
        n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual
    )


def axis_size(axis_name: str | None) -> int:
    """Number of workers on ``axis_name`` inside ``shard_map`` (1 for ``None``).

    Raises:
      ValueError: if ``axis_name`` is not a manual axis of the enclosing ``shard_map``.
    """
    if axis_name is None:
        return 1
    if not isinstance(axis_name, str):
        raise ValueError(f"axis_name must be a mesh axis name (str) or None; got {axis_name!r}.")
    manual = manual_axes()
    if axis_name not in manual:
        where = f"the manual axes here are {manual}" if manual else "not inside shard_map"
        raise ValueError(
            f"axis_name {axis_name!r} is not a mesh axis of the enclosing shard_map ({where}). "
            f"Run this inside jax.shard_map over a mesh with an axis named {axis_name!r}, "
            "or pass the right axis_name."
        )
    return lax.axis_size(axis_name)


def num_workers(axis_name: str | None) -> int | None:
    """Workers on ``axis_name`` where that is known: inside ``shard_map``, or under
    ``jax.set_mesh(mesh)`` outside it; ``None`` otherwise (1 for ``axis_name=None``)."""
    if axis_name is None:
        return 1
    if axis_name in manual_axes():
        return lax.axis_size(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    if axis_name in getattr(mesh, "axis_names", ()):
        return dict(zip(mesh.axis_names, mesh.axis_sizes))[axis_name]
    return None


def per_worker(tree: Any, axis_name: str | None, *, stacked: bool = False) -> PerWorker:
    """Wraps this worker's ``tree`` as :class:`PerWorker`: a leading axis of size 1, varying
    over ``axis_name`` (inside ``shard_map``). ``stacked``: the leaves already have it.

    Computing an update in the ``[1, ...]`` layout (``x[None] + part.value``) and wrapping it
    with ``stacked=True`` lets XLA write a donated state in place; slicing to ``[...]`` and
    adding the axis back makes it copy the buffer."""
    if not stacked:
        tree = jax.tree.map(lambda leaf: jnp.asarray(leaf)[None], tree)
    if axis_name is not None and axis_name in manual_axes():
        tree = to_varying(tree, axis_name)
    return PerWorker(tree)


def per_worker_zeros(like: Like, dtype: Any = None) -> PerWorker:
    """A :class:`PerWorker` of zeros ``[1, *like.shape]`` (in ``dtype``, default ``like``'s)."""
    return PerWorker(jnp.zeros((1, *like.shape), dtype or like.dtype))


def this_worker(part: PerWorker) -> Any:
    """This worker's tree inside a :class:`PerWorker` (drops the leading axis of size 1)."""
    if not isinstance(part, PerWorker):
        raise TypeError(f"expected a PerWorker state part; got {type(part).__name__}.")
    for leaf in jax.tree.leaves(part.value):
        if leaf.shape[:1] != (1,):
            raise ValueError(
                f"a per-worker state leaf of shape {tuple(leaf.shape)} reached a reduction "
                "without its leading worker axis of size 1: inside shard_map give per-worker "
                "state the in_specs of jaxcomp.comm.state_specs (P(axis)), or run on the "
                "state tx.init returned when there is no axis."
            )
    return jax.tree.map(lambda leaf: leaf[0], part.value)


def worker_key(key: Array | None, axis_name: str | None) -> Array | None:
    """``key`` decorrelated per worker (``fold_in`` of the axis index)."""
    if key is None or axis_name is None:
        return key
    return jax.random.fold_in(key, lax.axis_index(axis_name))


def psum(tree: Any, axis_name: str | None) -> Any:
    """``lax.psum`` of every leaf (identity without an axis)."""
    return tree if axis_name is None else jax.tree.map(lambda x: lax.psum(x, axis_name), tree)


def all_gather(tree: Any, axis_name: str | None) -> Any:
    """Replicated ``all_gather`` of every leaf on a new leading axis (``[1, ...]`` without an
    axis)."""
    if axis_name is None:
        return jax.tree.map(lambda x: x[None], tree)

    def gather(t):
        return jax.tree.map(lambda x: lax.all_gather(x, axis_name, to="invarying"), t)

    return move_as_bits(gather, tree)  # a bf16 payload crosses as u16, not widened


def prescale_exponent(num: int, dtype: Any) -> int:
    """``k`` with ``2**k >= num`` for a float ``dtype`` whose range reaches ``2**-126`` (float32,
    bfloat16, float64), else 0 (float16 and narrower keep their bottom binades).

    A sum of ``num`` terms each scaled by ``2**-k`` cannot overflow, and the scaling is exact
    for terms above ``2**(k - 126)``.
    """
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).minexp > -126:
        return 0
    return _scaling.sum_exponent(num)


def pmean(x: Array, axis_name: str | None) -> Array:
    """``lax.pmean`` (identity without an axis).

    Where the float32 sum of the workers' arrays overflows (entries near ``3e38 / W``) the mean
    is inf, never a finite wrong value (tests/comm/test_reduce_magnitudes.py). Scaling the
    terms by ``2**-k`` before the ``psum`` would make it exact there, but it costs the dense
    mean a pass over the array (``docs/performance.md``) and reads terms below ``2**(k - 126)``
    as zero (the CPU backend flushes subnormals, ``jaxcomp._cpu`` [subnormals]): not taken.
    """
    return x if axis_name is None else lax.pmean(x, axis_name)


#: element bytes of a reduction's operand on the CPU backend, where it widens them
#: (``jaxcomp._cpu`` [widened-collectives]): a ``bfloat16`` ``psum`` crosses as ``float32``,
#: an 8-bit float one as ``float16`` (``float16`` stays)
_CPU_REDUCED_ITEMSIZE = {"bfloat16": 4, "float8_e4m3fn": 2, "float8_e5m2": 2}


def reduced_bytes(tree: Any) -> int | Array:
    r"""Bytes one worker puts into a ``psum`` of the arrays in ``tree``, on this backend.

    .. math::
      \mathrm{bytes} = \sum_{x} |x| \cdot \mathrm{itemsize}_{\mathrm{wire}}(x)

    GPU and TPU reduce every float in its own width. The CPU backend widens ``bfloat16`` and
    8-bit float reductions (``jaxcomp._cpu`` [widened-collectives]): the psum of a ``bfloat16``
    array crosses as ``float32``, twice its bytes, and a reduction cannot go as bits
    (:func:`jaxcomp._bits.move_as_bits` is for collectives that only move data). The count is
    chosen when the program is lowered (``jaxcomp._cpu.kernel``), so it is what the compiled
    program's collectives hold (:func:`jaxcomp.comm.measure_collectives`) on every backend.

    Args:
      tree: arrays or ``ShapeDtypeStruct``\ s, the operands of one or more ``psum``\ s.

    Returns:
      A Python int where no operand is widened anywhere (every ``float32`` tree), else a
      ``float32`` scalar: usable inside ``jit`` and ``shard_map`` (invariant over every axis).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> reduced_bytes(jax.ShapeDtypeStruct((8,), jnp.float32))
      32
    """
    own = array_bytes(tree)
    widened = sum(
        math.prod(x.shape) * _CPU_REDUCED_ITEMSIZE.get(np.dtype(x.dtype).name, x.dtype.itemsize)
        for x in jax.tree.leaves(tree)
    )
    if widened == own:
        return own
    return _cpu.kernel(cpu=lambda: jnp.float32(widened), default=lambda: jnp.float32(own))


def array_bytes(tree: Any) -> int:
    """Bytes of the arrays (or ``ShapeDtypeStruct``s) in ``tree``."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
