"""Pipeline mode: the model's stages on the ``stage`` mesh axis, compressed at every boundary.

``config.pipeline`` (all optional)::

  num_microbatches = 8          # M (>= the number of stages)
  forward = {"name": "top_k", "fraction": 0.1, "per_sample": True, "feedback": "ef"}
  backward = {"name": "quantize", "bits": 8}
  backward_mode = "independent" # or "shared_mask" (backward reuses the forward TopK mask)
  boundaries = None             # or a list with one {"forward": ..., "backward": ...} per cut
  warmup_epochs = 0             # uncompressed first epochs (AQ-SGD's warm-up)
  simulate = False              # one device, compression at the cut points, same numbers
  schedule = "gpipe"            # or "1f1b" (at most S microbatches' activations alive)
  checkpoint = False            # True or a jax.checkpoint_policies name: recompute each stage
  replica_mean = None           # data replicas' gradient average: None (float32 pmean) or a
                                # config.data_parallel-style dict, e.g. {"transform":
                                # "compressed_mean", "codec": {"name": "power_sgd", "rank": 2,
                                # "feedback": "ef"}} or {"transform": "accordion", ...}
  forward_high = None           # Accordion on the links: with a channel spec here, `forward` is
  backward_high = None          # the low-compression channel (critical regimes) and this one
                                # the high-compression channel, chosen per boundary by the
                                # activation (gradient) norms (pipeline.adaptive_link)
  detector = {"interval_epochs": 1, "check_every": 10, "eta": 0.5}  # or "interval_steps"
                                # (one of the two; an interval is 1 epoch by default)
  sync_batch_stats = False      # BatchNorm with data replicas: per-replica statistics (False)
                                # or synchronised over data (SyncBatchNorm)
  eval_batch_stats = "worker0"  # BatchNorm, per replica: evaluate with replica 0's or "mean"

``config.mesh`` has a ``stage`` axis and optionally the replicas' axes: ``data``, or two axes
of a hierarchical cluster read as ``(slow, fast)`` in mesh order, e.g. ``[("slow", hosts),
("fast", 2), ("stage", 4)]``: ``replica_mean`` then averages densely over ``fast`` and with
its codec over ``slow`` (``data_wire_bytes``: the slow axis's bytes, ``data_fast_wire_bytes``
the fast one's; without ``replica_mean`` a float mean over each).

With ``forward_high`` / ``backward_high`` (also in ``boundaries`` entries) every step logs each
adaptive boundary's mode (``link_mode_forward_<b>`` / ``link_mode_backward_<b>``: 0 low, 1
high), ``low_compression_links`` and its own ``wire_bytes``; each mode combination is compiled
once, when first used (the all-low program at build time). The detector's
learning-rate rule reads the config's schedule (use ``constant`` or ``step``: a smooth decay
keeps every link in low compression).

Every step logs the gradient's global norm before clipping (``grad_norm``, after the replicas'
average) and each stage's (``grad_norm/stage_<s>``, ``s = 0 ... S-1``: the norm of stage
``s``'s parameters' gradient, the padding of the packed rows left out; the global norm is the
square root of the stages' sum of squares), with no collective beyond the one a global norm
needs (:func:`stage_square_sums`); a train record holds each one's mean over its steps.

A channel spec is a codec name plus its arguments, with ``feedback`` one of ``None``, ``"ef"``,
``"ef21"``, ``"aq_sgd"`` (``per_sample_buffers: True`` keys EF/EF21 buffers by sample id).
Each data replica keeps its own per-sample buffers, so with such a channel on ``R > 1``
replicas the training loader keeps sample ``i`` on replica ``i mod R`` for the whole run
(``data.Loader(shards=R)``, ``Mode.sample_shards``): every revisit finds the sample's buffer.
Each compressed step logs ``cold_sends`` (sends that met a row their replica never filled:
first visits only, with the fixed shards); a step of revisits that meets one prints one
warning line per run (``jaxcomp.train._cold_sends``).
Other runs shuffle the whole split over the batch each epoch.
Evaluation runs with boundary compression on (each forward codec, no feedback: the paper's
compressed inference) and off.

BatchNorm (``model.norm = "batch"``, as paper 1's ResNet-18) keeps its running statistics as
pipeline state: each stage's on the device that runs it (in ``PipelineState.link_states``,
checkpointed with it), updated by every real microbatch's forward in microbatch order, so after
a step they are what the unpipelined model leaves after applying the ``M`` microbatches one
after another (each normalised with its own statistics, as PyTorch does for a model fed
microbatch by microbatch). With data replicas each replica keeps its own statistics, or with
``sync_batch_stats`` normalises with the statistics of the microbatch concatenated over the
replicas; evaluation uses the running statistics (replica 0's, or their mean).
"""

