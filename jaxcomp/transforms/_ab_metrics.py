"""AB-Training metrics: phase, ranks, compression ratio, and bytes per step from compiled HLO."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.comm import GROUP
from jaxcomp.comm import MEMBER
from jaxcomp.comm import CollectiveReport
from jaxcomp.comm import measure_collectives
from jaxcomp.transforms._ab_layout import build_layout
from jaxcomp.transforms._ab_schedule import STEP_KINDS
from jaxcomp.transforms._ab_schedule import ABPhase
from jaxcomp.transforms._ab_step import ABTrainingState
from jaxcomp.transforms._ab_sync import num_a_groups
from jaxcomp.transforms._ab_training import _transform
from jaxcomp.transforms._ab_training import ab_training
from jaxcomp.transforms._ab_training import config_of


def ab_metrics(
    state: ABTrainingState, params: Any, *, exclude: Sequence[str] | None = None
) -> dict[str, Any]:
    """Phase, step, per-layer rank and parameter-level compression of an AB-Training state.

    Works on a per-group state (:func:`~jaxcomp.transforms.per_group`; all groups share these
    values) and inside the train step on a worker's state; it only reads shapes, ``count``,
    ``phase`` and ``rank``.

    Args:
      state: the :class:`~jaxcomp.transforms.ABTrainingState`.
      params: the dense parameters (per group or not, like ``state``); only shapes are used.
      exclude: the ``exclude`` given to :func:`~jaxcomp.transforms.ab_training`; with it the
        result also has ``rank_by_layer``, ``{parameter path: rank}``.

    Returns:
      ``phase`` (:class:`~jaxcomp.transforms.ABPhase` of the next step), ``step``, ``rank``
      (``int32[L]``, factorised parameters in tree order), ``compression_ratio`` (full-rank
      parameter count over the count the model trains now: ``r (m + n)`` per factorised weight
      in AB phases, dense otherwise; the paper's 44.14:1 for VGG-16) and ``param_fraction``
      (its inverse, the reference's ``get_network_compression`` / 100).

    Raises:
      ValueError: if ``exclude`` does not give the factorised parameters of ``state``.
    """
    stacked = state.count.ndim == 1
    groups = state.count.shape[0] if stacked else 1
    count, phase, rank = state.count, state.phase, state.rank
    if stacked:
        count, phase, rank = count.max(), phase.max(), rank.max(axis=0)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params)) // groups
    mn = [(a.shape[-2], b.shape[-1]) for a, b in zip(state.a, state.b)]
    dense_factored = sum(m * n for m, n in mn)
    low_rank = sum((rank[i] * (m + n) for i, (m, n) in enumerate(mn)), jnp.zeros([], jnp.int32))
    current = jnp.where(phase == ABPhase.AB, total - dense_factored + low_rank, total)
    current = current.astype(jnp.float32)
    metrics = {
        "phase": phase,
        "step": count,
        "rank": rank,
        "compression_ratio": total / current,
        "param_fraction": current / total,
    }
    if exclude is not None:
        unstacked = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape[int(stacked) :], x.dtype), params
        )
        specs = build_layout(unstacked, exclude).specs
        if [(s.rows, s.cols) for s in specs] != mn:
            raise ValueError(f"exclude={exclude!r} does not give this state's factorised layers.")
        metrics["rank_by_layer"] = {s.path: rank[i] for i, s in enumerate(specs)}
    return metrics


def _abstract(tree: Any, mesh: jax.sharding.Mesh, lead: tuple[int, ...], spec: P) -> Any:
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype, sharding=sharding), tree
    )


def ab_step_bytes(
    params: Any,
    mesh: jax.sharding.Mesh,
    *,
    state: ABTrainingState | None = None,
    kinds: tuple[str, ...] = STEP_KINDS,
    **ab_training_kwargs: Any,
) -> dict[str, dict[str, CollectiveReport]]:
    """Collectives of one AB-Training update per step kind and group role, read from HLO.

    Each kind is compiled on its own (``step_kind=...``) and, for AB kinds, once per role, so
    the reports are what one worker of that role sends; nothing runs.

    Args:
      params: the dense parameters (arrays or ``ShapeDtypeStruct``s, not per group).
      mesh: the :func:`~jaxcomp.transforms.ab_mesh`.
      state: a (not per-group) state or its ``ShapeDtypeStruct``s, e.g. with a cut capacity
        from :func:`~jaxcomp.transforms.fit_rank_capacity`; default: ``tx.init(params)``.
      kinds: which of :data:`STEP_KINDS` to compile.
      **ab_training_kwargs: the arguments of :func:`~jaxcomp.transforms.ab_training`.

    Returns:
      ``{kind: {role: report}}`` with roles ``"a"`` and ``"b"`` for the AB kinds of modes with
      A-groups, ``"b"`` in ``only-b`` mode, and ``"all"`` for the dense kinds.
    """
    tx = ab_training(**ab_training_kwargs)
    cfg = config_of(tx)
    if state is None:
        state = jax.eval_shape(tx.init, params)
    groups, members = mesh.shape[GROUP], mesh.shape[MEMBER]
    workers = P((GROUP, MEMBER))
    args = (
        _abstract(params, mesh, (groups * members,), workers),
        _abstract(state, mesh, (groups,), P(GROUP)),
        _abstract(params, mesh, (groups,), P(GROUP)),
    )
    num_a = num_a_groups(cfg.sync_mode, groups)
    out: dict[str, dict[str, CollectiveReport]] = {}
    for kind in kinds:
        roles = ("all",) if kind.startswith("dense") else (("a", "b") if num_a else ("b",))
        out[kind] = {}
        for role in roles:
            update = _transform(cfg, kind, None if role == "all" else role).update

            def body(grads, state, params, update=update):
                grads, state, params = jax.tree.map(lambda x: x[0], (grads, state, params))
                updates, state = update(grads, state, params)
                return jax.tree.map(lambda x: x[None], (updates, state))

            fn = jax.shard_map(
                body, mesh=mesh, in_specs=(workers, P(GROUP), P(GROUP)),
                out_specs=(P(GROUP), P(GROUP)),
            )  # fmt: skip
            out[kind][role] = measure_collectives(jax.jit(fn), *args)
    return out
