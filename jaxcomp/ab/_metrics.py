"""AB-Training metrics: phase, ranks, compression ratio, and bytes per step from compiled HLO."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.ab._config import ABConfig
from jaxcomp.ab._config import num_a_groups
from jaxcomp.ab._layout import build_layout
from jaxcomp.ab._schedule import STEP_KINDS
from jaxcomp.ab._schedule import ABPhase
from jaxcomp.ab._step import ABTrainingState
from jaxcomp.ab._step import Ctx
from jaxcomp.ab._step import init_state
from jaxcomp.ab._sync import SYNC_SCOPE
from jaxcomp.ab._topology import topology
from jaxcomp.ab._transform import update_kind
from jaxcomp.comm import CollectiveReport
from jaxcomp.comm import collective_report


def ab_metrics(
    state: ABTrainingState, params: Any, *, exclude: Sequence[str] | None = None
) -> dict[str, Any]:
    """Phase, step, per-layer rank and parameter-level compression of an AB-Training state.

    Works on a per-worker state (:func:`~jaxcomp.parallel.stack_per_worker`; all workers share these
    values) and inside the train step on a worker's state; it only reads shapes, ``count``,
    ``phase`` and ``rank``.

    Args:
      state: the :class:`~jaxcomp.transforms.ABTrainingState`.
      params: the dense parameters (per worker or not, like ``state``); only shapes are used.
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


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def collectives_by_role(hlo_text: str) -> dict[str, CollectiveReport]:
    """A compiled AB program's collectives, split by the group role that runs them.

    The factor training of each role runs under ``jax.named_scope("ab_role_a")`` (or ``_b``),
    which the compiled HLO keeps in each instruction's ``op_name``. A worker of role ``r``
    runs the shared collectives and those of its role: inside the role ``cond`` of a
    rectangular mesh it never reaches the other branch, and on a flat axis the other role's
    rings have it in no source-target pair.

    The sync the harness runs inside its AB program (only at a cycle's last AB step) runs
    under ``jax.named_scope("ab_sync")`` (:func:`~._sync.reconstruct_or_sync`): its
    collectives are the ``"sync"`` report, in no other.

    Returns:
      ``{"a": ..., "b": ..., "shared": ..., "sync": ...}`` reports; ``"a"`` and ``"b"``
      include the shared collectives.
    """
    ops = {}
    for line in hlo_text.splitlines():
        name, op = _NAME.match(line), _OP_NAME.search(line)
        if name and op:
            ops[name.group(1)] = op.group(1)
    report = collective_report(hlo_text)
    tagged = {"a": [], "b": [], "shared": [], "sync": []}
    for r in report.records:
        op = ops.get(r.name, "")
        role = "a" if "ab_role_a" in op else "b" if "ab_role_b" in op else "shared"
        tagged["sync" if SYNC_SCOPE in op else role].append(r)
    shared = tuple(tagged["shared"])
    unknown = report.unknown_trip_counts
    return {
        "a": CollectiveReport(shared + tuple(tagged["a"]), unknown),
        "b": CollectiveReport(shared + tuple(tagged["b"]), unknown),
        "shared": CollectiveReport(shared, unknown),
        "sync": CollectiveReport(tuple(tagged["sync"]), unknown),
    }


def _abstract(tree: Any, sharding: NamedSharding, lead: int) -> Any:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((lead, *x.shape), x.dtype, sharding=sharding), tree
    )


def ab_step_bytes(
    params: Any,
    mesh: jax.sharding.Mesh,
    config: ABConfig,
    *,
    state: ABTrainingState | None = None,
    kinds: tuple[str, ...] = STEP_KINDS,
) -> dict[str, dict[str, CollectiveReport]]:
    """Collectives of one AB-Training update per step kind and group role, read from HLO.

    Each kind of the transform's update is compiled on its own (grads in, no model), and its
    collectives are split by role (:func:`collectives_by_role`), so the reports are what one
    worker of that role sends; nothing runs.

    Args:
      params: the dense parameters (arrays or ``ShapeDtypeStruct`` values, not per worker).
      mesh: a mesh with ``config.axis_name`` (e.g. :func:`~jaxcomp.parallel.ab_mesh`).
      config: the :class:`~jaxcomp.transforms.ABConfig`.
      state: a (not per-worker) state or its ``ShapeDtypeStruct`` values, e.g. with a cut capacity
        from :func:`~jaxcomp.parallel.fit_rank_capacity`; default: the initial state.
      kinds: which of :data:`STEP_KINDS` to compile.

    Returns:
      ``{kind: {role: report}}`` with roles ``"a"`` and ``"b"`` for the AB kinds of modes with
      A-groups, ``"b"`` in ``only-b`` mode, and ``"all"`` for the dense kinds.
    """
    if state is None:
        state = jax.eval_shape(lambda p: init_state(config, p), params)
    axes, held = config.axis_name, config.state_axes(mesh)
    n, k = math.prod(mesh.shape[a] for a in axes), math.prod(mesh.shape[a] for a in held)
    workers, holders = NamedSharding(mesh, P(axes)), NamedSharding(mesh, P(held))
    args = (_abstract(params, workers, n), _abstract(state, holders, k),
            _abstract(params, holders, k))  # fmt: skip
    sizes = config.group_sizes([mesh.shape[a] for a in axes])
    roles = ("a", "b") if num_a_groups(config.sync_mode, len(sizes)) else ("b",)
    out: dict[str, dict[str, CollectiveReport]] = {}
    for kind in kinds:

        def body(grads, state, params, kind=kind):
            grads, state, params = jax.tree.map(lambda x: x[0], (grads, state, params))
            ctx = Ctx(config, build_layout(params, config.exclude), topology(config))
            lr = jnp.asarray(config.lr_schedule()(state.count), jnp.float32)
            new, state = update_kind(ctx, kind, grads, state, params, lr)
            return jax.tree.map(lambda x: x[None], (new, state))

        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(held), P(held)),
                           out_specs=(P(held),) * 2)  # fmt: skip
        text = jax.jit(fn).lower(*args).compile().as_text()
        split = collectives_by_role(text)
        out[kind] = (
            {"all": split["shared"]} if kind.startswith("dense") else {r: split[r] for r in roles}
        )
    return out
