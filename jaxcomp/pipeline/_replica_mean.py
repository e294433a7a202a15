"""Averaging each stage's gradient over the data replicas, inside the pipeline's program.

Every stage device holds its own stage's packed gradient row; :func:`average` runs the spec's
``replica_mean`` transform on it (a ``lax.switch`` on the stage index, so the transform's
collectives over ``data`` run in lockstep), :func:`plain_mean` the float ``pmean``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.pipeline import _params
from jaxcomp.pipeline._spec import Spec


def _bytes_sent(state: Any, field: str = "bytes_sent") -> jax.Array:
    """The data-axis bytes a transform's state reports for its last step (``bytes_sent`` of
    :func:`~jaxcomp.transforms.compressed_mean` / ``accordion`` states; ``fast_bytes_sent``:
    over the fast axis of a pair), NaN if none does."""
    found = []

    def has(x):
        return hasattr(x, "_fields") and field in x._fields

    def visit(x):
        if has(x):
            found.append(jnp.asarray(getattr(x, field), jnp.float32))
        return x

    jax.tree.map(visit, state, is_leaf=has)
    return sum(found[1:], found[0]) if found else jnp.asarray(jnp.nan, jnp.float32)


def average(spec: Spec, layout, replica_layout, local, grads, replica):
    """Each stage device averages its stage's gradient over ``data`` with the transform: a
    ``lax.switch`` on the stage index (uniform over ``data``, so the transform's collectives
    over ``data`` run in lockstep) unpacks the stage's gradient, parameters and transform
    state, runs ``update`` and packs the results back."""

    def make(s):
        def branch(grads, replica, local):
            g = layout.unpack_stage(s, grads)
            state = replica_layout.unpack_stage(s, replica)
            updates, state = spec.replica_mean.update(g, state, layout.unpack_stage(s, local))
            varying = set().union(*map(_local.varying_axes, jax.tree.leaves(updates)))
            differ = set(spec.data_axes) & varying
            if differ:
                raise ValueError(
                    f"replica_mean returned updates that differ per replica over {sorted(differ)}"
                    f": it must average over {spec.data!r} (e.g. transforms.compressed_mean("
                    f"codec, {spec.data!r}))."
                )
            # the averaged updates are replicated over data (as out_specs say); the state
            # (per-worker parts) is per replica (per slow worker with a pair), its byte
            # count per device
            updates = _local.to_varying(layout.pack_stage(s, updates), (_mesh.STAGE,))
            packed = replica_layout.pack_stage(s, state)
            packed = _local.to_varying(packed, (_mesh.STAGE, *spec.data_axes[:1]))
            sent = (_bytes_sent(state),)
            if len(spec.data_axes) == 2:
                sent += (_bytes_sent(state, "fast_bytes_sent"),)
            return updates, packed, _local.to_varying(sent, spec.axes)

        return branch

    branches = [make(s) for s in range(spec.model.num_stages)]
    return lax.switch(lax.axis_index(_mesh.STAGE), branches, grads, replica, local)


def plain_mean(spec: Spec, layout: _params.ParamLayout, grads: dict[str, jax.Array]):
    """The float ``pmean`` over ``data`` of each device's own stage gradient, without the
    padding of its packed row (a ``lax.switch`` on the stage index, one branch per stage):
    every replica sends its stages' parameter bytes, ``data_dense_bytes`` in all (with an axis
    pair, over each axis: the fast one first)."""

    def make(s):
        def branch(grads):
            out = {}
            for g, row in grads.items():
                used = sum(math.prod(sl.shape) for sl in layout.slots[s] if sl.group == g)
                mean = row[:used]
                for axis in spec.data_axes[::-1]:  # a pair: the fast axis first, then the slow
                    mean = lax.pmean(mean, axis)
                pad = jnp.zeros((row.shape[0] - used,), row.dtype)
                out[g] = _local.to_varying(jnp.concatenate([mean, pad]), (_mesh.STAGE,))
            sent = (jnp.asarray(layout.stage_bytes(s), jnp.float32),) * len(spec.data_axes)
            return out, _local.to_varying(sent, spec.axes)

        return branch

    branches = [make(s) for s in range(spec.model.num_stages)]
    return lax.switch(lax.axis_index(_mesh.STAGE), branches, grads)
