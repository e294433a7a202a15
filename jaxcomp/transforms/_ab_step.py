"""One traced AB-Training update: the four step kinds and the phase transitions.

See :mod:`jaxcomp.transforms._ab_training` for the transform built from these pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp.comm import GROUP
from jaxcomp.comm import MEMBER
from jaxcomp.comm import to_varying
from jaxcomp.transforms import _ab_factor as F
from jaxcomp.transforms._ab_layout import ABLayout
from jaxcomp.transforms._ab_schedule import ABSchedule
from jaxcomp.transforms._ab_sync import is_a_group
from jaxcomp.transforms._ab_sync import sync_groups


class ABTrainingState(NamedTuple):
    """State of :func:`~jaxcomp.transforms.ab_training` (per group: groups differ in AB phases).

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


@dataclasses.dataclass(frozen=True)
class _Config:
    schedule: ABSchedule
    learning_rate: optax.Schedule
    inner: optax.GradientTransformation
    sync_mode: str
    low_rank_cutoff: float
    split_sigma: bool
    exclude: tuple[str, ...]
    max_rank: int | float | None
    max_grad_norm: float | None
    reduce_dense_globally: bool


def _sq_norm(tree: Any) -> jax.Array:
    return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
               jnp.zeros([], jnp.float32))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Step:
    """One traced update: the config, the layout and this worker's role."""

    cfg: _Config
    layout: ABLayout
    num_a: int
    role: str | None  # "a", "b", or None: decided per group at run time

    def clip_scale(self, sq_norm: jax.Array) -> jax.Array:
        if self.cfg.max_grad_norm is None:
            return jnp.ones([], jnp.float32)
        # torch.nn.utils.clip_grad_norm_, as the reference
        return jnp.minimum(1.0, self.cfg.max_grad_norm / (jnp.sqrt(sq_norm) + 1e-6))

    def inner_step(self, grads, opt_state, params, lr, scale):
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
        updates, opt_state = self.cfg.inner.update(grads, opt_state, params)
        new = jax.tree.map(lambda p, u: p - (lr * u).astype(p.dtype), params, updates)
        return new, opt_state

    def trains_a(self) -> jax.Array | bool:
        if self.role is not None:
            return self.role == "a"
        return is_a_group(self.num_a)

    # ---- transitions -------------------------------------------------------------------

    def factorise(self, usv, state: ABTrainingState, rank: jax.Array) -> ABTrainingState:
        """Factors of rank ``rank`` (``int32[L]``) from the SVDs ``usv``, at current capacity."""
        a, b = [], []
        for i, ((u, s, vh), x) in enumerate(zip(usv, state.a)):
            y, z = F.factors_from_svd(
                u, s, vh, rank[i], x.shape[-1], split_sigma=self.cfg.split_sigma,
                sigma_on_a=self.trains_a(), dtype=x.dtype,
            )  # fmt: skip
            a.append(y)
            b.append(z)
        return state._replace(rank=rank, a=tuple(a), b=tuple(b))

    def svds(self, weights):
        return [F.svd(F.to_matrix(w, s)) for w, s in zip(weights, self.layout.specs)]

    def factorise_exact(self, weights, state: ABTrainingState):
        """Entering the first AB phase: no truncation (rank = capacity)."""
        caps = jnp.asarray([x.shape[-1] for x in state.a], jnp.int32).reshape(len(state.a))
        return to_varying(self.factorise(self.svds(weights), state, caps), GROUP)

    def refactor(self, weights, state: ABTrainingState):
        """Full-rank -> AB: truncated re-factorisation; returns the new dense weights too."""
        if not weights:
            return weights, state
        usv = self.svds(weights)
        rank = jnp.stack([F.cutoff_rank(s, self.cfg.low_rank_cutoff) for _, s, _ in usv])
        rank = lax.pmax(rank, (GROUP, MEMBER))  # agreed across workers, as the reference
        caps = jnp.asarray([x.shape[-1] for x in state.a], jnp.int32)
        state = self.factorise(usv, state, jnp.minimum(rank, caps))
        masks = [F.rank_mask(state.rank[i], x.shape[-1]) for i, x in enumerate(state.a)]
        a_state = F.map_like(state.a_state, state.a, lambda i, m: m * masks[i].astype(m.dtype))
        b_state = F.map_like(
            state.b_state, state.b, lambda i, m: m * masks[i][:, None].astype(m.dtype)
        )
        state = state._replace(a_state=a_state, b_state=b_state)
        specs = self.layout.specs
        weights = tuple(F.reconstruct(x, y, s) for x, y, s in zip(state.a, state.b, specs))
        return to_varying((weights, state), GROUP)

    def sync(self, weights, other, state: ABTrainingState):
        """AB -> full-rank: average the groups (:func:`._ab_sync.sync_groups`)."""
        weights, a, b = sync_groups(
            self.cfg.sync_mode, state.a, state.b, self.layout.specs, num_a=self.num_a
        )
        if lax.axis_size(GROUP) > 1 and not self.cfg.reduce_dense_globally:
            other = lax.pmean(other, GROUP)  # they were only reduced within the group
        return to_varying((weights, other, state._replace(a=a, b=b)), GROUP)

    # ---- the four step kinds -------------------------------------------------------------

    def dense(self, grads, state, params, lr, refactor: bool):
        grads = lax.pmean(grads, (GROUP, MEMBER))
        (gf, go), (pf, po) = self.layout.split(grads), self.layout.split(params)
        scale = self.clip_scale(_sq_norm((gf, go)))
        pf, dense_state = self.inner_step(gf, state.dense_state, pf, lr, scale)
        po, other_state = self.inner_step(go, state.other_state, po, lr, scale)
        state = state._replace(dense_state=dense_state, other_state=other_state)
        if refactor:
            pf, state = self.refactor(pf, state)
        return to_varying((self.layout.merge(pf, po), state), GROUP)

    def train_factor(self, role: str, gf, go_sq, lr, state):
        """One inner step on the factor ``role`` trains; its gradient is averaged in the group."""
        specs = self.layout.specs
        gm = [F.to_matrix(g, s) for g, s in zip(gf, specs)]
        grads = tuple(F.factor_grad(role, g, x, y) for g, x, y in zip(gm, state.a, state.b))
        grads = lax.pmean(grads, MEMBER)
        scale = self.clip_scale(_sq_norm(grads) + go_sq)
        masks = [F.rank_mask(state.rank[i], x.shape[-1]) for i, x in enumerate(state.a)]
        if role == "a":
            a, a_state = self.inner_step(grads, state.a_state, state.a, lr, scale)
            a = tuple(x * m.astype(x.dtype) for x, m in zip(a, masks))
            state = state._replace(a=a, a_state=a_state)
        else:
            b, b_state = self.inner_step(grads, state.b_state, state.b, lr, scale)
            b = tuple(y * m[:, None].astype(y.dtype) for y, m in zip(b, masks))
            state = state._replace(b=b, b_state=b_state)
        return to_varying((state, scale), GROUP)

    def ab(self, grads, state, params, lr, sync: bool):
        pf, po = self.layout.split(params)
        first = state.count == self.cfg.schedule.warmup_steps
        state = lax.cond(first, self.factorise_exact, lambda w, s: to_varying(s, GROUP), pf, state)
        gf, go = self.layout.split(grads)
        axes = (GROUP, MEMBER) if self.cfg.reduce_dense_globally else MEMBER
        go = lax.pmean(go, axes)
        go_sq = _sq_norm(go)
        role = self.role if self.role is not None or self.num_a else "b"
        if role is None:
            state, scale = lax.cond(
                self.trains_a(),
                lambda *x: self.train_factor("a", *x),
                lambda *x: self.train_factor("b", *x),
                gf, go_sq, lr, state,
            )  # fmt: skip
        else:
            state, scale = self.train_factor(role, gf, go_sq, lr, state)
        po, other_state = self.inner_step(go, state.other_state, po, lr, scale)
        state = state._replace(other_state=other_state)
        pf = tuple(F.reconstruct(x, y, s) for x, y, s in zip(state.a, state.b, self.layout.specs))
        if sync:
            pf, po, state = self.sync(pf, po, state)
        return to_varying((self.layout.merge(pf, po), state), GROUP)

    def run(self, kind: str, grads, state, params, lr):
        if kind.startswith("dense"):
            return self.dense(grads, state, params, lr, refactor=kind == "dense_then_refactor")
        return self.ab(grads, state, params, lr, sync=kind == "ab_then_sync")
