"""The packed parameters: per-stage trees packed per dtype, an optimizer's view of them by name,
and a model's running state packed the same way.

Stages of a real model have different parameter structures (a ResNet stage that changes
channels, an embedding stage, a head), so they cannot be stacked leaf by leaf. Instead every
stage's leaves are flattened into one vector per dtype, padded to the longest stage, and the
stages are stacked: buffer ``[s]`` is stage ``s``'s parameters. Sharded ``P("stage")``, each
device holds exactly its own stage's parameters (plus padding up to the largest stage).

The packed form is a pytree (:class:`PackedParams`), so optax optimizers apply to it directly:
elementwise updates (SGD, momentum, Adam, weight decay) are the same on the packed vector as on
the per-leaf arrays, the padding gets zero gradients, and global norms are unchanged. Per-leaf
masks (e.g. no weight decay on biases) can be packed into the same layout with
:meth:`ParamLayout.pack`, which casts every leaf to its buffer's dtype (``True`` -> ``1.0``).

**An optimizer by name.** An optax transformation applied to the packed form sees the buffers,
not the parameters: a mask or a label by name (``optax.masked``, ``optax.multi_transform``:
weight decay on kernels only) has no names to read, and a per-leaf statistic (LARS/LAMB trust
ratios, Adafactor's factored moments) is taken over a whole buffer. :func:`unpacked` runs the
transformation on the parameter trees instead. Each device unpacks its own stage's row into that
stage's tree (the names and shapes the stage function sees) and calls ``tx`` on the whole
model's structure, a tuple with one tree per stage in which the other stages' leaves are empty
(``(0, ..., 0)`` of the same rank and dtype): a mask function or an explicit mask tree written
for the unpipelined model (``params`` a tuple of per-stage trees, as
``models.get_model(...).init`` gives) applies as is. The updates and the optimizer state are
packed back per stage (the state as ``{dtype: [S, L']}``, sharded over ``stage`` like the
parameters), so nothing is gathered across stages. What runs stage by stage cannot see the other
stages: a transformation that combines leaves of different stages (``clip_by_global_norm``,
``apply_if_finite``'s count over all leaves) would compute it per stage. :func:`unpacked` finds
such a transformation when it is built (the dataflow of ``tx.update`` on the model's structure,
traced once) and raises; chain it outside, where it sees the packed buffers (whose global norm is
the model's).

**Model state.** A stateful model's running state (BatchNorm statistics): each stage's state (any
pytree, ``{}`` for a stage without one) is packed per dtype like the parameters
(:class:`~jaxcomp.pipeline.ParamLayout`) into ``{dtype: [S, L]}``, or ``{dtype: [S, D, L]}`` with
``D`` data replicas (each replica its own row), sharded like the link states, so that stage ``s``'s
state lives on the device that runs stage ``s``. It travels in :class:`~jaxcomp.pipeline.LinkStates`
(``model`` and ``model_layout``), in and out of every step and through a checkpoint with them. A
step updates it with each real microbatch's forward, in microbatch order
(:mod:`jaxcomp.pipeline._ticks`, :mod:`jaxcomp.pipeline._driver`); evaluation reads it, each replica
with replica 0's or the mean over the replicas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jaxcomp.comm import _mesh
from jaxcomp.compressors import _protocol
from jaxcomp.pipeline import _link_state


@dataclasses.dataclass(frozen=True)
class _Slot:
    group: str  # buffer (dtype) name
    offset: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Where each stage's leaves live in the packed buffers (static and hashable).

    Attributes:
      treedefs: one pytree structure per stage.
      slots: per stage, per leaf: buffer name, offset and shape.
      lengths: ``((buffer name, length), ...)``; buffer names are dtype names (``"float32"``).
    """

    treedefs: tuple[Any, ...]
    slots: tuple[tuple[_Slot, ...], ...]
    lengths: tuple[tuple[str, int], ...]

    @property
    def num_stages(self) -> int:
        return len(self.treedefs)

    def pack(self, stage_trees: Sequence[Any]) -> dict[str, jax.Array]:
        """Packs per-stage pytrees with this layout's structure into ``(S, length)`` buffers.

        Leaves are cast to their buffer's dtype; a scalar leaf fills its whole slot, so a
        per-leaf mask (``True`` for matrices, ``False`` for biases) packs to a 0/1 vector.
        """
        if len(stage_trees) != self.num_stages:
            raise ValueError(
                f"expected {self.num_stages} per-stage pytrees; got {len(stage_trees)}."
            )
        rows = [self.pack_stage(s, tree) for s, tree in enumerate(stage_trees)]
        return {g: jnp.stack([r[g] for r in rows]) for g, _ in self.lengths}

    def pack_stage(self, stage: int, tree: Any) -> dict[str, jax.Array]:
        """Stage ``stage``'s pytree as its packed vectors ``{name: [length]}`` (zero padded).

        One ``concatenate`` per buffer: the transpose of :meth:`unpack_stage`.
        """
        leaves, got = jax.tree.flatten(tree)
        if got != self.treedefs[stage]:
            raise ValueError(f"stage {stage}'s pytree structure differs from the layout's.")
        rows: dict[str, list[jax.Array]] = {g: [] for g, _ in self.lengths}
        for leaf, slot in zip(leaves, self.slots[stage]):
            if jnp.ndim(leaf) == 0:  # a per-leaf scalar (e.g. an optax-style mask)
                leaf = jnp.broadcast_to(jnp.asarray(leaf), slot.shape)
            if tuple(jnp.shape(leaf)) != slot.shape:
                raise ValueError(
                    f"stage {stage}: leaf of shape {jnp.shape(leaf)} where the layout has "
                    f"{slot.shape}."
                )
            rows[slot.group].append(jnp.ravel(jnp.asarray(leaf)).astype(slot.group))
        out = {}
        for g, length in self.lengths:
            used = sum(math.prod(sl.shape) for sl in self.slots[stage] if sl.group == g)
            pad = [jnp.zeros((length - used,), g)] if length > used else []
            parts = rows[g] + pad
            out[g] = (
                jnp.concatenate(parts)
                if len(parts) > 1
                else (parts[0] if parts else jnp.zeros((0,), g))
            )
        return out

    def stage_bytes(self, stage: int) -> int:
        """Bytes of stage ``stage``'s own leaves (without the padding)."""
        return sum(math.prod(sl.shape) * np.dtype(sl.group).itemsize for sl in self.slots[stage])

    def row_bytes(self) -> int:
        """Bytes of one packed row (every buffer's length, padding included)."""
        return sum(n * np.dtype(g).itemsize for g, n in self.lengths)

    def unpack_stage(self, stage: int, local: dict[str, jax.Array]) -> Any:
        """Stage ``stage``'s pytree from its packed vectors ``{name: [length]}``.

        One ``lax.split`` per buffer: its transpose (the gradient) is one ``concatenate`` of
        the leaves' cotangents. Slicing leaf by leaf would transpose to a zero-padded
        full-length vector per leaf, summed: ``O(leaves x length)`` work per stage call.
        """
        leaves: list[Any] = [None] * len(self.slots[stage])
        for group, length in self.lengths:
            mine = [(i, sl) for i, sl in enumerate(self.slots[stage]) if sl.group == group]
            sizes = [math.prod(sl.shape) for _, sl in mine]
            parts = jax.lax.split(local[group], (*sizes, length - sum(sizes)))
            for (i, sl), part in zip(mine, parts):
                leaves[i] = part.reshape(sl.shape)
        return jax.tree.unflatten(self.treedefs[stage], leaves)

    def structs(self) -> tuple[Any, ...]:
        """Per-stage pytrees of ``jax.ShapeDtypeStruct`` (no data)."""
        return tuple(
            jax.tree.unflatten(td, [jax.ShapeDtypeStruct(sl.shape, sl.group) for sl in slots])
            for td, slots in zip(self.treedefs, self.slots)
        )

    def unpack(self, buffers: dict[str, jax.Array]) -> tuple[Any, ...]:
        """All stages' pytrees from the ``(S, length)`` buffers.

        Buffers sharded over ``stage`` on an Explicit mesh are first gathered (indexing a sharded
        axis needs a declared output sharding there), so the stages come back replicated.
        """
        buffers = {g: _gathered(b) for g, b in buffers.items()}
        return tuple(
            self.unpack_stage(s, {g: b[s] for g, b in buffers.items()})
            for s in range(self.num_stages)
        )


