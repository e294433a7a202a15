"""A model as a chain of named segments, cut into pipeline stages at named points.

Every model in :mod:`jaxcomp.models` is built as an ordered list of named *segments* (``stem``,
``layer1``, ``block0``, ``head``, ...). Cutting after some of them gives the stages::

  model = models.resnet18(cuts=("layer1", "layer2", "layer3"))   # paper 1's four stages
  variables = model.init(jax.random.key(0))                       # one dict per stage
  model.stages                                                     # pure stage_fn(params, x) -> y
  y = model.apply(variables, x)                                    # the whole model, in order
  pipe = pipeline.distribute(model, config, mesh)                       # a pipeline.StagedModel

A :class:`FlaxStagedModel` *is* a :class:`jaxcomp.pipeline.StagedModel` (the one class of that
name): its ``stages`` are the pure training-mode stage functions and its ``loss_fn`` the mean
cross-entropy, so it feeds the pipeline directly with ``[v["params"] for v in variables]``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxcomp.pipeline import _config as _pipeline_config

StagedModel = _pipeline_config.StagedModel

TASKS = ("classification", "language_model")
#: compute dtypes of a mixed-precision policy (parameters stay float32)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


class Chain(nn.Module):
    """Applies named segments in order; each segment is called as ``segment(x, train)``."""

    segments: tuple[tuple[str, nn.Module], ...]

    @nn.compact
    def __call__(self, x, train: bool = False):
        for name, segment in self.segments:
            x = segment.clone(parent=self, name=name)(x, train)
        return x


@dataclasses.dataclass(frozen=True, eq=False)
class FlaxStagedModel(StagedModel):
    """A Flax model cut into pipeline stages at named points: a :class:`StagedModel`.

    Attributes:
      name: e.g. ``"resnet18"``.
      segments: ``((name, module), ...)`` in order; each module maps ``(x, train) -> y``.
      cuts: names of the segments after which the model is cut (empty: one stage).
      input_shape: shape of one sample (without the batch axis).
      input_dtype: dtype of the input (``float32`` images, ``int32`` tokens).
      num_outputs: classes, or vocabulary size for a language model.
      task: ``"classification"`` or ``"language_model"``.
      compute_dtype: the mixed-precision policy's compute dtype (:meth:`with_compute_dtype`):
        ``None`` (float32), ``"bfloat16"`` or ``"float16"``.

    As a :class:`StagedModel`, ``stages`` are ``stage_fns(train=True)`` and ``loss_fn`` the
    mean cross-entropy.
    """

    name: str
    segments: tuple[tuple[str, nn.Module], ...]
    cuts: tuple[str, ...]
    input_shape: tuple[int, ...]
    input_dtype: Any
    num_outputs: int
    task: str
    compute_dtype: Any = None

    def with_compute_dtype(self, dtype: Any) -> StagedModel:
        """The same model under a mixed-precision policy: parameters kept (and initialised,
        updated, averaged) in float32, computed in ``dtype``.

        Every stage casts its floating parameters and its floating input to ``dtype`` (the
        cast's transpose brings the gradients back to float32), so activations, and in a
        pipeline the tensors crossing the stage boundaries in both directions, are ``dtype``;
        the loss is computed in float32 (:func:`cross_entropy`) and normalisation statistics
        in float32 (Flax's norms reduce in float32). A float16 policy needs loss scaling
        against underflowing gradients (the trainer's ``compute_dtype="float16"`` scales
        dynamically).

        Args:
          dtype: ``"float32"`` (or ``None``: no policy), ``"bfloat16"`` or ``"float16"``.

        Returns:
          A model of the same class with ``compute_dtype`` set.

        Raises:
          ValueError: for another dtype.

        Example:
          >>> from jaxcomp import models
          >>> model = models.mlp(hidden=(8,)).with_compute_dtype("bfloat16")
          >>> v = model.init(jax.random.key(0))
          >>> y, _ = model.apply(v, jnp.ones((2, 64)))
          >>> v[0]["params"]["fc1"]["Dense_0"]["kernel"].dtype, y.dtype
          (dtype('float32'), dtype(bfloat16))
        """
        name = None if dtype is None else jnp.dtype(dtype).name
        if name not in (None, *COMPUTE_DTYPES):
            raise ValueError(f"compute dtype must be one of {COMPUTE_DTYPES}; got {dtype!r}.")
        return dataclasses.replace(self, compute_dtype=None if name == "float32" else name)

    def _compute(self, tree: Any) -> Any:
        """``tree``'s floating leaves in the compute dtype (unchanged without a policy)."""
        if self.compute_dtype is None:
            return tree
        dtype = jnp.dtype(self.compute_dtype)
        return jax.tree.map(
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
        )

    @property
    def segment_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.segments)

    @property
    def num_stages(self) -> int:
        return len(self.cuts) + 1

    @property
    def stage_modules(self) -> tuple[Chain, ...]:
        """One :class:`Chain` module per stage."""
        names = self.segment_names
        bounds = [0] + [names.index(c) + 1 for c in self.cuts] + [len(names)]
        return tuple(Chain(self.segments[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))

    @functools.cached_property
    def stages(self) -> tuple[Callable[..., Any], ...]:
        """The pure training-mode stage functions, built once: :meth:`stage_fns` for a
        stateless model, :meth:`stateful_stage_fns` for one with BatchNorm."""
        if self.stateful:
            return self.stateful_stage_fns(train=True)
        return self.stage_fns(train=True)

    @functools.cached_property
    def stateful(self) -> bool:  # type: ignore[override]
        """Whether the model keeps BatchNorm running statistics (pipeline model state)."""
        return self.has_batch_stats

    @functools.cached_property
    def eval_stages(self) -> tuple[Callable[..., Any], ...] | None:  # type: ignore[override]
        """A stateful model's evaluation stages (running statistics), else ``None``."""
        return self.stateful_stage_fns(train=False) if self.stateful else None

    def dummy_input(self, batch_size: int = 2) -> jax.Array:
        return jnp.zeros((batch_size, *self.input_shape), self.input_dtype)

    def init(self, key: jax.Array, batch_size: int = 2) -> tuple[dict, ...]:
        """Initialises every stage in order; returns one Flax variables dict per stage."""
        x = self.dummy_input(batch_size)
        out = []
        for i, stage in enumerate(self.stage_modules):
            variables = stage.init(jax.random.fold_in(key, i), x, False)
            x = stage.apply(variables, x, False)
            out.append(dict(variables))
        return tuple(out)

    def boundary_shapes(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shapes of the activations crossing each cut, for a batch of ``batch_size``."""
        variables = jax.eval_shape(lambda k: self.init(k, batch_size), jax.random.key(0))
        x = jax.ShapeDtypeStruct((batch_size, *self.input_shape), self.input_dtype)
        shapes = []

        def forward(stage, v, x):
            return stage.apply({**v, "params": self._compute(v["params"])}, self._compute(x))

        for stage, v in zip(self.stage_modules[:-1], variables[:-1]):
            x = jax.eval_shape(functools.partial(forward, stage), v, x)
            shapes.append(x)
        return tuple(shapes)

    @property
    def has_batch_stats(self) -> bool:
        return bool(self.batch_stats_segments)

    @functools.cached_property
    def batch_stats_segments(self) -> tuple[str, ...]:
        """Names of the segments that keep BatchNorm running statistics (the model's init
        traced once: 0.02-0.1 s a call for the digits MLP)."""
        variables = jax.eval_shape(lambda k: self.init(k), jax.random.key(0))
        return tuple(name for v in variables for name in v.get("batch_stats", {}))

    def with_batch_axis(self, axis_name: str | None) -> StagedModel:
        """The same model with its BatchNorm statistics synchronised over a mesh axis.

        Inside ``shard_map`` over ``axis_name`` each BatchNorm then normalises with, and
        updates its running averages from, the statistics of the batch concatenated over the
        axis (SyncBatchNorm): mean of the workers' means, variance from the mean of their
        squared deviations around it. Outside such a ``shard_map`` the model only runs with
        ``train=False`` (running statistics). The parameters and state are unchanged.

        Args:
          axis_name: the data axis, or ``None`` for per-worker statistics.

        Returns:
          A :class:`StagedModel` whose segments carry ``batch_axis=axis_name``.

        Raises:
          ValueError: if a segment keeping BatchNorm statistics has no ``batch_axis`` field.

        Example:
          >>> from jaxcomp import models
          >>> model = models.resnet18(width=8, blocks=(1, 1), cuts=()).with_batch_axis("data")
          >>> model.segments[0][1].batch_axis
          'data'
        """
        stateful = set(self.batch_stats_segments)
        fields = {n: getattr(m, "__dataclass_fields__", {}) for n, m in self.segments}
        missing = sorted(n for n in stateful if "batch_axis" not in fields[n])
        if missing:
            raise ValueError(
                f"{self.name}: segments {missing} keep BatchNorm statistics but cannot "
                "synchronise them (their module has no batch_axis field)."
            )
        segments = tuple(
            (n, m.clone(batch_axis=axis_name) if "batch_axis" in fields[n] else m)
            for n, m in self.segments
        )
        return dataclasses.replace(self, segments=segments)

    def stage_fns(self, train: bool = True) -> tuple[Callable[[Any, jax.Array], jax.Array], ...]:
        """Pure ``stage_fn(params, x) -> y`` per stage (the pipeline contract).

        Raises:
          ValueError: if the model keeps BatchNorm statistics (its stages take them as state:
            use :meth:`stateful_stage_fns`, or the model itself, which is a stateful
            :class:`StagedModel`).
        """
        if self.has_batch_stats:
            raise ValueError(
                f"{self.name}: its stages keep BatchNorm statistics; use stateful_stage_fns() "
                "(or the model itself: a stateful StagedModel)."
            )

        def make(stage):
            def stage_fn(params, x):
                return stage.apply({"params": self._compute(params)}, self._compute(x), train)

            return stage_fn

        return tuple(make(s) for s in self.stage_modules)

    def stateful_stage_fns(self, train: bool = True) -> tuple[Callable[..., Any], ...]:
        """Per stage, the stage with its non-parameter collections as explicit state.

        ``state`` is the stage's variables without ``"params"`` (``{"batch_stats": ...}``, or
        ``{}`` for a stage without BatchNorm). Training: ``stage_fn(params, state, x) -> (y,
        new_state)``, normalising with the microbatch's statistics and updating the running
        averages; evaluation (``train=False``): ``stage_fn(params, state, x) -> y`` with the
        running averages.

        Example:
          >>> import jax
          >>> from jaxcomp import models
          >>> model = models.resnet18(width=4, blocks=(1, 1), cuts=("layer1",))
          >>> variables = model.init(jax.random.key(0))
          >>> state = {"batch_stats": variables[0]["batch_stats"]}
          >>> fn = model.stateful_stage_fns(train=True)[0]
          >>> y, new = fn(variables[0]["params"], state, model.dummy_input(4))
          >>> sorted(new)
          ['batch_stats']
        """

        def make(stage):
            def stage_fn(params, state, x):
                variables = {"params": self._compute(params), **state}
                x = self._compute(x)
                if not train:
                    return stage.apply(variables, x, False)
                if "batch_stats" not in state:
                    return stage.apply(variables, x, True), state
                y, updates = stage.apply(variables, x, True, mutable=["batch_stats"])
                return y, {**state, "batch_stats": updates["batch_stats"]}

            return stage_fn

        return tuple(make(s) for s in self.stage_modules)

    def apply(
        self, variables: Sequence[dict], x: jax.Array, *, train: bool = False
    ) -> tuple[jax.Array, tuple[dict, ...]]:
        """Runs all stages in order.

        Returns:
          ``(y, new_variables)``: the output and the variables with updated BatchNorm
          statistics when ``train`` (unchanged otherwise).
        """
        new = []
        x = self._compute(x)
        for stage, v in zip(self.stage_modules, variables):
            computed = {**v, "params": self._compute(v["params"])}
            if train and "batch_stats" in v:
                x, updates = stage.apply(computed, x, True, mutable=["batch_stats"])
                new.append({**v, **updates})
            else:
                x = stage.apply(computed, x, train)
                new.append(v)
        return x, tuple(new)

    def loss_fn(self, logits: jax.Array, labels: jax.Array) -> jax.Array:  # type: ignore[override]
        """Mean cross-entropy (per token for a language model)."""
        return cross_entropy(logits, labels)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels, computed in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Fraction of argmax predictions equal to the labels (per token for an LM)."""
    return (jnp.argmax(logits, -1) == labels).mean()


def make_staged(
    name: str,
    segments: Sequence[tuple[str, nn.Module]],
    cuts: Sequence[str] | None,
    default_cuts: Sequence[str],
    *,
    input_shape: tuple[int, ...],
    input_dtype: Any,
    num_outputs: int,
    task: str,
    cls: type[FlaxStagedModel] | None = None,
) -> FlaxStagedModel:
    """Validates ``cuts`` against the segment names and builds a :class:`FlaxStagedModel`
    (or ``cls``, a subclass such as the NNX one)."""
    segments = tuple(segments)
    names = [n for n, _ in segments]
    twins = sorted({n for n in names if names.count(n) > 1})
    if twins:
        counts = ", ".join(f"{n!r} appears {names.count(n)} times" for n in twins)
        raise ValueError(f"{name}: segment names must be distinct; {counts}.")
    cuts = tuple(default_cuts if cuts is None else cuts)
    allowed = names[:-1]
    for c in cuts:
        if c not in allowed:
            raise ValueError(f"{name}: unknown cut point {c!r}; allowed cut points are {allowed}.")
    positions = [names.index(c) for c in cuts]
    if positions != sorted(set(positions)):
        raise ValueError(f"{name}: cut points must be distinct and in model order; got {cuts}.")
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}; got {task!r}.")
    cls = FlaxStagedModel if cls is None else cls
    return cls(name, segments, cuts, tuple(input_shape), input_dtype, num_outputs, task)
