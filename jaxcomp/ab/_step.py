r"""AB-Training's two kinds of training step, as module-level functions of one worker's state.

* :func:`dense_update` (warm-up and the full-rank steps after a sync): the dense gradients are
  averaged over all workers and every parameter takes an inner-optimizer step.
* :func:`ab_update`: the worker's group trains one factor, with gradient
  :math:`\partial L/\partial A = G B^\top` or :math:`\partial L/\partial B = A^\top G` of the
  dense gradient :math:`G`, averaged within the group (``comm_setup="groups"``) or not at all
  (``"individual"``); the non-factorised parameters' gradients are averaged within the group.
  The model's weights become :math:`W = A B`.

The phase transitions (first factorisation, re-factorisation, sync) are in :mod:`._sync`;
:mod:`._transform` strings both into the optax transform. All functions run inside
``shard_map`` over ``ABConfig.axis_name`` on one worker's slice of the state
(:class:`~._topology.Topology` holds the collectives and the rule for branches that hold
them).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp.ab import _factor as F
from jaxcomp.ab._config import ABConfig
from jaxcomp.ab._layout import ABLayout
from jaxcomp.ab._layout import build_layout
from jaxcomp.ab._topology import Topology
from jaxcomp.comm import to_varying


class ABTrainingState(NamedTuple):
    """State of :func:`~jaxcomp.transforms.ab_training` (one worker's; workers differ in AB phases).

    Attributes:
      count: ``int32[]``, steps taken.
      phase: ``int32[]``, the :class:`~jaxcomp.transforms.ABPhase` of the next step.
      rank: ``int32[L]``, current rank of each of the ``L`` factorised parameters.
      a: ``L`` arrays ``[m, c]``, the ``A`` factors at capacity ``c`` (zero beyond the rank).
      b: ``L`` arrays ``[c, n]``, the ``B`` factors.
      dense_state: inner-optimizer state of the factorisable weights, trained dense in the
        warm-up and full-rank phases.
      other_state: inner-optimizer state of the parameters that are never factorised.
      a_state: inner-optimizer state of ``a`` (A-groups train it).
      b_state: inner-optimizer state of ``b``.
    """

    count: jax.Array
    phase: jax.Array
    rank: jax.Array
    a: tuple[jax.Array, ...]
    b: tuple[jax.Array, ...]
    dense_state: optax.OptState
    other_state: optax.OptState
    a_state: optax.OptState
    b_state: optax.OptState


class Ctx(NamedTuple):
    """What one traced update knows statically: the config, the layout, the topology."""

    cfg: ABConfig
    layout: ABLayout
    topo: Topology


def init_state(cfg: ABConfig, params: Any) -> ABTrainingState:
    """The initial state for ``params`` (zero factors at their capacity, fresh inner states).

    Raises:
      ValueError: if a name in ``cfg.exclude`` matches no parameter.
    """
    layout = build_layout(params, cfg.exclude)
    fac, other = layout.split(params)
    caps = [cfg.capacity(s.cols) for s in layout.specs]
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


def sq_norm(tree: Any) -> jax.Array:
    return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
               jnp.zeros([], jnp.float32))  # fmt: skip


def clip_scale(cfg: ABConfig, sq: jax.Array) -> jax.Array:
    """``torch.nn.utils.clip_grad_norm_``'s factor (as the reference), 1 without clipping."""
    if cfg.max_grad_norm is None:
        return jnp.ones([], jnp.float32)
    return jnp.minimum(1.0, cfg.max_grad_norm / (jnp.sqrt(sq) + 1e-6))


def inner_step(cfg: ABConfig, grads, opt_state, params, lr, scale):
    """One inner-optimizer step: ``p - lr * inner(scale * g)``."""
    grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    updates, opt_state = cfg.inner.update(grads, opt_state, params)
    new = jax.tree.map(lambda p, u: p - (lr * u).astype(p.dtype), params, updates)
    return new, opt_state


def dense_update(ctx: Ctx, grads, state: ABTrainingState, params, lr):
    """A full-rank step: gradients averaged over all workers, every parameter updated."""
    grads = ctx.topo.all_mean(grads)
    (gf, go), (pf, po) = ctx.layout.split(grads), ctx.layout.split(params)
    scale = clip_scale(ctx.cfg, sq_norm((gf, go)))
    pf, dense_state = inner_step(ctx.cfg, gf, state.dense_state, pf, lr, scale)
    po, other_state = inner_step(ctx.cfg, go, state.other_state, po, lr, scale)
    state = state._replace(dense_state=dense_state, other_state=other_state)
    return to_varying((ctx.layout.merge(pf, po), state), ctx.topo.state_axes)


def _factor_step(ctx: Ctx, role: str, gm, go_sq, lr, state: ABTrainingState, reduce):
    """One inner step on the factor ``role`` trains, its gradient reduced by ``reduce``."""
    with jax.named_scope(f"ab_role_{role}"):
        grads = tuple(
            getattr(g, role) if isinstance(g, F.FactorGrads) else F.factor_grad(role, g, x, y)
            for g, x, y in zip(gm, state.a, state.b)
        )
        grads = reduce(grads)
        scale = clip_scale(ctx.cfg, sq_norm(grads) + go_sq)
        masks = [F.rank_mask(state.rank[i], x.shape[-1]) for i, x in enumerate(state.a)]
        if role == "a":
            a, a_state = inner_step(ctx.cfg, grads, state.a_state, state.a, lr, scale)
            a = tuple(x * m.astype(x.dtype) for x, m in zip(a, masks))
            state = state._replace(a=a, a_state=a_state)
        else:
            b, b_state = inner_step(ctx.cfg, grads, state.b_state, state.b, lr, scale)
            b = tuple(y * m[:, None].astype(y.dtype) for y, m in zip(b, masks))
            state = state._replace(b=b, b_state=b_state)
    return to_varying((state, scale), ctx.topo.state_axes)


def _train_factors(ctx: Ctx, gm, go_sq, lr, state: ABTrainingState):
    """Each worker trains its group's factor; returns the state and the clipping factor.

    * ``only-b``: every group trains ``B`` (no branch);
    * ``individual``: no factor collective, the role is a ``cond``;
    * ``groups`` on a rectangular mesh: a ``cond`` on the role whose branches reduce over the
      member axis (the predicate varies only over the group axis: see :mod:`._topology`);
    * ``groups`` on a flat axis: no branch; both factors' gradients are reduced, each by
      rings among its own role's workers only, and each worker keeps its role's result.
    """
    topo = ctx.topo

    def step(role, reduce):
        # only the factors and their moments go through a branch (and come out of it): the
        # rest of the state (the dense moments above all) is neither copied into a ``cond``
        # nor rewritten, so a program that does not donate its state need not return it
        def run(gm, go_sq, lr, factors):
            new, scale = _factor_step(ctx, role, gm, go_sq, lr, _with(state, factors), reduce)
            return _factors(new), scale

        return run

    args = (gm, go_sq, lr, _factors(state))
    if topo.num_a == 0:
        reduce = (lambda g: g) if ctx.cfg.comm_setup == "individual" else topo.group_mean
        factors, scale = step("b", reduce)(*args)
    elif ctx.cfg.comm_setup == "individual":
        factors, scale = lax.cond(topo.is_a(), step("a", lambda g: g), step("b", lambda g: g),
                                  *args)  # fmt: skip
    elif topo.rectangular:
        factors, scale = lax.cond(topo.is_a(), step("a", topo.group_mean),
                                  step("b", topo.group_mean), *args)  # fmt: skip
    else:
        a_groups, b_groups = range(topo.num_a), range(topo.num_a, topo.num_groups)
        sa = step("a", lambda g: topo.group_mean(g, a_groups))(*args)
        sb = step("b", lambda g: topo.group_mean(g, b_groups))(*args)
        factors, scale = jax.tree.map(lambda x, y: jnp.where(topo.is_a(), x, y), sa, sb)
    return _with(state, factors), scale


def _factors(state: ABTrainingState) -> tuple:
    """What an AB step's factor update writes: ``(a, b, a_state, b_state)``."""
    return state.a, state.b, state.a_state, state.b_state


def _with(state: ABTrainingState, factors: tuple) -> ABTrainingState:
    a, b, a_state, b_state = factors
    return state._replace(a=a, b=b, a_state=a_state, b_state=b_state)


def ab_update(ctx: Ctx, grads, state: ABTrainingState, params, lr, *, reconstruct: bool = True):
    """An AB step: the group's factor and the non-factorised parameters train; ``W = A B``.

    ``grads`` is the dense gradient (a tree like ``params``), or, from the factorised forward
    (:func:`._forward.value_and_grads`), the same tree with a :class:`~._factor.FactorGrads`
    in place of each factorised leaf's gradient. With ``reconstruct=False`` the factorised
    weights are returned as they came (the caller rebuilds them:
    :func:`~._sync.reconstruct_or_sync`).
    """
    cfg, topo, specs = ctx.cfg, ctx.topo, ctx.layout.specs
    pf, po = ctx.layout.split(params)
    gf, go = ctx.layout.split(grads)
    go = topo.all_mean(go) if cfg.reduce_dense_globally else topo.group_mean(go)
    gm = tuple(g if isinstance(g, F.FactorGrads) else F.to_matrix(g, s) for g, s in zip(gf, specs))
    state, scale = _train_factors(ctx, gm, sq_norm(go), lr, state)
    po, other_state = inner_step(cfg, go, state.other_state, po, lr, scale)
    state = state._replace(other_state=other_state)
    if reconstruct:
        pf = tuple(F.reconstruct(x, y, s) for x, y, s in zip(state.a, state.b, specs))
    return to_varying((ctx.layout.merge(pf, po), state), topo.state_axes)
