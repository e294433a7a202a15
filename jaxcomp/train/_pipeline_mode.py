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

A channel spec is a codec name plus its arguments, with ``feedback`` one of ``None``, ``"ef"``,
``"ef21"``, ``"aq_sgd"`` (``per_sample_buffers: True`` keys EF/EF21 buffers by sample id).
Evaluation runs with boundary compression on (each forward codec, no feedback: the paper's
compressed inference) and off.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validate
from jaxcomp import comm
from jaxcomp import pipeline
from jaxcomp.models import _staged
from jaxcomp.train import _config
from jaxcomp.train import _dense
from jaxcomp.train import _dp_mode
from jaxcomp.train import _mode

PIPELINE_DEFAULTS = {
    "num_microbatches": 8,
    "forward": "identity",
    "backward": "identity",
    "backward_mode": "independent",
    "boundaries": None,
    "warmup_epochs": 0,
    "simulate": False,
    "schedule": "gpipe",
    "checkpoint": False,
    "replica_mean": None,
}

REPLICA_TRANSFORMS = ("compressed_mean", "accordion")  #: averages for config.pipeline.replica_mean


class PipelineState(NamedTuple):
    """Training state of the pipeline mode."""

    params: Any  # pipeline.PackedParams, sharded over ``stage``
    opt_state: Any
    link_states: Any  # one pipeline.LinkState per boundary


def _links(cfg: dict, num_boundaries: int, num_samples: int) -> tuple[pipeline.Link, ...]:
    per = cfg["boundaries"]
    if per is None:
        per = [{"forward": cfg["forward"], "backward": cfg["backward"]}] * num_boundaries
    per = [dict(b) for b in per]
    if len(per) != num_boundaries:
        raise ValueError(
            f"config.pipeline.boundaries has {len(per)} entries; the model has "
            f"{num_boundaries} boundaries."
        )
    out = []
    for b in per:
        unknown = sorted(set(b) - {"forward", "backward"})
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in a config.pipeline.boundaries entry.")
        fwd = _config.build_channel(b.get("forward", "identity"), num_samples)
        shared = cfg["backward_mode"] == "shared_mask"
        bwd = None if shared else _config.build_channel(b.get("backward", "identity"), num_samples)
        out.append(pipeline.link(fwd, bwd, mode=cfg["backward_mode"]))
    return tuple(out)


def _replica_mean(cfg: dict, config, replicas: int, steps_per_epoch: int, num_samples: int):
    """``(transform or None, description)`` for ``config.pipeline.replica_mean``: the same
    keys and defaults as ``config.data_parallel``."""
    spec = cfg["replica_mean"]
    if spec is None:
        return None, "float32 pmean"
    if cfg["simulate"] or replicas < 2:
        raise ValueError(
            "config.pipeline.replica_mean averages the gradients of data replicas: it needs "
            f"the distributed pipeline on a mesh with a 'data' axis of >= 2 devices (simulate="
            f"{cfg['simulate']}, {replicas} replica(s))."
        )
    sub = _config.check_sub_config("pipeline.replica_mean", spec, _dp_mode.DP_DEFAULTS)
    # accordion_batch_size is not an average (it changes the batch per update)
    _validate.check_choice(
        "config.pipeline.replica_mean.transform", sub["transform"], REPLICA_TRANSFORMS
    )
    schedule = _config.learning_rate(config)
    return _dp_mode._reducer(sub, schedule, steps_per_epoch, num_samples)


def _loss_fn(model: _staged.StagedModel):
    def loss_fn(y, labels):
        return model.loss_fn(y, labels), {"accuracy": _staged.accuracy(y, labels)}

    return loss_fn


