"""AB-Training mode: data-parallel groups training low-rank factors ``W = A B`` independently.

``config.mesh`` is ``[("group", G), ("member", M)]`` (G equal groups of M workers) or a single
axis such as ``[("data", N)]`` with ``ab.group_size`` or ``ab.num_groups`` (groups of unequal
size allowed, as the reference spreads the remainder workers). ``config.ab`` (all optional)::

  warmup_steps = 100          # full-rank data parallelism first
  sync_every = 40             # S: groups sync every S steps
  full_rank_steps = 5         # D: full-rank "rebound" steps after each sync
  sync_mode = "with-stale"    # "only-learned", "full", "only-b"
  comm_setup = "groups"       # or "individual": factors train locally between syncs
  group_size = None           # or num_groups = None; default: the mesh's group axis
  low_rank_cutoff = 0.15      # relative singular-value cutoff of re-factorisations
  split_sigma = True
  exclude = ()                # layers kept full-rank, e.g. ("block1/conv1", "head/fc")
  max_rank = None             # static rank capacity: an int ...
  max_rank_fraction = None    # ... or a fraction of full rank
  lr_rebound_steps = 0        # the reference's LR rebound after each phase switch
  reset_lr_on_sync = True     # the reference's switch for the rebound
  reset_opt = False           # zero the optimizer moments at each switch
  dense_sync = None           # "average", "first", "keep"; None: the reference's rule
  align_moments = True        # moments follow the singular vectors at re-factorisations
  max_grad_norm = None        # clip the averaged trained gradients (the reference: 1.0)
  inner = "adamw"             # "adam", "adamw" (+ config.weight_decay) or "sgd" (momentum 0.9)
  sync_batch_stats = False    # BatchNorm: per-worker statistics (False) or synced over the group
  eval_batch_stats = "worker0"  # BatchNorm: evaluate with worker 0's statistics or the "mean"

The learning rate is ``config.lr`` with ``config.schedule``; ``ab_training`` applies it (with
the rebound). Every program (the dense and AB steps, the transitions, the finiteness check) is
compiled here, before the first step; bytes per step are read from their HLO and reported per
step by the step's kind. A step whose loss or new state is not finite is skipped (the state
is kept, as ``_mode.commit_if_finite`` does in the other modes); the AB schedule then runs a
step behind the trainer's count, as optax's ``count`` does in the dense mode.

**BatchNorm** (a model with running statistics, e.g. ``--set model.norm=batch`` on
``configs/vgg16_cifar10_ab.py``): the statistics are model state, each worker's own
(:func:`jaxcomp.parallel.ab_data_parallel` ``has_state``), updated only by its own batches.
``sync_batch_stats=True`` normalises with the statistics of the group's batch (SyncBatchNorm
over the group's workers: mean of the means, variance around that mean; the model's
``with_batch_axis`` on the member axis of a ``(group, member)`` mesh, or on the data axis
with one group; unequal flat groups are refused), so a group's workers agree, as its
parameters do. At an AB sync the statistics follow the non-factorised parameters (BatchNorm's
scale and shift): averaged over all workers by default, worker 0's with ``dense_sync="first"``
(the default in ``individual`` and ``only-b``), kept with ``"keep"``
(:func:`jaxcomp.ab._sync.sync_model_state` gives the reasoning). Evaluation uses
worker 0's parameters with worker 0's statistics (``eval_batch_stats="mean"``: the mean of
the workers' running means and variances, :class:`jaxcomp.train._batch_stats.BatchStats`).
Their all-reduces (synchronised) are in the programs' HLO, so in ``wire_bytes``.

A step's metrics: ``phase`` (:class:`~jaxcomp.transforms.ABPhase` of the next step),
``compression_ratio``, ``mean_rank`` and ``rank/<name>`` per factorised parameter
(``rank/fc2/Dense_0/kernel``; a record holds the means over its steps), ``wire_bytes`` (from
the HLO: the step kind's programs, and the factorisation before the first AB step).

The summary's ``collectives`` lists the run's mean step per collective kind and group size:
each step kind's programs weighted by how many steps the schedule gives it
(:mod:`jaxcomp.train._collectives`).
"""

from __future__ import annotations

import collections

import jax
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _fetch
from jaxcomp import compressors
from jaxcomp import models
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp._compile import lower_later
from jaxcomp.ab._config import num_a_groups
from jaxcomp.ab._layout import build_layout
from jaxcomp.ab._metrics import collectives_by_role
from jaxcomp.ab._parallel import kind_bytes as parallel_kind_bytes
from jaxcomp.ab._programs import PROGRAMS
from jaxcomp.ab._programs import schedule_programs
from jaxcomp.models import _staged
from jaxcomp.train import _batch_stats
from jaxcomp.train import _collectives
from jaxcomp.train import _config
from jaxcomp.train import _dense
from jaxcomp.train import _mode
from jaxcomp.train import _precision

