"""The public constructors: a pipeline over a ``stage`` mesh, or its single-device simulation,
and the :class:`Pipeline` of pure functions both return (with its memory plan)."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.pipeline import _adaptive
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _driver
from jaxcomp.pipeline import _params
from jaxcomp.pipeline import _residuals
from jaxcomp.pipeline import _schedule
from jaxcomp.pipeline import _ticks
from jaxcomp.pipeline._config import Spec


class Pipeline(NamedTuple):
    """A pipeline's pure functions (from :func:`~jaxcomp.pipeline.distribute` or
    :func:`~jaxcomp.pipeline.simulate`; both have the same signatures and numbers).

    ``step`` and ``evaluate`` validate their inputs and build the program in Python: wrap them
    in ``jax.jit`` once and reuse the jitted function (called bare, each call re-checks its
    inputs; the compiled program is reused).

    Attributes:
      init: ``init(params, batch, model_state=None) -> link_states``: every link end's
        initial state, as :class:`LinkStates` (each stage device holds the ends it owns); a
        stateful model (BatchNorm) passes its per-stage running state ``model_state`` (one
        pytree per stage, ``{}`` for a stage without), which the link states then carry.
      step: ``step(params, batch, link_states, key=None, compress=True, modes=None) ->
        (loss, grads, link_states, metrics)``: one training step's loss, gradients (in the form
        of ``params``: a per-stage sequence or :class:`PackedParams`) and new link states.
        ``key`` is required when a link's codec is stochastic. ``compress=False`` sends dense
        (AQ-SGD warm-up); mark it static under ``jax.jit``. With adaptive links
        (:func:`~jaxcomp.pipeline.adaptive_link`) the step runs the program of the modes in
        ``link_states``; under ``jax.jit`` pass them as the static
        ``modes=pipeline.link_modes(link_states)``.
      evaluate: ``evaluate(params, batch, key=None, compress=False, modes=None, states=None,
        stats="replica0") -> (loss, metrics, outputs)``: forward only, link states untouched;
        ``compress=True`` applies each forward codec without feedback (the paper's "compressed
        inference"; stochastic codecs use ``key``, by default ``jax.random.key(0)``);
        ``outputs`` is the last stage's output for the whole batch (e.g. logits, for
        accuracy). A stateful model needs ``states`` (the link states of its last step) and
        normalises with their running statistics, with data replicas replica 0's
        (``stats="replica0"``) or their mean (``"mean"``).
      bytes_per_step: ``bytes_per_step(params, batch, compress=True, train=True, modes=None,
        states=None) -> dict`` (``states``: a stateful model's link states) with the
        theoretical ``wire_bytes`` (payload bytes per step and pipeline replica, forward and
        backward) and ``dense_bytes`` (the same sends uncompressed). With adaptive links,
        ``evaluate`` and ``bytes_per_step`` use the links of ``modes`` (every boundary's low
        link by default).
      memory: ``memory(params, batch, states=None) -> dict``: the planned per-device memory
        of a training step (see :func:`jaxcomp.pipeline.distribute`).
      state_shardings: ``state_shardings(link_states) -> the same tree of NamedSharding``
        (``None`` from the simulation, on one device): where ``init`` puts each leaf.
        ``jax.eval_shape`` of ``init`` does not carry it; give it to abstract states you
        lower programs for.
      num_stages: ``S``.
      num_microbatches: ``M``.
      links: one :class:`Link` per boundary.
      schedule: ``"gpipe"`` or ``"1f1b"``.
    """

    init: Callable[..., Any]
    step: Callable[..., Any]
    evaluate: Callable[..., Any]
    bytes_per_step: Callable[..., dict[str, int]]
    memory: Callable[..., dict[str, int]]
    state_shardings: Callable[..., Any]
    num_stages: int
    num_microbatches: int
    links: tuple[_config.Link, ...]
    schedule: str


def _pipeline(spec: Spec) -> Pipeline:
    return Pipeline(
        init=functools.partial(_driver.init, spec),
        step=functools.partial(_driver.step, spec),
        evaluate=functools.partial(_driver.evaluate, spec),
        bytes_per_step=functools.partial(_driver.bytes_per_step, spec),
        memory=functools.partial(memory, spec),
        state_shardings=functools.partial(_driver.state_shardings, spec),
        num_stages=spec.model.num_stages,
        num_microbatches=spec.num_microbatches,
        links=spec.links,
        schedule=spec.schedule,
    )


def _make_spec(model, config, mesh, replicas, data_axes=(_mesh.DATA,)) -> Spec:
    _config.check_model(model)
    links, adaptive = _adaptive.resolve(config, model.num_stages)
    fns = _residuals.stage_fns(model, config.checkpoint)
    replica_mean = config.replica_mean if replicas > 1 else None
    return Spec(
        model, links, config.num_microbatches, config.schedule, fns, mesh, replicas, replica_mean,
        adaptive, data_axes,
    )  # fmt: skip


def distribute(
    model: _config.StagedModel,
    config: _config.PipelineConfig,
    mesh: jax.sharding.Mesh,
    *,
    data_axis: str | tuple[str, str] = _mesh.DATA,
) -> Pipeline:
    r"""A pipeline of ``model``'s stages over ``mesh``'s ``stage`` axis, with compressed links.

    Stage ``s`` runs on the devices at index ``s`` of the ``stage`` axis. An optional ``data``
    axis holds data-parallel replicas of the whole pipeline: the batch is split over it, link
    states are kept per replica (buffers ``[S, D, L]``) and gradients are averaged over it with
    a plain float32 ``pmean``, or with ``config.replica_mean`` (an optax transform such as
    :func:`jaxcomp.transforms.compressed_mean` or :func:`~jaxcomp.transforms.accordion`, run by
    each stage's devices on that stage's gradient; its bytes are the step's
    ``data_wire_bytes``, against ``data_dense_bytes``).

    **Hierarchical meshes.** ``data_axis=(slow, fast)`` takes the replicas from two mesh axes
    (e.g. ``[("slow", hosts), ("fast", devices per host / S), ("stage", S)]``): the batch is
    split over both, and ``config.replica_mean`` must average over the pair, e.g.
    ``compressed_mean(codec, (slow, fast))`` or ``accordion(..., axis_name=(slow, fast))``:
    dense over ``fast`` (inside a host), the codec's payload over ``slow`` (between hosts).
    ``data_wire_bytes`` is then the slow axis's bytes and ``data_fast_wire_bytes`` the fast
    one's (the plain ``pmean`` averages over ``fast``, then ``slow``: a stage's bytes on each).

    **Schedule** (``config.schedule``, :mod:`jaxcomp.pipeline._schedule`). ``"gpipe"``: ``M``
    microbatches flow forward through ``S`` stages in ``M + S - 1`` ticks, then backward in as
    many. ``"1f1b"``: each microbatch's backward starts as soon as its forward leaves the last
    stage, and after a warm-up of at most ``S`` forwards every stage alternates one forward and
    one backward. Both have the bubble fraction :math:`(S-1)/(M+S-1)`; both send each
    boundary's microbatches in order ``0 .. M - 1`` in both directions, so they give the same
    numbers. Bubble ticks run no stage, send nothing and leave every state untouched.

    **Bytes.** Each tick moves the payloads of every boundary that sends in it in one
    ``ppermute``, with one source-target pair per send, under 1F1B both directions together
    (:func:`jaxcomp.pipeline._ticks.tick_moves`, :func:`~jaxcomp.pipeline._ticks.move_boundaries`);
    payloads of different sizes are cut at their sizes instead (one permute per distinct size,
    each carrying the next piece of every payload that long), so no pair carries padding. The
    bytes per step and pipeline replica are the payloads'

    .. math::
      M \sum_b \big(|\mathrm{payload}^{fwd}_b| + |\mathrm{payload}^{bwd}_b|\big)

    (``Pipeline.bytes_per_step``, also in the step's metrics as ``wire_bytes``). The HLO
    meter (:func:`jaxcomp.comm.measure_collectives`) counts each ``collective-permute``'s
    operand once per execution; times its pairs, over the ``ppermute`` ops along the ``stage``
    axis (:func:`jaxcomp.pipeline._links.hlo_sent_bytes`), that is ``R`` times ``wire_bytes``
    with ``R`` data replicas. The only other collectives of a step are scalar all-reduces of
    the loss and metrics (and, with a data axis, the gradient average's collectives; with
    unpacked parameters, the gather of the stage-sharded gradient that unpacks it).

    **Keys.** The send of microbatch ``m`` at boundary ``b`` uses
    ``fold_in(fold_in(key, b), m)`` (then ``fold_in(., 0)`` forward, ``fold_in(., 1)``
    backward); with more than one data replica, replica ``r`` first folds in ``r``.
    :func:`~jaxcomp.pipeline.simulate` derives the same keys, so it reproduces the numbers.

    **Memory** (``Pipeline.memory``). A stage's forward saves the residuals of its pullback that
    depend on its input (activations; parameters and other input-independent values are not
    stored) in a ring-buffer slot of the microbatch; every device's slots are as large as the
    largest stage's need, and there are ``M`` (GPipe) or ``S`` (1F1B) of them, so a device holds
    its own stage's activations for at most ``S`` microbatches under 1F1B, whatever ``M`` is.
    ``config.checkpoint`` wraps every stage in ``jax.checkpoint``: it then saves only its input
    (and what the policy keeps) and recomputes the rest in its backward.

    **Link states.** Each device holds only the ends of the links it owns (a boundary's
    forward sender and backward receiver on stage ``b``, forward receiver and backward sender
    on ``b + 1``), packed per dtype (:class:`LinkStates`): an AQ-SGD cache costs its live size.
    Per-sample buffers are read and written at the microbatch's rows only. With data replicas
    each replica keeps its own caches: a sample's cache is only current on the replica that last
    saw it, so feed each sample to the same replica every epoch (``data.Loader(...,
    shards=R)`` does; the trainer shards so wherever a link keeps per-sample buffers).

    **Placement.** Batches are replicated over ``stage`` (split over ``data``); on an Explicit
    mesh place them with ``NamedSharding(mesh, P())`` (or ``P("data")``). Link states come from
    ``init`` already sharded.

    Args:
      model: the :class:`StagedModel` (``S`` stages, e.g. from :func:`jaxcomp.models.get_model`);
        ``S`` must equal the ``stage`` axis size.
      config: :class:`PipelineConfig` (microbatches, links, schedule, checkpointing).
      mesh: a mesh with a ``stage`` axis (e.g. :func:`pipeline_mesh`) and optionally ``data``
        (or the two axes of ``data_axis``).
      data_axis: the replicas' axis, or a ``(slow, fast)`` pair of axes (see above).

    Returns:
      A :class:`Pipeline`. ``params`` may be :class:`PackedParams` placed on the stages with
      ``pack_params(params, NamedSharding(mesh, P("stage")))`` (the fast path: every device
      holds only its stage's parameters, and gradients come back the same way) or a sequence of
      per-stage pytrees (convenient, but packed inside every step and unpacked to replicated
      gradients, which costs collectives). Gradients come back in the form of ``params``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import compressors, feedback, pipeline
      >>> def stage(w, x):
      ...     return jnp.tanh(x @ w)
      >>> model = pipeline.StagedModel((stage,) * 2, lambda y, t: jnp.mean((y - t) ** 2))
      >>> params = [jnp.eye(8)] * 2
      >>> batch = {"x": jnp.ones((16, 8)), "label": jnp.zeros((16, 8))}
      >>> ef_topk = feedback.error_feedback(compressors.top_k(0.25, per_sample=True))
      >>> link = pipeline.link(ef_topk, compressors.quantize(8))
      >>> mesh = pipeline.pipeline_mesh(2, jax.devices()[:2])
      >>> config = pipeline.PipelineConfig(4, link, schedule="1f1b")
      >>> pipe = pipeline.distribute(model, config, mesh)
      >>> states = pipe.init(params, batch)
      >>> step = jax.jit(pipe.step, static_argnames="compress")
      >>> loss, grads, states, metrics = step(params, batch, states, jax.random.key(0))
      >>> int(metrics["wire_bytes"]), int(metrics["dense_bytes"])
      (304, 1024)

    References:
      Huang et al., `GPipe: Efficient Training of Giant Neural Networks using Pipeline
      Parallelism <https://arxiv.org/abs/1811.06965>`_, 2019.
      Narayanan et al., `Memory-Efficient Pipeline-Parallel DNN Training
      <https://arxiv.org/abs/2006.09503>`_ (PipeDream-flush, 1F1B), 2021.
      Rudakov et al., `Activations and Gradients Compression for Model-Parallel Training
      <https://arxiv.org/abs/2401.07788>`_, 2024.
    """
    _config.check_model(model)
    num = model.num_stages
    if _mesh.STAGE not in mesh.axis_names:
        raise ValueError(f"mesh must have a {_mesh.STAGE!r} axis; got axes {mesh.axis_names}.")
    if mesh.shape[_mesh.STAGE] != num:
        raise ValueError(
            f"the mesh's {_mesh.STAGE!r} axis has {mesh.shape[_mesh.STAGE]} devices; the model "
            f"has {num} stages."
        )
    data_axes = _data_axes(data_axis)
    extra = [a for a in mesh.axis_names if a not in (_mesh.STAGE, *data_axes)]
    if extra:
        raise ValueError(
            f"mesh axes must be 'stage' and optionally {' and '.join(map(repr, data_axes))} "
            f"(data_axis); got {extra}."
        )
    missing = [a for a in data_axes if a not in mesh.axis_names]
    if len(data_axes) == 2 and missing:
        raise ValueError(f"data_axis {data_axis!r}: {missing} not an axis of the mesh.")
    replicas = math.prod(mesh.shape[a] for a in data_axes if a in mesh.axis_names)
    return _pipeline(_make_spec(model, config, mesh, replicas, data_axes))


def gpipe(
    model: _config.StagedModel,
    config: _config.PipelineConfig,
    mesh: jax.sharding.Mesh,
    *,
    data_axis: str | tuple[str, str] = _mesh.DATA,
) -> Pipeline:
    """Deprecated alias of :func:`distribute`, which it calls (removed in the next release).

    The name said GPipe, but the pipeline runs ``config.schedule`` (``"gpipe"`` or ``"1f1b"``).
    """
    warnings.warn(
        "pipeline.gpipe is deprecated and will be removed in the next release: use "
        "pipeline.distribute (the same pipeline; it runs config.schedule, GPipe or 1F1B).",
        DeprecationWarning,
        stacklevel=2,
    )
    return distribute(model, config, mesh, data_axis=data_axis)


def _data_axes(data_axis) -> tuple[str, ...]:
    """``(data,)`` or ``(slow, fast)``; ``ValueError`` naming anything else."""
    pair = tuple(data_axis) if isinstance(data_axis, (tuple, list)) else ()
    if isinstance(data_axis, str):
        pair = (data_axis,)
    ok = len(pair) in (1, 2) and all(isinstance(a, str) for a in pair)
    if not ok or len(set(pair)) != len(pair) or _mesh.STAGE in pair:
        raise ValueError(
            "data_axis must be a mesh axis name (str) or a pair of distinct names (slow, fast), "
            f"none of them {_mesh.STAGE!r}; got {data_axis!r}."
        )
    return pair


def simulate(model: _config.StagedModel, config: _config.PipelineConfig) -> Pipeline:
    """The single-device counterpart of :func:`distribute`: same numbers, one device.

    Each microbatch runs through the stages and back, and every cut point applies its link with
    the same channel calls, keys, sample ids and state updates as the distributed pipeline's
    sends, with nothing sent. For the same params, batch, link states and key it returns the
    same loss, gradients and link states as :func:`distribute` on a stage-only mesh under either
    schedule (up to float summation order), in the same layout, so a run can switch between the
    two. It is the fast way to run the paper's sweeps on one device, and what Rudakov et al. did
    ("integrating compression to the model directly"). ``config.schedule`` does not change what
    it computes.

    Args:
      model: the :class:`StagedModel`.
      config: :class:`PipelineConfig`; ``M`` sets the microbatches that stateful channels
        (EF residuals per position, EF21) see, as in the pipeline.

    Returns:
      A :class:`Pipeline` (``init``, ``step``, ``evaluate``, ``bytes_per_step``, ``memory``);
      its byte counts are those the distributed pipeline would send.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import compressors, pipeline
      >>> def stage(w, x):
      ...     return jnp.tanh(x @ w)
      >>> model = pipeline.StagedModel((stage,) * 4, lambda y, t: jnp.mean((y - t) ** 2))
      >>> params = [jnp.eye(8)] * 4
      >>> batch = {"x": jnp.ones((16, 8)), "label": jnp.zeros((16, 8))}
      >>> link = pipeline.link(compressors.top_k(0.25, per_sample=True), mode="shared_mask")
      >>> sim = pipeline.simulate(model, pipeline.PipelineConfig(4, link))
      >>> states = sim.init(params, batch)
      >>> loss, grads, states, metrics = jax.jit(sim.step)(params, batch, states, None)
      >>> round(float(loss), 4)
      0.0657
    """
    return _pipeline(_make_spec(model, config, None, 1))


# ----------------------------------------------------------------------------------------------
# A pipeline's planned per-device memory (``Pipeline.memory``): residuals and link states.


def _residual_plan(spec: Spec, static: _driver.Static, labels: Any) -> _residuals.ResidualPlan:
    """The residual plan the program makes (traced in a ``shard_map`` body on a mesh)."""
    m_ = spec.num_microbatches
    if spec.mesh is None:
        lab = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                           _driver.microbatches(labels, m_))  # fmt: skip
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
        lab = _local.to_varying(_driver.microbatches(labels, m_), spec.axes)
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
        spec, params, batch, need_ids=False, model_layout=_params.model_layout_of(states)
    )
    static = prep.static
    num, m_ = spec.model.num_stages, spec.num_microbatches
    per_stage = _residual_plan(spec, static, prep.batch.labels).stage_bytes()
    if spec.mesh is None:  # one microbatch at a time, no ring buffer
        flight, slots = (1,) * num, 1
    else:
        flight = _schedule.in_flight(spec.schedule, num, m_)
        slots = _schedule.residual_slots(spec.schedule, num, m_)
    row = (
        max(per_stage)
        if spec.mesh is None
        else _residual_plan(spec, static, prep.batch.labels).layout.row_bytes()
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
