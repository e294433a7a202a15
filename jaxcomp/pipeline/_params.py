"""Per-stage trees packed per dtype: heterogeneous parameters, and a model's running state.

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
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jaxcomp.comm import _mesh
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