def build_pipeline(
    config: ml_collections.ConfigDict,
    model: _staged.StagedModel,
    mesh: jax.sharding.Mesh,
    num_train_samples: int,
) -> _mode.Mode:
    """Builds the pipeline mode (``config.mode = "pipeline"``)."""
    cfg = _config.check_sub_config("pipeline", config.pipeline, PIPELINE_DEFAULTS)
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
    replicas = mesh.shape.get(comm.DATA, 1)
    m = int(cfg["num_microbatches"])
    for name, bs in (
        ("batch_size", config.batch_size),
        ("eval_batch_size", config.eval_batch_size),
    ):
        if bs % (m * replicas):
            raise ValueError(
                f"config.{name} ({bs}) must be divisible by num_microbatches x data replicas "
                f"({m} x {replicas})."
            )
    links = _links(cfg, model.num_stages - 1, num_train_samples)
    steps_per_epoch = max(1, num_train_samples // config.batch_size)
    averaging, averaging_name = _replica_mean(
        cfg, config, replicas, steps_per_epoch, num_train_samples
    )
    pmodel = pipeline.StagedModel(model.stage_fns(train=True), _loss_fn(model))
    checkpoint = cfg["checkpoint"] if cfg["checkpoint"] not in (False, None) else None
    pconfig = pipeline.PipelineConfig(
        m, links, schedule=cfg["schedule"], checkpoint=checkpoint, replica_mean=averaging
    )
    pipe = (
        pipeline.simulate(pmodel, pconfig)
        if cfg["simulate"]
        else pipeline.gpipe(pmodel, pconfig, mesh)
    )
    opt = _config.optimizer(config)
    warmup_steps = int(cfg["warmup_epochs"]) * steps_per_epoch

    replicated = NamedSharding(mesh, P())
    stage_sharding = NamedSharding(mesh, P(comm.STAGE)) if not cfg["simulate"] else replicated
    data_axis = (comm.DATA,) if replicas > 1 and not cfg["simulate"] else ()
    batch_sharding = NamedSharding(mesh, P(data_axis) if data_axis else P())
    batch_abs = _dense.abstract_batch(model, config.batch_size, batch_sharding)

    def init(key):
        params, _ = _mode.split_variables(model.init(key))
        packed = pipeline.pack_params(params)
        return packed, opt.init(packed)

    with jax.set_mesh(mesh):
        params_abs, opt_abs = jax.eval_shape(init, jax.random.key(0))
        link_abs = jax.eval_shape(lambda: pipe.init(params_abs, batch_abs))
    shardings = PipelineState(
        jax.tree.map(lambda _: stage_sharding, params_abs),
        jax.tree.map(lambda _: stage_sharding if not cfg["simulate"] else replicated, opt_abs),
        jax.tree.map(lambda a: a.sharding if hasattr(a, "sharding") else replicated, link_abs),
    )
    # scalar optimizer leaves (counts) cannot be sharded over stage
    shardings = shardings._replace(
        opt_state=jax.tree.map(
            lambda a, s: replicated if a.ndim == 0 else s, opt_abs, shardings.opt_state
        )
    )

    def full_init(key):
        packed, opt_state = init(key)
        return PipelineState(packed, opt_state, pipe.init(packed, batch_abs))

    def train_step(state, batch, key_data, compress):
        key = jax.random.wrap_key_data(key_data)
        loss, grads, link_states, metrics = pipe.step(
            state.params, batch, state.link_states, key, compress=compress
        )
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new, finite = _mode.commit_if_finite(
            PipelineState(params, opt_state, link_states), state, loss, grads
        )
        out = {
            "loss": loss,
            "accuracy": metrics["accuracy"],
            "finite": finite.astype(jnp.int32),
            "grad_norm": optax.tree.norm(grads),
        }
        if "data_wire_bytes" in metrics:  # data replicas: the gradient average's bytes
            out["data_wire_bytes"] = metrics["data_wire_bytes"]
        return new, out

    def eval_step(state, batch, compress):
        _, _, logits = pipe.evaluate(state.params, batch, None, compress=compress)
        return _mode.eval_sums(model, logits, batch)

    with jax.set_mesh(mesh):
        init_jit = jax.jit(full_init, out_shardings=shardings)
        state_abs = jax.eval_shape(full_init, jax.random.key(0))
        state_abs = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state_abs, shardings
        )
        key_abs = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
        compiled = {}
        for compress in (True, False) if warmup_steps else (True,):
            fn = jax.jit(train_step, donate_argnums=0, static_argnums=3)
            compiled[compress] = fn.lower(state_abs, batch_abs, key_abs, compress).compile()
        eval_jit = jax.jit(eval_step, static_argnums=2)
    hlo = _mode.compiled_text_bytes(compiled[True])
    counts = pipe.bytes_per_step(params_abs, batch_abs, compress=True, train=True)

    def step_fn(state, batch, key, step):
        return compiled[step >= warmup_steps](state, batch, key)

    kind = (
        "simulated on one device"
        if cfg["simulate"]
        else f"{cfg['schedule']} over {dict(mesh.shape)}"
    )
    if replicas > 1 and not cfg["simulate"]:
        kind += f", replicas averaged by {averaging_name}"
    names = "; ".join(
        f"{lk.forward.name} / {lk.backward.name if lk.backward else 'shared mask'}"
        for lk in links[:1]
    )
    extra = {
        "boundary_bytes_per_step": float(counts["wire_bytes"]),
        "boundary_dense_bytes_per_step": float(counts["dense_bytes"]),
        "hlo_collective_bytes_per_step": hlo,
        "microbatches": m,
        "links": names,
        "schedule": cfg["schedule"],
    }
    if replicas > 1 and not cfg["simulate"]:
        # the float gradient of every stage, what a plain mean sends per replica
        layout = params_abs.layout
        extra["replica_mean"] = averaging_name
        extra["data_dense_bytes_per_step"] = float(
            sum(layout.stage_bytes(s) for s in range(model.num_stages))
        )
    return _mode.Mode(
        name="pipeline",
        mesh=mesh,
        init=init_jit,
        train_step=step_fn,
        eval_step=lambda s, b, compressed: eval_jit(s, b, bool(compressed)),
        batch_sharding=batch_sharding,
        wire_bytes=float(counts["wire_bytes"]),
        dense_bytes=float(counts["dense_bytes"]),
        description=f"{model.num_stages}-stage pipeline, M={m}, {kind}; links: {names}",
        has_compressed_eval=True,
        extra=extra,
    )