from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validate
from jaxcomp import comm
from jaxcomp import pipeline
from jaxcomp._compile import compile_all
from jaxcomp._compile import lower_later
from jaxcomp.models import _staged
from jaxcomp.pipeline import _links
from jaxcomp.train import _batch_stats
from jaxcomp.train import _config
from jaxcomp.train import _dense
from jaxcomp.train import _mode
from jaxcomp.train import _pipeline_config
from jaxcomp.train import _precision


class PipelineState(NamedTuple):
    """Training state of the pipeline mode."""

    params: Any  # pipeline.PackedParams, sharded over ``stage``
    opt_state: Any
    link_states: Any  # one pipeline.LinkState per boundary
    loss_scale: Any = ()  # float16 compute: _precision.LossScale


def _adaptive_metrics(metrics: dict, mask) -> dict:
    """Per adaptive boundary and direction, the mode this step ran (0 low, 1 high), the
    number of adaptive directions in low compression, and the step's boundary bytes."""
    modes = metrics["link_modes"]
    out = {"wire_bytes": metrics["wire_bytes"]}
    low = jnp.zeros((), jnp.int32)
    for b, flags in enumerate(mask):
        for d, direction in enumerate(("forward", "backward")):
            if flags[d]:
                out[f"link_mode_{direction}_{b}"] = modes[b, d]
                low = low + (modes[b, d] == pipeline.LOW_COMPRESSION)
    out["low_compression_links"] = low
    return out


def _own_lengths(layout: pipeline.ParamLayout) -> dict[str, np.ndarray]:
    """Per packed buffer, each stage's own entries (its row without the padding), ``[S]``."""

    def own(g, slots):
        return sum(math.prod(sl.shape) for sl in slots if sl.group == g)

    return {g: np.array([own(g, slots) for slots in layout.slots]) for g, _ in layout.lengths}


def _row_square_sums(rows: dict[str, jax.Array], own: dict[str, jax.Array]) -> jax.Array:
    """``sum(x ** 2)`` over the first ``own[g]`` entries of each row of every buffer ``g``
    (``[..., L]`` rows, ``[...]`` lengths), in float32: ``[...]``."""
    total = 0.0
    for g, row in rows.items():
        x = row.astype(jnp.float32)
        kept = jnp.arange(row.shape[-1]) < own[g][..., None]
        total = total + jnp.sum(jnp.where(kept, x * x, 0.0), axis=-1)
    return total


