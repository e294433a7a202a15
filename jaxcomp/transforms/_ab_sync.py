r"""Group roles and the four ways AB-Training syncs its groups (SPEC §3.4-3.5).

Workers form ``G`` groups along the :data:`~jaxcomp.comm.GROUP` mesh axis, each of
:data:`~jaxcomp.comm.MEMBER` workers. The first ``G // 2`` groups train ``A`` ("A-groups"), the
others train ``B``; in ``only-b`` mode every group trains ``B``. Within a group all members hold
the same values, so averaging over all workers equals averaging over the group axis, and that
is the collective used here.

With :math:`A_g, B_g` held by group :math:`g` (:math:`g < G_A` trained ``A``):

* ``with-stale``: :math:`\bar A = \frac1G\sum_g A_g`, :math:`\bar B = \frac1G\sum_g B_g`
  (the untrained, stale copies included), :math:`W = \bar A \bar B`;
* ``only-learned``: :math:`\bar A = \frac1{G_A}\sum_{g<G_A} A_g`,
  :math:`\bar B = \frac1{G-G_A}\sum_{g\ge G_A} B_g`, :math:`W = \bar A \bar B`;
* ``full``: :math:`W = \frac1G\sum_g A_g B_g` (a dense average);
* ``only-b``: :math:`\bar B = \frac1G\sum_g B_g`, :math:`W = A \bar B` (``A = U`` everywhere).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm import GROUP
from jaxcomp.transforms._ab_factor import reconstruct
from jaxcomp.transforms._ab_layout import FactorSpec

SYNC_MODES = ("with-stale", "only-learned", "full", "only-b")


def num_a_groups(sync_mode: str, num_groups: int) -> int:
    """How many groups train ``A``: ``num_groups // 2``, or 0 in ``only-b`` mode."""
    return 0 if sync_mode == "only-b" else num_groups // 2


def is_a_group(num_a: int) -> jax.Array | bool:
    """Whether this worker's group trains ``A`` (inside ``shard_map``)."""
    if num_a == 0:
        return False
    return lax.axis_index(GROUP) < num_a


def _masked_mean(x: jax.Array, keep: jax.Array | bool, count: int) -> jax.Array:
    return lax.psum(jnp.where(keep, x, jnp.zeros_like(x)), GROUP) / count


def sync_groups(
    sync_mode: str,
    a: Sequence[jax.Array],
    b: Sequence[jax.Array],
    specs: Sequence[FactorSpec],
    *,
    num_a: int,
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Averages the groups' factors (inside ``shard_map``).

    Args:
      sync_mode: one of :data:`SYNC_MODES`.
      a, b: this worker's factors (``[m, c]`` and ``[c, n]`` per factorised parameter).
      specs: the factorised parameters' :class:`~jaxcomp.transforms._ab_layout.FactorSpec`.
      num_a: number of A-groups (:func:`num_a_groups`).

    Returns:
      ``(weights, a, b)``: the synced dense parameters (original shapes) and the synced factors
      (unchanged in ``full`` mode, which averages the products instead).
    """
    a, b = tuple(a), tuple(b)
    num_groups = lax.axis_size(GROUP)
    if sync_mode == "with-stale":
        a, b = lax.pmean((a, b), GROUP)
    elif sync_mode == "only-learned":
        trains_a = is_a_group(num_a)
        if num_a:
            a = tuple(_masked_mean(x, trains_a, num_a) for x in a)
        b = tuple(_masked_mean(x, jnp.logical_not(trains_a), num_groups - num_a) for x in b)
    elif sync_mode == "only-b":
        b = lax.pmean(b, GROUP)
    elif sync_mode != "full":
        raise ValueError(f"sync_mode must be one of {SYNC_MODES}; got {sync_mode!r}.")
    weights = tuple(reconstruct(x, y, s) for x, y, s in zip(a, b, specs))
    if sync_mode == "full":
        weights = lax.pmean(weights, GROUP)
    return weights, a, b
