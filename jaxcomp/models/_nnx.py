"""Flax NNX models in the registry: the same staged-model contract as the Linen ones.

An :class:`NNXStagedModel` is a :class:`~jaxcomp.models.FlaxStagedModel` whose segments are NNX
modules: each segment is a factory ``factory(input_shape, rngs) -> (module, output_shape)``
(NNX layers are built with their input sizes, so a stage's segments are built in order, each
from the previous one's output shape). Its variables are what the Linen models' are, one dict
per stage with ``"params"`` (and ``"batch_stats"``), nested dicts keyed by segment and
attribute name, so the trainer, the pipeline and the name-based masks take an NNX model exactly
as a Linen one. A stage is rebuilt from its graph (``nnx.split`` of an abstract build, once
per input shape) and those dicts on every call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcomp import _nnx
from jaxcomp.models import _staged

#: ``factory(input_shape, rngs) -> (module, output_shape)``; shapes without the batch axis
SegmentFactory = Callable[[tuple[int, ...], nnx.Rngs], tuple[nnx.Module, tuple[int, ...]]]


class Segments(nnx.Module):
    """One stage: its named segments, applied in order (``module(x)``)."""

    def __init__(self, segments: Sequence[tuple[str, nnx.Module]]):
        self.order = tuple(n for n, _ in segments)
        for name, module in segments:
            setattr(self, name, module)

    def __call__(self, x):
        for name in self.order:
            x = getattr(self, name)(x)
        return x


@dataclasses.dataclass(frozen=True)
class NNXStage:
    """A stage of NNX segments behind the Linen module interface a staged model calls:
    ``init(key, x, train) -> variables`` and ``apply(variables, x, train, mutable=None)``."""

    segments: tuple[tuple[str, SegmentFactory], ...]

    def build(self, input_shape: tuple[int, ...], rngs: nnx.Rngs) -> Segments:
        built, shape = [], tuple(input_shape)
        for name, factory in self.segments:
            module, shape = factory(shape, rngs)
            built.append((name, module))
        return Segments(built)

    @functools.lru_cache(maxsize=8)  # noqa: B019  (the graph of a frozen, hashable stage)
    def graphdef(self, input_shape: tuple[int, ...]) -> Any:
        abstract = nnx.eval_shape(lambda: self.build(input_shape, nnx.Rngs(0)))
        return nnx.graphdef(abstract)

    def init(self, key: jax.Array, x: jax.Array, train: bool = False) -> dict:
        del train
        params, rest = _nnx.functional(self.build(tuple(x.shape[1:]), nnx.Rngs(key)))
        return _variables(params, rest.state)

    def apply(self, variables: dict, x: jax.Array, train: bool = False, mutable=None):
        stats = variables.get("batch_stats", {})
        module = _nnx.Rest(self.graphdef(tuple(x.shape[1:])), stats).merge(variables["params"])
        module.train() if train else module.eval()
        y = module(x)
        if mutable:
            return y, _variables(None, _nnx.pure(_nnx.rest_of(module)))
        return y


def _variables(params: Any, rest: dict) -> dict:
    """Linen-style variables: ``{"params": ..., "batch_stats": ...}`` (the latter if any)."""
    out = {} if params is None else {"params": params}
    if jax.tree.leaves(rest):
        out["batch_stats"] = rest
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class NNXStagedModel(_staged.FlaxStagedModel):
    """A :class:`~jaxcomp.models.FlaxStagedModel` of Flax NNX segments (see the module
    docstring): ``segments`` are ``(name, factory)`` pairs."""

    @property
    def stage_modules(self) -> tuple[NNXStage, ...]:  # type: ignore[override]
        names = self.segment_names
        bounds = [0] + [names.index(c) + 1 for c in self.cuts] + [len(names)]
        return tuple(NNXStage(self.segments[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))


class DenseBlock(nnx.Module):
    """``Linear -> ReLU`` (flattens its input first); ``relu=False``: a linear read-out."""

    def __init__(self, in_features: int, features: int, *, relu: bool, rngs: nnx.Rngs):
        self.linear = nnx.Linear(in_features, features, rngs=rngs)
        self.relu = relu

    def __call__(self, x):
        y = self.linear(x.reshape(x.shape[0], -1))
        return nnx.relu(y) if self.relu else y


def _dense(features: int, relu: bool, input_shape, rngs):
    block = DenseBlock(math.prod(input_shape), features, relu=relu, rngs=rngs)
    return block, (features,)


def nnx_mlp(
    input_shape: Sequence[int] = (64,),
    num_classes: int = 10,
    hidden: Sequence[int] = (256, 256, 256),
    *,
    cuts: Sequence[str] | None = None,
) -> NNXStagedModel:
    """The MLP of :func:`~jaxcomp.models.mlp` in Flax NNX: ``fc1 ... fcN -> head``, cut after
    every hidden layer by default (the main job's digits model as ``model_name="nnx_mlp"``).

    Its parameters are ``{"fc1": {"linear": {"kernel", "bias"}}, ...}`` per stage.

    Args:
      input_shape: shape of one sample (flattened by the first layer).
      num_classes: outputs of the head.
      hidden: widths of the hidden layers, named ``fc1``, ``fc2``, ...
      cuts: segment names to cut after (default: every hidden layer).

    Returns:
      An :class:`NNXStagedModel`.

    Example:
      >>> model = nnx_mlp(hidden=(32, 32))
      >>> model.num_stages, model.segment_names
      (3, ('fc1', 'fc2', 'head'))
    """
    segments = [(f"fc{i + 1}", functools.partial(_dense, w, True)) for i, w in enumerate(hidden)]
    segments.append(("head", functools.partial(_dense, num_classes, False)))
    default = tuple(n for n, _ in segments[:-1])
    return _staged.make_staged(
        "nnx_mlp",
        segments,
        cuts,
        default,
        input_shape=tuple(input_shape),
        input_dtype=jnp.float32,
        num_outputs=num_classes,
        task="classification",
        cls=NNXStagedModel,
    )
