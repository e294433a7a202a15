"""Grouped data parallelism for AB-Training: the mesh, the per-group layout, the train step.

During AB phases the groups hold different factors and weights, so every AB-Training array
carries a leading axis of one entry per group, sharded over :data:`~jaxcomp.comm.GROUP` and
replicated over :data:`~jaxcomp.comm.MEMBER` (:func:`per_group`). Inside ``shard_map`` each
worker sees its group's entry.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.comm import GROUP
from jaxcomp.comm import MEMBER
from jaxcomp.comm import local_value_and_grad
from jaxcomp.comm import make_mesh
from jaxcomp.comm import varying_axes
from jaxcomp.transforms import _ab_factor as F
from jaxcomp.transforms._ab_step import ABTrainingState
from jaxcomp.transforms._data_parallel import DataParallel
from jaxcomp.transforms._data_parallel import TrainState


def ab_mesh(num_groups: int, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The ``(group, member)`` mesh: the data-parallel workers split into ``num_groups`` groups.

    Args:
      num_groups: number of independent groups; must divide the number of devices.
      devices: the data-parallel workers (default: all devices).

    Returns:
      A mesh with axes ``("group", "member")`` of sizes ``(num_groups, len(devices) //
      num_groups)``; consecutive devices share a group (e.g. the GPUs of one node).

    Raises:
      ValueError: if ``num_groups`` is not a positive divisor of the number of devices.

    Example:
      >>> mesh = ab_mesh(2, jax.devices()[:8])  # doctest: +SKIP
      >>> dict(mesh.shape)  # doctest: +SKIP
      {'group': 2, 'member': 4}
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int; got {num_groups!r}.")
    if len(devices) % num_groups:
        raise ValueError(
            f"num_groups={num_groups} does not divide the data axis of {len(devices)} devices; "
            f"use one of {[g for g in range(1, len(devices) + 1) if len(devices) % g == 0]}."
        )
    return make_mesh([(GROUP, num_groups), (MEMBER, len(devices) // num_groups)], devices)


def per_group(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Copies every leaf once per group: ``[G, ...]``, sharded over ``group``.

    Use it on the parameters and the :func:`~jaxcomp.transforms.ab_training` state (from
    ``tx.init`` on the unstacked parameters) before the first step.
    """
    groups = mesh.shape[GROUP]
    sharding = NamedSharding(mesh, P(GROUP))

    def stack(x):
        x = np.asarray(x)
        return jax.device_put(np.broadcast_to(x, (groups, *x.shape)), sharding)

    return jax.tree.map(stack, tree)


def group_entry(tree: Any, group: int = 0) -> Any:
    """One group's entry of a per-group tree (a host copy)."""
    return jax.tree.map(lambda x: np.asarray(x)[group], tree)


