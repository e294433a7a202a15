"""GPipe over a ``shard_map`` stage mesh with compressed activations and gradients."""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.comm import _send
from jaxcomp.pipeline import _batch
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _params
from jaxcomp.pipeline import _prepare
from jaxcomp.pipeline import _ticks


def _place(tree: Any, sharding: NamedSharding) -> Any:
    """Puts ``tree`` on ``sharding`` inside or outside ``jit``, for Explicit and Auto meshes."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
    if explicit:
        return jax.sharding.reshard(tree, sharding)
    return lax.with_sharding_constraint(tree, sharding)


def gpipe(
    model: _config.StagedModel, config: _config.PipelineConfig, mesh: jax.sharding.Mesh
) -> _prepare.Pipeline:
    r"""A GPipe pipeline of ``model``'s stages over ``mesh``'s ``stage`` axis, compressed links.

    Stage ``s`` runs on the devices at index ``s`` of the ``stage`` axis. An optional ``data``
    axis holds data-parallel replicas of the whole pipeline: the batch is split over it, link
    states are kept per replica (leaves ``[S, D, ...]``) and gradients are averaged over it with
    a plain ``pmean`` (uncompressed; only the stage boundaries are compressed here).

    **Schedule.** ``M`` microbatches flow through ``S`` stages in ``M + S - 1`` forward ticks
    and the reverse backward (GPipe); bubble ticks run no stage, send nothing and leave every
    state untouched. Bubble fraction :math:`(S-1)/(M+S-1)`.

    **Bytes.** Boundary ``b`` is one ``ppermute`` per direction and microbatch with the single
    pair ``(b, b+1)``, carrying the channel's payload in its wire dtypes. The theoretical bytes
    per step and pipeline replica are

    .. math::
      M \sum_b \big(|\mathrm{payload}^{fwd}_b| + |\mathrm{payload}^{bwd}_b|\big)

    (``Pipeline.bytes_per_step``, also in the step's metrics as ``wire_bytes``). The HLO meter
    (:func:`jaxcomp.comm.measure_collectives`) counts each ``collective-permute``'s operand once
    per execution, which for a single-pair permute is exactly the bytes that cross the wire;
    on a stage-only mesh its collective-permute total equals ``wire_bytes``. The only other
    collectives of a step are scalar all-reduces of the loss and metrics (and, with a data
    axis, the gradient ``pmean``).

    **Keys.** The send of microbatch ``m`` at boundary ``b`` uses
    ``fold_in(fold_in(key, b), m)`` (then ``fold_in(., 0)`` forward, ``fold_in(., 1)``
    backward); with more than one data replica, replica ``r`` first folds in ``r``.
    :func:`~jaxcomp.pipeline.simulate` derives the same keys, so it reproduces the numbers.

    **Memory.** Each tick runs a ``lax.switch`` over the stages, and the backward pass keeps
    the union of its branches' residuals: with stages of different sizes every device stores
    room for every stage's saved activations at each tick (about the sum over stages instead of
    its own). Stages wrapped in ``jax.checkpoint`` save only their inputs and recompute the
    rest in the backward pass (a heterogeneous 4-stage CNN: 60 -> 26 MB of scratch memory).

    **Placement.** Batches are replicated over ``stage`` (split over ``data``); on an Explicit
    mesh place them with ``NamedSharding(mesh, P())`` (or ``P("data")``). Link states come from
    ``init`` already sharded. Every device keeps a slot of *every* boundary's states (only the
    slots at the boundary's two ends are live), so per-sample AQ-SGD caches cost ``S - 1``
    times their live size in memory; their update touches only the microbatch's rows. With
    data replicas each replica keeps its own caches: a sample's cache is only current on the
    replica that last saw it, so feed each sample to the same replica every epoch.

    Args:
      model: the :class:`StagedModel` (``S`` stages); ``S`` must equal the ``stage`` axis size.
      config: :class:`PipelineConfig` (microbatches, links).
      mesh: a mesh with a ``stage`` axis (e.g. :func:`pipeline_mesh`) and optionally ``data``.

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
      >>> model = pipeline.StagedModel((stage,) * 4, lambda y, t: jnp.mean((y - t) ** 2))
      >>> params = [jnp.eye(8)] * 4
      >>> batch = {"x": jnp.ones((16, 8)), "label": jnp.zeros((16, 8))}
      >>> ef_topk = feedback.error_feedback(compressors.top_k(0.25, per_sample=True))
      >>> link = pipeline.link(ef_topk, compressors.quantize(8))
      >>> mesh = pipeline.pipeline_mesh(4, jax.devices()[:4])
      >>> pipe = pipeline.gpipe(model, pipeline.PipelineConfig(4, link), mesh)
      >>> states = pipe.init(params, batch)
      >>> step = jax.jit(pipe.step, static_argnames="compress")
      >>> loss, grads, states, metrics = step(params, batch, states, jax.random.key(0))
      >>> int(metrics["wire_bytes"]), int(metrics["dense_bytes"])
      (912, 3072)

    References:
      Huang et al., `GPipe: Efficient Training of Giant Neural Networks using Pipeline
      Parallelism <https://arxiv.org/abs/1811.06965>`_, 2019.
      Rudakov et al., `Activations and Gradients Compression for Model-Parallel Training
      <https://arxiv.org/abs/2401.07788>`_, 2024.
    """
    _config.check_model(model)
    num = model.num_stages
    links = _config.resolve_links(config, num)
    m_ = config.num_microbatches
    if _mesh.STAGE not in mesh.axis_names:
        raise ValueError(f"mesh must have a {_mesh.STAGE!r} axis; got axes {mesh.axis_names}.")
    if mesh.shape[_mesh.STAGE] != num:
        raise ValueError(
            f"the mesh's {_mesh.STAGE!r} axis has {mesh.shape[_mesh.STAGE]} devices; the model "
            f"has {num} stages."
        )
    extra = [a for a in mesh.axis_names if a not in (_mesh.STAGE, _mesh.DATA)]
    if extra:
        raise ValueError(f"mesh axes must be 'stage' and optionally 'data'; got {extra}.")
    replicas = mesh.shape[_mesh.DATA] if _mesh.DATA in mesh.axis_names else 1
    has_data = replicas > 1  # a data axis of size 1 is ignored: same layout as simulate()
    lead = (num, replicas) if has_data else (num,)
    axes = (_mesh.STAGE, _mesh.DATA) if has_data else (_mesh.STAGE,)
    state_spec = P(_mesh.STAGE, _mesh.DATA) if has_data else P(_mesh.STAGE)
    batch_spec = P(_mesh.DATA) if has_data else P()
    param_sharding = NamedSharding(mesh, P(_mesh.STAGE))

    def prepare(params, batch, need_ids=None):
        return _prepare.prepare(model, links, m_, params, batch, replicas, need_ids)

    def init(params, batch):
        prep = prepare(params, batch, need_ids=False)
        expected = _prepare.expected_states(links, prep, lead)
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, state_spec), expected)
        make = functools.partial(_links.init_link_states, links, prep.shapes, lead)
        return jax.jit(make, out_shardings=shardings)()

    def buffers_of(params, layout):
        if isinstance(params, _params.PackedParams):
            return _place(params.buffers, param_sharding)
        return _place(layout.pack(params), param_sharding)

    def local_view(tree):
        return jax.tree.map(lambda a: a[0, 0] if has_data else a[0], tree)

    def stacked_view(tree):
        return jax.tree.map(lambda a: a[None, None] if has_data else a[None], tree)

    def replica_key(key):
        if key is None or replicas == 1:
            return key
        return jax.random.fold_in(key, lax.axis_index(_mesh.DATA))

    def local_step(buffers, inputs, labels, ids, states, key, *, ctx):
        local = {g: b[0] for g, b in buffers.items()}
        if has_data:
            local = _local.to_varying(local, _mesh.DATA)  # per-replica grads, pmean below
        states = local_view(states)
        x, lab = _batch.microbatches(inputs, m_), _batch.microbatches(labels, m_)
        ids = None if ids is None else _batch.microbatches(ids, m_)
        key = replica_key(key)
        fwd0 = tuple(st.forward for st in states)
        bwd0 = tuple(st.backward for st in states)

        def objective(local, tokens):
            res = _ticks.run_ticks(ctx, local, x, lab, ids, key, fwd0, tokens)
            loss = res.loss_sum / m_
            seed = sum(_send.seed_backward_state(t, b) for t, b in zip(res.tokens, bwd0))
            metrics = jax.tree.map(lambda v: v / m_, res.metrics_sum)
            return loss + seed, (loss, metrics, res.fwd_states)

        tokens0 = tuple(_send.backward_token(b) for b in bwd0)
        (_, (loss, metrics, fwd)), (grads, bwd) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True
        )(local, tokens0)
        loss, metrics = lax.psum((loss, metrics), _mesh.STAGE)
        if has_data:
            loss, metrics, grads = lax.pmean((loss, metrics, grads), _mesh.DATA)
        new_states = tuple(_links.LinkState(f, b) for f, b in zip(fwd, bwd))
        return loss, {g: v[None] for g, v in grads.items()}, stacked_view(new_states), metrics

    def step(params, batch, link_states, key=None, compress=True):
        compress = _prepare.check_compress(compress)
        prep = prepare(params, batch)
        _links.check_key(links, key, compress)
        _links.check_link_states(link_states, _prepare.expected_states(links, prep, lead))
        ctx = _ticks.TickContext(
            model, links, m_, prep.layout, prep.shapes, prep.final, prep.metrics, axes,
            bool(compress), False,
        )  # fmt: skip
        ids = prep.batch.ids

        def body(buffers, inputs, labels, states, key_and_ids):
            key, ids = key_and_ids
            return local_step(buffers, inputs, labels, ids, states, key, ctx=ctx)

        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(_mesh.STAGE), batch_spec, batch_spec, state_spec, (P(), batch_spec)),
            out_specs=(P(), P(_mesh.STAGE), state_spec, P()),
        )
        buffers = buffers_of(params, prep.layout)
        loss, grads, new_states, metrics = fn(
            buffers, prep.batch.inputs, prep.batch.labels, link_states, (key, ids)
        )
        if isinstance(params, _params.PackedParams):
            grads = _params.PackedParams(grads, prep.layout)
        else:
            grads = type(params)(prep.layout.unpack(grads))
        metrics = _prepare.with_bytes({"loss": loss, **metrics}, prep, links, m_, compress, True)
        return loss, grads, new_states, metrics

    def evaluate(params, batch, key=None, compress=False):
        compress = _prepare.check_compress(compress)
        prep = prepare(params, batch, need_ids=False)
        elinks = _links.eval_links(links)
        key = _prepare.eval_key(links, key, compress)
        ctx = _ticks.TickContext(
            model, elinks, m_, prep.layout, prep.shapes, prep.final, prep.metrics, axes,
            bool(compress), True,
        )  # fmt: skip

        def body(buffers, inputs, labels, key):
            local = {g: b[0] for g, b in buffers.items()}
            x, lab = _batch.microbatches(inputs, m_), _batch.microbatches(labels, m_)
            key = replica_key(key)
            fwd = tuple(
                _local.to_varying(_send.init_channel_states(lk.forward, s), axes)
                for lk, s in zip(elinks, prep.shapes)
            )
            tokens = tuple(_send.init_channel_states(None, s) for s in prep.shapes)
            res = _ticks.run_ticks(ctx, local, x, lab, None, key, fwd, tokens)
            loss = res.loss_sum / m_
            metrics = jax.tree.map(lambda v: v / m_, res.metrics_sum)
            loss, metrics, outputs = lax.psum((loss, metrics, res.outputs), _mesh.STAGE)
            if has_data:
                loss, metrics = lax.pmean((loss, metrics), _mesh.DATA)
            return loss, metrics, _batch.unmicrobatch(outputs)

        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(_mesh.STAGE), batch_spec, batch_spec, P()),
            out_specs=(P(), P(), batch_spec),
        )
        loss, metrics, outputs = fn(
            buffers_of(params, prep.layout), prep.batch.inputs, prep.batch.labels, key
        )
        metrics = _prepare.with_bytes({"loss": loss, **metrics}, prep, elinks, m_, compress, False)
        return loss, metrics, outputs

    bytes_per_step = _prepare.bytes_per_step_fn(prepare, links, m_)
    return _prepare.Pipeline(init, step, evaluate, bytes_per_step, num, m_, links)
