"""The step driver of both pipelines: what a call checks and derives before anything is
compiled, and the programs it runs.

A pipeline is a static :class:`~jaxcomp.pipeline._config.Spec`; ``init``, ``step``,
``evaluate`` and ``bytes_per_step`` are the module-level functions below with the spec bound
(``memory``: :mod:`jaxcomp.pipeline._build`). Each first validates its inputs
(:func:`prepare`: the parameters against the model, the batch, cut into microbatches, and the
links against the boundary shapes; no FLOPs, nothing compiled) and derives the static shapes of
one step (:class:`Static`), then runs the spec's program:

* on the ``stage`` mesh, :func:`_program`: a ``shard_map`` (built once per shape signature and
  cached) whose body runs the tick engine (:func:`jaxcomp.pipeline._ticks.run`) and, with data
  replicas, averages each stage's gradient over them (below);
* on one device (:func:`~jaxcomp.pipeline.simulate`), :func:`_simulated_step` (below).

A step's link states go in as ``LinkStates.buffers``, come out of the program as the new
buffers (the ticks' ``Carry.states``, or the simulation's scan carry), pass the adaptive links'
statistic collection (:func:`jaxcomp.pipeline._adaptive.program_statistic`, a no-op without
them) and are packed back into :class:`~jaxcomp.pipeline.LinkStates` at the end of
:func:`step`.

**Replica averaging.** Every stage device holds its own stage's packed gradient row;
:func:`_average_replicas` runs the spec's ``replica_mean`` transform on it (a ``lax.switch`` on
the stage index, so the transform's collectives over ``data`` run in lockstep),
:func:`_plain_replica_mean` the float ``pmean``.

**The single-device program.** Microbatch ``m`` runs forward through stages ``0 .. S - 1`` (each
boundary's forward link applied with :func:`jaxcomp.pipeline._links.send_forward`), then
backward through ``S - 1 .. 0`` (each backward link applied with ``send_backward``), before
microbatch ``m + 1``. Every boundary therefore sees its forward sends in microbatch order and its
backward sends in microbatch order, with the same keys and ids, as in both distributed
schedules: the channel states go through the same sequence of updates, so the numbers are the
same. Likewise each stage's running state (BatchNorm statistics) is updated by microbatches
``0 .. M - 1`` in order. Only one microbatch's activations are alive at a time. Link states
keep the distributed layout (row ``d`` is device ``d``'s ends).
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validate
from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.compressors import _base
from jaxcomp.pipeline import _adaptive
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _link_state
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _params
from jaxcomp.pipeline import _residuals
from jaxcomp.pipeline import _ticks
from jaxcomp.pipeline._config import Spec

# ----------------------------------------------------------------------------------------------
# Before anything is compiled: a call's checks and the static shapes of its step.


class Static(NamedTuple):
    """Everything derived from the shapes of (params, batch) at trace time (hashable)."""

    layout: _params.ParamLayout
    microbatch_size: int
    inputs: tuple[jax.ShapeDtypeStruct, ...]  # per stage: its input for one microbatch
    shapes: tuple[jax.ShapeDtypeStruct, ...]  # the S - 1 boundary activations
    final: jax.ShapeDtypeStruct  # last stage output (one microbatch)
    metrics_def: Any  # loss_fn metrics structure
    metrics_leaves: tuple[jax.ShapeDtypeStruct, ...]
    state_layout: _link_state.StateLayout
    mask_layout: _params.ParamLayout  # shared-mask payloads kept per microbatch
    payloads: tuple[Any, ...]  # per boundary: its shared-mask payload struct, or None
    model_layout: _params.ParamLayout  # per stage: its running state (e.g. BatchNorm statistics)

    @property
    def metrics(self) -> Any:
        return jax.tree.unflatten(self.metrics_def, self.metrics_leaves)


class Prepared(NamedTuple):
    static: Static
    batch: Batch


def _payload_layout(links, shapes, num):
    payloads = tuple(
        _base.payload_shape(lk.forward.codec, s) if lk.mode == "shared_mask" else None
        for lk, s in zip(links, shapes)
    )
    trees = [
        (payloads[d] if d < num - 1 else None, payloads[d - 1] if d > 0 else None)
        for d in range(num)
    ]
    return payloads, _params.param_layout(trees)


def prepare(
    model: _config.StagedModel,
    links: tuple[_config.Link, ...],
    num_microbatches: int,
    params: Any,
    batch: Any,
    *,
    replicas: int = 1,
    need_ids: bool | None = None,
    model_layout: _params.ParamLayout | None = None,
) -> Prepared:
    """Validates params and batch against the model and links (no FLOPs, nothing compiled).

    ``model_layout`` is the layout of a stateful model's per-stage state (required for one;
    ``None`` for a stateless model, whose stages then hold ``{}``).
    """
    layout = _params.param_layout(params)
    num = model.num_stages
    if layout.num_stages != num:
        raise ValueError(f"params hold {layout.num_stages} stages; the model has {num}.")
    model_layout = check_model_layout(model, model_layout)
    need = _links.needs_ids(links) if need_ids is None else need_ids
    parsed = parse_batch(batch, need)
    mb = check_batch(parsed, num_microbatches, replicas)
    x_mb = jax.ShapeDtypeStruct((mb, *parsed.inputs.shape[1:]), parsed.inputs.dtype)
    labels_mb = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((mb, *a.shape[1:]), a.dtype), parsed.labels
    )
    shapes, final = _links.boundary_shapes(
        model, layout.structs(), x_mb, labels_mb, model_layout.structs()
    )
    _links.check_links(links, shapes)
    metrics = jax.eval_shape(
        lambda y, lab: _config.split_loss(model.loss_fn(y, lab))[1], final, labels_mb
    )
    inputs = (x_mb, *shapes)
    payloads, mask_layout = _payload_layout(links, shapes, num)
    leaves, treedef = jax.tree.flatten(metrics)
    static = Static(
        layout, mb, inputs, shapes, final, treedef, tuple(leaves),
        _link_state.state_layout(links, shapes, num), mask_layout, payloads, model_layout,
    )  # fmt: skip
    return Prepared(static, parsed)


def check_model_layout(
    model: _config.StagedModel, model_layout: _params.ParamLayout | None
) -> _params.ParamLayout:
    """The layout of the model's per-stage state: ``model_layout`` for a stateful model (which
    must have one, with a tree per stage), an empty one (``{}`` per stage) otherwise."""
    num = model.num_stages
    if not model.stateful:
        if model_layout is not None and model_layout.lengths:
            raise ValueError(
                "the states carry a model state (e.g. BatchNorm statistics) but this "
                "pipeline's model is not stateful."
            )
        return _params.param_layout(({},) * num)
    if model_layout is None:
        raise ValueError(
            "this pipeline's model is stateful (e.g. BatchNorm running statistics): pass its "
            "per-stage state to init (pipe.init(params, batch, model_state)) and the link "
            "states init returns to step and evaluate."
        )
    if model_layout.num_stages != num:
        raise ValueError(
            f"the model state holds {model_layout.num_stages} stages; the model has {num}."
        )
    return model_layout


def check_compress(compress: Any) -> bool:
    """``compress`` must be a Python bool (it selects the program); returns it."""
    if not isinstance(compress, bool):
        raise TypeError(
            f"compress must be a Python bool (under jax.jit mark it static: "
            f"jax.jit(pipe.step, static_argnames='compress')); got {type(compress).__name__}."
        )
    return compress


def with_bytes(
    metrics: dict, static: Static, links, num_microbatches: int, compress: bool, train: bool
) -> dict:
    """``metrics`` plus the static byte counts of the step (float32 scalars)."""
    counts = _links.step_bytes(links, static.shapes, num_microbatches, compress, train)
    return {**metrics, **{k: jnp.asarray(v, jnp.float32) for k, v in counts.items()}}


def eval_key(links: tuple[_config.Link, ...], key: Any, compress: bool) -> Any:
    """The evaluation key: ``key``, or a fixed ``key(0)`` when a stochastic forward codec
    compresses and none was given (compressed evaluation is then deterministic)."""
    if key is None and compress and any(lk.forward.codec.stochastic for lk in links):
        return jax.random.key(0)
    return key


# ----------------------------------------------------------------------------------------------
# Batches: dicts with inputs, labels and sample ids, cut into microbatches.


INPUT_KEYS = ("x", "inputs")
LABEL_KEYS = ("label", "labels", "targets", "y")
ID_KEY = "ids"


class Batch(NamedTuple):
    """The three parts of a batch the pipeline reads.

    Attributes:
      inputs: ``[B, ...]`` array fed to stage 0.
      labels: pytree of ``[B, ...]`` arrays passed to ``loss_fn``.
      ids: ``int[B]`` sample ids (for per-sample channels) or ``None``.
    """

    inputs: jax.Array
    labels: Any
    ids: jax.Array | None


def _pick(batch: dict, keys: tuple[str, ...], what: str) -> Any:
    found = [k for k in keys if k in batch]
    if not found:
        raise ValueError(
            f"batch must hold the {what} under one of {keys}; got keys {sorted(batch)}."
        )
    if len(found) > 1:
        raise ValueError(f"batch holds the {what} under several keys {found}; keep one.")
    return batch[found[0]]


def parse_batch(batch: Any, need_ids: bool) -> Batch:
    """Reads ``x``/``inputs``, ``label``/``labels``/``targets``/``y`` and ``ids`` from a dict.

    Raises:
      ValueError: on missing keys, or missing ``ids`` when ``need_ids`` (AQ-SGD, per-sample EF).
    """
    if isinstance(batch, Batch):
        parsed = batch
    else:
        if not isinstance(batch, dict):
            raise TypeError(f"batch must be a dict; got {type(batch).__name__}.")
        parsed = Batch(
            _pick(batch, INPUT_KEYS, "inputs"),
            _pick(batch, LABEL_KEYS, "labels"),
            batch.get(ID_KEY),
        )
    if need_ids and parsed.ids is None:
        raise ValueError(
            "a link uses per-sample buffers (AQ-SGD or per-sample error feedback): the batch "
            f"must carry the sample ids of its rows under {ID_KEY!r}."
        )
    return parsed


def check_batch(batch: Batch, num_microbatches: int, replicas: int = 1) -> int:
    """Checks leading sizes and returns the microbatch size ``B / (replicas * M)``."""
    size = jnp.shape(batch.inputs)[0] if jnp.ndim(batch.inputs) else 0
    for name, tree in (("labels", batch.labels), ("ids", batch.ids)):
        for leaf in jax.tree.leaves(tree):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != size:
                raise ValueError(
                    f"batch {name} must have the inputs' leading size {size}; got shape "
                    f"{jnp.shape(leaf)}."
                )
    if batch.ids is not None:
        if jnp.ndim(batch.ids) != 1 or not jnp.issubdtype(batch.ids.dtype, jnp.integer):
            raise ValueError(
                "batch ids must be a 1-D integer array; got "
                f"{batch.ids.dtype}{list(jnp.shape(batch.ids))}."
            )
    per = replicas * num_microbatches
    if size == 0 or size % per:
        what = f"{replicas} replicas x {num_microbatches}" if replicas > 1 else num_microbatches
        raise ValueError(f"batch size {size} must be a positive multiple of {what} microbatches.")
    return size // per


def microbatches(tree: Any, num_microbatches: int) -> Any:
    """Reshapes every leaf's leading axis ``B`` into ``(M, B // M)``."""
    return jax.tree.map(
        lambda a: a.reshape(num_microbatches, a.shape[0] // num_microbatches, *a.shape[1:]), tree
    )


def unmicrobatch(tree: Any) -> Any:
    """Inverse of :func:`microbatches`."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


# ----------------------------------------------------------------------------------------------
# The entry points (init, step, evaluate, bytes_per_step) and the stage mesh's program.


def prepare_for(spec: Spec, params, batch, *, links=None, need_ids=None, model_layout=None):
    return prepare(
        spec.model, spec.links if links is None else links, spec.num_microbatches, params,
        batch, replicas=spec.replicas, need_ids=need_ids, model_layout=model_layout,
    )  # fmt: skip


def init(spec: Spec, params: Any, batch: Any, model_state: Any = None) -> _link_state.LinkStates:
    """Every link end's initial state, and a stateful model's running state (see
    :class:`jaxcomp.pipeline.Pipeline`)."""
    sharding = None if spec.mesh is None else NamedSharding(spec.mesh, spec.state_spec)
    model, model_layout = _params.init_model_state(spec.model, model_state, spec.lead, sharding)
    prep = prepare_for(spec, params, batch, need_ids=False, model_layout=model_layout)
    layout = prep.static.state_layout
    detector = _adaptive.init_detector(spec.adaptive, prep.static.shapes, spec.mesh)
    shapes, lead = prep.static.shapes, spec.lead

    def make():
        return _params.per_replica(_link_state.init_buffers(spec.links, shapes, layout), lead)

    if spec.mesh is None:
        return _link_state.LinkStates(
            jax.jit(make)(), layout, adaptive=detector, model=model, model_layout=model_layout
        )
    shardings = {name: sharding for name, _, _ in layout.buffers}
    buffers = jax.jit(make, out_shardings=shardings)()
    replica, replica_layout = {}, None
    if spec.replica_mean is not None:
        replica, replica_layout = _replica_init(spec, prep.static.layout)
    return _link_state.LinkStates(
        buffers, layout, replica, replica_layout, detector, model=model, model_layout=model_layout
    )


def state_shardings(spec: Spec, states: _link_state.LinkStates) -> _link_state.LinkStates | None:
    """Where :func:`init` puts each leaf of ``states`` (the same tree, leaves
    ``NamedSharding``); ``None`` in the single-device simulation.

    ``init`` places its parts inside ``jax.jit`` programs, and ``jax.eval_shape`` of a function
    that calls them does not carry those placements: a caller lowering a program for abstract
    link states (a trainer's setup) takes them from here, so that the program it compiles is
    the one later calls with the real states find in JAX's caches.
    """
    if spec.mesh is None:
        return None
    state = NamedSharding(spec.mesh, spec.state_spec)
    replica = NamedSharding(spec.mesh, spec.replica_spec)
    replicated = NamedSharding(spec.mesh, P())
    return _link_state.LinkStates(
        {name: state for name in states.buffers},
        states.layout,
        {name: replica for name in states.replica},
        states.replica_layout,
        jax.tree.map(lambda _: replicated, states.adaptive),
        model={name: state for name in states.model},
        model_layout=states.model_layout,
    )


def _replica_init(spec: Spec, layout: _params.ParamLayout):
    """Every stage's state of the averaging transform, packed: ``({dtype: [S, D, L]}, layout)``
    (per-worker parts start equal on every replica, as :func:`jaxcomp.comm.place_state`).

    The transform's ``init`` sees zeros of each stage's parameter shapes (an averaging
    transform's state depends on shapes only), so ``init`` also works on abstract parameters
    (``jax.eval_shape``, ``ShapeDtypeStruct`` leaves).
    """
    found = {}

    def make():
        stages = [
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), st) for st in layout.structs()
        ]
        states = [jax.tree.map(jnp.asarray, spec.replica_mean.init(p)) for p in stages]
        found["layout"] = replica_layout = _params.param_layout(states)
        return _params.per_replica(replica_layout.pack(states), spec.replica_lead)

    out = jax.jit(make, out_shardings=NamedSharding(spec.mesh, spec.replica_spec))()
    return out, found["layout"]


def _place(tree: Any, sharding: NamedSharding) -> Any:
    """Puts ``tree`` on ``sharding`` inside or outside ``jit``, for Explicit and Auto meshes."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
    if explicit:
        return jax.sharding.reshard(tree, sharding)
    return lax.with_sharding_constraint(tree, sharding)


def _stage_buffers(spec: Spec, params: Any, layout: _params.ParamLayout) -> dict:
    sharding = NamedSharding(spec.mesh, P(_mesh.STAGE))
    if isinstance(params, _params.PackedParams):
        return _place(params.buffers, sharding)
    return _place(layout.pack(params), sharding)


def _replica_key(spec: Spec, key):
    if key is None or spec.replicas == 1:
        return key
    return jax.random.fold_in(key, lax.axis_index(spec.data))


@functools.lru_cache(maxsize=64)
def _program(
    spec: Spec,
    static: Static,
    compress: bool,
    train: bool,
    replica_layout=None,
    eval_stats: str = "replica0",
):
    """The ``shard_map``-ed program of one shape signature (built once, then reused)."""
    links = spec.links if train else _links.eval_links(spec.links)
    prog = _ticks.Program(
        spec.model.loss_fn, links, spec.fns, static, spec.schedule, spec.num_microbatches,
        spec.axes, compress, train, not train,
    )  # fmt: skip
    m_, has_data = spec.num_microbatches, spec.replicas > 1

    def body(buffers, inputs, labels, states, key, ids):
        if train:
            states, replica, detector, model = states
        else:  # evaluation: every replica applies replica 0's or the mean running state
            states, replica, detector, model = None, None, None, states
            if has_data and model:
                model = _params.model_state_for_eval(model, eval_stats, spec.data)
        local = _local.to_varying({g: b[0] for g, b in buffers.items()}, spec.axes)
        x, lab = microbatches(inputs, m_), microbatches(labels, m_)
        ids = None if ids is None else microbatches(ids, m_)
        key = _replica_key(spec, key)
        if train:
            mine = {g: b.reshape(b.shape[len(spec.lead) :]) for g, b in states.items()}
            mine, cold = _link_state.mark_seen(
                mine, static.state_layout, ids, lax.axis_index(_mesh.STAGE)
            )
        else:  # compressed evaluation: fresh states of the plain forward codecs
            full = _link_state.init_buffers(links, static.shapes, static.state_layout)
            stage = lax.axis_index(_mesh.STAGE)
            mine = {g: lax.dynamic_index_in_dim(b, stage, 0, False) for g, b in full.items()}
        model_in, lead = model, len(spec.lead)
        model = _local.to_varying({g: b.reshape(b.shape[lead:]) for g, b in model.items()},
                                  spec.axes)  # fmt: skip
        carry = _ticks.run(prog, local, x, lab, ids, key, _local.to_varying(mine, spec.axes), model)
        loss = carry.loss / m_
        metrics = jax.tree.map(lambda v: v / m_, carry.metrics)
        if train and compress and _link_state.has_seen(static.state_layout):
            # summed over stages and replicas by the metrics' own reductions (no collective
            # of its own): float32 is exact for counts below 2**24
            metrics["cold_sends"] = cold.astype(jnp.float32) * spec.replicas
        if not train:
            loss, metrics, outputs = lax.psum((loss, metrics, carry.outputs), _mesh.STAGE)
            if has_data:
                loss, metrics = lax.pmean((loss, metrics), spec.data)
            return loss, metrics, unmicrobatch(outputs)
        loss, metrics = lax.psum((loss, metrics), _mesh.STAGE)
        grads, new_replica = carry.grads, replica
        if has_data:
            loss, metrics = lax.pmean((loss, metrics), spec.data)
            if spec.replica_mean is None:
                grads, sent = _plain_replica_mean(spec, static.layout, grads)
            else:
                mine = {g: b.reshape(b.shape[2:]) for g, b in replica.items()}
                grads, mine, sent = _average_replicas(
                    spec, static.layout, replica_layout, local, grads, mine
                )
                new_replica = {g: v.reshape(replica[g].shape) for g, v in mine.items()}
            sent = lax.pmean(lax.psum(sent, _mesh.STAGE), spec.data)
            metrics = {**metrics, "data_wire_bytes": sent[0]}
            if len(spec.data_axes) == 2:  # a pair: the slow axis's above, the fast one's here
                metrics["data_fast_wire_bytes"] = sent[1]
        stats, own = _adaptive.program_statistic(  # adaptive links: the interval's norms
            spec.adaptive, static.state_layout, carry.states, detector, spec.replicas, spec.data
        )
        new_states = {g: v.reshape(states[g].shape) for g, v in own.items()}
        new_model = {g: v.reshape(model_in[g].shape) for g, v in carry.model.items()}
        out_grads = {g: v[None] for g, v in grads.items()}
        return loss, out_grads, (new_states, new_replica, stats, new_model), metrics

    bs = spec.batch_spec
    if train:
        carried = (spec.state_spec, spec.replica_spec, P(), spec.state_spec)
        in_specs = (P(_mesh.STAGE), bs, bs, carried, P(), bs)
        out_specs = (P(), P(_mesh.STAGE), carried, P())
    else:
        in_specs = (P(_mesh.STAGE), bs, bs, spec.state_spec, P(), bs)
        out_specs = (P(), P(), bs)
    return jax.shard_map(body, mesh=spec.mesh, in_specs=in_specs, out_specs=out_specs)


def _check_replica(spec: Spec, link_states: Any) -> None:
    if (spec.replica_mean is None) != (link_states.replica_layout is None):
        what = "have no" if link_states.replica_layout is None else "carry a"
        raise ValueError(
            f"link_states {what} replica-averaging state, but this pipeline's replica_mean is "
            f"{spec.replica_mean!r}: initialise them with this pipeline's init."
        )


def _stage_params(params: Any) -> tuple[Any, ...]:
    return params.unpack() if isinstance(params, _params.PackedParams) else tuple(params)


def step(spec: Spec, params, batch, link_states, key=None, compress=True, modes=None):
    """One training step (see :class:`jaxcomp.pipeline.Pipeline`)."""
    compress = check_compress(compress)
    modes = _adaptive.step_modes(spec.adaptive, link_states, modes)
    spec = _adaptive.combo(spec, modes)
    prep = prepare_for(spec, params, batch, model_layout=_params.model_layout_of(link_states))
    static, parsed = prep.static, prep.batch
    _links.check_key(spec.links, key, compress)
    _link_state.check_link_states(link_states, static.state_layout, spec.lead)
    _params.check_model_state(link_states, static.model_layout, spec.lead)
    layout, m_ = static.layout, spec.num_microbatches
    if spec.mesh is None:
        x = microbatches(parsed.inputs, m_)
        labels = microbatches(parsed.labels, m_)
        ids = None if parsed.ids is None else microbatches(parsed.ids, m_)
        replica = {}
        loss, metrics, grads, states, model = _simulated_step(
            spec, static, _stage_params(params), x, labels, ids, key, link_states.buffers,
            compress, static.model_layout.unpack(link_states.model),
        )  # fmt: skip
        stats, states = _adaptive.stacked_statistic(
            spec.adaptive, static.state_layout, states, link_states.adaptive
        )
        model = static.model_layout.pack(model)
        if isinstance(params, _params.PackedParams):
            grads = _params.PackedParams(layout.pack(grads), layout)
        else:
            grads = type(params)(grads)
    else:
        _check_replica(spec, link_states)
        fn = _program(spec, static, compress, True, link_states.replica_layout)
        loss, grads, (states, replica, stats, model), metrics = fn(
            _stage_buffers(spec, params, layout), parsed.inputs, parsed.labels,
            (link_states.buffers, link_states.replica, link_states.adaptive, link_states.model),
            key, parsed.ids,
        )  # fmt: skip
        if isinstance(params, _params.PackedParams):
            grads = _params.PackedParams(grads, layout)
        else:
            grads = type(params)(layout.unpack(grads))
    metrics = with_bytes({"loss": loss, **metrics}, static, spec.links, m_, compress, True)
    if spec.replicas > 1:  # the dense reference of the data axis: every stage's float gradient
        dense = sum(layout.stage_bytes(s) for s in range(spec.model.num_stages))
        metrics["data_dense_bytes"] = jnp.asarray(dense, jnp.float32)
    detector, loss, grads, metrics = _adaptive.finish_step(
        spec.adaptive, modes, link_states.adaptive, stats, loss, grads, metrics
    )
    new_states = _link_state.LinkStates(
        states, static.state_layout, replica, link_states.replica_layout, detector, model=model,
        model_layout=link_states.model_layout,
    )  # fmt: skip
    return loss, grads, new_states, metrics


def evaluate(
    spec: Spec, params, batch, key=None, compress=False, modes=None, states=None, stats="replica0"
):
    """Forward only (see :class:`jaxcomp.pipeline.Pipeline`)."""
    compress = check_compress(compress)
    _validate.check_choice("stats", stats, _params.EVAL_STATS)
    spec = _adaptive.combo_or_low(spec, modes)
    elinks = _links.eval_links(spec.links)
    prep = prepare_for(
        spec,
        params,
        batch,
        links=elinks,
        need_ids=False,
        model_layout=_params.model_layout_of(states),
    )
    static, parsed, m_ = prep.static, prep.batch, spec.num_microbatches
    model = {}
    if spec.model.stateful:
        _params.check_model_state(states, static.model_layout, spec.lead)
        model = states.model
    key = eval_key(spec.links, key, compress)
    if spec.mesh is None:
        x = microbatches(parsed.inputs, m_)
        labels = microbatches(parsed.labels, m_)
        fresh = _link_state.init_buffers(elinks, static.shapes, static.state_layout)
        loss, metrics, ys = _simulated_evaluate(
            spec, static, elinks, _stage_params(params), x, labels, key, fresh, compress,
            static.model_layout.unpack(model),
        )  # fmt: skip
        outputs = unmicrobatch(ys)
    else:
        fn = _eval_program(spec, static, compress, stats)
        loss, metrics, outputs = fn(
            _stage_buffers(spec, params, static.layout), parsed.inputs, parsed.labels, model,
            key, None,
        )  # fmt: skip
    metrics = with_bytes({"loss": loss, **metrics}, static, elinks, m_, compress, False)
    return loss, metrics, outputs


def bytes_per_step(
    spec: Spec, params, batch, compress=True, train=True, modes=None, states=None
) -> dict[str, int]:
    """Theoretical bytes per step and pipeline replica (see :func:`jaxcomp.pipeline.distribute`)."""
    spec = _adaptive.combo_or_low(spec, modes)
    prep = prepare_for(
        spec, params, batch, need_ids=False, model_layout=_params.model_layout_of(states)
    )
    use = spec.links if train else _links.eval_links(spec.links)
    return _links.step_bytes(use, prep.static.shapes, spec.num_microbatches, compress, train)


@functools.lru_cache(maxsize=64)
def _eval_program(spec: Spec, static: Static, compress: bool, eval_stats: str):
    """:func:`_program`'s evaluation, jitted: called eagerly, an un-jitted ``shard_map`` runs
    (and compiles) op by op, ~400 programs for a small GPT (15.6 s of the README example)."""
    return jax.jit(_program(spec, static, compress, False, None, eval_stats))


# ----------------------------------------------------------------------------------------------
# Averaging each stage's gradient over the data replicas (inside the program).


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


def _average_replicas(spec: Spec, layout, replica_layout, local, grads, replica):
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


def _plain_replica_mean(spec: Spec, layout: _params.ParamLayout, grads: dict[str, jax.Array]):
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


# ----------------------------------------------------------------------------------------------
# The single-device program (the simulation).


_SIMULATED = _links.Wire(True, True, lambda tree, reverse: tree, True)


def _simulated_step(
    spec: Any,
    static: Static,
    params: tuple[Any, ...],
    x: Any,
    labels: Any,
    ids: jax.Array | None,
    key: jax.Array | None,
    states: dict[str, jax.Array],
    compress: bool,
    model_state: tuple[Any, ...],
):
    """One training step on one device.

    Returns:
      ``(loss, metrics, grads, states, model_state)``: microbatch means, per-stage gradient
      pytrees, the new link-state buffers ``{dtype: [S, L]}`` and the stages' new running
      states (per-stage pytrees).
    """
    model, links, m_ = spec.model, spec.links, spec.num_microbatches
    num = model.num_stages

    def body(carry, m):
        states, grads, loss_sum, metrics_sum, mstate = carry
        labels_m = jax.tree.map(lambda a: a[m], labels)
        ids_m = None if ids is None else ids[m]
        h, pulls, payloads, mstate = x[m], [], [], list(mstate)
        for s in range(num):
            out, pull, (aux, mstate[s]) = _residuals.vjp(
                spec.fns[s], params[s], h, labels_m, mstate[s]
            )
            pulls.append(pull)
            if s < num - 1:
                h, states, kept = _links.send_forward(
                    links[s], s, out, states, static.state_layout, _links.link_key(key, s, m),
                    ids_m, _SIMULATED, compress,
                )  # fmt: skip
                payloads.append(kept)
        loss_sum = loss_sum + out
        metrics_sum = jax.tree.map(jnp.add, metrics_sum, aux)
        g = jnp.asarray(1.0 / m_, jnp.float32)
        new_grads = list(grads)
        for s in reversed(range(num)):
            got = pulls[s](g)
            new_grads[s] = jax.tree.map(jnp.add, grads[s], got[0])
            if s > 0:
                g, states = _links.send_backward(
                    links[s - 1], s - 1, got[1], states, static.state_layout, payloads[s - 1],
                    _links.link_key(key, s - 1, m), ids_m, _SIMULATED, compress,
                )  # fmt: skip
        return (states, tuple(new_grads), loss_sum, metrics_sum, tuple(mstate)), None

    zero = jnp.zeros((), jnp.float32)
    grads0 = tuple(jax.tree.map(jnp.zeros_like, p) for p in params)
    metrics0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), static.metrics)
    carry = (states, grads0, zero, metrics0, tuple(model_state))
    states, cold = _link_state.mark_seen(states, static.state_layout, ids, None)
    carry = (states, grads0, zero, metrics0, tuple(model_state))
    (states, grads, loss, metrics, model_state), _ = lax.scan(body, carry, jnp.arange(m_))
    metrics = jax.tree.map(lambda v: v / m_, metrics)
    if compress and _link_state.has_seen(static.state_layout):
        metrics["cold_sends"] = cold.astype(jnp.float32)
    return loss / m_, metrics, grads, states, model_state


def _simulated_evaluate(
    spec: Any,
    static: Static,
    links: tuple,
    params: tuple[Any, ...],
    x: Any,
    labels: Any,
    key: jax.Array | None,
    states: dict[str, jax.Array],
    compress: bool,
    model_state: tuple[Any, ...],
):
    """The forward pass of every microbatch with the stages' running states ``model_state``;
    returns ``(loss, metrics, outputs [M, mb, ...])``."""
    model, m_ = spec.model, spec.num_microbatches
    num = model.num_stages

    def body(carry, m):
        states, loss_sum, metrics_sum = carry
        h = x[m]
        for s in range(num - 1):
            y = spec.fns[s].stage(params[s], model_state[s], h)
            h, states, _ = _links.send_forward(
                links[s], s, y, states, static.state_layout, _links.link_key(key, s, m), None,
                _SIMULATED, compress,
            )  # fmt: skip
        y = spec.fns[num - 1].stage(params[num - 1], model_state[num - 1], h)
        loss, metrics = _config.split_loss(model.loss_fn(y, jax.tree.map(lambda a: a[m], labels)))
        loss_sum = loss_sum + loss.astype(jnp.float32)
        metrics_sum = jax.tree.map(lambda a, v: a + v.astype(jnp.float32), metrics_sum, metrics)
        return (states, loss_sum, metrics_sum), y

    zero = jnp.zeros((), jnp.float32)
    metrics0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), static.metrics)
    (_, loss, metrics), ys = lax.scan(body, (states, zero, metrics0), jnp.arange(m_))
    return loss / m_, jax.tree.map(lambda v: v / m_, metrics), ys