def _gathered(buffer: jax.Array) -> jax.Array:
    sharding = getattr(jax.typeof(buffer), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None:
        return buffer
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    if not any(types.get(n) == jax.sharding.AxisType.Explicit for n in names):
        return buffer
    return jax.sharding.reshard(buffer, NamedSharding(sharding.mesh, PartitionSpec()))


@jax.tree_util.register_pytree_node_class
class PackedParams:
    """Per-stage parameters packed as ``{dtype name: (S, length)}`` buffers plus their layout.

    A pytree whose leaves are the buffers (the layout is static auxiliary data), so it passes
    through ``jax.jit``, optax and orbax like any parameter tree. Build it with
    :func:`pack_params`; get the per-stage pytrees back with :meth:`unpack`.
    """

    def __init__(self, buffers: dict[str, jax.Array], layout: ParamLayout):
        self.buffers = dict(buffers)
        self.layout = layout

    def tree_flatten(self):
        names = tuple(sorted(self.buffers))
        return tuple(self.buffers[n] for n in names), (names, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        names, layout = aux
        return cls(dict(zip(names, children)), layout)

    def unpack(self) -> tuple[Any, ...]:
        """The per-stage pytrees."""
        return self.layout.unpack(self.buffers)

    def __repr__(self) -> str:
        shapes = {n: tuple(b.shape) for n, b in self.buffers.items()}
        return f"PackedParams({shapes}, num_stages={self.layout.num_stages})"


def param_layout(stage_params: Sequence[Any]) -> ParamLayout:
    """The packing layout of a sequence of per-stage parameter pytrees (arrays or structs)."""
    if isinstance(stage_params, PackedParams):
        return stage_params.layout
    if not isinstance(stage_params, (list, tuple)) or not stage_params:
        raise ValueError("params must be a non-empty sequence of per-stage pytrees.")
    treedefs, slots, lengths = [], [], {}
    for tree in stage_params:
        leaves, treedef = jax.tree.flatten(tree)
        used: dict[str, int] = {}
        stage_slots = []
        for leaf in leaves:
            group = np.dtype(leaf.dtype).name
            shape = tuple(int(d) for d in jnp.shape(leaf))
            stage_slots.append(_Slot(group, used.get(group, 0), shape))
            used[group] = used.get(group, 0) + math.prod(shape)
        for g, n in used.items():
            lengths[g] = max(lengths.get(g, 0), n)
        treedefs.append(treedef)
        slots.append(tuple(stage_slots))
    return ParamLayout(tuple(treedefs), tuple(slots), tuple(sorted(lengths.items())))


def pack_params(stage_params: Sequence[Any], sharding: Any = None) -> PackedParams:
    """Packs per-stage parameter pytrees into :class:`PackedParams`.

    Args:
      stage_params: one parameter pytree per stage (structures may differ).
      sharding: optional ``jax.sharding.Sharding`` for the buffers, e.g.
        ``NamedSharding(mesh, P("stage"))`` (what :func:`jaxcomp.pipeline.distribute` expects).

    Returns:
      The packed parameters.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import pipeline
      >>> packed = pipeline.pack_params([{"w": jnp.ones((2, 3))}, {"b": jnp.zeros(4)}])
      >>> packed.buffers["float32"].shape
      (2, 6)
      >>> packed.unpack()[1]["b"].shape
      (4,)
    """
    if isinstance(stage_params, PackedParams):
        buffers, layout = stage_params.buffers, stage_params.layout
    else:
        layout = param_layout(stage_params)
        buffers = layout.pack(stage_params)
    if sharding is not None:
        buffers = jax.device_put(buffers, sharding)
    return PackedParams(buffers, layout)


# ----------------------------------------------------------------------------------------------
# An optimizer that sees the parameters by name, stage by stage (see the module docstring).


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
        packed = pack_params(states)
        if mesh is None:
            return packed
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(_mesh.STAGE))
        buffers = lax.with_sharding_constraint(packed.buffers, sharding)
        return PackedParams(buffers, packed.layout)

    def update(updates, state, params=None):
        layout = _layout_of(updates)
        if not isinstance(state, PackedParams):
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
            PackedParams(new_u, layout),
            PackedParams(new_s, state_layout),
        )

    return optax.GradientTransformation(init, update)


