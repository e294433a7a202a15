"""Placing a transform's state on a mesh: per-worker parts sharded, the rest replicated.

``tx.init(params)`` runs where optax users call it, outside ``shard_map``. What one worker
owns is declared in the state as :class:`~jaxcomp.compressors.PerWorker` (leaves with a leading
axis of size 1, the per-device view); :func:`place_state` stacks those to ``[W, ...]`` sharded
over the data axis and replicates everything else, and :func:`state_specs` gives the matching
``PartitionSpec``s for ``shard_map``.

On a hierarchical ``(slow, fast)`` pair a worker is a fast group (a host): ``PerWorker`` parts
are sharded over ``slow`` and replicated over ``fast``. What one *device* of a group keeps for
itself (a sharded mean's state of the parameters that device reduces,
:mod:`jaxcomp.comm._reduce_shards`) is declared :class:`PerDevice`: leading axes ``[1, 1]``
from ``init``, placed ``[W_slow, W_fast, ...]`` sharded over both axes, so a state placed on
another split of the devices has other shapes (a clear error, never a device reading the
state of parameters it did not reduce).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.compressors import _protocol


class PerDevice(NamedTuple):
    """A part of a state owned by one device of a ``(slow, fast)`` pair (not by its group).

    Attributes:
      value: a pytree whose leaves have two leading axes: ``[1, 1]`` from ``init`` and inside
        ``shard_map``, ``[W_slow, W_fast]`` once placed on a mesh.
    """

    value: Any


REPLICATED, PER_WORKER, PER_DEVICE = 0, 1, 2


def _is_part(node: Any) -> bool:
    return isinstance(node, (_protocol.PerWorker, PerDevice))


def _map(fn, state: Any) -> Any:
    """``fn(leaf, kind)`` over every array leaf of ``state`` (``kind``: :data:`REPLICATED`,
    :data:`PER_WORKER` or :data:`PER_DEVICE`, by the outermost part holding it)."""

    def visit(node):
        if isinstance(node, PerDevice):
            return PerDevice(jax.tree.map(lambda x: fn(x, PER_DEVICE), node.value))
        if _is_part(node):
            return _protocol.PerWorker(jax.tree.map(lambda x: fn(x, PER_WORKER), node.value))
        return fn(node, REPLICATED)

    return jax.tree.map(visit, state, is_leaf=_is_part)


def _axes(axis_name: str | tuple[str, str]) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _spec(kind: int, axes: tuple[str, ...]) -> P:
    if kind == PER_WORKER:
        return P(axes[0])
    if kind == PER_DEVICE:
        if len(axes) != 2:
            raise ValueError(
                "a state with PerDevice parts (a mean sharded over the fast axis of a (slow, "
                f"fast) pair) must be placed on the pair; got the axis {axes[0]!r}."
            )
        return P(*axes)
    return P()


def state_specs(state: Any, axis_name: str | tuple[str, str]) -> Any:
    """``PartitionSpec``s of ``state``: ``P(axis_name)`` for per-worker leaves, else ``P()``.

    With a ``(slow, fast)`` pair: ``P(slow)`` for per-worker leaves, ``P(slow, fast)`` for
    :class:`PerDevice` ones.

    Use them as ``shard_map`` in/out specs of a placed state (see :func:`place_state`).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import comm, compressors, feedback, transforms
      >>> tx = transforms.compressed_mean(feedback.error_feedback(compressors.top_k(0.1)))
      >>> specs = comm.state_specs(tx.init({"w": jnp.zeros((8, 8))}), "data")
      >>> specs.leaves["w"].memory.residual.value
      P('data',)
    """
    axes = _axes(axis_name)
    return _map(lambda leaf, kind: _spec(kind, axes), state)


def place_state(state: Any, mesh: jax.sharding.Mesh, axis_name: str | tuple[str, str]) -> Any:
    """Places a state from ``tx.init`` on ``mesh``: per-worker parts sharded over ``axis_name``.

    Leaves inside :class:`~jaxcomp.compressors.PerWorker` (leading axis 1, as ``init`` made
    them, or already W) become ``[W, ...]`` arrays sharded ``P(axis_name)``, every worker
    starting from the same value; the other leaves are replicated. Works on
    ``ShapeDtypeStruct`` trees too (e.g. ``jax.eval_shape(tx.init, params)``), giving the
    placed shapes and shardings of an orbax restore target. New buffers are always made (the
    caller's arrays are never aliased, so a step may donate the result).

    Args:
      state: an optimizer state, or its abstract shape.
      mesh: the mesh.
      axis_name: the data-parallel axis of ``mesh``, or a ``(slow, fast)`` pair (per-worker
        parts over ``slow``, :class:`PerDevice` parts over both).

    Returns:
      The placed state (or ``ShapeDtypeStruct`` tree with shardings).

    Raises:
      ValueError: if ``axis_name`` is not an axis of ``mesh``, a per-worker leaf has no
        leading worker axis of size 1 or W, or a :class:`PerDevice` one no leading
        ``[1, 1]`` or ``[W_slow, W_fast]`` (or it is placed on one axis).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import comm, compressors, feedback, transforms
      >>> mesh = comm.make_mesh([("data", 2)], jax.devices()[:2])
      >>> tx = transforms.compressed_mean(feedback.error_feedback(compressors.top_k(0.1)))
      >>> state = comm.place_state(tx.init({"w": jnp.zeros((8, 8))}), mesh, "data")
      >>> state.leaves["w"].memory.residual.value.shape
      (2, 8, 8)
    """
    axes = _axes(axis_name)
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"axis_name {a!r} is not an axis of the mesh {mesh.axis_names}.")
    num = mesh.shape[axes[0]]
    grid = tuple(mesh.shape[a] for a in axes)

    leaves, treedef = jax.tree.flatten(state)
    kinds = jax.tree.leaves(_map(lambda leaf, kind: kind, state))
    shapes, shardings = [], []
    for leaf, kind in zip(leaves, kinds):
        spec = _spec(kind, axes)
        shape = tuple(jnp.shape(leaf))
        if kind == PER_WORKER:
            if not shape or shape[0] not in (1, num):
                raise ValueError(
                    f"a per-worker state leaf of shape {shape} must have a leading worker axis of "
                    f"size 1 (from init) or {num} (placed on {axes[0]!r})."
                )
            shape = (num, *shape[1:])
        elif kind == PER_DEVICE:
            if shape[:2] not in ((1, 1), grid):
                raise ValueError(
                    f"a per-device state leaf of shape {shape} must have leading axes (1, 1) "
                    f"(from init) or {grid} (placed on {axes}): placed on another split of "
                    "the devices, a device would hold the state of parameters it does not reduce."
                )
            shape = (*grid, *shape[2:])
        shapes.append(shape)
        shardings.append(NamedSharding(mesh, spec))
    if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return treedef.unflatten(
            [
                jax.ShapeDtypeStruct(shape, x.dtype, sharding=s)
                for x, shape, s in zip(leaves, shapes, shardings)
            ]
        )

    def place(flat):
        return [jnp.broadcast_to(x, shape) for x, shape in zip(flat, shapes)]

    placed = jax.jit(place, out_shardings=shardings)(leaves)
    return treedef.unflatten(placed)
