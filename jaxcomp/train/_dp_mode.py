"""Compressed data parallelism: per-worker gradients averaged by ``compressed_mean`` or Accordion.

``config.data_parallel`` (all optional)::

  transform = "accordion"        # or "compressed_mean", or "accordion_batch_size"
  low = {"name": "power_sgd", "rank": 2}     # accordion: critical regimes
  high = {"name": "power_sgd", "rank": 1}    # accordion: otherwise
  codec = {"name": "top_k", "fraction": 0.01, "feedback": "ef"}  # compressed_mean
  interval_epochs = 1            # accordion: the norm-accumulation interval (the paper's epoch)
  check_every = 10               # accordion: T, in intervals
  eta = 0.5                      # accordion: the critical-regime threshold
  error_feedback = True          # accordion
  min_compression_rate = 2.0     # leaves compressing less than this go dense
  small_steps = 1                # accordion_batch_size: micro-batches per update, critical
  large_steps = 8                # accordion_batch_size: micro-batches per update, otherwise
  lr_scaling = "linear"          # accordion_batch_size: "linear", "sqrt" or "none"
  sync_batch_stats = False       # BatchNorm: per-worker statistics (False) or SyncBatchNorm
  eval_batch_stats = "worker0"   # BatchNorm, per worker: evaluate with "worker0"'s or "mean"

``accordion_batch_size`` is Accordion's batch-size variant: the same detector chooses how many
``batch_size`` micro-batches make one update (``small_steps`` in critical regimes,
``large_steps`` otherwise), the mean over them goes through ``compressed_mean(codec)`` and the
optimizer once per update (:func:`jaxcomp.transforms.accordion_batch_size`). A training step is
one micro-batch: ``total_steps`` counts micro-batches (equal epochs for every batch size), a
step that completes no update sends nothing, and the detector's interval is
``interval_epochs`` epochs of micro-batches. The metric ``every_k`` is the current choice.

Parameters are replicated; each worker differentiates its shard of the batch with no hidden
all-reduce (:func:`jaxcomp.comm.local_value_and_grad`) and the transform's payloads are the
only gradient traffic. The step is compiled when the mode is built; its HLO gives the summary's
``collectives`` (per kind and group size, those inside Accordion's mode branches marked:
:mod:`jaxcomp.train._collectives`), and the transform reports each step's bytes.

BatchNorm running statistics are model state. By default each worker keeps its own
(``[W, ...]`` sharded over data), normalising with its own shard's batch statistics and
sending nothing for them: Accordion's reference all-reduces parameter gradients only and never
touches the BN buffers. Evaluation then uses worker 0's running statistics, as the
reference's logged test accuracy does (each rank evaluates its own model; the logs are rank
0's); ``eval_batch_stats="mean"`` uses the mean of the workers' running means and variances
instead (timm's ``distribute_bn``). ``sync_batch_stats=True`` normalises with the statistics of
the whole global batch, as PyTorch's SyncBatchNorm (AB-Training's VGG and ImageNet configs):
the statistics are then replicated, and their all-reduces (forward: mean and variance,
backward: their cotangents; measured on the compiled gradient, 20 bytes per channel per step
on CPU) are counted in ``wire_bytes``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.models import _staged
from jaxcomp.train import _batch_stats
from jaxcomp.train import _collectives
from jaxcomp.train import _config
from jaxcomp.train import _dense
from jaxcomp.train import _mode

DP_DEFAULTS = {
    "transform": "accordion",
    "low": {"name": "power_sgd", "rank": 2},
    "high": {"name": "power_sgd", "rank": 1},
    "codec": {"name": "top_k", "fraction": 0.01, "feedback": "ef"},
    "interval_epochs": 1,
    "check_every": 10,
    "eta": 0.5,
    "error_feedback": True,
    "min_compression_rate": 2.0,
    "small_steps": 1,
    "large_steps": 8,
    "lr_scaling": "linear",
    "sync_batch_stats": False,
    "eval_batch_stats": "worker0",
}
TRANSFORMS = ("accordion", "compressed_mean", "accordion_batch_size")


def _reducer(cfg: dict, schedule, steps_per_epoch: int, num_samples: int):
    """``(transform, description)`` for ``config.data_parallel``."""
    _base_choice("config.data_parallel.transform", cfg["transform"], TRANSFORMS)
    if cfg["transform"] == "accordion":
        low, high = _config.build_codec(cfg["low"]), _config.build_codec(cfg["high"])
        tx = transforms.accordion(
            low,
            high,
            interval_steps=int(cfg["interval_epochs"]) * steps_per_epoch,
            check_every=int(cfg["check_every"]),
            eta=float(cfg["eta"]),
            learning_rate=schedule,
            axis_name=comm.DATA,
            error_feedback=bool(cfg["error_feedback"]),
            min_compression_rate=float(cfg["min_compression_rate"]),
        )
        return tx, f"accordion({low.name} / {high.name}, eta={cfg['eta']})"
    channel = _config.build_channel(cfg["codec"], num_samples)
    tx = transforms.compressed_mean(
        channel, comm.DATA, min_compression_rate=float(cfg["min_compression_rate"])
    )
    return tx, f"compressed_mean({channel.name})"


def _transform(cfg: dict, config, schedule, steps_per_epoch: int, num_samples: int):
    """``(transform, description)``: the reducer chained with the optimizer, or, for
    ``accordion_batch_size``, the accumulation around ``chain(compressed_mean, optimizer)``."""
    opt = _config.optimizer(config, schedule)
    if cfg["transform"] != "accordion_batch_size":
        reducer, name = _reducer(cfg, schedule, steps_per_epoch, num_samples)
        return optax.chain(reducer, opt), name
    channel = _config.build_channel(cfg["codec"], num_samples)
    mean = transforms.compressed_mean(
        channel, comm.DATA, min_compression_rate=float(cfg["min_compression_rate"])
    )
    small, large = int(cfg["small_steps"]), int(cfg["large_steps"])
    tx = transforms.accordion_batch_size(
        optax.chain(mean, opt),
        interval_steps=int(cfg["interval_epochs"]) * steps_per_epoch,
        small_steps=small,
        large_steps=large,
        check_every=int(cfg["check_every"]),
        eta=float(cfg["eta"]),
        learning_rate=schedule,
        lr_scaling=cfg["lr_scaling"],
        axis_name=comm.DATA,
    )
    return tx, f"accordion_batch_size({small} / {large} micro-batches, {channel.name})"


def _reducer_state(opt_state):
    """The reducer's state (its ``bytes_sent``: this step's bytes); under
    ``accordion_batch_size`` the inner ``compressed_mean``'s, 0 bytes when no update ran."""
    if isinstance(opt_state, transforms.AccordionBatchState):
        inner = opt_state.inner[0]  # chain(compressed_mean, optimizer)
        sent = jnp.where(opt_state.mini_step == 0, inner.bytes_sent, 0.0)
        return inner._replace(bytes_sent=sent)
    return opt_state[0]  # chain(reducer, optimizer)


