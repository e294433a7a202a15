r"""AB-Training (Coquelin et al., 2024) as an optax optimizer alias over grouped workers.

``update`` runs inside ``shard_map`` over ``ABConfig.axis_name`` on per-worker dense gradients
(:func:`jaxcomp.comm.local_value_and_grad`) and one worker's state. Every step is one of four
kinds (:data:`~jaxcomp.ab._schedule.STEP_KINDS`), chosen from the step count with
``lax.switch`` (the count is agreed over the workers first, so the predicate is uniform over
every axis whose collectives the branches hold):

* ``dense`` (warm-up and full-rank rebound): :func:`._step.dense_update`;
* ``dense_then_refactor``: the same, then :func:`._sync.refactor`;
* ``ab``: :func:`._step.ab_update` (the first AB step after warm-up first runs
  :func:`._sync.factorise_exact`);
* ``ab_then_sync``: the same, then :func:`._sync.sync`.

The model always sees dense weights: ``update`` returns ``W_new - W_old`` with ``W = A·B``.
:func:`~jaxcomp.parallel.ab_data_parallel` runs the same functions as separate compiled
programs chosen on the host, which is faster on CPU than the ``lax.switch``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp.ab._config import ABConfig
from jaxcomp.ab._layout import ABLayout
from jaxcomp.ab._layout import build_layout
from jaxcomp.ab._schedule import STEP_KINDS
from jaxcomp.ab._schedule import ABPhase
from jaxcomp.ab._schedule import ABSchedule
from jaxcomp.ab._step import ABTrainingState
from jaxcomp.ab._step import Ctx
from jaxcomp.ab._step import ab_update
from jaxcomp.ab._step import dense_update
from jaxcomp.ab._step import init_state
from jaxcomp.ab._sync import factorise_exact
from jaxcomp.ab._sync import refactor
from jaxcomp.ab._sync import sync
from jaxcomp.ab._topology import topology
from jaxcomp.comm import to_varying
from jaxcomp.comm import varying_axes


def kind_index(schedule: ABSchedule, count: jax.Array) -> jax.Array:
    """Index into :data:`STEP_KINDS` of the step with index ``count`` (traceable)."""
    now, nxt = schedule.phase(count), schedule.phase(count + 1)
    ab = now == ABPhase.AB
    sync_ = ab & (nxt == ABPhase.FULL)
    refactor_ = (now == ABPhase.FULL) & (nxt == ABPhase.AB)
    return jnp.where(ab, jnp.where(sync_, 3, 2), jnp.where(refactor_, 1, 0)).astype(jnp.int32)


def check_shapes(layout: ABLayout, state: ABTrainingState, grads: Any, params: Any) -> None:
    """Raises ``ValueError`` if ``params``/``grads`` are not the tree the state was made for."""
    if len(layout.specs) != len(state.a):
        raise ValueError(
            f"ab_training: params have {len(layout.specs)} factorised weights but the state "
            f"was initialised for {len(state.a)}; pass the params given to init."
        )
    for s, a, b in zip(layout.specs, state.a, state.b):
        if (a.shape[-2], b.shape[-1]) != (s.rows, s.cols):
            raise ValueError(
                f"ab_training: {s.path} has shape {s.shape} (tall view {s.rows}x{s.cols}) but "
                f"the state's factors are {a.shape[-2]}x{b.shape[-1]}; pass the params given "
                "to init."
            )
    try:
        g_leaves = layout.treedef.flatten_up_to(grads)
    except (ValueError, TypeError) as e:
        raise ValueError(f"ab_training: grads do not have the params' structure: {e}") from e
    for path, g, p in zip(layout.paths, g_leaves, layout.treedef.flatten_up_to(params)):
        if g.shape != p.shape:
            raise ValueError(f"ab_training: the gradient of {path} has shape {g.shape}, the "
                             f"parameter {p.shape}.")  # fmt: skip


def match_vma(tree: Any, like: Any) -> Any:
    """``tree`` with every leaf also varying over the axes its counterpart in ``like`` varies
    over, so that branches of a ``cond``/``switch`` return one type whatever the caller's
    state layout (per worker or per group)."""
    return jax.tree.map(lambda x, y: to_varying(x, tuple(sorted(varying_axes(y)))), tree, like)


def update_kind(ctx: Ctx, kind: str, grads, state: ABTrainingState, params, lr):
    """One step of a static ``kind`` (count not advanced): ``(new_params, state)``."""
    given = (params, state)
    if kind in ("dense", "dense_then_refactor"):
        params, state = dense_update(ctx, grads, state, params, lr)
        if kind == "dense_then_refactor":
            params, state = refactor(ctx, state, params, in_branch=True)
        return match_vma((params, state), given)
    # the first AB step after the warm-up factorises first; only what that writes goes through
    # the ``cond`` (a branch that passes a value through copies it)
    fields = ("rank", "a", "b", "a_state", "b_state")
    fields += ("dense_state", "other_state") if ctx.cfg.reset_opt else ()

    def exact(carried, params):
        part = state._replace(**dict(zip(fields, carried)))
        new = factorise_exact(ctx, part, params, in_branch=True)
        return match_vma(tuple(getattr(new, f) for f in fields), carried)

    def keep(carried, params):
        return match_vma(to_varying(carried, ctx.topo.state_axes), carried)

    first = state.count == ctx.cfg.warmup_steps
    carried = lax.cond(first, exact, keep, tuple(getattr(state, f) for f in fields), params)
    state = state._replace(**dict(zip(fields, carried)))
    params, state = ab_update(ctx, grads, state, params, lr)
    if kind == "ab_then_sync":
        params, state = sync(ctx, state, params)
    return match_vma((params, state), given)


def advance(cfg: ABConfig, state: ABTrainingState, count: jax.Array) -> ABTrainingState:
    """``count + 1`` and its phase, in the vma type of the incoming count."""
    axes = tuple(sorted(varying_axes(state.count)))
    count = to_varying(optax.safe_int32_increment(count), axes)
    return state._replace(count=count, phase=to_varying(cfg.schedule.phase(count), axes))


def update(cfg: ABConfig, grads: Any, state: ABTrainingState, params: Any = None, **extra):
    """The transform's ``update``: the step kind chosen by ``lax.switch`` on the count."""
    del extra
    if params is None:
        raise ValueError("ab_training needs params: call update(grads, state, params).")
    layout = build_layout(params, cfg.exclude)
    check_shapes(layout, state, grads, params)
    ctx = Ctx(cfg, layout, topology(cfg))
    count = state.count
    if varying_axes(count) & set(ctx.topo.axes):
        count = ctx.topo.agree_max(count)  # uniform (typed invariant) for the switch below
    lr = jnp.asarray(cfg.lr_schedule()(count), jnp.float32)
    branches = [functools.partial(update_kind, ctx, k) for k in STEP_KINDS]
    new_params, state = lax.switch(kind_index(cfg.schedule, count), branches, grads, state,
                                   params, lr)  # fmt: skip
    updates = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_params, params)
    return updates, advance(cfg, state, count)