def ab_data_parallel(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    *,
    has_aux: bool = False,
    donate: bool = True,
) -> DataParallel:
    """A jitted grouped data-parallel train step for :func:`~jaxcomp.transforms.ab_training`.

    The grouped counterpart of :func:`~jaxcomp.transforms.data_parallel`, with the same
    :class:`~jaxcomp.transforms.DataParallel` interface: ``state = dp.init(params)``;
    ``state, metrics = dp.step(state, batch)``. Parameters and optimizer state are laid out
    per group (:func:`per_group`), since the groups' weights differ during AB phases. Each
    worker takes the gradient of its shard of ``batch`` with
    :func:`jaxcomp.comm.local_value_and_grad` (no hidden all-reduce); ``tx`` does all the
    communication.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), the
        mean over this worker's shard of the batch.
      tx: the optimizer, :func:`~jaxcomp.transforms.ab_training` (last in any chain).
      mesh: the :func:`ab_mesh`; ``batch`` leaves are split over both axes along their first
        dimension.
      has_aux: ``metrics["aux"]`` is ``aux`` averaged over all workers.
      donate: donate the old state's buffers to the new one.

    Returns:
      A :class:`~jaxcomp.transforms.DataParallel` (``axis_name`` is ``("group", "member")``);
      ``metrics["loss"]`` is the loss averaged over all workers; ``state_sharding(params)``
      gives the per-group shardings (an orbax restore target).

    Example:
      >>> # mesh = ab_mesh(num_groups=2)
      >>> # dp = ab_data_parallel(loss_fn, ab_training(1e-3, warmup_steps=..., ...), mesh)
      >>> # state = dp.init(params); state, metrics = dp.step(state, batch)
    """
    axes = (GROUP, MEMBER)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(axes))

    def init(params):
        step0 = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        return TrainState(step0, per_group(params, mesh), per_group(tx.init(params), mesh))

    def body(state, batch):
        params, opt_state = jax.tree.map(lambda x: x[0], (state.params, state.opt_state))
        value, grads = local_value_and_grad(loss_fn, axes, has_aux=has_aux)(params, batch)
        loss, aux = value if has_aux else (value, None)
        updates, opt_state = tx.update(grads, opt_state, params)
        if any(MEMBER in varying_axes(u) for u in jax.tree.leaves(updates)):
            raise ValueError(
                "tx returned updates that differ between the members of a group: it must "
                "average gradients within groups (use transforms.ab_training)."
            )
        params = optax.apply_updates(params, updates)
        params, opt_state = jax.tree.map(lambda x: x[None], (params, opt_state))
        metrics = {"loss": lax.pmean(loss, axes)}
        if has_aux:
            metrics["aux"] = jax.tree.map(lambda a: lax.pmean(a, axes), aux)
        return TrainState(state.step + 1, params, opt_state), metrics

    specs = TrainState(P(), P(GROUP), P(GROUP))
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axes)), out_specs=(specs, P()))
    jitted = jax.jit(sharded, donate_argnums=(0,) if donate else ())

    def shard_batch(batch):
        return jax.device_put(batch, split)

    def step(state, batch):
        return jitted(state, shard_batch(batch))

    def state_sharding(params):
        group = NamedSharding(mesh, P(GROUP))
        opt_state = jax.eval_shape(tx.init, params)
        return TrainState(
            replicated,
            jax.tree.map(lambda _: group, params),
            jax.tree.map(lambda _: group, opt_state),
        )

    return DataParallel(
        init=init, step=step, shard_batch=shard_batch, state_sharding=state_sharding, mesh=mesh,
        axis_name=axes,
    )  # fmt: skip


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def fit_rank_capacity(
    state: ABTrainingState,
    capacity: str | Sequence[int] = "rank",
    *,
    multiple: int = 1,
) -> ABTrainingState:
    """Resizes the stored factors (and their optimizer moments) to a new rank capacity.

    Collectives carry the factors at their capacity, so after a truncated re-factorisation
    the wire saving is only real once the capacity is cut to the ranks. Factors are unused in
    full-rank phases, so a host loop can keep them at full capacity there (for the next
    re-factorisation) and cut them right after it::

      kind = schedule.step_kind(int(state.step))
      state, metrics = dp.step(state, batch)  # recompiles once per new capacity
      if kind == "dense_then_refactor":
          state = state._replace(opt_state=fit_rank_capacity(state.opt_state, multiple=8))
      elif kind == "ab_then_sync":
          state = state._replace(opt_state=fit_rank_capacity(state.opt_state, "full"))

    Columns beyond a rank are zero (values and moments), so cutting or padding them changes
    nothing numerically; it is the reference's ``change_adam_shapes``.

    Args:
      state: an :class:`~jaxcomp.transforms.ABTrainingState`, per group or not.
      capacity: ``"rank"`` (the current ranks; reads them from the device), ``"full"``
        (``min(m, n)``) or one int per factorised parameter.
      multiple: round capacities up to a multiple of this (fewer recompilations).

    Returns:
      The resized state (same sharding).
    """
    full = [min(a.shape[-2], b.shape[-1]) for a, b in zip(state.a, state.b)]
    if isinstance(capacity, str):
        if capacity == "full":
            caps = full
        elif capacity == "rank":
            ranks = np.asarray(state.rank).reshape(-1, len(full)).max(axis=0)
            caps = [int(r) for r in ranks]
        else:
            raise ValueError(f"capacity must be 'rank', 'full' or a sequence; got {capacity!r}.")
    else:
        caps = [int(c) for c in capacity]
        if len(caps) != len(full) or any(c < 1 for c in caps):
            raise ValueError(f"capacity needs {len(full)} positive ints; got {capacity!r}.")
    caps = tuple(min(_round_up(c, multiple), f) for c, f in zip(caps, full))

    def resize(state):
        a = tuple(F.resize_rank_axis(x, c, -1) for x, c in zip(state.a, caps))
        b = tuple(F.resize_rank_axis(x, c, -2) for x, c in zip(state.b, caps))
        a_state = F.map_like(
            state.a_state, state.a, lambda i, x: F.resize_rank_axis(x, caps[i], -1)
        )
        b_state = F.map_like(
            state.b_state, state.b, lambda i, x: F.resize_rank_axis(x, caps[i], -2)
        )
        rank = state.rank.clip(max=np.asarray(caps, np.int32)) if caps else state.rank
        return state._replace(rank=rank, a=a, b=b, a_state=a_state, b_state=b_state)

    return jax.jit(resize)(state)
