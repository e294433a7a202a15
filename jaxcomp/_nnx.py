"""Flax NNX modules as pure functions: split into parameters and the rest, merge back.

The core of jaxcomp takes pure functions over pytrees. An ``nnx.Module`` fits through
``nnx.split`` / ``nnx.merge``: its ``nnx.Param`` variables are the parameters (what is
differentiated, averaged and updated), everything else (BatchNorm statistics, RNG counts) its
*rest*, carried through a step unchanged or as the module leaves it. A module is also a pytree
(flax >= 0.12), so it passes through ``jit``, ``shard_map`` and ``device_put`` whole.

The parameters are handed on as nested dicts of arrays (:func:`functional`), the paths a Linen
model's parameters have (``fc1/kernel``), so that name-based masks and excludes read the same
on both. Nothing here imports Flax: a value can only be an ``nnx.Module`` once ``flax.nnx`` is
imported, so :func:`is_module` looks in ``sys.modules`` (Linen-only runs never import NNX).
Every package (``comm`` to ``train``) may use this module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax


def _nnx():
    return sys.modules.get("flax.nnx")


def is_module(x: Any) -> bool:
    """Whether ``x`` is an ``nnx.Module`` (False while ``flax.nnx`` was never imported)."""
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.Module)


def split(model: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, params, rest)``: the module's ``nnx.Param`` state and everything else."""
    nnx = _nnx()
    return nnx.split(model, nnx.Param, ...)


def merge(graphdef: Any, params: Any, rest: Any) -> Any:
    """A new module from :func:`split`'s parts."""
    return _nnx().merge(graphdef, params, rest)


def params_of(model: Any) -> Any:
    """The module's ``nnx.Param`` state (an ``nnx.State``)."""
    nnx = _nnx()
    return nnx.state(model, nnx.Param)


def rest_of(model: Any) -> Any:
    """The module's state other than its parameters (an ``nnx.State``, maybe empty)."""
    nnx = _nnx()
    return nnx.state(model, nnx.Not(nnx.Param))


def update(model: Any, *states: Any) -> None:
    """Writes ``states`` into ``model`` in place (``nnx.update``)."""
    _nnx().update(model, *states)


def with_params(model: Any, fn: Callable[[Any], Any]) -> Any:
    """A new module: ``model`` with its parameters replaced by ``fn(params)``; ``model``
    itself is unchanged."""
    graphdef, params, rest = split(model)
    return merge(graphdef, fn(params), rest)


def value_and_grad(
    fun: Callable[..., Any], argnums: int | tuple[int, ...], has_aux: bool
) -> Callable[..., Any]:
    """``nnx.value_and_grad``: module arguments differentiated with respect to their
    ``nnx.Param`` variables (gradients as an ``nnx.State``), their other state updated in
    place as ``fun`` leaves it."""
    return _nnx().value_and_grad(fun, argnums=argnums, has_aux=has_aux)


@jax.tree_util.register_pytree_node_class
class Rest:
    """An NNX module without its parameters: its graph (static) and its other state.

    What a train state holds beside the parameters (``model_state``):
    the module's structure as static pytree data, so that a compiled step can rebuild the
    module from the parameters it differentiates, and the rest of its state (BatchNorm
    statistics, RNG counts) as arrays. :meth:`merge` gives the module back.
    """

    def __init__(self, graphdef: Any, state: Any):
        self.graphdef, self.state = graphdef, state

    def tree_flatten(self):
        return (self.state,), self.graphdef

    @classmethod
    def tree_unflatten(cls, graphdef, children):
        return cls(graphdef, children[0])

    def merge(self, params: Any) -> Any:
        """The module with parameters ``params`` (a nested dict, :func:`functional`'s) and
        this state."""
        return merge(self.graphdef, params, self.state)

    def __repr__(self) -> str:
        return f"Rest({type(self.graphdef).__name__}, {self.state!r})"


def pure(state: Any) -> Any:
    """An ``nnx.State`` as nested dicts of arrays (``nnx.to_pure_dict``)."""
    return _nnx().to_pure_dict(state)


def functional(model: Any) -> tuple[Any, Rest]:
    """``(params, rest)``: an ``nnx.Module`` as its parameters, nested dicts of arrays keyed
    by attribute name (``{"fc1": {"kernel": ..., "bias": ...}}``, the names a Linen model's
    parameters have, so name-based masks see the same paths), and a :class:`Rest`
    (``rest.merge(params)`` rebuilds it)."""
    graphdef, params, rest = split(model)
    return pure(params), Rest(graphdef, pure(rest))


def stateful_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``loss_fn(model, batch)`` of an NNX model as ``(params, rest, batch) -> (loss, (aux,
    rest))``: the module rebuilt from ``params`` and the :class:`Rest`, the rest returned as
    ``loss_fn`` left it (``aux`` is ``None`` without ``has_aux``)."""

    def fn(params, rest, batch):
        model = rest.merge(params)
        out = loss_fn(model, batch)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, Rest(rest.graphdef, pure(rest_of(model))))

    return fn