def _compile_step(dp, tx, mesh, stats, model, batch_size, variables_abs):
    """``dp.step`` compiled ahead of time for the state ``dp.init`` places and a training batch."""
    params, model_state = _mode.split_variables(variables_abs)
    replicated = NamedSharding(mesh, P())
    with jax.set_mesh(mesh):
        opt_state = jax.eval_shape(tx.init, params)
    state = parallel.TrainState(
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params),
        comm.place_state(opt_state, mesh, comm.DATA),
        comm.place_state(jax.eval_shape(stats.wrap, model_state), mesh, comm.DATA),
    )
    batch = _dense.abstract_batch(model, batch_size, NamedSharding(mesh, P(comm.DATA)))
    batch = {k: np.zeros(v.shape, v.dtype) for k, v in batch.items()}
    return dp.step.lower(state, batch).compile()


def _base_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}.")


def build_data_parallel(
    config: ml_collections.ConfigDict,
    model: _staged.StagedModel,
    mesh: jax.sharding.Mesh,
    num_train_samples: int,
) -> _mode.Mode:
    """Builds the compressed data-parallel mode (``config.mode = "data_parallel"``)."""
    cfg = _config.check_sub_config("data_parallel", config.data_parallel, DP_DEFAULTS)
    if tuple(mesh.axis_names) != (comm.DATA,):
        raise ValueError(
            f"data_parallel mode needs a mesh with only a 'data' axis; got {dict(mesh.shape)}."
        )
    _base_choice(
        "config.data_parallel.eval_batch_stats", cfg["eval_batch_stats"], _batch_stats.EVAL_WITH
    )
    sync = cfg["sync_batch_stats"]
    if not isinstance(sync, bool):
        raise ValueError(f"config.data_parallel.sync_batch_stats must be a bool; got {sync!r}.")
    if sync:
        model = model.with_batch_axis(comm.DATA)
    workers = mesh.shape[comm.DATA]
    if config.batch_size % workers:
        raise ValueError(f"batch_size {config.batch_size} is not divisible by {workers} workers.")
    steps_per_epoch = max(1, num_train_samples // config.batch_size)
    schedule = _config.learning_rate(config)
    tx, name = _transform(cfg, config, schedule, steps_per_epoch, num_train_samples)

    stats = _batch_stats.BatchStats(per_worker=not sync, eval_with=cfg["eval_batch_stats"])

    def loss_fn(params, model_state, batch):
        variables = _mode.join_variables(params, stats.unwrap(model_state))
        logits, new = model.apply(variables, batch["x"], train=True)
        new_state = stats.wrap(_mode.split_variables(new)[1])
        loss = model.loss_fn(logits, batch["label"])
        return loss, (_staged.accuracy(logits, batch["label"]), new_state)

    dp = parallel.data_parallel(loss_fn, tx, mesh, has_aux=True, has_state=True, donate=False)
    batch_sharding = NamedSharding(mesh, P(comm.DATA))
    is_accordion = cfg["transform"] == "accordion"

    def init(key):
        params, model_state = _mode.split_variables(jax.jit(model.init)(key))
        return dp.init(params, stats.wrap(model_state))

    @jax.jit
    def check(new, old, loss):
        finite = jnp.isfinite(loss) & _mode.all_finite(new.params, new.model_state)
        reducer_state = _reducer_state(new.opt_state)
        wire = reducer_state.bytes_sent + sync_bytes  # BatchNorm sync: every micro-step
        out = {"finite": finite.astype(jnp.int32), "wire_bytes": wire}
        if is_accordion:
            modes = transforms.accordion_metrics(new.opt_state)["modes"]
            modes = jnp.stack([jnp.asarray(v) for v in jax.tree.leaves(modes)])
            out["low_compression_leaves"] = (modes == transforms.LOW_COMPRESSION).sum()
        if isinstance(new.opt_state, transforms.AccordionBatchState):
            out["every_k"] = new.opt_state.every_k
        return _mode.keep_if_finite(finite, new, old), out

    def train_step(state, batch, key, step):
        del key, step
        new, metrics = step_c(state, batch)
        kept, out = check(new, state, metrics["loss"])
        return kept, {"loss": metrics["loss"], "accuracy": metrics["aux"], **out}

    @jax.jit
    def eval_step(state, batch):
        variables = _mode.join_variables(state.params, stats.for_eval(state.model_state))
        logits, _ = model.apply(variables, batch["x"])
        return _mode.eval_sums(model, logits, batch)

    params_abs = jax.eval_shape(model.init, jax.random.key(0))
    dense = 4.0 * _mode.param_count([v["params"] for v in params_abs])
    # compiled here (the trainer runs this executable): its HLO gives the step's collectives
    step_c = _compile_step(dp, tx, mesh, stats, model, config.batch_size, params_abs)
    sync_bytes = 0.0
    if sync and model.has_batch_stats:
        # synchronised statistics are replicated, like the parameters
        params_a, state_a = comm.place_state(_mode.split_variables(params_abs), mesh, comm.DATA)
        batch_abs = _dense.abstract_batch(model, config.batch_size, batch_sharding)
        sync_bytes = _batch_stats.gradient_collective_bytes(
            loss_fn, mesh, comm.DATA, params_a, state_a, batch_abs
        )
    return _mode.Mode(
        name="data_parallel",
        mesh=mesh,
        init=init,
        train_step=train_step,
        eval_step=lambda s, b, compressed=False: eval_step(s, b),
        batch_sharding=batch_sharding,
        wire_bytes=math.nan,  # the transform reports each step's bytes (modes switch)
        dense_bytes=dense,
        description=f"data parallel over {workers} workers, {name}, optax.{config.optax_name}",
        extra={
            "reducer": name,
            "batch_stats": stats.describe(model.has_batch_stats),
            "batch_stats_bytes": sync_bytes,
            "collectives": _collectives.records(step_c.as_text()),
        },
    )