AB_DEFAULTS = {
    "warmup_steps": 100,
    "sync_every": 40,
    "full_rank_steps": 5,
    "sync_mode": "with-stale",
    "comm_setup": "groups",
    "group_size": None,
    "num_groups": None,
    "low_rank_cutoff": 0.15,
    "split_sigma": True,
    "exclude": (),
    "max_rank": None,
    "max_rank_fraction": None,
    "lr_rebound_steps": 0,
    "reset_lr_on_sync": True,
    "reset_opt": False,
    "dense_sync": None,
    "align_moments": True,
    "max_grad_norm": None,
    "inner": "adamw",
    "sync_batch_stats": False,
    "eval_batch_stats": "worker0",
}
_USED_WORKER_METRICS = ("finite", "phase", "compression_ratio", "mean_rank", "rank")
_HARNESS_KEYS = ("inner", "sync_batch_stats", "eval_batch_stats")  # not ABConfig fields
INNERS = ("adam", "adamw", "sgd")


def _inner(name: str, weight_decay: float) -> optax.GradientTransformation:
    if name not in INNERS:
        raise ValueError(f"config.ab.inner must be one of {INNERS}; got {name!r}.")
    parts = [optax.trace(0.9)] if name == "sgd" else [optax.scale_by_adam()]
    if weight_decay and name != "adam":
        parts.append(optax.add_decayed_weights(weight_decay))
    return optax.chain(*parts)


