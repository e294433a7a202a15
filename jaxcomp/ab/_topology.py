r"""Where AB-Training's workers sit, and the collectives over their groups (inside ``shard_map``).

Workers are numbered along the flattened ``axis_name`` axes of :class:`~._config.ABConfig`
(``lax.axis_index(axis_name)``) and form consecutive groups (:func:`._config.group_sizes`).
Two layouts:

* **rectangular**: ``axis_name = (group_axis, member_axis)`` and every group is one row of
  the mesh. A group-local mean is ``pmean`` over the member axis (an all-reduce within the
  group, bandwidth-optimal).
* **flat**: any other grouping, unequal groups included, which a rectangular mesh cannot hold.
  A group-local mean is a ring of ``ppermute``\ s within each group: step ``k`` sends every
  worker's value to the worker ``k`` places ahead in its group, ``max(size) - 1`` steps in
  all, so a worker of a group of ``s`` sends its payload ``s - 1`` times (a ring all-reduce
  sends ``2 (s - 1) / s`` times; for ``s = 2`` they are equal). The same rings restricted to
  the A-groups' (or B-groups') workers reduce the factor gradients with no ``cond``.

**Collectives and control flow.** A ``lax.cond``/``lax.switch`` whose branches hold a
collective over axis ``a`` must have a predicate that is uniform over ``a``: every device of
each of the collective's groups must take the same branch, or the devices that reach it wait
for ones that never come (a hang on NCCL/TPU; on the CPU backend a "rendezvous" stall and
a SIGABRT after 40 s). The A/B role differs between groups, so AB-Training branches on it
only where that holds: on the rectangular layout its predicate varies over the group axis
and the branches' collectives run over the member axis; on the flat layout the role is never
a branch (both factors' rings run, each among its own role's workers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp._bits import move_as_bits
from jaxcomp.ab._config import ABConfig
from jaxcomp.ab._config import num_a_groups


def _axis_sizes(axes: tuple[str, ...]) -> tuple[int, ...]:
    try:
        return tuple(lax.axis_size(a) for a in axes)
    except NameError as e:
        raise ValueError(
            f"ab_training's update must run inside shard_map over a mesh with the axes "
            f"{axes} (ABConfig.axis_name; see jaxcomp.parallel.ab_mesh and "
            f"ab_data_parallel): {e}"
        ) from e


@dataclasses.dataclass(frozen=True)
class Topology:
    """The static worker grouping of one traced update.

    Attributes:
      axes: the workers' mesh axes.
      sizes: the group sizes, first group first.
      num_a: how many (leading) groups train ``A``.
      rectangular: whether each group is a row of a ``(group, member)`` mesh.
      members_agree: whether the members of a group hold equal values (rectangular layout,
        ``comm_setup="groups"``): means over all workers then run over the group axis only,
        the same numbers with a shorter ring.
    """

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    num_a: int
    rectangular: bool
    members_agree: bool = False

    @property
    def state_axes(self) -> tuple[str, ...]:
        """The axes the state varies over (the group axis alone if the members agree)."""
        return self.axes[:1] if self.members_agree else self.axes

    @property
    def num_workers(self) -> int:
        return sum(self.sizes)

    @property
    def num_groups(self) -> int:
        return len(self.sizes)

    def groups(self) -> list[range]:
        starts = np.cumsum((0, *self.sizes))
        return [range(int(starts[g]), int(starts[g + 1])) for g in range(len(self.sizes))]

    def group_of_worker(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.sizes)), self.sizes)

    def worker(self) -> jax.Array:
        """This worker's index (``int32[]``, varying over the axes)."""
        return lax.axis_index(self.axes)

    def _lookup(self, table: np.ndarray) -> jax.Array:
        return jnp.asarray(table)[self.worker()]

    def is_a(self) -> jax.Array | bool:
        """Whether this worker's group trains ``A`` (a traced bool, or False in only-b)."""
        if self.num_a == 0:
            return False
        if self.rectangular:
            return lax.axis_index(self.axes[0]) < self.num_a
        return self._lookup(self.group_of_worker() < self.num_a)

    def a_workers(self) -> int:
        return sum(self.sizes[: self.num_a])

    # ---- collectives --------------------------------------------------------------------

    def all_mean(self, tree: Any) -> Any:
        """Mean over all workers."""
        return lax.pmean(tree, self.axes)

    def _sync_axes(self) -> tuple[str, ...]:
        return self.axes[:1] if self.members_agree else self.axes

    def sync_mean(self, tree: Any) -> Any:
        """Mean over all workers of values that agree within groups if ``members_agree``."""
        return lax.pmean(tree, self._sync_axes())

    def group_mean(self, tree: Any, groups: range | None = None) -> Any:
        """Mean within each worker's group.

        Args:
          tree: the values to average.
          groups: on the flat layout, run the rings only within these groups (the others'
            workers send nothing and get their own value back); None: all groups.
        """
        if self.rectangular:
            return lax.pmean(tree, self.axes[1])
        chosen = [r for g, r in enumerate(self.groups()) if groups is None or g in groups]
        longest = max((len(r) for r in chosen), default=1)
        acc = tree
        for k in range(1, longest):
            perm = [(w, r.start + (w - r.start + k) % len(r)) for r in chosen if len(r) > k
                    for w in r]  # fmt: skip
            got = move_as_bits(lambda t, perm=perm: lax.ppermute(t, self.axes, perm), tree)
            acc = jax.tree.map(jnp.add, acc, got)  # zeros where nothing was received
        used = [len(r) if groups is None or g in groups else 1 for g, r in enumerate(self.groups())]
        size = self._lookup(np.repeat(np.asarray(used, np.float32), self.sizes))
        return jax.tree.map(lambda x: (x / size.astype(x.dtype)).astype(x.dtype), acc)

    def mean_over(self, tree: Any, keep: jax.Array | bool, count: int) -> Any:
        """Mean over the ``count`` workers where ``keep`` holds (a masked ``psum``).

        ``keep`` must agree within groups if ``members_agree`` (then ``count`` is the number
        of workers still, and the sum runs over the group axis times the group size).
        """
        masked = jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)
        scale = count / self.sizes[0] if self.members_agree else count
        return jax.tree.map(lambda x: x / scale, lax.psum(masked, self._sync_axes()))

    def first(self, tree: Any) -> Any:
        """Worker 0's value, on every worker (a masked ``psum``: CPU has no broadcast)."""
        if self.members_agree:
            return self.mean_over(tree, lax.axis_index(self.axes[0]) == 0, self.sizes[0])
        return self.mean_over(tree, self.worker() == 0, 1)

    def agree_max(self, x: jax.Array) -> jax.Array:
        return lax.pmax(x, self.axes)


def topology(cfg: ABConfig) -> Topology:
    """The :class:`Topology` of ``cfg`` on the current ``shard_map`` mesh.

    Raises:
      ValueError: outside ``shard_map`` over ``cfg.axis_name``, or for a grouping the workers
        cannot form.
    """
    axes = cfg.axis_name
    axis_sizes = _axis_sizes(axes)
    sizes = cfg.group_sizes(axis_sizes)
    rect = len(axes) == 2 and sizes == (axis_sizes[1],) * axis_sizes[0]
    if math.prod(axis_sizes) != sum(sizes):  # pragma: no cover - group_sizes guarantees it
        raise ValueError(f"groups {sizes} do not cover the {math.prod(axis_sizes)} workers.")
    agree = cfg.members_agree(axis_sizes)
    return Topology(axes, sizes, num_a_groups(cfg.sync_mode, len(sizes)), rect, agree)
