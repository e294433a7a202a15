"""An optimizer that sees a pipeline's parameters by name, stage by stage, in the packed layout.

A pipeline's parameters are :class:`~jaxcomp.pipeline.PackedParams`: per dtype one ``[S, L]``
buffer, sharded over ``stage``. An optax transformation applied to it directly sees those
buffers, not the parameters: elementwise updates (SGD, Adam, weight decay on everything) and
global norms come out right, but a mask or a label by name (``optax.masked``,
``optax.multi_transform``: weight decay on kernels only) has no names to read, and a per-leaf
statistic (LARS/LAMB trust ratios, Adafactor's factored moments) is taken over a whole buffer.

:func:`unpacked` runs the transformation on the parameter trees instead. Each device unpacks its
own stage's row into that stage's tree (the names and shapes the stage function sees) and
calls ``tx`` on the whole model's structure, a tuple with one tree per stage in which the other
stages' leaves are empty (``(0, ..., 0)`` of the same rank and dtype): a mask function or an
explicit mask tree written for the unpipelined model (``params`` a tuple of per-stage trees,
as ``models.get_model(...).init`` gives) applies as is. The updates and the optimizer state
are packed back per stage (the state as ``{dtype: [S, L']}``, sharded over ``stage`` like the
parameters), so nothing is gathered across stages.

What runs stage by stage cannot see the other stages: a transformation that combines leaves of
different stages (``clip_by_global_norm``, ``apply_if_finite``'s count over all leaves) would
compute it per stage. :func:`unpacked` finds such a transformation when it is built (the
dataflow of ``tx.update`` on the model's structure, traced once) and raises; chain it outside,
where it sees the packed buffers (whose global norm is the model's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jex_core

from jaxcomp.comm import _mesh
from jaxcomp.compressors import _protocol
from jaxcomp.pipeline import _params


def unpacked(
    tx: optax.GradientTransformation, mesh: jax.sharding.Mesh | None = None
) -> optax.GradientTransformation:
    """``tx`` applied to a pipeline's parameters stage by stage, by name, as on the unpipelined
    model.

    Each stage's parameters are unpacked from the :class:`~jaxcomp.pipeline.PackedParams`
    buffers into the stage's own tree, ``tx`` runs on the model's structure (one tree per
    stage, the other stages' leaves empty), and the updates and state are packed back. With
    the pipeline's ``mesh`` each device runs its own stage (a ``lax.switch`` over the stage
    index inside ``shard_map``: nothing crosses stages) and the state is sharded over
    ``stage``; without (the single-device simulation) the stages run one after another.

    Args:
      tx: any optax transformation whose update of one stage's leaves reads only that stage's
        leaves (masks and labels by name, per-leaf statistics and elementwise optimizers do;
        a global norm does not: chain it outside, on the packed buffers).
      mesh: the mesh of :func:`~jaxcomp.pipeline.distribute` (its ``stage`` axis), or
        ``None`` for :func:`~jaxcomp.pipeline.simulate`'s unsharded parameters.

    Returns:
      A transformation over :class:`~jaxcomp.pipeline.PackedParams`; its state is a
      ``PackedParams`` of ``tx``'s per-stage states (``[S, L']`` per dtype).

    Raises:
      ValueError: at ``init``, if ``tx``'s update of a stage reads another stage's leaves.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxcomp import pipeline
      >>> kernels = lambda p: jax.tree_util.tree_map_with_path(
      ...     lambda path, _: path[-1].key == "kernel", p)
      >>> tx = pipeline.unpacked(optax.chain(  # mesh=: the pipeline's, when distributed
      ...     optax.masked(optax.add_decayed_weights(0.1), kernels), optax.sgd(1.0)))
      >>> params = pipeline.pack_params([{"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}] * 2)
      >>> updates, _ = tx.update(params, tx.init(params), params)
      >>> updates.unpack()[1]["bias"].tolist(), updates.unpack()[1]["kernel"][0].tolist()
      ([-1.0, -1.0], [-1.100000023841858, -1.100000023841858])
    """

    def init(params):
        layout = _layout_of(params)
        _check_stage_local(tx, layout)
        rows = _rows(params, layout)
        states = [tx.init(_view(layout, s, layout.unpack_stage(s, rows[s]))) for s in
                  range(layout.num_stages)]  # fmt: skip
        packed = _params.pack_params(states)
        if mesh is None:
            return packed
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(_mesh.STAGE))
        buffers = lax.with_sharding_constraint(packed.buffers, sharding)
        return _params.PackedParams(buffers, packed.layout)

    def update(updates, state, params=None):
        layout = _layout_of(updates)
        if not isinstance(state, _params.PackedParams):
            raise ValueError("this state was not made by pipeline.unpacked(tx).init.")
        state_layout = state.layout

        def stage_update(s, u_row, s_row, p_row):
            view = lambda row: _view(layout, s, layout.unpack_stage(s, row))  # noqa: E731
            new_u, new_s = tx.update(
                view(u_row), state_layout.unpack_stage(s, s_row),
                None if p_row is None else view(p_row),
            )  # fmt: skip
            return layout.pack_stage(s, new_u[s]), state_layout.pack_stage(s, new_s)

        args = (updates.buffers, state.buffers, None if params is None else params.buffers)
        if mesh is None:  # one stage after another (the simulation, an unsharded tree)
            outs = [
                stage_update(s, *(None if a is None else {g: b[s] for g, b in a.items()}
                                  for a in args))
                for s in range(layout.num_stages)
            ]  # fmt: skip
            new_u = {g: jnp.stack([o[0][g] for o in outs]) for g in updates.buffers}
            new_s = {g: jnp.stack([o[1][g] for o in outs]) for g in state.buffers}
        else:
            new_u, new_s = _per_device(stage_update, args, layout.num_stages, mesh, _mesh.STAGE)
        return (
            _params.PackedParams(new_u, layout),
            _params.PackedParams(new_s, state_layout),
        )

    return optax.GradientTransformation(init, update)


def _layout_of(params: Any) -> _params.ParamLayout:
    if not isinstance(params, _params.PackedParams):
        raise ValueError(
            "pipeline.unpacked(tx) applies to a pipeline's PackedParams (pipeline.pack_params); "
            f"got {type(params).__name__}."
        )
    return params.layout


def _rows(params: _params.PackedParams, layout: _params.ParamLayout) -> list[dict]:
    buffers = {g: _params._gathered(b) for g, b in params.buffers.items()}
    return [{g: b[s] for g, b in buffers.items()} for s in range(layout.num_stages)]


def _empty_like(x: Any) -> jax.Array:
    """An empty array of ``x``'s rank (a scalar's: ``(0,)``, so that it is empty too)."""
    return jnp.zeros((0,) * max(1, len(x.shape)), x.dtype)


def _view(layout: _params.ParamLayout, stage: int, tree: Any) -> tuple[Any, ...]:
    """The model's structure, one tree per stage: ``tree`` at ``stage``, the others' leaves
    empty arrays of their rank and dtype."""
    structs = layout.structs()
    return tuple(
        tree if s == stage else jax.tree.map(_empty_like, structs[s])
        for s in range(layout.num_stages)
    )


def _per_device(stage_update, args, num_stages: int, mesh, axis: str):
    """Each device of ``axis`` runs its own stage's update on its rows (``shard_map`` with a
    ``lax.switch`` over the stage index)."""
    u, st, p = args

    def body(u, st, p):
        rows = [None if a is None else {g: b[0] for g, b in a.items()} for a in (u, st, p)]
        branches = [lambda r, s=s: stage_update(s, *r) for s in range(num_stages)]
        # a stage without leaves of some dtype packs constant zeros: varying like the rest
        branches = [lambda r, f=f: _protocol.to_varying(f(r), (axis,)) for f in branches]
        new_u, new_s = lax.switch(lax.axis_index(axis), branches, rows)
        return (jax.tree.map(lambda x: x[None], new_u), jax.tree.map(lambda x: x[None], new_s))

    spec = jax.sharding.PartitionSpec(axis)
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(u, st, p)


# ----------------------------------------------------------------------------------------------
# Which stage each leaf belongs to, and whether tx's update keeps to it.


def _check_stage_local(tx: optax.GradientTransformation, layout: _params.ParamLayout) -> None:
    """Raises unless every output of ``tx.update`` belonging to a stage reads only that stage's
    inputs (and leaves shared by all stages, such as a step count)."""
    structs = tuple(layout.structs())
    state = jax.eval_shape(tx.init, structs)
    owners = _state_owners(tx, layout, state)
    jaxpr = jax.make_jaxpr(lambda u, s, p: tx.update(u, s, p))(structs, state, structs)
    param_owner = [s for s in range(layout.num_stages) for _ in jax.tree.leaves(structs[s])]
    labels = [frozenset([o]) if o is not None else frozenset() for o in
              param_owner + owners + param_owner]  # fmt: skip
    deps = _dependencies(jaxpr.jaxpr, labels)
    out_owner = param_owner + owners
    for i, (dep, owner) in enumerate(zip(deps, out_owner)):
        allowed = frozenset() if owner is None else frozenset([owner])
        if dep - allowed:
            what = "update" if i < len(param_owner) else "state"
            where = f"stage {owner}'s" if owner is not None else "a shared"
            raise ValueError(
                f"pipeline.unpacked: tx computes {where} {what} from stage(s) "
                f"{sorted(dep - allowed)}' leaves, which a stage does not see (e.g. a global "
                "norm, optax.clip_by_global_norm). Chain such a transformation outside "
                "pipeline.unpacked, on the packed buffers (their global norm is the model's)."
            )


def _state_owners(tx, layout: _params.ParamLayout, state: Any) -> list[int | None]:
    """Per leaf of ``tx``'s state: the stage whose leaves it mirrors (non-empty only when that
    stage's are), or ``None`` for a leaf every stage has (a count)."""
    sizes = []
    for s in range(layout.num_stages):
        view = _view(layout, s, layout.structs()[s])
        sizes.append([int(np.prod(x.shape)) for x in
                      jax.tree.leaves(jax.eval_shape(tx.init, view))])  # fmt: skip
    owners = []
    for i in range(len(jax.tree.leaves(state))):
        present = [s for s in range(layout.num_stages) if sizes[s][i]]
        owners.append(present[0] if len(present) == 1 and layout.num_stages > 1 else None)
    return owners


@dataclasses.dataclass
class _Deps:
    sets: dict

    def read(self, v: Any) -> frozenset:
        if isinstance(v, jex_core.Literal):
            return frozenset()
        return self.sets.get(v, frozenset())


def _dependencies(jaxpr: Any, labels: Sequence[frozenset]) -> list[frozenset]:
    """For each output of ``jaxpr``, the union of the labels of the inputs it depends on
    (calls are followed into their bodies; other higher-order primitives join all their
    inputs)."""
    deps = _Deps(dict(zip(jaxpr.invars, labels)))
    for eqn in jaxpr.eqns:
        ins = [deps.read(v) for v in eqn.invars]
        inner = _inner_jaxpr(eqn)
        if (
            inner is not None
            and len(inner.invars) == len(ins)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            outs = _dependencies(inner, ins)
        else:
            joined = frozenset().union(*ins)
            outs = [joined] * len(eqn.outvars)
        deps.sets.update(zip(eqn.outvars, outs))
    return [deps.read(v) for v in jaxpr.outvars]


def _inner_jaxpr(eqn: Any) -> Any:
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(name)
        if inner is not None:
            return getattr(inner, "jaxpr", inner) if not hasattr(inner, "eqns") else inner
    return None
