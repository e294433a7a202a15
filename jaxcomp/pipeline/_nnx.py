"""Pipeline stages from Flax NNX modules: one module per stage, split into pure stage functions.

A pipeline runs pure ``stage_fn(params, x) -> y`` over per-stage parameter pytrees. An NNX
stage module is split (``nnx.split``) into its graph, its ``nnx.Param`` variables (nested dicts
keyed by attribute name, the paths a Linen stage's parameters have) and its other state; the
stage function merges them back on every call. A stage with BatchNorm statistics makes the
model *stateful* (:class:`~jaxcomp.pipeline.StagedModel`): its statistics travel as the
pipeline's per-stage model state, in training mode (``module.train()``: the microbatch's
statistics, running averages updated) and in evaluation (``module.eval()``: the running
averages).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax

from jaxcomp import _nnx
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _params


class NNXStages(NamedTuple):
    """What :func:`nnx_stages` returns.

    Attributes:
      model: the :class:`~jaxcomp.pipeline.StagedModel` to give :func:`distribute` or
        :func:`simulate` (stateful when a stage has state besides its parameters).
      params: one parameter pytree per stage (nested dicts), to :func:`pack_params`.
      model_state: a stateful model's per-stage state (nested dicts, ``{}`` for a stage
        without), to ``pipe.init(params, batch, model_state)``; ``None`` otherwise.
      rests: per stage, the module without its parameters (:class:`jaxcomp._nnx.Rest`).
    """

    model: _config.StagedModel
    params: tuple[Any, ...]
    model_state: tuple[Any, ...] | None
    rests: tuple[Any, ...]

    def modules(self, params: Any, model_state: Any = None) -> tuple[Any, ...]:
        """The stage modules with ``params`` (per stage, or :class:`PackedParams`) and
        ``model_state`` (per stage, or ``None``: each stage's state at :func:`nnx_stages`)
        merged back: ``nnx.update(stage, nnx.state(new))`` writes one into your module."""
        if isinstance(params, _params.PackedParams):
            params = params.unpack()
        states = model_state if model_state is not None else [r.state for r in self.rests]
        return tuple(
            _nnx.Rest(r.graphdef, s).merge(p) for r, p, s in zip(self.rests, params, states)
        )


def nnx_stages(modules: Sequence[Any], loss_fn: Callable[..., Any]) -> NNXStages:
    """A pipeline's stages from Flax NNX modules, one module per stage.

    Each module maps a microbatch ``x`` to its output (``module(x)``); the last stage's output
    goes to ``loss_fn``. The modules are split, not copied: merge the trained parameters back
    with :meth:`NNXStages.modules`.

    Args:
      modules: one ``nnx.Module`` per stage, in order.
      loss_fn: ``loss_fn(y, labels) -> loss`` or ``(loss, metrics)``, microbatch means.

    Returns:
      An :class:`NNXStages`: the :class:`~jaxcomp.pipeline.StagedModel`, the per-stage
      parameters and (for stages with BatchNorm statistics) the per-stage model state.

    Raises:
      ValueError: if a stage is not an ``nnx.Module``.

    Example:
      >>> from flax import nnx
      >>> from jaxcomp import pipeline
      >>> mods = [nnx.Linear(4, 4, rngs=nnx.Rngs(s)) for s in range(2)]
      >>> stages = pipeline.nnx_stages(mods, lambda y, t: ((y - t) ** 2).mean())
      >>> stages.model.num_stages, sorted(stages.params[0])
      (2, ['bias', 'kernel'])
    """
    modules = tuple(modules)
    if not modules or not all(_nnx.is_module(m) for m in modules):
        kinds = [type(m).__name__ for m in modules]
        raise ValueError(f"nnx_stages takes one nnx.Module per stage; got {kinds}.")
    split = [_nnx.functional(m) for m in modules]
    params = tuple(p for p, _ in split)
    rests = tuple(r for _, r in split)
    stateful = any(jax.tree.leaves(r.state) for r in rests)
    if not stateful:
        stages = tuple(_stage(r) for r in rests)
        return NNXStages(_config.StagedModel(stages, loss_fn), params, None, rests)
    model = _config.StagedModel(
        tuple(_stateful_stage(r, train=True) for r in rests),
        loss_fn,
        stateful=True,
        eval_stages=tuple(_stateful_stage(r, train=False) for r in rests),
    )
    return NNXStages(model, params, tuple(r.state for r in rests), rests)


def _stage(rest: Any) -> Callable[[Any, jax.Array], jax.Array]:
    def stage_fn(params, x):
        return rest.merge(params)(x)

    return stage_fn


def _stateful_stage(rest: Any, train: bool) -> Callable[..., Any]:
    def stage_fn(params, state, x):
        module = _nnx.Rest(rest.graphdef, state).merge(params)
        if not train:
            module.eval()
            return module(x)
        module.train()
        y = module(x)
        return y, _nnx.pure(_nnx.rest_of(module))

    return stage_fn
