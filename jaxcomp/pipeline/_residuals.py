"""A stage's forward and backward as two separate calls, with its saved activations packed.

An explicit schedule (1F1B, or GPipe with the backward in microbatch order) runs a stage's
backward ticks after its forward, with other microbatches in between, so what the backward needs
must be kept between the two. ``jax.vjp`` of the stage says what that is: the *residuals* of its
pullback. They fall into two kinds, told apart once per stage from the jaxpr of the forward
(a dataflow pass from the stage input):

* residuals that depend on the stage's input (the activations, masks, normalisation
  statistics): **saved**, packed into one vector per dtype and stored in a ring buffer slot of
  the microbatch;
* residuals that do not (the parameters, a reshaped LayerNorm scale, constants): not stored;
  the backward retraces the forward on the stage's parameters and a zero input and takes them
  from there (XLA removes the rest of that forward as dead code).

Every stage's saved vector is padded to the largest stage's, so a device stores its own stage's
activations only (a ``lax.switch`` over stages differentiated as a whole keeps the union of its
branches' residuals instead). With ``jax.checkpoint`` around a stage (``PipelineConfig.
checkpoint``) the saved residuals shrink to the stage input plus what the policy keeps, and the
backward recomputes the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _params


def checkpointed(stage_fn: Callable, checkpoint: Any) -> Callable:
    """``stage_fn`` wrapped in ``jax.checkpoint`` with ``checkpoint``'s policy (``None``: as is).

    ``checkpoint`` is ``None``, ``True`` (save nothing but the input), a name of
    ``jax.checkpoint_policies`` listed in ``_config.CHECKPOINT_POLICIES``, or a policy callable.
    """
    if checkpoint is None or checkpoint is False:
        return stage_fn
    if checkpoint is True:
        policy = jax.checkpoint_policies.nothing_saveable
    elif isinstance(checkpoint, str):
        policy = getattr(jax.checkpoint_policies, checkpoint)
    else:
        policy = checkpoint
    return jax.checkpoint(stage_fn, policy=policy)


class StageFns(NamedTuple):
    """What one stage runs.

    Every stage is run in its stateful form (a stateless stage's state is ``{}``, passed
    through), so the programs thread one per-stage state whatever the model.

    Attributes:
      objective: ``objective(params, x, labels, state) -> (out, (aux, new_state))`` for
        training: ``out`` is the activation (for the last stage: the float32 loss, ``aux`` its
        float32 metrics), the stage wrapped per ``checkpoint``.
      stage: ``stage(params, state, x) -> y`` (evaluation, with the running state).
      is_last: the last stage (its objective ends in the loss).
      differentiate_input: not stage 0 (the batch inputs get no gradient).
    """

    objective: Callable[..., Any]
    stage: Callable[..., Any]
    is_last: bool
    differentiate_input: bool


def _stateful(model: Any) -> tuple[tuple[Callable, ...], tuple[Callable, ...]]:
    """The model's ``(train, eval)`` stages in the stateful form."""
    if getattr(model, "stateful", False):
        return tuple(model.stages), tuple(model.eval_stages)

    def lift(f):
        return lambda p, state, x: (f(p, x), state)

    def lift_eval(f):
        return lambda p, state, x: f(p, x)

    return tuple(lift(f) for f in model.stages), tuple(lift_eval(f) for f in model.stages)


def stage_fns(model: Any, checkpoint: Any) -> tuple[StageFns, ...]:
    """The per-stage objectives of ``model`` (stages wrapped per ``checkpoint``)."""

    stages, evals = _stateful(model)
    loss_fn = model.loss_fn
    num = len(stages)

    def make(s):
        stage = checkpointed(stages[s], checkpoint)
        if s < num - 1:

            def hidden(p, x, labels, state):
                y, new_state = stage(p, state, x)
                return y, (None, new_state)

            return StageFns(hidden, evals[s], False, s > 0)

        def last(p, x, labels, state):
            y, new_state = stage(p, state, x)
            loss, metrics = _config.split_loss(loss_fn(y, labels))
            metrics = jax.tree.map(lambda v: v.astype(jnp.float32), metrics)
            return loss.astype(jnp.float32), (metrics, new_state)

        return StageFns(last, evals[s], True, s > 0)

    return tuple(make(s) for s in range(num))


def vjp(fns: StageFns, params: Any, x: Any, labels: Any, state: Any = None):
    """``(out, pullback, (aux, new_state))``; the pullback returns ``(d params, d x)`` (``d x``
    None for stage 0). ``state`` gets no gradient."""
    state = {} if state is None else state
    if fns.differentiate_input:
        return jax.vjp(lambda p, h: fns.objective(p, h, labels, state), params, x, has_aux=True)
    out, pull, aux = jax.vjp(lambda p: fns.objective(p, x, labels, state), params, has_aux=True)
    return out, pull, aux