def ab_transform(config: ABConfig) -> optax.GradientTransformationExtraArgs:
    """The optax transform of an :class:`~jaxcomp.transforms.ABConfig` (see :func:`ab_training`)."""
    if not isinstance(config, ABConfig):
        raise ValueError(f"ab_transform needs an ABConfig; got {type(config).__name__}.")
    return optax.GradientTransformationExtraArgs(
        functools.partial(init_state, config), functools.partial(update, config)
    )


def ab_training(learning_rate: optax.ScalarOrSchedule, **options: Any):
    r"""AB-Training: group-local training of low-rank factors with periodic syncs.

    Every factorisable weight (at least two non-trivial dimensions, not ``exclude``-d) is viewed
    as a tall matrix :math:`W = A B` (:math:`A = U\sqrt\Sigma`, :math:`B = \sqrt\Sigma V^\top`).
    After ``warmup_steps`` of full-rank data parallelism, the worker groups train
    independently: the first half of the groups train :math:`A` with
    :math:`\partial L/\partial A = G B^\top`, the others :math:`B` with
    :math:`\partial L/\partial B = A^\top G`, and only that factor's gradient is averaged,
    within the group (nothing at all with ``comm_setup="individual"``). At each multiple of
    ``sync_every`` the groups sync (``sync_mode``), ``full_rank_steps`` full-rank steps follow,
    and the weights are re-factorised with the rank truncated where :math:`\sigma_i \le`
    ``low_rank_cutoff`` :math:`\cdot\,\sigma_0` (agreed across workers). Parameters that are
    not factorised (1-D, excluded) train dense every step, averaged over all workers in
    full-rank steps and within the group in AB steps.

    The state holds the factors, ranks, step count and four inner-optimizer states (dense
    factorisable weights, other parameters, ``A``, ``B``), each updated only in the steps that
    train its parameters, so their moments persist across phases as in the reference's
    per-parameter PyTorch state. ``update`` returns *dense* updates :math:`A'B' - W`.

    **Why an optimizer alias, like** ``optax.adamw``: the transform keeps the factors in its
    state and must move them by :math:`A \leftarrow A - \eta\,\mathrm{inner}(g)` itself, and
    its syncs and re-factorisations are not linear in :math:`\eta`, so the learning rate (and
    its rebound after each switch) cannot come from a later ``scale_by_learning_rate``. Put
    gradient preprocessing before it in a chain and nothing after it.

    ``update`` runs inside ``jax.shard_map`` over ``axis_name`` on *per-worker* gradients
    (:func:`jaxcomp.comm.local_value_and_grad`) and that worker's state (the harness lays
    states out with a leading worker axis, :func:`~jaxcomp.parallel.stack_per_worker`).
    ``init`` works anywhere (it has no collectives). :func:`~jaxcomp.parallel.ab_data_parallel`
    does all of this, faster on CPU; on a multi-device CPU process it also limits OpenBLAS to
    one thread (every device runs its SVDs through it at once, and its spinning threads stall
    the others' collectives; :func:`jaxcomp._cpu.for_mesh`).

    Args:
      learning_rate: :math:`\eta`, a float or an optax schedule of the step count.
      **options: the other fields of :class:`~jaxcomp.transforms.ABConfig`
        (``warmup_steps``, ``sync_every`` and ``full_rank_steps`` are required).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state
      :class:`~jaxcomp.transforms.ABTrainingState`.

    Raises:
      ValueError: for invalid options (at construction), an ``exclude`` name that matches no
        parameter (at ``init``), params or grads other than init's, or an ``update`` outside a
        ``shard_map`` over ``axis_name``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import parallel, transforms
      >>> mesh = parallel.ab_mesh(num_groups=2, devices=jax.devices()[:4])
      >>> config = transforms.ABConfig(1e-2, warmup_steps=2, sync_every=4, full_rank_steps=1)
      >>> tx = transforms.ab_training(1e-2, warmup_steps=2, sync_every=4, full_rank_steps=1)
      >>> params = {"w": jnp.ones((8, 4)) / 8, "b": jnp.zeros(4)}
      >>> state = tx.init(params)  # works outside shard_map
      >>> loss_fn = lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2)
      >>> dp = parallel.ab_data_parallel(loss_fn, config, mesh)
      >>> train = dp.init(params)
      >>> for _ in range(6):
      ...   train, metrics = dp.step(train, jnp.ones((8, 8)))
      >>> int(transforms.ab_metrics(train.opt_state, train.params)["phase"])  # AB
      1

    References:
      Coquelin et al., `AB-Training: A Communication-Efficient Approach for Distributed
      Low-Rank Learning <https://arxiv.org/abs/2405.01067>`_, 2024; reference code
      ``Helmholtz-AI-Energy/AB-Training`` (``madonna/trainers/ab_lowrank.py``).

    .. warning::
      ``inner`` must not apply a learning rate: ``optax.adam(1e-3)`` as ``inner`` would scale
      the step twice and flip its sign. With ``split_sigma=False`` and
      ``sync_mode="only-learned"`` the synced weight is ``(U Σ)(Σ Vᵀ)``, Σ counted twice (the
      A-groups hold ``Σ`` on ``A``, the B-groups on ``B``), exactly as the reference does.

    .. note::
      Collectives in branches: a ``lax.cond``/``lax.switch`` whose branches hold a collective
      over an axis must have a predicate uniform over that axis (all devices of each of the
      collective's groups reach it; otherwise NCCL/TPU hang and the CPU backend aborts after
      40 s). The step-kind ``switch`` branches on the step count, agreed over all workers;
      the A/B role ``cond`` (rectangular mesh) varies only over the group axis and its
      branches reduce only over the member axis; on a flat axis the role is never a branch
      (:mod:`jaxcomp.ab._topology`).

      Where the reference code is wrong this does the right thing (SPEC §3.8):
      ``warmup_steps=0`` works; an empty ``exclude`` excludes nothing; the rebound never drives
      the rate to zero or below. Beyond the reference: moments follow the singular vectors
      across re-factorisations (``align_moments``). The warm-up -> AB factorisation happens at
      the start of the first AB step (exact, so the gradient is the same).
    """
    return ab_transform(ABConfig(learning_rate, **options))