def _layout_of(params: Any) -> ParamLayout:
    if not isinstance(params, PackedParams):
        raise ValueError(
            "pipeline.unpacked(tx) applies to a pipeline's PackedParams (pipeline.pack_params); "
            f"got {type(params).__name__}."
        )
    return params.layout


def _rows(params: PackedParams, layout: ParamLayout) -> list[dict]:
    buffers = {g: _gathered(b) for g, b in params.buffers.items()}
    return [{g: b[s] for g, b in buffers.items()} for s in range(layout.num_stages)]


def _empty_like(x: Any) -> jax.Array:
    """An empty array of ``x``'s rank (a scalar's: ``(0,)``, so that it is empty too)."""
    return jnp.zeros((0,) * max(1, len(x.shape)), x.dtype)


def _view(layout: ParamLayout, stage: int, tree: Any) -> tuple[Any, ...]:
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


def _check_stage_local(tx: optax.GradientTransformation, layout: ParamLayout) -> None:
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


def _state_owners(tx, layout: ParamLayout, state: Any) -> list[int | None]:
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


# ----------------------------------------------------------------------------------------------
# A stateful model's running state (see the module docstring).


EVAL_STATS = ("replica0", "mean")


def per_replica(packed: dict[str, jax.Array], lead: tuple[int, ...]) -> dict[str, jax.Array]:
    """``{dtype: [S, L]}`` broadcast to ``{dtype: [*lead, L]}`` (every replica the same row)."""
    if len(lead) == 1:
        return dict(packed)
    return {
        g: jnp.broadcast_to(b[:, None], (b.shape[0], *lead[1:], *b.shape[1:]))
        for g, b in packed.items()
    }