def _input_dependent(fns: StageFns, params: Any, x: Any, labels: Any, state: Any):
    """Per pullback residual: whether it depends on the stage input ``x`` or on the stage's
    state (a dataflow pass over the forward's jaxpr; any equation touching a marked value
    marks all its outputs), and its shape and dtype. The backward runs with another state than
    the forward saw, so a residual depending on the state is saved too."""

    def residuals(p, h, lab, st):
        return jax.tree.leaves(vjp(fns, p, h, lab, st)[1])

    closed = jax.make_jaxpr(residuals)(params, x, labels, state)
    jaxpr = closed.jaxpr
    num_params = len(jax.tree.leaves(params))
    num_labels = len(jax.tree.leaves(labels))
    num_state = len(jax.tree.leaves(state))
    first_state = num_params + 1 + num_labels
    marked = set(jaxpr.invars[num_params : num_params + 1])
    marked.update(jaxpr.invars[first_state : first_state + num_state])

    def is_marked(v):
        return not isinstance(v, jex_core.Literal) and v in marked

    for eqn in jaxpr.eqns:
        if any(is_marked(v) for v in eqn.invars):
            marked.update(eqn.outvars)
    return tuple(is_marked(v) for v in jaxpr.outvars), tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.out_avals
    )


class ResidualPlan(NamedTuple):
    """Which pullback residuals each stage saves, and the packing of the saved ones.

    Attributes:
      saved: per stage, per pullback residual leaf, whether it is saved (input-dependent).
      structs: per stage, every residual leaf's shape and dtype (to check each trace).
      layout: the :class:`ParamLayout` of the saved leaves, one tuple per stage: its
        ``lengths`` are the padded ring-buffer row, the largest stage's per dtype.
    """

    saved: tuple[tuple[bool, ...], ...]
    structs: tuple[tuple[jax.ShapeDtypeStruct, ...], ...]
    layout: _params.ParamLayout

    def stage_bytes(self) -> tuple[int, ...]:
        """Saved bytes per microbatch of each stage."""
        return tuple(self.layout.stage_bytes(s) for s in range(len(self.saved)))


def plan(
    fns: tuple[StageFns, ...],
    param_structs: tuple[Any, ...],
    inputs: tuple[jax.ShapeDtypeStruct, ...],
    labels: Any,
    states: tuple[Any, ...] | None = None,
) -> ResidualPlan:
    """Traces every stage's pullback once (no FLOPs) and plans its saved residuals.

    Args:
      fns: :func:`stage_fns`.
      param_structs: per stage, its parameters' structure.
      inputs: per stage, the struct of its input (one microbatch).
      labels: the labels' structure for one microbatch.
      states: per stage, its running state (``None``: no stage has any).
    """
    saved, structs = [], []
    states = ({},) * len(fns) if states is None else states
    for f, p, x, st in zip(fns, param_structs, inputs, states):
        flags, leaf_structs = _input_dependent(f, p, x, labels, st)
        saved.append(flags)
        structs.append(leaf_structs)
    kept = [tuple(s for s, k in zip(st, fl) if k) for st, fl in zip(structs, saved)]
    return ResidualPlan(tuple(saved), tuple(structs), _params.param_layout(kept))


def _check_trace(plan_: ResidualPlan, stage: int, leaves: list) -> None:
    got = tuple((tuple(jnp.shape(a)), jnp.result_type(a)) for a in leaves)
    want = tuple((s.shape, s.dtype) for s in plan_.structs[stage])
    if got != want:
        raise ValueError(
            f"stage {stage}'s pullback saves different residuals inside the pipeline than when "
            f"it was planned ({len(got)} vs {len(want)} leaves); the stage must be a pure "
            f"function of (params, x) (and of its state). {got} {want}"
        )


def forward(
    plan_: ResidualPlan,
    fns: StageFns,
    stage: int,
    params: Any,
    x: Any,
    labels: Any,
    state: Any = None,
) -> tuple[Any, Any, dict[str, jax.Array], Any]:
    """Runs stage ``stage``'s forward; returns ``(out, aux, packed saved residuals,
    new state)``."""
    out, pull, (aux, new_state) = vjp(fns, params, x, labels, state)
    leaves = jax.tree.leaves(pull)
    _check_trace(plan_, stage, leaves)
    kept = tuple(a for a, k in zip(leaves, plan_.saved[stage]) if k)
    return out, aux, plan_.layout.pack_stage(stage, kept), new_state


def backward(
    plan_: ResidualPlan,
    fns: StageFns,
    stage: int,
    params: Any,
    packed: dict[str, jax.Array],
    cotangent: Any,
    x_like: Any,
    labels: Any,
    state_like: Any = None,
) -> tuple[Any, Any]:
    """Stage ``stage``'s backward from its packed saved residuals: ``(d params, d x)``.

    ``x_like`` is any array shaped as the stage input and ``state_like`` any state of the
    stage's structure (their values are not used: what depends on them was saved); ``d x`` is
    ``None`` for stage 0.
    """
    zero = jax.tree.map(jnp.zeros_like, x_like)
    _, pull, _ = vjp(fns, params, zero, labels, state_like)
    leaves, treedef = jax.tree.flatten(pull)
    _check_trace(plan_, stage, leaves)
    saved = iter(plan_.layout.unpack_stage(stage, packed))
    merged = [next(saved) if k else a for a, k in zip(leaves, plan_.saved[stage])]
    grads = jax.tree.unflatten(treedef, merged)(cotangent)
    return (grads[0], grads[1]) if fns.differentiate_input else (grads[0], None)
