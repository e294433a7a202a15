r"""AB-Training's phase transitions: first factorisation, re-factorisation, and the group sync.

All run inside ``shard_map`` on one worker's state (SPEC §3.3-3.5):

* :func:`factorise_exact` (warm-up -> first AB phase): ``W = A B`` by SVD, no truncation (the
  rank is the capacity; the weights are kept);
* :func:`refactor` (full-rank -> AB): SVD of the current dense weights, rank cut where
  :math:`\sigma_i \le` ``low_rank_cutoff`` :math:`\cdot\,\sigma_0` (the largest rank over the
  workers is agreed, as the reference); factor moments are aligned with the new singular
  vectors (``align_moments``) and zeroed beyond the new rank (the reference's pad/truncate);
* :func:`sync` (AB -> full-rank): the factors are averaged per ``sync_mode``, and the
  non-factorised parameters per ``dense_sync``; a model's running state (BatchNorm
  statistics) follows the non-factorised parameters (:func:`sync_model_state`).

Each ends with the reference's ``reset_opt`` when set. With ``A_w, B_w`` held by worker ``w``
(``N`` workers, ``N_A`` of them in A-groups):

* ``with-stale``: :math:`\bar A = \frac1N\sum_w A_w`, :math:`\bar B = \frac1N\sum_w B_w`
  (the untrained, stale copies included), :math:`W = \bar A \bar B`;
* ``only-learned``: :math:`\bar A` over the A-groups' workers, :math:`\bar B` over the
  B-groups' workers, :math:`W = \bar A \bar B` (with one A-group in ``individual`` mode the
  reference takes its first worker's ``A`` instead of the mean);
* ``full``: :math:`W = \frac1N\sum_w A_w B_w` (a dense average);
* ``only-b``: :math:`\bar B = \frac1N\sum_w B_w`, :math:`W = A \bar B` (``A = U`` everywhere).

With ``comm_setup="groups"`` the members of a group hold equal values, so these are the
group averages weighted by group size, as the reference's all-rank means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.ab import _factor as F
from jaxcomp.ab._step import ABTrainingState
from jaxcomp.ab._step import Ctx
from jaxcomp.comm import to_varying


def _svds(ctx: Ctx, weights, in_branch: bool = False):
    specs = ctx.layout.specs
    return [F.scaled_svd(F.to_matrix(w, s), in_branch=in_branch) for w, s in zip(weights, specs)]


def _factorise(ctx: Ctx, usv, state: ABTrainingState, rank: jax.Array) -> ABTrainingState:
    """Factors of rank ``rank`` (``int32[L]``) from the SVDs ``usv`` (of :func:`._factor.
    scaled_svd`), at current capacity."""
    a, b = [], []
    for i, ((u, s, vh, k), x) in enumerate(zip(usv, state.a)):
        y, z = F.factors_from_svd(
            u, s, vh, rank[i], x.shape[-1], split_sigma=ctx.cfg.effective_split_sigma,
            sigma_on_a=ctx.topo.is_a(), dtype=x.dtype, scale=k,
        )  # fmt: skip
        a.append(y)
        b.append(z)
    return state._replace(rank=rank, a=tuple(a), b=tuple(b))


def reset_moments(state: ABTrainingState, params) -> ABTrainingState:
    """The reference's ``reset_opt``: every moment zeroed, counters and the rest kept."""
    zero = lambda i, x, first: jnp.zeros_like(x)  # noqa: E731
    dense_like = tuple(params[0])
    return state._replace(
        dense_state=F.map_moments(state.dense_state, dense_like, zero),
        other_state=F.map_moments(state.other_state, tuple(params[1]), zero),
        a_state=F.map_moments(state.a_state, state.a, zero),
        b_state=F.map_moments(state.b_state, state.b, zero),
    )


def _finish(ctx: Ctx, state: ABTrainingState, pf, po) -> ABTrainingState:
    if ctx.cfg.reset_opt:
        state = reset_moments(state, (pf, po))
    return state


def factorise_exact(
    ctx: Ctx, state: ABTrainingState, params, *, in_branch: bool = False
) -> ABTrainingState:
    """Entering the first AB phase: factors of the current weights, rank = capacity."""
    return refactor(ctx, state, params, exact=True, in_branch=in_branch)[1]


