r"""Finiteness flags over whole states, compiled to a few kernels whatever the leaf count.

A step that commits its new state only when every value is finite (the trainer's modes, the parallel
drivers' per-worker flags) tests every inexact leaf. Tested one by one, that costs about three fused
kernels per leaf shape on the CPU backend (the elementwise test and a reduction split in two by its
tree-reduction rewrite), and compile time follows the number of distinct kernels (``jaxcomp._cpu``
[fusion]). Here the leaves are tested in groups of one dtype, each as one vector ``v`` (their
concatenation), by

.. math::
  \sum_i 0 \cdot v_i ,

each term zero for a finite element and NaN for an infinite or NaN one, so the sum is exactly
zero (no rounding, no overflow) unless some element is not finite.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

#: The most elements :func:`all_finite` concatenates into one vector (4 MiB of ``float32``).
FINITE_GROUP_SIZE = 1 << 20


def capped_groups(leaves: list[jax.Array]) -> list[list[jax.Array]]:
    """``leaves`` in groups of one dtype and at most :data:`FINITE_GROUP_SIZE` elements (a
    larger leaf alone), in order."""
    groups: list[list[jax.Array]] = []
    open_: dict[Any, tuple[list[jax.Array], int]] = {}
    for x in leaves:
        if x.size >= FINITE_GROUP_SIZE:
            groups.append([x])
            continue
        group, size = open_.get(x.dtype, (None, 0))
        if group is None or size + x.size > FINITE_GROUP_SIZE:
            group, size = [], 0
            groups.append(group)
        group.append(x)
        open_[x.dtype] = (group, size + x.size)
    return groups


def inexact_leaves(trees: Any) -> list[jax.Array]:
    """The floating and complex leaves of ``trees``, the ones a finiteness flag tests."""
    return [x for x in jax.tree.leaves(trees) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _grouped(leaves: list[jax.Array]) -> jax.Array:
    """``bool[]``: every element of ``leaves`` (non-empty) finite, tested in groups."""
    groups = [[jnp.ravel(x) for x in group] for group in capped_groups(leaves)]
    zeros = [jnp.sum(jnp.concatenate(g) * 0) for g in groups]  # 0, or NaN
    return jnp.stack([jnp.isfinite(z) for z in zeros]).all()


def all_finite(tree: Any, *scalars: jax.Array) -> jax.Array:
    r"""``int32[]`` 1 if every inexact leaf of ``tree`` (one worker's view) and every scalar is
    finite, else 0. Inside ``shard_map`` it is this worker's flag: no collective is added.

    The leaves are tested in groups (module docstring): the values are concatenated, not
    per-leaf flags, since XLA splits the reduction of a concatenation of flags back into one
    per operand. A group holds at most :data:`FINITE_GROUP_SIZE` elements (a larger leaf is
    tested alone), so the concatenation, a temporary, stays far below the 32 MiB past which
    glibc hands XLA fresh pages on every call. Fewer tests compile faster
    (``docs/performance.md``).

    Args:
      tree: any pytree; integer and boolean leaves are ignored.
      *scalars: more values to test (a loss).

    Returns:
      ``int32[]``, 1 or 0.

    Example:
      >>> import jax.numpy as jnp
      >>> int(all_finite({"w": jnp.ones(3), "n": jnp.arange(2)}, jnp.float32(jnp.inf)))
      0
    """
    leaves = inexact_leaves((tree, scalars))
    if not leaves:
        return jnp.ones((), jnp.int32)
    return _grouped(leaves).astype(jnp.int32)


def all_finite_global(*trees: Any, replicated: bool = False) -> jax.Array:
    r"""``bool[]``: every inexact leaf of ``trees`` finite, in a global-view ``jit``.

    Args:
      *trees: pytrees whose leaves may be sharded over a mesh.
      replicated: every leaf is replicated (or the program runs on one device). The leaves
        are then tested in groups, as :func:`all_finite` does: a few kernels for the whole
        state (its compile time: ``docs/performance.md``).
        Otherwise each leaf is tested alone: a concatenation of leaves sharded over a mesh
        axis would add resharding collectives (on a mesh of ``Auto`` axes the leaves' types
        do not say how they are placed).

    Example:
      >>> import jax.numpy as jnp
      >>> bool(all_finite_global({"w": jnp.ones(3)}, jnp.float32(jnp.nan), replicated=True))
      False
    """
    leaves = inexact_leaves(trees)
    if not leaves:
        return jnp.array(True)
    if replicated:
        return _grouped(leaves)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()
