"""Placing a transform's state on a mesh: per-worker parts sharded, the rest replicated.

``tx.init(params)`` runs where optax users call it, outside ``shard_map``. What one worker
owns is declared in the state as :class:`~jaxcomp.compressors.PerWorker` (leaves with a leading
axis of size 1, the per-device view); :func:`place_state` stacks those to ``[W, ...]`` sharded
over the data axis and replicates everything else, and :func:`state_specs` gives the matching
``PartitionSpec``s for ``shard_map``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.compressors import _protocol


def _is_part(node: Any) -> bool:
    return isinstance(node, _protocol.PerWorker)


def _map(fn, state: Any) -> Any:
    """``fn(leaf, per_worker)`` over every array leaf of ``state``."""

    def visit(node):
        if _is_part(node):
            return _protocol.PerWorker(jax.tree.map(lambda x: fn(x, True), node.value))
        return fn(node, False)

    return jax.tree.map(visit, state, is_leaf=_is_part)


def state_specs(state: Any, axis_name: str) -> Any:
    """``PartitionSpec``s of ``state``: ``P(axis_name)`` for per-worker leaves, else ``P()``.

    Use them as ``shard_map`` in/out specs of a placed state (see :func:`place_state`).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import comm, compressors, feedback, transforms
      >>> tx = transforms.compressed_mean(feedback.error_feedback(compressors.top_k(0.1)))
      >>> specs = comm.state_specs(tx.init({"w": jnp.zeros((8, 8))}), "data")
      >>> specs.leaves["w"].memory.residual.value
      P('data',)
    """
    return _map(lambda leaf, per: P(axis_name) if per else P(), state)


def place_state(state: Any, mesh: jax.sharding.Mesh, axis_name: str) -> Any:
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
      axis_name: the data-parallel axis of ``mesh``.

    Returns:
      The placed state (or ``ShapeDtypeStruct`` tree with shardings).

    Raises:
      ValueError: if ``axis_name`` is not an axis of ``mesh``, or a per-worker leaf has no
        leading worker axis of size 1 or W.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import comm, compressors, feedback, transforms
      >>> mesh = comm.make_mesh([("data", 2)], jax.devices()[:2])
      >>> tx = transforms.compressed_mean(feedback.error_feedback(compressors.top_k(0.1)))
      >>> state = comm.place_state(tx.init({"w": jnp.zeros((8, 8))}), mesh, "data")
      >>> state.leaves["w"].memory.residual.value.shape
      (2, 8, 8)
    """
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}.")
    num = mesh.shape[axis_name]

    leaves, treedef = jax.tree.flatten(state)
    flags = jax.tree.leaves(_map(lambda leaf, per: per, state))
    shapes = []
    for leaf, per in zip(leaves, flags):
        shape = tuple(jnp.shape(leaf))
        if per and (not shape or shape[0] not in (1, num)):
            raise ValueError(
                f"a per-worker state leaf of shape {shape} must have a leading worker axis of "
                f"size 1 (from init) or {num} (placed on {axis_name!r})."
            )
        shapes.append((num, *shape[1:]) if per else shape)
    shardings = [NamedSharding(mesh, P(axis_name) if per else P()) for per in flags]
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