def refactor(
    ctx: Ctx,
    state: ABTrainingState,
    params,
    exact: bool | jax.Array = False,
    *,
    in_branch: bool = False,
):
    """Full-rank -> AB: the truncated re-factorisation; returns ``(params, state)``.

    With ``exact`` (a Python bool, or a traced one that the harness passes so that one
    compiled program serves both transitions) this is :func:`factorise_exact` instead: rank =
    capacity and the parameters are returned unchanged. ``in_branch``: it runs in a branch of
    the transform's step-kind ``switch`` (see :func:`._factor.svd`).
    """
    pf, po = ctx.layout.split(params)
    if not pf:
        return to_varying((params, _finish(ctx, state, pf, po)), ctx.topo.state_axes)
    usv = _svds(ctx, pf, in_branch)
    caps = jnp.asarray([x.shape[-1] for x in state.a], jnp.int32)
    if exact is True:
        rank = caps
    else:
        rank = jnp.stack([F.cutoff_rank(s, ctx.cfg.low_rank_cutoff) for _, s, _, _ in usv])
        rank = jnp.minimum(ctx.topo.agree_max(rank), caps)  # the same on every worker
        rank = jnp.where(exact, caps, rank)
    old_a = state.a
    state = _factorise(ctx, usv, state, rank)
    masks = [F.rank_mask(state.rank[i], x.shape[-1]) for i, x in enumerate(state.a)]
    if ctx.cfg.align_moments:
        match = [F.match_columns(x, u) for x, (u, *_) in zip(old_a, usv)]
        fix_a = lambda i, m, first: F.align_moment(m, *match[i], -1, first)  # noqa: E731
        fix_b = lambda i, m, first: F.align_moment(m, *match[i], -2, first)  # noqa: E731
        state = state._replace(
            a_state=F.map_moments(state.a_state, state.a, fix_a),
            b_state=F.map_moments(state.b_state, state.b, fix_b),
        )
    state = state._replace(
        a_state=F.map_like(state.a_state, state.a, lambda i, m: m * masks[i].astype(m.dtype)),
        b_state=F.map_like(
            state.b_state, state.b, lambda i, m: m * masks[i][:, None].astype(m.dtype)
        ),
    )
    if exact is not True:
        specs = ctx.layout.specs
        product = tuple(F.reconstruct(x, y, s) for x, y, s in zip(state.a, state.b, specs))
        pf = tuple(jnp.where(exact, w, p) for w, p in zip(pf, product))
    state = _finish(ctx, state, pf, po)
    return to_varying((ctx.layout.merge(pf, po), state), ctx.topo.state_axes)


def sync_factors(ctx: Ctx, a, b):
    """Averages the workers' factors per ``sync_mode``; returns ``(weights, a, b)``.

    ``weights`` are the synced dense parameters (original shapes); the factors are unchanged
    in ``full`` mode, which averages the products instead.
    """
    topo, mode = ctx.topo, ctx.cfg.sync_mode
    a, b = tuple(a), tuple(b)
    if mode == "with-stale":
        a, b = topo.sync_mean((a, b))
    elif mode == "only-learned":
        trains_a = topo.is_a()
        if topo.num_a:
            a = topo.mean_over(a, trains_a, topo.a_workers())
        b = topo.mean_over(b, jnp.logical_not(trains_a), topo.num_workers - topo.a_workers())
    elif mode == "only-b":
        b = topo.sync_mean(b)
    weights = tuple(F.reconstruct(x, y, s) for x, y, s in zip(a, b, ctx.layout.specs))
    if mode == "full":
        weights = topo.sync_mean(weights)
    return weights, a, b


def sync(ctx: Ctx, state: ABTrainingState, params):
    """AB -> full-rank: the groups' factors and dense parameters synced; ``(params, state)``."""
    _, po = ctx.layout.split(params)
    weights, a, b = sync_factors(ctx, state.a, state.b)
    rule = ctx.cfg.effective_dense_sync
    # Non-factorised parameters already agree everywhere with one group or global reduction.
    if ctx.topo.num_groups > 1 and not ctx.cfg.reduce_dense_globally:
        if rule == "average":
            po = ctx.topo.sync_mean(po)
        elif rule == "first":
            po = ctx.topo.first(po)
    state = _finish(ctx, state._replace(a=a, b=b), weights, po)
    return to_varying((ctx.layout.merge(weights, po), state), ctx.topo.state_axes)


