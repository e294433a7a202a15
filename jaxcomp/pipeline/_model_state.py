"""A stateful model's running state in the pipeline (BatchNorm statistics), per stage.

Each stage's state (any pytree, ``{}`` for a stage without one) is packed per dtype like the
parameters (:class:`~jaxcomp.pipeline.ParamLayout`) into ``{dtype: [S, L]}``, or ``{dtype: [S,
D, L]}`` with ``D`` data replicas (each replica its own row), sharded like the link states, so
that stage ``s``'s state lives on the device that runs stage ``s``. It travels in
:class:`~jaxcomp.pipeline.LinkStates` (``model`` and ``model_layout``), in and out of every step
and through a checkpoint with them. A step updates it with each real microbatch's forward, in
microbatch order (:mod:`jaxcomp.pipeline._ticks`, :mod:`jaxcomp.pipeline._simulate`);
evaluation reads it, each replica with replica 0's or the mean over the replicas.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from jaxcomp.comm import _mesh
from jaxcomp.pipeline import _link_state
from jaxcomp.pipeline import _params

EVAL_STATS = ("replica0", "mean")


def per_replica(packed: dict[str, jax.Array], lead: tuple[int, ...]) -> dict[str, jax.Array]:
    """``{dtype: [S, L]}`` broadcast to ``{dtype: [*lead, L]}`` (every replica the same row)."""
    if len(lead) == 1:
        return dict(packed)
    return {
        g: jnp.broadcast_to(b[:, None], (b.shape[0], *lead[1:], *b.shape[1:]))
        for g, b in packed.items()
    }


def init(
    model: Any, model_state: Any, lead: tuple[int, ...], sharding: NamedSharding | None
) -> tuple[dict[str, jax.Array], _params.ParamLayout | None]:
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
    layout = _params.param_layout(tuple(model_state))

    def make(model_state):
        return per_replica(layout.pack(model_state), lead)

    return jax.jit(make, out_shardings=sharding)(tuple(model_state)), layout


def layout_of(link_states: Any) -> _params.ParamLayout | None:
    """The model-state layout ``link_states`` carry (``None``: none, or not link states)."""
    if isinstance(link_states, _link_state.LinkStates):
        return link_states.model_layout
    return None


def check(
    link_states: _link_state.LinkStates, layout: _params.ParamLayout, lead: tuple[int, ...]
) -> None:
    """Raises unless the states' model buffers are ``{dtype: [*lead, L]}`` of ``layout``."""
    want = {g: (*lead, n) for g, n in layout.lengths}
    got = {g: tuple(jnp.shape(b)) for g, b in link_states.model.items()}
    if got != want:
        raise ValueError(
            f"the link states' model state buffers are {got}; this pipeline expects {want} "
            "(initialise them with this pipeline's init)."
        )


def for_eval(
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