def init_model_state(
    model: Any, model_state: Any, lead: tuple[int, ...], sharding: NamedSharding | None
) -> tuple[dict[str, jax.Array], ParamLayout | None]:
    """A stateful model's per-stage state packed ``{dtype: [*lead, L]}`` (every replica starting
    from the same state) and its layout; ``({}, None)`` for a stateless model.

    Args:
      model: the pipeline's :class:`~jaxcomp.pipeline.StagedModel`.
      model_state: one pytree per stage (``{}`` for a stage without state), or ``None`` for a
        stateless model.
      lead: ``(S,)`` or ``(S, D)``.
      sharding: where the packed state goes (``None``: the single-device simulation).

    Raises:
      ValueError: if a stateful model gets no per-stage state or a stateless one gets one.
    """
    if not model.stateful:
        if model_state is not None:
            raise ValueError(
                "model_state is only for a stateful model (StagedModel(stateful=True), e.g. "
                "a Flax model with BatchNorm); this pipeline's model has no running state."
            )
        return {}, None
    if not isinstance(model_state, (list, tuple)) or len(model_state) != model.num_stages:
        raise ValueError(
            "this pipeline's model is stateful (e.g. BatchNorm running statistics): init needs "
            f"model_state, one pytree per stage ({model.num_stages}, {{}} for a stage "
            f"without state); got {type(model_state).__name__}."
        )
    layout = param_layout(tuple(model_state))

    def make(model_state):
        return per_replica(layout.pack(model_state), lead)

    return jax.jit(make, out_shardings=sharding)(tuple(model_state)), layout


def model_layout_of(link_states: Any) -> ParamLayout | None:
    """The model-state layout ``link_states`` carry (``None``: none, or not link states)."""
    if isinstance(link_states, _link_state.LinkStates):
        return link_states.model_layout
    return None


def check_model_state(
    link_states: _link_state.LinkStates, layout: ParamLayout, lead: tuple[int, ...]
) -> None:
    """Raises unless the states' model buffers are ``{dtype: [*lead, L]}`` of ``layout``."""
    want = {g: (*lead, n) for g, n in layout.lengths}
    got = {g: tuple(jnp.shape(b)) for g, b in link_states.model.items()}
    if got != want:
        raise ValueError(
            f"the link states' model state buffers are {got}; this pipeline expects {want} "
            "(initialise them with this pipeline's init)."
        )


def model_state_for_eval(
    model: dict[str, jax.Array], how: str, data: str | tuple[str, ...] = _mesh.DATA
) -> dict[str, jax.Array]:
    """Inside ``shard_map``: the running state every replica evaluates with, replica 0's
    (``how="replica0"``: a ``psum`` of it and zeros, exact) or the mean over replicas
    (``data``: the replicas' axis, or axes)."""
    if how == "mean":
        return lax.pmean(model, data)
    first = lax.axis_index(data) == 0
    kept = jax.tree.map(lambda b: jnp.where(first, b, jnp.zeros_like(b)), model)
    return lax.psum(kept, data)