def stage_square_sums(
    grads: pipeline.PackedParams, mesh: jax.sharding.Mesh | None = None
) -> jax.Array:
    r"""Each stage's sum of squared gradient entries, ``[S]`` float32 and replicated, without the
    padding of the packed rows.

    .. math::
      q_s = \sum_{i \in \text{stage } s} g_i^2, \qquad
      \lVert g \rVert = \sqrt{\textstyle\sum_s q_s}

    The stages' norms are ``sqrt(q)``, the global norm ``sqrt(q.sum())``. With ``mesh`` (the
    buffers sharded over ``stage``) each stage's device sums its own row and one ``psum`` of
    the ``[S]`` vector (its own entry, zeros elsewhere) over ``stage`` replicates the sums:
    the one all-reduce a global norm needs, ``S`` floats instead of one. Without, the rows
    are summed where they are (the simulation: replicated, no collective).

    Args:
      grads: the packed gradient, ``{dtype: [S, L]}``.
      mesh: the mesh its buffers are sharded on over ``stage``, or ``None``.

    Returns:
      ``[S]`` float32.

    Example:
      >>> g = pipeline.pack_params([{"w": jnp.full(3, 2.0)}, {"b": jnp.ones(1)}])
      >>> stage_square_sums(g).tolist()  # stage 1: its one entry, not its row's padding
      [12.0, 1.0]
    """
    own = _own_lengths(grads.layout)
    if mesh is None:
        return _row_square_sums(grads.buffers, {g: jnp.asarray(n) for g, n in own.items()})
    num_stages = grads.layout.num_stages

    def body(rows):  # [1, L] per buffer: this device's stage
        s = lax.axis_index(comm.STAGE)
        mine = _row_square_sums(rows, {g: jnp.asarray(n)[s][None] for g, n in own.items()})
        return lax.psum(jnp.where(jnp.arange(num_stages) == s, mine, 0.0), comm.STAGE)

    return jax.shard_map(body, mesh=mesh, in_specs=P(comm.STAGE), out_specs=P())(grads.buffers)


def optimizer(
    config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh | None
) -> optax.GradientTransformation:
    """The config's optimizer on the packed parameters: ``grad_clip_norm`` on the packed
    buffers (their global norm is the model's), the rest stage by stage on each stage's
    parameters by name (:func:`jaxcomp.pipeline.unpacked`: per-leaf statistics, e.g. LAMB's
    trust ratios, see the leaves, as in the unpipelined modes)."""
    inner = pipeline.unpacked(_config.optimizer(config, clip=False), mesh)
    if not config.grad_clip_norm:
        return inner
    return optax.chain(optax.clip_by_global_norm(float(config.grad_clip_norm)), inner)


def _sample_shards(links, replicas: int) -> int:
    """The training loader's per-replica shards: ``replicas`` when a link keeps per-sample
    buffers (each replica its own, so each sample must come back to its replica), else 1."""
    plain = [x for lk in links for x in (lk if isinstance(lk, pipeline.AdaptiveLink) else (lk,))]
    return replicas if _links.needs_ids(plain) else 1


def _loss_fn(model: _staged.StagedModel):
    def loss_fn(y, labels):
        if isinstance(labels, dict):  # float16: the loss scale rides along with the labels
            scale, labels = labels["loss_scale"][0], labels["label"]
            loss = model.loss_fn(y, labels)
            return loss * scale, {"accuracy": _staged.accuracy(y, labels), "loss": loss}
        return model.loss_fn(y, labels), {"accuracy": _staged.accuracy(y, labels)}

    return loss_fn


