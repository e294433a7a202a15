"""Compressed data parallelism: per-worker gradients averaged by ``compressed_mean`` or Accordion.

``config.data_parallel`` (all optional)::

  transform = "accordion"        # or "compressed_mean", or "accordion_batch_size"
  low = {"name": "power_sgd", "rank": 2}     # accordion: critical regimes
  high = {"name": "power_sgd", "rank": 1}    # accordion: otherwise
  codec = {"name": "top_k", "fraction": 0.01, "feedback": "ef"}  # compressed_mean
  interval_epochs = 1            # accordion: the norm-accumulation interval (the paper's epoch)
  interval_steps = None          # ... or in steps (one of the two)
  check_every = 10               # accordion: T, in intervals
  eta = 0.5                      # accordion: the critical-regime threshold
  error_feedback = True          # accordion
  min_compression_rate = 2.0     # leaves compressing less than this go dense
  small_steps = 1                # accordion_batch_size: micro-batches per update, critical
  large_steps = 8                # accordion_batch_size: micro-batches per update, otherwise
  lr_scaling = "linear"          # accordion_batch_size: "linear", "sqrt" or "none"
  sync_batch_stats = False       # BatchNorm: per-worker statistics (False) or SyncBatchNorm
  eval_batch_stats = "worker0"   # BatchNorm, per worker: evaluate with "worker0"'s or "mean"

``config.mesh`` is ``[("data", W)]``, or two data axes of a hierarchical cluster, read as
``(slow, fast)`` in that order (:func:`jaxcomp.comm.make_mesh` puts the first across hosts),
e.g. ``[("slow", hosts), ("fast", devices_per_host)]``: the transform averages densely over
``fast`` (inside a host: NVLink, ICI) and compressed over ``slow`` (between hosts), each
parameter by one device of a host (``shard_fast``: the slow links carry its payload once per
host), per-worker state belongs to a host (the reductions' own state to that device), and
the step's ``wire_bytes`` are the slow axis's (a host's), ``fast_wire_bytes`` the fast one's.
On a pair: ``accordion`` and ``compressed_mean`` (not ``accordion_batch_size``), models
without BatchNorm.

``accordion_batch_size`` is Accordion's batch-size variant: the same detector chooses how many
``batch_size`` micro-batches make one update (``small_steps`` in critical regimes,
``large_steps`` otherwise), the mean over them goes through ``compressed_mean(codec)`` and the
optimizer once per update (:func:`jaxcomp.transforms.accordion_batch_size`). A training step is
one micro-batch: ``total_steps`` counts micro-batches (equal epochs for every batch size), a
step that completes no update sends nothing, and the detector's interval is
``interval_epochs`` epochs of micro-batches. The metric ``every_k`` is the current choice.

Parameters are replicated; each worker differentiates its shard of the batch with no hidden
all-reduce (:func:`jaxcomp.comm.local_value_and_grad`) and the transform's payloads are the
only gradient traffic. Accordion's metrics: ``low_compression_leaves`` (how many parameters
are in the low-compression mode) and ``layer_mode/<name>`` per parameter it compresses (0 low,
1 high; a record holds the mean over its steps; ``<name>`` is :func:`_mode.parameter_name`:
``layer_mode/fc2/Dense_0/kernel``). The step is compiled when the mode is built;
its HLO gives the summary's ``collectives`` (per kind and group size, those inside Accordion's
mode branches marked: :mod:`jaxcomp.train._collectives`), and the transform reports each step's
bytes.

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

from jaxcomp import _fetch
from jaxcomp import comm
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp._compile import compile_all
from jaxcomp._compile import lower_later
from jaxcomp.models import _staged
from jaxcomp.train import _batch_stats
from jaxcomp.train import _collectives
from jaxcomp.train import _config
from jaxcomp.train import _dense
from jaxcomp.train import _mode
from jaxcomp.train import _precision

DP_DEFAULTS = {
    "transform": "accordion",
    "low": {"name": "power_sgd", "rank": 2},
    "high": {"name": "power_sgd", "rank": 1},
    "codec": {"name": "top_k", "fraction": 0.01, "feedback": "ef"},
    "interval_epochs": None,  # 1 unless interval_steps is given
    "interval_steps": None,
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


def _reducer(
    cfg: dict, schedule, steps_per_epoch: int, num_samples: int, axis=comm.DATA, shard_fast=False
):
    """``(transform, description)`` for ``config.data_parallel``, averaging over ``axis`` (the
    data axis or a ``(slow, fast)`` pair; ``shard_fast``: each parameter reduced over slow by
    one device of a host, see :func:`jaxcomp.transforms.compressed_mean`)."""
    _base_choice("config.data_parallel.transform", cfg["transform"], TRANSFORMS)
    if cfg["transform"] == "accordion":
        low, high = _config.build_codec(cfg["low"]), _config.build_codec(cfg["high"])
        tx = transforms.accordion(
            low,
            high,
            interval_steps=_config.interval_steps("config.data_parallel", cfg, steps_per_epoch),
            check_every=int(cfg["check_every"]),
            eta=float(cfg["eta"]),
            learning_rate=schedule,
            axis_name=axis,
            error_feedback=bool(cfg["error_feedback"]),
            min_compression_rate=float(cfg["min_compression_rate"]),
            shard_fast=shard_fast,
        )
        return tx, f"accordion({low.name} / {high.name}, eta={cfg['eta']})"
    channel = _config.build_channel(cfg["codec"], num_samples)
    tx = transforms.compressed_mean(
        channel,
        axis,
        min_compression_rate=float(cfg["min_compression_rate"]),
        shard_fast=shard_fast,
    )
    return tx, f"compressed_mean({channel.name})"


def _transform(cfg: dict, config, schedule, steps_per_epoch: int, num_samples: int, axis):
    """``(transform, description)``: the reducer chained with the optimizer, or, for
    ``accordion_batch_size``, the accumulation around ``chain(compressed_mean, optimizer)``."""
    opt = _config.optimizer(config, schedule)
    if cfg["transform"] != "accordion_batch_size":
        # on a pair the per-device state is placed over both axes (_abstract_state)
        shard = not isinstance(axis, str)
        reducer, name = _reducer(cfg, schedule, steps_per_epoch, num_samples, axis, shard)
        return optax.chain(reducer, opt), name
    if not isinstance(axis, str):
        raise ValueError(
            "config.data_parallel.transform 'accordion_batch_size' takes one data axis; got the "
            f"(slow, fast) pair {axis!r} (use 'accordion' or 'compressed_mean' on a pair)."
        )
    channel = _config.build_channel(cfg["codec"], num_samples)
    mean = transforms.compressed_mean(
        channel, comm.DATA, min_compression_rate=float(cfg["min_compression_rate"])
    )
    small, large = int(cfg["small_steps"]), int(cfg["large_steps"])
    tx = transforms.accordion_batch_size(
        optax.chain(mean, opt),
        interval_steps=_config.interval_steps("config.data_parallel", cfg, steps_per_epoch),
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


def _layer_modes(opt_state) -> dict[str, jax.Array]:
    """Accordion's mode of each parameter it compresses (in either mode), by the metric's name
    ``layer_mode/<name>`` (0 low compression, 1 high)."""
    is_state = lambda x: isinstance(x, transforms.AccordionState)  # noqa: E731
    (state,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
    is_leaf = lambda x: isinstance(x, transforms.AccordionLeaf)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(state.leaves, is_leaf=is_leaf)[0]
    return {
        "layer_mode/"
        + _mode.parameter_name(jax.tree_util.keystr(path, simple=True, separator="/")): leaf.mode
        for path, leaf in flat
        if is_leaf(leaf)
    }


def _abstract_state(tx, mesh, stats, variables_abs, axes, has_state):
    """The abstract (shapes and shardings) state ``dp.init`` places (``axes``: the data axis
    or the ``(slow, fast)`` pair; per-worker state over the first, per-device over both)."""
    params, model_state = _mode.split_variables(variables_abs)
    replicated = NamedSharding(mesh, P())
    with jax.set_mesh(mesh):
        opt_state = jax.eval_shape(tx.init, params)
    model_state = jax.eval_shape(stats.wrap, model_state) if has_state else ()
    return parallel.TrainState(
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params),
        comm.place_state(opt_state, mesh, axes if len(axes) == 2 else axes[0]),
        comm.place_state(model_state, mesh, axes[0]),
    )


def _over(axes, mesh) -> str:
    if len(axes) == 1:
        return ""
    slow, fast = axes
    return f" ({mesh.shape[slow]} {slow} x {mesh.shape[fast]} {fast}: dense over {fast})"


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
    scaled = _precision.scaled(config)
    cfg = _config.check_sub_config("data_parallel", config.data_parallel, DP_DEFAULTS)
    axes = _config.data_axes(mesh, "data_parallel")
    if not axes:
        raise ValueError(
            "data_parallel mode needs a 'data' mesh axis or two (slow, fast) data axes; got "
            f"mesh {dict(mesh.shape)}."
        )
    axis = axes[0] if len(axes) == 1 else axes  # what the transforms average over
    # a model state per worker is per device, the optimizer's per slow worker on a pair:
    # parallel.data_parallel(has_state=True) takes one axis, so a pair runs stateless models
    has_state = len(axes) == 1
    if not has_state and model.has_batch_stats:
        raise ValueError(
            f"data_parallel mode over the (slow, fast) pair {axes} does not support BatchNorm "
            f"statistics yet ({model.name} has them): use a 'data' mesh axis, or a model "
            "without BatchNorm (e.g. config.model.norm = 'group')."
        )
    _base_choice(
        "config.data_parallel.eval_batch_stats", cfg["eval_batch_stats"], _batch_stats.EVAL_WITH
    )
    sync = cfg["sync_batch_stats"]
    if not isinstance(sync, bool):
        raise ValueError(f"config.data_parallel.sync_batch_stats must be a bool; got {sync!r}.")
    if sync and has_state:
        model = model.with_batch_axis(comm.DATA)
    workers = math.prod(mesh.shape[a] for a in axes)
    _config.check_batch_divisible(config, workers, f"{workers} workers")
    steps_per_epoch = max(1, num_train_samples // config.batch_size)
    schedule = _config.learning_rate(config)
    tx, name = _transform(cfg, config, schedule, steps_per_epoch, num_train_samples, axis)

    stats = _batch_stats.BatchStats(per_worker=not sync, eval_with=cfg["eval_batch_stats"])

    def loss_fn(params, model_state, batch):
        if scaled:  # float16: the backward pass on the scaled loss, the gradients unscaled
            scale = batch["loss_scale"][0]
            params = _precision.gradient_unscaled(params, scale)
        variables = _mode.join_variables(params, stats.unwrap(model_state))
        logits, new = model.apply(variables, batch["x"], train=True)
        new_state = stats.wrap(_mode.split_variables(new)[1])
        loss = model.loss_fn(logits, batch["label"])
        if scaled:
            loss = _precision.gradient_scaled(loss, scale)
        return loss, (_staged.accuracy(logits, batch["label"]), new_state)

    no_state = None  # a stateless model's (empty) per-stage collections, on a pair

    def stateless_loss_fn(params, batch):
        loss, (aux, _) = loss_fn(params, no_state, batch)
        return loss, aux

    # check_finite: each worker flags its loss and new state inside the step (fused with the
    # update; no collective), the host-side check below only combines the flags
    dp = parallel.data_parallel(
        loss_fn if has_state else stateless_loss_fn, tx, mesh, axis_name=axis, has_aux=True,
        has_state=has_state, donate=False, check_finite=True,
    )  # fmt: skip
    batch_sharding = NamedSharding(mesh, P(axis))
    is_accordion = cfg["transform"] == "accordion"

    model_init = _mode.jit_init(model.init)

    def init(key):
        params, model_state = _mode.split_variables(model_init(key))
        state = dp.init(params, *((stats.wrap(model_state),) if has_state else ()))
        return _precision.ScaledState(state, _precision.placed_initial(mesh)) if scaled else state

    @jax.jit
    def check(new, old, loss, worker_finite):
        # the workers' flags cover the parameters, optimizer and model state (as every mode's
        # commit_if_finite); the mean loss too, should the finite losses' mean overflow. A
        # global-view program: the flags are combined across devices, so the skip and the loss
        # scale's decision are the same on every worker
        finite = jnp.isfinite(loss) & jnp.all(worker_finite == 1)
        if scaled:
            (new, loss_scale), old = new, old.inner
        reducer_state = _reducer_state(new.opt_state)
        wire = reducer_state.bytes_sent + sync_bytes  # BatchNorm sync: every micro-step
        out = {"finite": finite.astype(jnp.int32), "wire_bytes": wire}
        if not has_state:  # a pair: wire_bytes over the slow axis, the dense mean's over fast
            out["fast_wire_bytes"] = reducer_state.fast_bytes_sent
        if is_accordion:
            modes = transforms.accordion_metrics(new.opt_state)["modes"]
            modes = jnp.stack([jnp.asarray(v) for v in jax.tree.leaves(modes)])
            out["low_compression_leaves"] = (modes == transforms.LOW_COMPRESSION).sum()
            leaf_modes = list(_layer_modes(new.opt_state).values())
            if leaf_modes:  # none where every leaf goes dense
                out["layer_modes"] = jnp.stack(leaf_modes)
        if isinstance(new.opt_state, transforms.AccordionBatchState):
            out["every_k"] = new.opt_state.every_k
        kept = _mode.keep_if_finite(finite, new, old)
        if scaled:
            kept = _precision.ScaledState(kept, _precision.adjust(loss_scale, finite))
        return kept, out

    def train_step(state, batch, key, step):
        del key, step
        if not scaled:
            new, metrics = step_c(state, batch)
        else:  # the scale rides in the batch, one entry per example (read on the host)
            scale = np.full(config.batch_size, _fetch.fetch(state.loss_scale.scale), np.float32)
            batch = {**batch, "loss_scale": jax.device_put(scale, batch_sharding)}
            new, metrics = step_c(state.inner, batch)
            new = _precision.ScaledState(new, state.loss_scale)
        kept, out = check(new, state, metrics["loss"], metrics["finite"])
        if "layer_modes" in out:  # one transfer for every leaf's mode
            out.update(zip(mode_names, _fetch.fetch(out.pop("layer_modes")).tolist()))
        return kept, {"loss": metrics["loss"], "accuracy": metrics["aux"], **out}

    @jax.jit
    def eval_step(state, batch):
        if scaled:
            state = state.inner
        model_state = state.model_state if has_state else no_state
        variables = _mode.join_variables(state.params, stats.for_eval(model_state))
        logits, _ = model.apply(variables, batch["x"])
        return _mode.eval_sums(model, logits, batch)

    key_abs = jax.eval_shape(jax.random.key, 0)  # as the trainer's key, never placed
    params_abs = jax.eval_shape(model.init, key_abs)
    if not has_state:  # a pair (no BatchNorm): the per-stage collections are empty dicts
        no_state = stats.wrap(_mode.split_variables(params_abs)[1])
    dense = 4.0 * _mode.param_count([v["params"] for v in params_abs])
    batch_abs = _dense.abstract_batch(model, config.batch_size, batch_sharding)
    sync_bytes = 0.0
    if sync and model.has_batch_stats:
        # synchronised statistics are replicated, like the parameters
        params_a, state_a = comm.place_state(_mode.split_variables(params_abs), mesh, comm.DATA)
        sync_bytes = _batch_stats.gradient_collective_bytes(
            loss_fn, mesh, comm.DATA, params_a, state_a, batch_abs
        )
    state_abs = _abstract_state(tx, mesh, stats, params_abs, axes, has_state)
    mode_names = tuple(_layer_modes(state_abs.opt_state)) if is_accordion else ()
    train_batch = {k: np.zeros(v.shape, v.dtype) for k, v in batch_abs.items()}
    mode_abs = state_abs
    if scaled:
        train_batch["loss_scale"] = np.zeros(config.batch_size, np.float32)
        mode_abs = _precision.ScaledState(state_abs, _precision.abstract_on(mesh))
    eval_abs = _dense.abstract_batch(model, config.eval_batch_size, batch_sharding, True)
    replicated = NamedSharding(mesh, P())
    workers_sharding = NamedSharding(mesh, P(axes if len(axes) == 2 else axes[0]))
    # the step (its HLO gives the step's collectives), the model's and the transform's inits
    # (the latter in the mesh, as dp.init runs it), the finite check and the evaluation,
    # compiled side by side, each as soon as it is lowered; the trainer's calls of the latter
    # four are served by JAX's caches (lowered as they are called)
    compiled = compile_all({
        "train_step": lower_later(dp.step, state_abs, train_batch),
        "init": lower_later(model_init, key_abs),
        "opt_init": lower_later(jax.jit(tx.init), state_abs.params, mesh=mesh),
        "check": lower_later(
            check, mode_abs, mode_abs,
            jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
            jax.ShapeDtypeStruct((workers,), jnp.int32, sharding=workers_sharding),
        ),
        "eval_step": lower_later(eval_step, mode_abs, eval_abs),
    })  # fmt: skip
    step_c = compiled["train_step"]
    return _mode.Mode(
        name="data_parallel",
        mesh=mesh,
        init=init,
        train_step=train_step,
        eval_step=lambda s, b, compressed=False: eval_step(s, b),
        batch_sharding=batch_sharding,
        wire_bytes=math.nan,  # the transform reports each step's bytes (modes switch)
        dense_bytes=dense,
        description=f"data parallel over {workers} workers{_over(axes, mesh)}, {name}, "
        f"optax.{config.optax_name}",
        extra={
            "reducer": name,
            "batch_stats": stats.describe(model.has_batch_stats),
            "batch_stats_bytes": sync_bytes,
            "collectives": _collectives.records(step_c.as_text()),
            # each parameter's slow collectives run on one device of a host (the study's model)
            "shard_fast": not has_state,
        },
    )
