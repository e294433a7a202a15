"""A pipeline's planned per-device memory (``Pipeline.memory``): residuals and link states."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.pipeline import _batch
from jaxcomp.pipeline import _driver
from jaxcomp.pipeline import _model_state
from jaxcomp.pipeline import _prepare
from jaxcomp.pipeline import _residuals
from jaxcomp.pipeline import _schedule
from jaxcomp.pipeline import _ticks
from jaxcomp.pipeline._spec import Spec


def _plan(spec: Spec, static: _prepare.Static, labels: Any) -> _residuals.ResidualPlan:
    """The residual plan the program makes (traced in a ``shard_map`` body on a mesh)."""
    m_ = spec.num_microbatches
    if spec.mesh is None:
        lab = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                           _batch.microbatches(labels, m_))  # fmt: skip
        return _residuals.plan(
            spec.fns, static.layout.structs(), static.inputs, lab, static.model_layout.structs()
        )
    prog = _ticks.Program(
        spec.model.loss_fn, spec.links, spec.fns, static, spec.schedule, m_, spec.axes, True, True,
        False,
    )  # fmt: skip
    found = []

    def probe(buffers, labels):
        local = _local.to_varying({g: b[0] for g, b in buffers.items()}, spec.axes)
        lab = _local.to_varying(_batch.microbatches(labels, m_), spec.axes)
        found.append(_ticks.plan_here(prog, local, lab))
        return jnp.zeros((), jnp.float32)

    def struct(shape, dtype, pspec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(spec.mesh, pspec))

    buffers = {
        g: struct((spec.model.num_stages, n), g, P(_mesh.STAGE)) for g, n in static.layout.lengths
    }
    labels = jax.tree.map(lambda a: struct(a.shape, a.dtype, spec.batch_spec), labels)
    fn = jax.shard_map(
        probe, mesh=spec.mesh, in_specs=(P(_mesh.STAGE), spec.batch_spec), out_specs=P()
    )
    jax.eval_shape(fn, buffers, labels)
    return found[0]


def memory(spec: Spec, params, batch, states=None) -> dict[str, Any]:
    """The planned per-device memory of a training step, in bytes.

    Returns:
      ``residual_bytes_per_stage`` (each stage's saved residuals per microbatch),
      ``residual_row_bytes`` (one ring-buffer row: the largest stage's, per dtype),
      ``in_flight`` (per stage, microbatches alive at once), ``residual_slots``,
      ``ideal_activation_bytes`` (over the stages, the largest of a stage's residuals times its
      in-flight microbatches), ``residual_buffer_bytes`` (what every device allocates for them),
      ``link_state_bytes`` (one device's packed row of link states) and
      ``live_link_state_bytes`` (per device, the bytes of its own ends). A stateful model
      needs its ``states`` (from ``init``).
    """
    prep = _driver.prepare_for(
        spec, params, batch, need_ids=False, model_layout=_model_state.layout_of(states)
    )
    static = prep.static
    num, m_ = spec.model.num_stages, spec.num_microbatches
    per_stage = _plan(spec, static, prep.batch.labels).stage_bytes()
    if spec.mesh is None:  # one microbatch at a time, no ring buffer
        flight, slots = (1,) * num, 1
    else:
        flight = _schedule.in_flight(spec.schedule, num, m_)
        slots = _schedule.residual_slots(spec.schedule, num, m_)
    row = (
        max(per_stage)
        if spec.mesh is None
        else _plan(spec, static, prep.batch.labels).layout.row_bytes()
    )
    return {
        "residual_bytes_per_stage": per_stage,
        "residual_row_bytes": row,
        "in_flight": flight,
        "residual_slots": slots,
        "ideal_activation_bytes": max(b * f for b, f in zip(per_stage, flight)),
        "residual_buffer_bytes": slots * row,
        "link_state_bytes": static.state_layout.row_bytes(),
        "live_link_state_bytes": tuple(static.state_layout.device_bytes(d) for d in range(num)),
    }