def build_pipeline(
    config: ml_collections.ConfigDict,
    model: _staged.StagedModel,
    mesh: jax.sharding.Mesh,
    num_train_samples: int,
) -> _mode.Mode:
    """Builds the pipeline mode (``config.mode = "pipeline"``)."""
    cfg = _config.check_sub_config("pipeline", config.pipeline, _pipeline_config.PIPELINE_DEFAULTS)
    if model.num_stages < 2:
        raise ValueError(
            f"pipeline mode needs a model cut into >= 2 stages; {model.name} has cuts "
            f"{model.cuts}. Set config.model.cuts."
        )
    if comm.STAGE not in mesh.axis_names or mesh.shape[comm.STAGE] != model.num_stages:
        raise ValueError(
            f"pipeline mode needs a mesh with a 'stage' axis of {model.num_stages} devices "
            f"(one per stage); got mesh {dict(mesh.shape)}."
        )
    data_axes = _config.data_axes(mesh, "pipeline", (comm.STAGE,))
    replicas = math.prod(mesh.shape[a] for a in data_axes)
    pair = len(data_axes) == 2
    data = data_axes if pair else comm.DATA  # the replicas' axis, or the (slow, fast) pair
    sync, eval_with = cfg["sync_batch_stats"], cfg["eval_batch_stats"]
    if not isinstance(sync, bool):
        raise ValueError(f"config.pipeline.sync_batch_stats must be a bool; got {sync!r}.")
    if eval_with not in _batch_stats.EVAL_WITH:
        raise ValueError(
            f"config.pipeline.eval_batch_stats must be one of {_batch_stats.EVAL_WITH}; got "
            f"{eval_with!r}."
        )
    if sync and model.has_batch_stats and replicas > 1 and not cfg["simulate"]:
        if pair:
            raise ValueError(
                "config.pipeline.sync_batch_stats over the (slow, fast) data axes "
                f"{data_axes} is not supported; use per-replica statistics (False) or a 'data' "
                "axis."
            )
        model = model.with_batch_axis(comm.DATA)
    eval_stats = "mean" if eval_with == "mean" else "replica0"
    m = _validate.check_int("config.pipeline.num_microbatches", cfg["num_microbatches"], 1)
    _validate.check_int("config.pipeline.warmup_epochs", cfg["warmup_epochs"], 0)
    for name, bs in (
        ("batch_size", config.batch_size),
        ("eval_batch_size", config.eval_batch_size),
    ):
        if bs % (m * replicas):
            raise ValueError(
                f"config.{name} ({bs}) must be divisible by num_microbatches x data replicas "
                f"({m} x {replicas})."
            )
    links = _pipeline_config.links_of(cfg, model.num_stages - 1, num_train_samples)
    steps_per_epoch = max(1, num_train_samples // config.batch_size)
    averaging, averaging_name = _pipeline_config.replica_mean_of(
        cfg, config, replicas, steps_per_epoch, num_train_samples, data
    )
    pmodel = pipeline.StagedModel(
        model.stages, _loss_fn(model), stateful=model.stateful, eval_stages=model.eval_stages
    )
    checkpoint = cfg["checkpoint"] if cfg["checkpoint"] not in (False, None) else None
    detector = _pipeline_config.detector_of(cfg, links, config, steps_per_epoch)
    mask = tuple(
        lk.directions if isinstance(lk, pipeline.AdaptiveLink) else (False, False) for lk in links
    )
    pconfig = pipeline.PipelineConfig(
        m, links, schedule=cfg["schedule"], checkpoint=checkpoint, replica_mean=averaging,
        detector=detector,
    )  # fmt: skip
    pipe = (
        pipeline.simulate(pmodel, pconfig)
        if cfg["simulate"]
        else pipeline.distribute(pmodel, pconfig, mesh, **({"data_axis": data} if pair else {}))
    )
    opt = optimizer(config, None if cfg["simulate"] else mesh)
    scaled = _precision.scaled(config)
    warmup_steps = int(cfg["warmup_epochs"]) * steps_per_epoch

    replicated = NamedSharding(mesh, P())
    stage_sharding = NamedSharding(mesh, P(comm.STAGE)) if not cfg["simulate"] else replicated
    split = replicas > 1 and not cfg["simulate"]
    sample_shards = _sample_shards(links, replicas if split else 1)
    batch_sharding = NamedSharding(mesh, P(data) if split else P())
    batch_abs = _dense.abstract_batch(model, config.batch_size, batch_sharding)

    def init(key):
        params, model_state = _mode.split_variables(model.init(key))
        packed = pipeline.pack_params(params)
        return packed, opt.init(packed), (model_state if model.stateful else None)

    with jax.set_mesh(mesh):
        params_abs, opt_abs, model_abs = jax.eval_shape(init, jax.random.key(0))
        link_abs = jax.eval_shape(lambda: pipe.init(params_abs, batch_abs, model_abs))
    link_shardings = pipe.state_shardings(link_abs)  # eval_shape drops init's placements
    shardings = PipelineState(
        jax.tree.map(lambda _: stage_sharding, params_abs),
        jax.tree.map(lambda _: stage_sharding if not cfg["simulate"] else replicated, opt_abs),
        jax.tree.map(lambda _: replicated, link_abs) if link_shardings is None else link_shardings,
        jax.tree.map(lambda _: replicated, _precision.initial(config)),
    )
    # scalar optimizer leaves (counts) cannot be sharded over stage
    shardings = shardings._replace(
        opt_state=jax.tree.map(
            lambda a, s: replicated if a.ndim == 0 else s, opt_abs, shardings.opt_state
        )
    )

    def full_init(key):
        packed, opt_state, model_state = init(key)
        link = pipe.init(packed, batch_abs, model_state)
        return PipelineState(packed, opt_state, link, _precision.initial(config))

    def train_step(state, batch, key_data, compress, modes):
        key = jax.random.wrap_key_data(key_data)
        if scaled:  # each microbatch's loss times the scale: the gradients come out scaled
            scale = jnp.broadcast_to(state.loss_scale.scale, batch["label"].shape[:1])
            batch = {**batch, "label": {"label": batch["label"], "loss_scale": scale}}
        loss, grads, link_states, metrics = pipe.step(
            state.params, batch, state.link_states, key, compress=compress, modes=modes
        )
        if scaled:
            loss, grads = metrics["loss"], _precision.unscale(grads, state.loss_scale)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new, finite = _mode.commit_if_finite(
            PipelineState(params, opt_state, link_states, state.loss_scale), state, loss, grads
        )
        if scaled:
            new = new._replace(loss_scale=_precision.adjust(state.loss_scale, finite))
        squares = stage_square_sums(grads, None if cfg["simulate"] else mesh)
        out = {
            "loss": loss,
            "accuracy": metrics["accuracy"],
            "finite": finite.astype(jnp.int32),
            "grad_norm": jnp.sqrt(jnp.sum(squares)),
            **{f"grad_norm/stage_{s}": jnp.sqrt(squares[s]) for s in range(model.num_stages)},
        }
        if "data_wire_bytes" in metrics:  # data replicas: the gradient average's bytes
            out["data_wire_bytes"] = metrics["data_wire_bytes"]
        if "data_fast_wire_bytes" in metrics:  # a (slow, fast) pair: the fast axis's
            out["data_fast_wire_bytes"] = metrics["data_fast_wire_bytes"]
        if "cold_sends" in metrics:  # per-sample buffers: sends that met a cold row
            out["cold_sends"] = metrics["cold_sends"]
        if detector is not None:
            out.update(_adaptive_metrics(metrics, mask))
        elif not compress:  # a warm-up step sends dense: its own bytes, not the run's
            out["wire_bytes"] = metrics["wire_bytes"]
        return new, out

    def eval_step(state, batch, compress, modes):
        _, _, logits = pipe.evaluate(
            state.params, batch, None, compress=compress, modes=modes, states=state.link_states,
            stats=eval_stats,
        )  # fmt: skip
        return _mode.eval_sums(model, logits, batch)

    with jax.set_mesh(mesh):
        init_jit = _mode.jit_init(full_init, out_shardings=shardings)
        state_abs = jax.eval_shape(full_init, jax.random.key(0))
        state_abs = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state_abs, shardings
        )
        key_abs = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
        eval_jit = jax.jit(eval_step, static_argnums=(2, 3))
    train_jit = jax.jit(train_step, donate_argnums=0, static_argnums=(3, 4))
    compiled = {}

    def program(compress, modes):
        """The compiled step of one (compress, mode combination), built when first used."""
        if (compress, modes) not in compiled:
            with jax.set_mesh(mesh):
                lowered = train_jit.lower(state_abs, batch_abs, key_abs, compress, modes)
                compiled[compress, modes] = lowered.compile()
        return compiled[compress, modes]

    low = high = None
    if detector is not None:
        low = tuple((0, 0) for _ in mask)
        high = tuple((int(f), int(b)) for f, b in mask)
    # the step programs the run starts with (the all-low modes), the state init and the
    # evaluation (compression on and off) compiled side by side; the latter two lowered outside
    # the mesh, as the trainer calls them, so that JAX's caches serve those calls
    # (each compiled as soon as it is lowered)
    starts = (True, False) if warmup_steps else (True,)
    lowered = {
        f"train_step(compress={c})": lower_later(
            train_jit, state_abs, batch_abs, key_abs, c, low, mesh=mesh
        )
        for c in starts
    }
    lowered["init"] = lower_later(init_jit, jax.eval_shape(jax.random.key, 0))
    eval_abs = _dense.abstract_batch(model, config.eval_batch_size, batch_sharding, True)
    for c in (False, True):
        lowered[f"eval_step(compress={c})"] = lower_later(eval_jit, state_abs, eval_abs, c, low)
    done = compile_all(lowered)
    compiled.update({(c, low): done[f"train_step(compress={c})"] for c in starts})
    # a tick's permute carries one payload per pair: its bytes per pipeline replica
    text = program(True, low).as_text()
    report, sent = comm.collective_report(text), _links.hlo_sent_bytes(text, mesh)
    hlo = report.total_bytes - report.bytes_by_kind().get("collective-permute", 0.0)
    hlo += sent["total"] / replicas
    counts = pipe.bytes_per_step(
        params_abs, batch_abs, compress=True, train=True, modes=low, states=link_abs
    )

    def modes_of(state):
        return None if detector is None else pipeline.link_modes(state.link_states)

    def step_fn(state, batch, key, step):
        return program(step >= warmup_steps, modes_of(state))(state, batch, key)

    def eval_fn(state, batch, compressed):
        # without compression nothing passes a link's codec: the program is the same for
        # every mode combination, the all-low one's (compiled once, not again per switch)
        compressed = bool(compressed)
        return eval_jit(state, batch, compressed, modes_of(state) if compressed else low)

    kind = (
        "simulated on one device"
        if cfg["simulate"]
        else f"{cfg['schedule']} over {dict(mesh.shape)}"
    )
    if replicas > 1 and not cfg["simulate"]:
        kind += f", replicas averaged by {averaging_name}"
    names = "; ".join(
        f"{lk.forward.name} / {lk.backward.name if lk.backward else 'shared mask'}"
        for lk in (lk.low if isinstance(lk, pipeline.AdaptiveLink) else lk for lk in links[:1])
    )
    extra = {
        "boundary_bytes_per_step": float(counts["wire_bytes"]),
        "boundary_dense_bytes_per_step": float(counts["dense_bytes"]),
        "hlo_collective_bytes_per_step": hlo,
        "permutes_per_step": sent["permutes"],
        # each permute's pairs and bytes: the cost model plays them (study._moves)
        "boundary_permutes": [
            {
                "bytes_per_execution": r.bytes_per_execution,
                "pairs": [list(p) for p in r.pairs],
                "executions": r.executions,
            }
            for r in report.records
            if r.kind == "collective-permute"
        ],
        "microbatches": m,
        "links": names,
        "schedule": cfg["schedule"],
        "batch_stats": _batch_stats.BatchStats(not sync or replicas == 1, eval_with).describe(
            model.has_batch_stats
        ),
    }
    if replicas > 1 and not cfg["simulate"]:
        # the float gradient of every stage, what a plain mean sends per replica
        layout = params_abs.layout
        extra["replica_mean"] = averaging_name
        extra["data_dense_bytes_per_step"] = float(
            sum(layout.stage_bytes(s) for s in range(model.num_stages))
        )
    if detector is not None:
        hi_counts = pipe.bytes_per_step(params_abs, batch_abs, modes=high, states=link_abs)
        extra.update(
            adaptive=f"interval {detector.interval_steps} steps, every {detector.check_every}, "
            f"eta={detector.eta}",
            boundary_bytes_per_step_high=float(hi_counts["wire_bytes"]),
        )
        names += f"; adaptive, high: {_pipeline_config.high_names(links)}"
        extra["links"] = names
    return _mode.Mode(
        name="pipeline",
        mesh=mesh,
        init=init_jit,
        train_step=step_fn,
        eval_step=eval_fn,
        batch_sharding=batch_sharding,
        # adaptive links: each step reports the bytes of its mode combination
        wire_bytes=math.nan if detector is not None else float(counts["wire_bytes"]),
        dense_bytes=float(counts["dense_bytes"]),
        description=f"{model.num_stages}-stage pipeline, M={m}, {kind}; links: {names}",
        has_compressed_eval=True,
        extra=extra,
        sample_shards=sample_shards,
    )
