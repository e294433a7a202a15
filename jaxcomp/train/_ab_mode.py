"""AB-Training mode: data-parallel groups training low-rank factors ``W = A B`` independently.

``config.mesh`` is ``[("group", G), ("member", M)]``: G independent groups of M workers.
``config.ab`` (all optional)::

  warmup_steps = 100          # full-rank data parallelism first
  sync_every = 40             # S: groups sync every S steps
  full_rank_steps = 5         # D: full-rank "rebound" steps after each sync
  sync_mode = "with-stale"    # "only-learned", "full", "only-b"
  low_rank_cutoff = 0.15      # relative singular-value cutoff of re-factorisations
  split_sigma = True
  exclude = ()                # layers kept full-rank, e.g. ("block1/conv1", "head/fc")
  max_rank = None             # static rank capacity (int, fraction, or None = full)
  lr_rebound_steps = 0        # the reference's LR rebound after each phase switch
  max_grad_norm = None        # clip the averaged trained gradients (the reference: 1.0)
  inner = "adamw"             # "adam", "adamw" (+ config.weight_decay) or "sgd" (momentum 0.9)

The learning rate is ``config.lr`` with ``config.schedule``; ``ab_training`` applies it (with
the rebound). Bytes per step are read from the compiled HLO of each step kind (dense, AB for
A- and B-groups, sync) and reported per step by the phase the step is in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import transforms
from jaxcomp.models import _staged
from jaxcomp.train import _config
from jaxcomp.train import _mode

AB_DEFAULTS = {
    "warmup_steps": 100,
    "sync_every": 40,
    "full_rank_steps": 5,
    "sync_mode": "with-stale",
    "low_rank_cutoff": 0.15,
    "split_sigma": True,
    "exclude": (),
    "max_rank": None,
    "lr_rebound_steps": 0,
    "max_grad_norm": None,
    "inner": "adamw",
}
INNERS = ("adam", "adamw", "sgd")


def _inner(name: str, weight_decay: float) -> optax.GradientTransformation:
    if name not in INNERS:
        raise ValueError(f"config.ab.inner must be one of {INNERS}; got {name!r}.")
    if name == "sgd":
        parts = [optax.trace(0.9)]
    else:
        parts = [optax.scale_by_adam()]
    if weight_decay and name != "adam":
        parts.append(optax.add_decayed_weights(weight_decay))
    return optax.chain(*parts)


def build_ab(
    config: ml_collections.ConfigDict,
    model: _staged.StagedModel,
    mesh: jax.sharding.Mesh,
    num_train_samples: int,
) -> _mode.Mode:
    """Builds the AB-Training mode (``config.mode = "ab"``)."""
    del num_train_samples
    cfg = _config.check_sub_config("ab", config.ab, AB_DEFAULTS)
    if tuple(mesh.axis_names) != (comm.GROUP, comm.MEMBER):
        raise ValueError(
            f"ab mode needs config.mesh = [('group', G), ('member', M)]; got {dict(mesh.shape)}."
        )
    if model.has_batch_stats:
        raise ValueError(f"ab mode: {model.name} keeps BatchNorm statistics; use a model without.")
    workers = mesh.size
    if config.batch_size % workers:
        raise ValueError(f"batch_size {config.batch_size} is not divisible by {workers} workers.")
    kwargs = dict(
        learning_rate=_config.learning_rate(config),
        warmup_steps=int(cfg["warmup_steps"]),
        sync_every=int(cfg["sync_every"]),
        full_rank_steps=int(cfg["full_rank_steps"]),
        inner=_inner(cfg["inner"], float(config.weight_decay)),
        sync_mode=cfg["sync_mode"],
        low_rank_cutoff=float(cfg["low_rank_cutoff"]),
        split_sigma=bool(cfg["split_sigma"]),
        exclude=tuple(cfg["exclude"]),
        max_rank=cfg["max_rank"],
        lr_rebound_steps=int(cfg["lr_rebound_steps"]),
        max_grad_norm=cfg["max_grad_norm"],
    )
    tx = transforms.ab_training(**kwargs)
    schedule = transforms.ABSchedule(
        kwargs["warmup_steps"], kwargs["sync_every"], kwargs["full_rank_steps"]
    )

    def unstack(params):
        return tuple({"params": p} for p in params)

    def loss_fn(params, batch):
        logits, _ = model.apply(unstack(params), batch["x"], train=True)
        return model.loss_fn(logits, batch["label"]), _staged.accuracy(logits, batch["label"])

    dp = transforms.ab_data_parallel(loss_fn, tx, mesh, has_aux=True, donate=False)
    batch_sharding = NamedSharding(mesh, P((comm.GROUP, comm.MEMBER)))
    params_abs = tuple(v["params"] for v in jax.eval_shape(model.init, jax.random.key(0)))
    # exclude names are checked against the parameters here, before anything runs
    jax.eval_shape(tx.init, params_abs)

    def init(key):
        # dp.init's layout, with the factorising tx.init compiled rather than run op by op
        params, _ = _mode.split_variables(jax.jit(model.init)(key))
        step0 = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
        opt_state = jax.jit(tx.init)(params)
        return transforms.TrainState(
            step0, transforms.per_group(params, mesh), transforms.per_group(opt_state, mesh)
        )

    @jax.jit
    def check(new, old, loss):
        finite = jnp.isfinite(loss) & _mode.all_finite(new.params)
        m = transforms.ab_metrics(new.opt_state, new.params)
        out = {
            "finite": finite.astype(jnp.int32),
            "phase": m["phase"],
            "compression_ratio": m["compression_ratio"],
            "mean_rank": m["rank"].astype(jnp.float32).mean(),
        }
        return _mode.keep_if_finite(finite, new, old), out

    kind_bytes: dict[str, float] = {}

    def bytes_of(kind: str) -> float:
        """HLO bytes of one step of ``kind`` (mean over group roles), compiled on first use."""
        if kind not in kind_bytes:
            reports = transforms.ab_step_bytes(params_abs, mesh, kinds=(kind,), **kwargs)[kind]
            kind_bytes[kind] = float(np.mean([r.total_bytes for r in reports.values()]))
            extra[f"hlo_bytes_{kind}"] = kind_bytes[kind]
        return kind_bytes[kind]

    def train_step(state, batch, key, step):
        del key
        new, metrics = dp.step(state, batch)
        kept, out = check(new, state, metrics["loss"])
        wire = bytes_of(schedule.step_kind(step))
        return kept, {
            "loss": metrics["loss"],
            "accuracy": metrics["aux"],
            "wire_bytes": wire,
            **out,
        }

    @jax.jit
    def eval_step(state, batch):
        params = jax.tree.map(lambda x: x[0], state.params)  # group 0 (all agree after a sync)
        logits, _ = model.apply(unstack(params), batch["x"])
        return _mode.eval_sums(model, logits, batch)

    extra: dict = {"sync_mode": cfg["sync_mode"]}
    dense = bytes_of("dense")
    cycle = range(schedule.first_sync, schedule.first_sync + schedule.sync_every)
    if schedule.first_sync + schedule.sync_every <= config.total_steps:  # a whole cycle runs
        cycle_bytes = float(np.mean([bytes_of(schedule.step_kind(t)) for t in cycle]))
        extra.update(
            cycle_bytes_per_step=cycle_bytes, cycle_traffic_reduction=1.0 - cycle_bytes / dense
        )
    return _mode.Mode(
        name="ab",
        mesh=mesh,
        init=init,
        train_step=train_step,
        eval_step=lambda s, b, compressed=False: eval_step(s, b),
        batch_sharding=batch_sharding,
        wire_bytes=dense,  # the warm-up's; each step reports its own kind's bytes
        dense_bytes=dense,
        description=(
            f"AB-Training over {dict(mesh.shape)}, {cfg['sync_mode']}, warm-up "
            f"{cfg['warmup_steps']}, S={cfg['sync_every']}, D={cfg['full_rank_steps']}, "
            f"inner {cfg['inner']}"
        ),
        extra=extra,
    )