#: The named scope of :func:`reconstruct_or_sync`'s sync branch: its collectives are a sync's,
#: not an AB step's (``collectives_by_role`` reads it from the compiled HLO).
SYNC_SCOPE = "ab_sync"


def reconstruct_or_sync(ctx: Ctx, state: ABTrainingState, params, model_state, synced: jax.Array):
    """The end of an AB step: ``W = A B``, or with ``synced`` (a bool uniform over the workers)
    the sync that follows the cycle's last AB step (:func:`sync` and :func:`sync_model_state`).

    The harness runs the cycle's last AB step and its sync as one program: ``params`` are
    the step's, with the factorised weights not yet rebuilt (their values are not read), so
    ``W = A B`` is computed once (of the synced factors) instead of once per program. Only
    the factors, the non-factorised parameters and the model state go through the ``cond``
    (and the moments, which a sync zeroes with ``reset_opt``). Returns ``(params, state,
    model_state)``, the same values as ``ab_update`` followed by :func:`sync` and
    :func:`sync_model_state`.
    """
    pf, po = ctx.layout.split(params)
    moments = ("dense_state", "other_state", "a_state", "b_state") if ctx.cfg.reset_opt else ()
    carried = (state.a, state.b, *(getattr(state, m) for m in moments))

    def plain(carried, po, model_state):
        a, b = carried[:2]
        weights = tuple(F.reconstruct(x, y, s) for x, y, s in zip(a, b, ctx.layout.specs))
        return to_varying((weights, carried, po, model_state), ctx.topo.state_axes)

    def with_sync(carried, po, model_state):
        with jax.named_scope(SYNC_SCOPE):
            part = state._replace(a=carried[0], b=carried[1], **dict(zip(moments, carried[2:])))
            params, new = sync(ctx, part, ctx.layout.merge(pf, po))
            weights, po = ctx.layout.split(params)
            model_state = sync_model_state(ctx, model_state)
        carried = (new.a, new.b, *(getattr(new, m) for m in moments))
        return to_varying((weights, carried, po, model_state), ctx.topo.state_axes)

    weights, carried, po, model_state = lax.cond(synced, with_sync, plain, carried, po, model_state)
    state = state._replace(a=carried[0], b=carried[1], **dict(zip(moments, carried[2:])))
    return ctx.layout.merge(weights, po), state, model_state


def sync_model_state(ctx: Ctx, model_state):
    r"""A model's running state (one per worker, e.g. BatchNorm statistics) at a sync.

    It follows the rule of the non-factorised parameters it belongs with (BatchNorm's scale
    and shift; :attr:`~jaxcomp.transforms.ABConfig.effective_dense_sync`, by default
    ``"average"`` with ``comm_setup="groups"`` outside ``only-b``, else ``"first"``):
    ``"average"``: every worker gets the mean over all ``N`` workers,
    :math:`\bar\mu = \frac1N\sum_w \mu_w`, :math:`\bar v = \frac1N\sum_w v_w` (the
    running means and the running variances averaged, as timm's ``distribute_bn``);
    ``"first"``: worker 0's; ``"keep"``: each worker keeps its own (the weights drift apart
    too). Unlike the parameters, it is reduced even with one group or
    ``reduce_dense_globally``: between syncs each worker (or, synchronised, each group)
    updates it from its own batches only, so the workers' copies differ.

    Why the reference's parameter rule: after a sync the workers share the weights, and
    running statistics describe the weights that produced them; the reference's VGG-16 has
    no BatchNorm, and its SyncBatchNorm configs all-reduce the batch statistics every step,
    so there is no reference buffer rule to copy.
    """
    if not jax.tree.leaves(model_state):
        return model_state
    rule, axes = ctx.cfg.effective_dense_sync, ctx.topo.axes
    if rule == "average":
        model_state = lax.pmean(model_state, axes)
    elif rule == "first":
        first = ctx.topo.worker() == 0
        kept = jax.tree.map(lambda x: jnp.where(first, x, jnp.zeros_like(x)), model_state)
        model_state = lax.psum(kept, axes)  # exact: one non-zero term
    return to_varying(model_state, axes)