def ab_config(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> transforms.ABConfig:
    """The :class:`~jaxcomp.transforms.ABConfig` of ``config.ab`` on ``mesh``.

    Raises:
      ValueError: naming the ``config.ab`` key whose value is invalid.
    """
    cfg = _config.check_sub_config("ab", config.ab, AB_DEFAULTS)
    options = {k: v for k, v in cfg.items() if k not in _HARNESS_KEYS}
    options["exclude"] = tuple(cfg["exclude"])
    try:
        return transforms.ABConfig(
            _config.learning_rate(config),
            inner=_inner(cfg["inner"], float(config.weight_decay)),
            axis_name=tuple(mesh.axis_names),
            **options,
        )
    except ValueError as e:
        raise ValueError(f"config.ab: {e}") from e


def _batch_stats_of(ab, model, cfg, mesh, sizes):
    """``(model, BatchStats)``: the model synchronising its BatchNorm statistics over each
    group's workers with ``ab.sync_batch_stats`` (``ValueError`` where groups are not mesh
    rows), the statistics per worker otherwise."""
    sync, eval_with = ab.get("sync_batch_stats", False), ab.get("eval_batch_stats", "worker0")
    if not isinstance(sync, bool):
        raise ValueError(f"config.ab.sync_batch_stats must be a bool; got {sync!r}.")
    if eval_with not in _batch_stats.EVAL_WITH:
        raise ValueError(f"config.ab.eval_batch_stats must be one of {_batch_stats.EVAL_WITH}; "
                         f"got {eval_with!r}.")  # fmt: skip
    # the harness stacks every worker's statistics: evaluation picks from them per worker
    stats = _batch_stats.BatchStats(per_worker=True, eval_with=eval_with)
    if not (sync and model.has_batch_stats):
        return model, stats
    axes = cfg.axis_name
    if len(sizes) == 1:  # one group: all the workers
        axis = axes[0] if len(axes) == 1 else axes
    elif len(axes) == 2 and sizes == (mesh.shape[axes[1]],) * mesh.shape[axes[0]]:
        axis = axes[1]  # groups are the rows of a (group, member) mesh
    else:
        raise ValueError(
            f"config.ab.sync_batch_stats: the groups {list(sizes)} are not the rows of a "
            "(group, member) mesh; synchronised statistics need config.mesh = [('group', G), "
            "('member', M)] (or one group)."
        )
    return model.with_batch_axis(axis), stats


def _describe(stats, model) -> str:
    if not model.has_batch_stats:
        return "none"
    synced = any(getattr(m, "batch_axis", None) for _, m in model.segments)
    if synced:
        return "synchronised over each group (SyncBatchNorm)"
    return f"per worker (evaluation: {stats.eval_with})"


def _step_collectives(cfg, sizes, by: dict[str, dict], total_steps: int) -> list[dict]:
    """The collectives of the run's mean step (:mod:`jaxcomp.train._collectives`): each step
    kind's programs weighted by how many of ``total_steps`` the schedule gives it, an AB step's
    role parts by the share of workers in each role (as ``kind_bytes`` averages them), and
    the factorisation before the first AB step once; ``by``: each program's
    ``collectives_by_role`` reports."""
    num_a = num_a_groups(cfg.sync_mode, len(sizes))
    share_a = sum(sizes[:num_a]) / sum(sizes)
    kinds = collections.Counter(cfg.schedule.step_kind(t) for t in range(total_steps))
    parts = []
    for kind, count in kinds.items():
        w = count / max(total_steps, 1)
        if kind.startswith("dense"):
            parts.append(_collectives.from_report(by["dense"]["shared"], w))
        else:
            if num_a:
                parts.append(_collectives.from_report(by["ab"]["a"], w * share_a))
            parts.append(_collectives.from_report(by["ab"]["b"], w * (1.0 - share_a)))
        if kind == "dense_then_refactor":
            parts.append(_collectives.from_report(by["refactor"]["shared"], w))
        elif kind == "ab_then_sync":  # the sync runs inside the AB program
            parts.append(_collectives.from_report(by["ab"]["sync"], w))
    if cfg.schedule.warmup_steps < total_steps:  # the factorisation before the first AB step
        parts.append(_collectives.from_report(by["refactor"]["shared"], 1 / max(total_steps, 1)))
    return _collectives.merge(*parts)


def rank_metric_names(params, exclude) -> tuple[str, ...]:
    """``rank/<name>`` per factorised parameter, in the layout's order (names:
    :func:`jaxcomp.train._mode.parameter_name`)."""
    specs = build_layout(params, exclude).specs
    return tuple(f"rank/{_mode.parameter_name(spec.path)}" for spec in specs)


def build_ab(
    config: ml_collections.ConfigDict,
    model: _staged.StagedModel,
    mesh: jax.sharding.Mesh,
    num_train_samples: int,
) -> _mode.Mode:
    """Builds the AB-Training mode (``config.mode = "ab"``) and compiles its programs."""
    del num_train_samples
    scaled = _precision.scaled(config)
    cfg = ab_config(config, mesh)
    _config.check_batch_divisible(config, mesh.size, f"{mesh.size} workers")
    sizes = cfg.group_sizes([mesh.shape[a] for a in cfg.axis_name])
    model, stats = _batch_stats_of(config.ab, model, cfg, mesh, sizes)

    def loss_fn(params, model_state, batch):
        logits, new = model.apply(_mode.join_variables(params, model_state), batch["x"], train=True)
        loss = model.loss_fn(logits, batch["label"])
        return loss, (_staged.accuracy(logits, batch["label"]), _mode.split_variables(new)[1])

    dp = parallel.ab_data_parallel(loss_fn, cfg, mesh, has_aux=True, has_state=True, donate=False,
                                   factored_forward=models.factored_dense,
                                   loss_scaling=scaled)  # fmt: skip
    batch_sharding = NamedSharding(mesh, P(cfg.axis_name))
    key_abs = jax.eval_shape(jax.random.key, 0)  # as the trainer's key, never placed
    params_abs, model_state_abs = _mode.split_variables(jax.eval_shape(model.init, key_abs))
    state_abs = dp.abstract_state(params_abs, model_state_abs)
    rank_names = rank_metric_names(params_abs, cfg.exclude)
    batch_abs = _dense.abstract_batch(model, config.batch_size, batch_sharding)
    eval_abs = _dense.abstract_batch(model, config.eval_batch_size, batch_sharding, True)

    @jax.jit
    def eval_step(state, batch):
        params = jax.tree.map(lambda x: x[0], state.params)  # worker 0 (all agree after a sync)
        # worker 0's running statistics, or their mean (every leaf is [workers, ...])
        per_worker = tuple(compressors.PerWorker(s) if s else s for s in state.model_state)
        logits, _ = model.apply(_mode.join_variables(params, stats.for_eval(per_worker)),
                                batch["x"])  # fmt: skip
        return _mode.eval_sums(model, logits, batch)

    model_init = _mode.jit_init(model.init)

    def init(key):
        state = dp.init(*_mode.split_variables(model_init(key)))
        return _precision.ScaledState(state, _precision.placed_initial(mesh)) if scaled else state

    adjust = jax.jit(_precision.adjust)  # float16: the scale after a step, kept on the mesh

    # every step program, the model's init and the evaluation step, compiled side by side
    # (the latter two as their calls below compile them: JAX's caches serve those calls);
    # the step programs' HLO is parsed once, for the bytes and the collectives
    also = {
        "init": lower_later(model_init, key_abs),
        "eval": lower_later(eval_step, state_abs, eval_abs),
    }
    if scaled:
        also["adjust"] = lower_later(adjust, _precision.abstract_on(mesh), np.bool_(True))
    compiled = dp.compile(state_abs, batch_abs, also)
    texts = {k: compiled[k].as_text() for k in PROGRAMS}
    by_role = {k: collectives_by_role(text) for k, text in texts.items()}
    kind_bytes = parallel_kind_bytes(cfg, sizes, by_role)

    def bytes_of(kind: str) -> float:
        return kind_bytes[kind]["all" if kind.startswith("dense") else "mean"]

    factorise = by_role["refactor"]["shared"].total_bytes  # before the first AB step

    def step_bytes(t: int) -> float:
        """What step ``t`` sends: its kind's programs, and the factorisation where it runs."""
        first = "factorise" in schedule_programs(cfg, t)
        return bytes_of(cfg.schedule.step_kind(t)) + (factorise if first else 0.0)

    def train_step(state, batch, key, step):
        # The state's own step picks the kind: a skipped (non-finite) step changes nothing,
        # so after one the schedule runs that many steps behind the trainer's (as optax's
        # count does in the dense mode). A state *ahead* of the trainer cannot happen.
        del key
        if scaled:  # the mode's state and float16's loss scale
            state, loss_scale = state
        t = int(state.step)
        if t > step:
            raise ValueError(
                f"ab mode: the optimizer state counts {t} steps but the trainer is at step "
                f"{step}; the checkpoint's state and step disagree."
            )
        new, metrics = dp.step(state, batch, *((loss_scale.scale,) if scaled else ()))
        # only the per-worker metrics used here (not lr and count): one transfer each (of
        # every worker's entry: several processes hold a part each, and all must agree)
        workers = _fetch.fetch({k: metrics[k] for k in _USED_WORKER_METRICS})
        # the harness checks the loss and what each program wrote; the same rule as
        # _mode.commit_if_finite, without a second pass over the whole state
        finite = int(workers["finite"].min())
        out = {
            "loss": metrics["loss"],
            "accuracy": metrics["aux"],
            "finite": finite,
            "phase": int(workers["phase"].max()),
            "compression_ratio": float(workers["compression_ratio"].min()),
            "mean_rank": float(workers["mean_rank"].max()),
            "wire_bytes": step_bytes(t),
        }
        # each factorised parameter's rank (the groups agree after a sync; the largest before)
        out.update(zip(rank_names, workers["rank"].max(axis=0).tolist()))
        # a non-finite loss or new state keeps the previous one (not donated); the scale's
        # decision is the host's, from every worker's flag: the same on every device
        kept = new if finite else state
        if scaled:
            kept = _precision.ScaledState(kept, adjust(loss_scale, np.bool_(finite)))
        return kept, out

    dense = bytes_of("dense")
    extra: dict = {"sync_mode": cfg.sync_mode, "comm_setup": cfg.comm_setup,
                   "groups": list(sizes)}  # fmt: skip
    extra.update({f"hlo_bytes_{k}": bytes_of(k) for k in kind_bytes})
    schedule = cfg.schedule
    cycle = range(schedule.first_sync, schedule.first_sync + schedule.sync_every)
    cycle_bytes = float(np.mean([bytes_of(schedule.step_kind(t)) for t in cycle]))
    extra.update(
        cycle_bytes_per_step=cycle_bytes, cycle_traffic_reduction=1.0 - cycle_bytes / dense
    )
    extra["collectives"] = _step_collectives(cfg, sizes, by_role, int(config.total_steps))
    return _mode.Mode(
        name="ab",
        mesh=mesh,
        init=init,
        train_step=train_step,
        eval_step=lambda s, b, compressed=False: eval_step(s.inner if scaled else s, b),
        batch_sharding=batch_sharding,
        wire_bytes=dense,  # the warm-up's; each step reports its own kind's bytes
        dense_bytes=dense,
        description=(
            f"AB-Training over {dict(mesh.shape)}, groups {list(sizes)}, {cfg.sync_mode}, "
            f"{cfg.comm_setup}, warm-up {cfg.warmup_steps}, S={cfg.sync_every}, "
            f"D={cfg.full_rank_steps}, inner {config.ab.get('inner', 'adamw')}, "
            f"BatchNorm statistics: {_describe(stats, model)}"
        ),
        extra=extra,
    )
