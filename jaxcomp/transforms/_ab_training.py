r"""AB-Training (Coquelin et al., 2024) as an optax transform over grouped data-parallel workers.

``update`` runs inside ``shard_map`` over a mesh with the :data:`~jaxcomp.comm.GROUP` and
:data:`~jaxcomp.comm.MEMBER` axes (:func:`~jaxcomp.transforms.ab_mesh`), on per-worker dense
gradients (:func:`jaxcomp.comm.local_value_and_grad`). Every step is one of four kinds
(:data:`~jaxcomp.transforms._ab_schedule.STEP_KINDS`), chosen from the step count with
``lax.switch``, so only the chosen kind's collectives run:

* ``dense`` (warm-up and full-rank rebound): all gradients are averaged over all workers and the
  dense weights take an inner-optimizer step;
* ``dense_then_refactor``: the same, then every factorisable weight is re-split by SVD into
  ``A·B`` truncated at the relative singular-value cutoff (rank agreed with a ``pmax``), and the
  factor moments beyond the new rank are zeroed (the reference's pad/truncate);
* ``ab``: the worker's group trains one factor; only that factor's gradient
  (``G·Bᵀ`` or ``Aᵀ·G``) and the dense parameters' gradients are averaged, within the group; the
  first AB step after warm-up first factorises exactly (no truncation);
* ``ab_then_sync``: the same, then the groups are synced (:mod:`._ab_sync`).

The model always sees dense weights: ``update`` returns ``W_new - W_old`` with ``W = A·B``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp.comm import GROUP
from jaxcomp.comm import MEMBER
from jaxcomp.transforms._ab_layout import FactorSpec
from jaxcomp.transforms._ab_layout import build_layout
from jaxcomp.transforms._ab_schedule import STEP_KINDS
from jaxcomp.transforms._ab_schedule import ABPhase
from jaxcomp.transforms._ab_schedule import ABSchedule
from jaxcomp.transforms._ab_step import ABTrainingState
from jaxcomp.transforms._ab_step import _Config
from jaxcomp.transforms._ab_step import _Step
from jaxcomp.transforms._ab_sync import SYNC_MODES
from jaxcomp.transforms._ab_sync import num_a_groups


def _check_config(cfg: _Config) -> None:
    if cfg.sync_mode not in SYNC_MODES:
        raise ValueError(f"sync_mode must be one of {SYNC_MODES}; got {cfg.sync_mode!r}.")
    cutoff = cfg.low_rank_cutoff
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)) or not 0 < cutoff < 1:
        raise ValueError(f"low_rank_cutoff must be in (0, 1); got {cfg.low_rank_cutoff!r}.")
    if isinstance(cfg.exclude, str) or not all(isinstance(n, str) for n in cfg.exclude):
        raise ValueError(f"exclude must be a sequence of layer names; got {cfg.exclude!r}.")
    if not (hasattr(cfg.inner, "init") and hasattr(cfg.inner, "update")):
        raise ValueError(f"inner must be an optax GradientTransformation; got {cfg.inner!r}.")
    mr = cfg.max_rank
    if mr is not None and (
        isinstance(mr, bool)
        or not isinstance(mr, (int, float))
        or (isinstance(mr, int) and mr < 1)
        or (isinstance(mr, float) and not 0.0 < mr <= 1.0)
    ):
        raise ValueError(f"max_rank must be None, an int >= 1 or a float in (0, 1]; got {mr!r}.")
    clip = cfg.max_grad_norm
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0
    ):
        raise ValueError(f"max_grad_norm must be None or a number > 0; got {clip!r}.")


def _capacity(spec: FactorSpec, max_rank: int | float | None) -> int:
    if max_rank is None:
        return spec.cols
    if isinstance(max_rank, float):
        return max(1, min(spec.cols, int(round(max_rank * spec.cols))))
    return min(spec.cols, max_rank)


def _init(cfg: _Config, params: Any) -> ABTrainingState:
    layout = build_layout(params, cfg.exclude)
    fac, other = layout.split(params)
    caps = [_capacity(s, cfg.max_rank) for s in layout.specs]
    a = tuple(jnp.zeros((s.rows, c), x.dtype) for s, c, x in zip(layout.specs, caps, fac))
    b = tuple(jnp.zeros((c, s.cols), x.dtype) for s, c, x in zip(layout.specs, caps, fac))
    return ABTrainingState(
        count=jnp.zeros([], jnp.int32),
        phase=cfg.schedule.phase(0),
        rank=jnp.asarray(caps, jnp.int32).reshape(len(caps)),
        a=a,
        b=b,
        dense_state=cfg.inner.init(fac),
        other_state=cfg.inner.init(other),
        a_state=cfg.inner.init(a),
        b_state=cfg.inner.init(b),
    )


def _kind_index(schedule: ABSchedule, count: jax.Array) -> jax.Array:
    now, nxt = schedule.phase(count), schedule.phase(count + 1)
    ab = now == ABPhase.AB
    sync = ab & (nxt == ABPhase.FULL)
    refactor = (now == ABPhase.FULL) & (nxt == ABPhase.AB)
    return jnp.where(ab, jnp.where(sync, 3, 2), jnp.where(refactor, 1, 0)).astype(jnp.int32)


def _check_mesh() -> tuple[int, int]:
    try:
        return lax.axis_size(GROUP), lax.axis_size(MEMBER)
    except NameError as e:
        raise ValueError(
            f"ab_training's update must run inside shard_map over a mesh with axes {GROUP!r} "
            f"and {MEMBER!r} (see jaxcomp.transforms.ab_mesh and ab_data_parallel)."
        ) from e


def _update(
    cfg: _Config,
    grads: Any,
    state: ABTrainingState,
    params: Any,
    *,
    kind: str | None = None,
    role: str | None = None,
) -> tuple[Any, ABTrainingState]:
    if params is None:
        raise ValueError("ab_training needs params: call update(grads, state, params).")
    num_groups, _ = _check_mesh()
    step = _Step(cfg, build_layout(params, cfg.exclude), num_a_groups(cfg.sync_mode, num_groups),
                 role)  # fmt: skip
    t = state.count
    lr = jnp.asarray(cfg.learning_rate(t), jnp.float32)
    if kind is None:
        branches = [lambda g, s, p, lr, k=k: step.run(k, g, s, p, lr) for k in STEP_KINDS]
        new_params, state = lax.switch(
            _kind_index(cfg.schedule, t), branches, grads, state, params, lr
        )
    else:
        new_params, state = step.run(kind, grads, state, params, lr)
        # A static kind that does not match the count poisons the step instead of silently
        # training the wrong phase.
        wrong = _kind_index(cfg.schedule, t) != STEP_KINDS.index(kind)
        new_params = jax.tree.map(lambda x: jnp.where(wrong, jnp.nan, x), new_params)
    count = optax.safe_int32_increment(t)
    state = state._replace(count=count, phase=cfg.schedule.phase(count))
    updates = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_params, params)
    return updates, state


def _transform(
    cfg: _Config, kind: str | None = None, role: str | None = None
) -> optax.GradientTransformationExtraArgs:
    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        return _update(cfg, updates, state, params, kind=kind, role=role)

    return optax.GradientTransformationExtraArgs(functools.partial(_init, cfg), update_fn)


def config_of(tx: optax.GradientTransformationExtraArgs) -> _Config:
    """The validated configuration of a transform made by :func:`ab_training`."""
    return tx.init.args[0]


def ab_training(
    learning_rate: optax.ScalarOrSchedule,
    *,
    warmup_steps: int,
    sync_every: int,
    full_rank_steps: int,
    inner: optax.GradientTransformation | None = None,
    sync_mode: str = "with-stale",
    low_rank_cutoff: float = 0.15,
    split_sigma: bool = True,
    exclude: Sequence[str] = (),
    max_rank: int | float | None = None,
    lr_rebound_steps: int = 0,
    lr_rebound_floor: float = 1e-5,
    max_grad_norm: float | None = None,
    reduce_dense_globally: bool = False,
    step_kind: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""AB-Training: group-local training of low-rank factors with periodic syncs.

    Every factorisable weight (at least two non-trivial dimensions, not ``exclude``-d) is viewed
    as a tall matrix :math:`W = A B` (:math:`A = U\sqrt\Sigma`, :math:`B = \sqrt\Sigma V^\top`).
    After ``warmup_steps`` of full-rank data parallelism, the workers' groups (the ``"group"``
    mesh axis) train independently: the first half of the groups train :math:`A` with
    :math:`\partial L/\partial A = G B^\top`, the others :math:`B` with
    :math:`\partial L/\partial B = A^\top G`, and only that factor's gradient is averaged,
    within the group (the ``"member"`` axis). At each multiple of ``sync_every`` the groups are
    synced (``sync_mode``), ``full_rank_steps`` full-rank steps follow, and the weights are
    re-factorised with the rank truncated where :math:`\sigma_i \le` ``low_rank_cutoff``
    :math:`\cdot\,\sigma_0` (agreed across workers). Parameters that are not factorised (1-D,
    excluded) are trained dense every step: averaged over all workers in full-rank steps,
    within the group in AB steps (over all workers with ``reduce_dense_globally``), and averaged
    over the groups at each sync.

    The transform holds the factors, ranks, step count and four inner-optimizer states (dense
    factorisable weights, other parameters, ``A``, ``B``), each updated only in the steps that
    train its parameters, so their moments persist across phases as in the reference's
    per-parameter PyTorch state; moments of factor columns beyond a new rank are zeroed
    (the reference's pad/truncate). It returns *dense* updates ``A'B' - W`` for the model's
    weights, and applies the learning rate itself (so that the rebound can act):
    :math:`\Delta = -\eta_t \cdot \mathrm{inner}(g)`.

    ``update`` must run inside ``jax.shard_map`` over a mesh with axes ``"group"`` and
    ``"member"`` (:func:`~jaxcomp.transforms.ab_mesh`), on *per-worker* gradients
    (:func:`jaxcomp.comm.local_value_and_grad`), with the state laid out per group
    (:func:`~jaxcomp.transforms.per_group`); :func:`~jaxcomp.transforms.ab_data_parallel` does
    all of this. Place it last in a chain: its outputs are final updates.

    Args:
      learning_rate: :math:`\eta`, a float or an optax schedule of the step count.
      warmup_steps: full-rank steps before the first (untruncated) AB phase.
      sync_every: ``S``, the cycle length; groups sync when the step count is a multiple of it.
      full_rank_steps: ``D``, full-rank steps after each sync (``1 <= D < S``).
      inner: gradient transformation that does **not** apply the learning rate; default
        ``optax.scale_by_adam()``; the reference's AdamW is
        ``optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(wd))``. It sees tuples
        of arrays (dense weights, other parameters, factors), so use element-wise transforms.
      sync_mode: ``"with-stale"``, ``"only-learned"``, ``"full"`` or ``"only-b"`` (every group
        trains ``B``; ``A = U`` stays fixed and ``split_sigma`` is off), see
        :mod:`jaxcomp.transforms._ab_sync`.
      low_rank_cutoff: relative singular-value cutoff in (0, 1) for re-factorisations.
      split_sigma: put :math:`\sqrt\Sigma` on both factors; if False, :math:`\Sigma` goes to
        the factor the group trains.
      exclude: names of layers kept full-rank (matched as contiguous path components, e.g.
        ``"Conv_0"`` or ``"head/kernel"``); each must match some parameter.
      max_rank: static rank capacity of the stored factors: ``None`` (full, ``min(m, n)``), an
        int, or a fraction of ``min(m, n)``. Ranks above it are cut to it (also at the first,
        otherwise untruncated, factorisation). Collectives carry the capacity, so set it, or
        resize between steps with :func:`~jaxcomp.transforms.fit_rank_capacity`, to put the
        compressed sizes on the wire.
      lr_rebound_steps: ``R``: after each phase switch the rate restarts at
        ``lr_rebound_floor`` and climbs back over ``R`` steps
        (:meth:`~jaxcomp.transforms.ABSchedule.learning_rate`); 0 disables it.
      lr_rebound_floor: the rate right after a switch (the reference's ``1e-5``).
      max_grad_norm: clip the averaged gradients of the trained parameters to this global norm
        (the reference uses 1.0), or None.
      reduce_dense_globally: average the non-factorised parameters' gradients over all workers
        in AB steps too (the reference averages them within the group).
      step_kind: None (the step kind follows the count, one program for all phases) or one of
        ``"dense"``, ``"dense_then_refactor"``, ``"ab"``, ``"ab_then_sync"`` to compile only
        that kind, for host-driven loops (:meth:`~jaxcomp.transforms.ABSchedule.step_kind`) and
        per-phase byte counts. A step whose count does not match it returns NaN updates.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state
      :class:`~jaxcomp.transforms.ABTrainingState`.

    Raises:
      ValueError: for invalid arguments (at construction), an ``exclude`` name that matches no
        parameter (at ``init``), or an ``update`` outside a ``group``/``member`` ``shard_map``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import transforms
      >>> mesh = transforms.ab_mesh(num_groups=2, devices=jax.devices()[:4])
      >>> tx = transforms.ab_training(1e-2, warmup_steps=2, sync_every=4, full_rank_steps=1)
      >>> params = {"w": jnp.ones((8, 4)) / 8, "b": jnp.zeros(4)}
      >>> loss_fn = lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2)
      >>> dp = transforms.ab_data_parallel(loss_fn, tx, mesh)
      >>> state = dp.init(params)
      >>> for _ in range(6):
      ...   state, metrics = dp.step(state, jnp.ones((8, 8)))
      >>> int(transforms.ab_metrics(state.opt_state, state.params)["phase"])  # AB
      1

    References:
      Coquelin et al., `AB-Training: A Communication-Efficient Approach for Distributed
      Low-Rank Learning <https://arxiv.org/abs/2405.01067>`_, 2024; reference code
      ``Helmholtz-AI-Energy/AB-Training`` (``madonna/trainers/ab_lowrank.py``).

    .. warning::
      ``inner`` must not apply a learning rate: ``optax.adam(1e-3)`` as ``inner`` would scale
      the step twice and flip its sign. Factor moments carry over re-factorisations by
      position, as in the reference, so a singular vector whose sign flipped meets its old
      moment with the opposite sign (the rebound's small rate limits the harm). The A/B role
      is a ``lax.cond`` whose branches hold group-local collectives; that runs on the CPU
      backend and has not been checked on multi-GPU NCCL here. With ``split_sigma=False``
      and ``sync_mode="only-learned"`` the synced weight is ``(U Σ)(Σ Vᵀ)``, Σ counted twice
      (the A-groups hold ``Σ`` on ``A``, the B-groups on ``B``), exactly as the reference does.

    .. note::
      Where the reference code is wrong this does the right thing (SPEC §3.8): dense
      parameters are averaged over the groups at every sync (the reference skips this in
      ``only-b`` mode, so with several groups they drift apart for good); ``warmup_steps=0``
      works; an empty ``exclude`` excludes nothing; the rebound never drives the rate to
      zero or below. The warm-up -> AB factorisation happens at the start of the first AB
      step (exact, so the gradient is the same).
    """
    if step_kind is not None and step_kind not in STEP_KINDS:
        raise ValueError(f"step_kind must be None or one of {STEP_KINDS}; got {step_kind!r}.")
    lr = learning_rate
    if not callable(lr) and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0):
        raise ValueError(f"learning_rate must be a float >= 0 or a schedule; got {lr!r}.")
    schedule = ABSchedule(warmup_steps, sync_every, full_rank_steps)
    steps = lr_rebound_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"lr_rebound_steps must be an int >= 0; got {steps!r}.")
    floor = lr_rebound_floor
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0:
        raise ValueError(f"lr_rebound_floor must be a number > 0; got {floor!r}.")
    cfg = _Config(
        schedule=schedule,
        learning_rate=schedule.learning_rate(learning_rate, lr_rebound_steps, lr_rebound_floor),
        inner=optax.scale_by_adam() if inner is None else inner,
        sync_mode=sync_mode,
        low_rank_cutoff=low_rank_cutoff,
        # only-b keeps A = U frozen everywhere, so Sigma sits on B (as the reference).
        split_sigma=bool(split_sigma) and sync_mode != "only-b",
        exclude=exclude if isinstance(exclude, str) else tuple(exclude),
        max_rank=max_rank,
        max_grad_norm=max_grad_norm,
        reduce_dense_globally=bool(reduce_dense_globally),
    )
    _check_config(cfg)
    return _transform(cfg, step_kind)
