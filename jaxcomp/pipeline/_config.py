"""What a pipeline is made of: a staged model, per-boundary links, and the schedule's sizes.

**Stages.** A stage is a pure function ``stage_fn(params, x) -> y`` on a *microbatch*: ``x`` and
``y`` are arrays whose leading axis is the microbatch axis (it must be kept). ``params`` is any
pytree; stages may differ in parameter structure and in boundary shapes (a Flax stage is
``lambda p, x: module.apply({"params": p}, x)``). A model with running state (BatchNorm
statistics) is ``stateful``: its stages are ``stage_fn(params, state, x) -> (y, new_state)`` in
training and ``eval_stage(params, state, x) -> y`` in evaluation, the state an explicit per-stage
pytree kept in the pipeline's :class:`LinkStates` on the device that runs the stage and updated
by each real microbatch's forward, in microbatch order. Dropout or other randomness is not
supported inside stages yet.

**Loss.** ``loss_fn(y, labels) -> loss`` or ``-> (loss, metrics)`` on the last stage's output for
one microbatch: a scalar mean over the microbatch (and a dict of scalar means, e.g. accuracy).
The pipeline's loss and metrics are their means over the ``M`` microbatches, which for equal
microbatches equals the full-batch mean.

**Links.** Boundary ``b`` (between stages ``b`` and ``b + 1``) has a :class:`Link`: a forward
channel for activations, a backward channel for activation-gradients and the backward mode.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jaxcomp import _validate
from jaxcomp.comm import _mesh
from jaxcomp.comm import _send
from jaxcomp.compressors import _base
from jaxcomp.compressors import _cast
from jaxcomp.feedback import _channel
from jaxcomp.pipeline import _schedule

CHECKPOINT_POLICIES = (
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
)


class StagedModel:
    """A model cut into sequential stages: what a pipeline runs.

    Build one from pure stage functions and a loss, ``StagedModel(stages, loss_fn)``. The
    models of :mod:`jaxcomp.models` (``models.get_model(...)``) are StagedModels too, with Flax
    initialisation and named cut points on top, so they feed :func:`distribute` and
    :func:`simulate` directly.

    A stage with running state (BatchNorm statistics) makes the model ``stateful``: pass
    ``stateful=True`` and ``eval_stages``. Its training stages are ``stage_fn(params, state, x)
    -> (y, new_state)`` (``state`` any per-stage pytree, ``{}`` for a stage without state, its
    structure kept), its evaluation stages ``eval_stage(params, state, x) -> y``. The pipeline
    keeps each stage's state on the device that runs the stage (``pipe.init(params, batch,
    model_state)``, then in the :class:`LinkStates` every step returns): after a step, stage
    ``s``'s state is what ``M`` calls of its ``stage_fn`` on microbatches ``0 .. M - 1``, in
    that order, leave; bubble ticks and backward ticks do not touch it. The state gets no
    gradient: a stage's output must not depend on it in training (BatchNorm normalises with the
    microbatch's own statistics there).

    Attributes:
      stages: ``S`` pure functions ``stage_fn(params, x) -> y`` (leading microbatch axis kept),
        or for a stateful model ``stage_fn(params, state, x) -> (y, new_state)``.
      loss_fn: ``loss_fn(y, labels) -> loss`` or ``(loss, metrics)``, microbatch means.
      stateful: whether the stages carry running state.
      eval_stages: a stateful model's ``eval_stage(params, state, x) -> y`` (``None`` for a
        stateless one: evaluation runs ``stages``).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import pipeline
      >>> model = pipeline.StagedModel([lambda w, x: x @ w] * 2, lambda y, t: jnp.mean(y - t))
      >>> model.num_stages
      2
    """

    def __init__(
        self,
        stages: Sequence[Callable[..., Any]],
        loss_fn: Callable,
        *,
        stateful: bool = False,
        eval_stages: Sequence[Callable[..., Any]] | None = None,
    ):
        if not isinstance(stateful, bool):
            raise TypeError(f"stateful must be a bool; got {type(stateful).__name__}.")
        if stateful and eval_stages is None:
            raise ValueError(
                "a stateful StagedModel needs eval_stages: eval_stage(params, state, x) -> y "
                "per stage (evaluation with the running state)."
            )
        if not stateful and eval_stages is not None:
            raise ValueError("eval_stages is only for a stateful StagedModel (stateful=True).")
        self._stages = tuple(stages)
        self._loss_fn = loss_fn
        self._stateful = stateful
        self._eval_stages = None if eval_stages is None else tuple(eval_stages)

    @property
    def stages(self) -> tuple[Callable[[Any, jax.Array], jax.Array], ...]:
        return self._stages

    @property
    def loss_fn(self) -> Callable[..., Any]:
        return self._loss_fn

    @property
    def stateful(self) -> bool:
        return getattr(self, "_stateful", False)

    @property
    def eval_stages(self) -> tuple[Callable[..., Any], ...] | None:
        return getattr(self, "_eval_stages", None)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def _replace(self, **changes: Any) -> StagedModel:
        """A plain :class:`StagedModel` with ``stages`` and/or ``loss_fn`` replaced."""
        unknown = sorted(set(changes) - {"stages", "loss_fn"})
        if unknown:
            raise ValueError(f"StagedModel has no field(s) {unknown}; it has stages, loss_fn.")
        return StagedModel(
            changes.get("stages", self.stages), changes.get("loss_fn", self.loss_fn),
            stateful=self.stateful, eval_stages=self.eval_stages,
        )  # fmt: skip

    def _key(self) -> tuple:
        return (self.stages, self.loss_fn, self.stateful, self.eval_stages)

    def __eq__(self, other: Any) -> bool:
        if type(other) is not StagedModel or type(self) is not StagedModel:
            return self is other
        return self._key() == other._key()

    def __hash__(self) -> int:
        if type(self) is not StagedModel:
            return id(self)
        return hash(self._key())

    def __repr__(self) -> str:
        return f"StagedModel({self.num_stages} stages)"


class Link(NamedTuple):
    """One boundary's compression: forward channel, backward channel, backward mode.

    Attributes:
      forward: :class:`~jaxcomp.feedback.Channel` for activations.
      backward: channel for activation-gradients (``None`` in ``"shared_mask"`` mode).
      mode: ``"independent"`` (the gradient is compressed on its own, Rudakov et al.'s ResNet
        runs) or ``"shared_mask"`` (only the gradient entries at the forward's kept positions
        travel, their GPT-2 runs).
    """

    forward: _channel.Channel
    backward: _channel.Channel | None
    mode: str = "independent"


def link(
    forward: _channel.Channel | _base.Codec | None = None,
    backward: _channel.Channel | _base.Codec | None = None,
    *,
    mode: str = "independent",
) -> Link:
    """Builds a :class:`Link`; codecs are lifted to channels with ``feedback.plain``.

    Args:
      forward: channel or codec for activations (default: identity).
      backward: channel or codec for gradients (default: identity in ``"independent"`` mode;
        must be omitted in ``"shared_mask"`` mode).
      mode: ``"independent"`` or ``"shared_mask"``.

    Returns:
      A :class:`Link`.

    Example:
      >>> from jaxcomp import compressors, feedback, pipeline
      >>> ef = feedback.error_feedback(compressors.top_k(0.1, per_sample=True))
      >>> lk = pipeline.link(ef, compressors.quantize(8))
      >>> lk.backward.name
      'quantize(8, tensor)'
    """
    _validate.check_choice("mode", mode, _send.BACKWARD_MODES)
    forward = _channel.as_channel(_cast.identity() if forward is None else forward)
    if mode == "independent" and backward is None:
        backward = _cast.identity()
    backward = None if backward is None else _channel.as_channel(backward)
    _send.check_link(forward, backward, mode)
    return Link(forward, backward, mode)


class PipelineConfig(NamedTuple):
    """Static sizes, per-boundary links and the schedule of a pipeline.

    Attributes:
      num_microbatches: ``M``, the microbatches per step (``M >= S``).
      links: one :class:`Link` per boundary (``S - 1``), or a single link used everywhere; an
        :class:`~jaxcomp.pipeline.AdaptiveLink` switches between two links (with ``detector``).
      schedule: ``"gpipe"`` (every forward, then every backward: all ``M`` microbatches'
        activations alive) or ``"1f1b"`` (PipeDream-flush: at most ``S``); same numbers.
      checkpoint: ``None`` (a stage's backward uses the activations its forward saved),
        ``True`` or a ``jax.checkpoint_policies`` name / policy callable: each stage runs under
        ``jax.checkpoint`` with that policy, saving only its input (and what the policy keeps)
        and recomputing the rest in the backward.
      replica_mean: how data replicas average their gradients: ``None`` (a float32
        ``pmean``) or an optax transform whose ``update`` reduces over the ``data`` axis inside
        ``shard_map``, e.g. :func:`jaxcomp.transforms.compressed_mean` (any codec or channel,
        PowerSGD included) or :func:`jaxcomp.transforms.accordion`. Each stage device averages
        its own stage's gradient with its own transform state (in the link states).
      detector: with adaptive links (:func:`~jaxcomp.pipeline.adaptive_link` in ``links``),
        Accordion's :class:`~jaxcomp.pipeline.Detector` that switches them; ``None`` otherwise.
    """

    num_microbatches: int
    links: Any = link()  # a Link or AdaptiveLink, or one per boundary
    schedule: str = "gpipe"
    checkpoint: Any = None
    replica_mean: Any = None
    detector: Any = None


def resolve_links(config: PipelineConfig, num_stages: int) -> tuple[Link, ...]:
    """Validates ``config`` for ``num_stages`` stages and returns one link per boundary."""
    _validate.check_int("num_stages", num_stages, 2)
    m = config.num_microbatches
    _validate.check_int("num_microbatches", m, 1)
    if m < num_stages:
        raise ValueError(
            f"num_microbatches must be >= the number of stages for a GPipe schedule; got "
            f"num_microbatches={m} with {num_stages} stages."
        )
    _validate.check_choice("schedule", config.schedule, _schedule.SCHEDULES)
    check_checkpoint(config.checkpoint)
    tx = config.replica_mean
    if tx is not None and not (
        callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))
    ):
        raise TypeError(
            "replica_mean must be None or an optax GradientTransformation (e.g. "
            f"transforms.compressed_mean(...)); got {type(tx).__name__}."
        )
    links = config.links
    if isinstance(links, Link):
        links = (links,) * (num_stages - 1)
    links = tuple(links)
    if len(links) != num_stages - 1:
        raise ValueError(
            f"links must hold one Link per boundary ({num_stages - 1} for {num_stages} stages); "
            f"got {len(links)}."
        )
    for b, lk in enumerate(links):
        if not isinstance(lk, Link):
            raise TypeError(f"links[{b}] must be a pipeline.Link; got {type(lk).__name__}.")
    return links


def check_checkpoint(checkpoint: Any) -> None:
    """Raises ``ValueError`` unless ``checkpoint`` is a valid :func:`checkpointed` argument."""
    if checkpoint is None or isinstance(checkpoint, bool) or callable(checkpoint):
        return
    if isinstance(checkpoint, str) and checkpoint in CHECKPOINT_POLICIES:
        return
    raise ValueError(
        f"checkpoint must be None, True, a policy callable or one of {CHECKPOINT_POLICIES}; "
        f"got {checkpoint!r}."
    )


def check_model(model: StagedModel) -> None:
    """Raises unless ``model`` has at least two callable stages and a callable loss."""
    if not isinstance(model, StagedModel):
        raise TypeError(
            f"model must be a pipeline.StagedModel (e.g. from jaxcomp.models.get_model); got "
            f"{type(model).__name__}."
        )
    if len(model.stages) < 2:
        raise ValueError(f"a pipeline needs at least 2 stages; got {len(model.stages)}.")
    if not all(callable(f) for f in model.stages) or not callable(model.loss_fn):
        raise TypeError("model.stages and model.loss_fn must be callables.")
    if model.stateful and (
        len(model.eval_stages) != len(model.stages)
        or not all(callable(f) for f in model.eval_stages)
    ):
        raise TypeError(
            f"a stateful model needs one callable eval_stage per stage ({len(model.stages)}); "
            f"got {len(model.eval_stages)}."
        )


def split_loss(out: Any) -> tuple[jax.Array, dict]:
    """``loss_fn``'s output (``loss`` or ``(loss, metrics)``) as ``(loss, metrics)``."""
    if isinstance(out, tuple):
        loss, metrics = out
        return loss, dict(metrics)
    return out, {}


def pipeline_mesh(
    num_stages: int, devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
    """A ``(data, stage)`` mesh: ``num_stages`` consecutive devices per pipeline replica.

    Args:
      num_stages: ``S``; must divide the number of devices.
      devices: devices to use (default: all). With ``len(devices) == S`` the mesh has a data
        axis of size 1.

    Returns:
      A mesh with axes ``("data", "stage")``.

    Raises:
      ValueError: if ``num_stages`` does not divide the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    _validate.check_int("num_stages", num_stages, 2)
    if len(devices) % num_stages:
        raise ValueError(
            f"num_stages={num_stages} does not divide the {len(devices)} devices; use a "
            f"divisor of {len(devices)} or pass devices=jax.devices()[:k * {num_stages}]."
        )
    return _mesh.make_mesh([(_mesh.DATA, -1), (_mesh.STAGE, num_stages)], devices)


# ----------------------------------------------------------------------------------------------
# A pipeline, statically: what the driver's programs are built from (:class:`Spec`).


class Spec(NamedTuple):
    """A pipeline, statically (hashable).

    Attributes:
      model: the :class:`StagedModel`.
      links: one :class:`Link` per boundary.
      num_microbatches: ``M``.
      schedule: ``"gpipe"`` or ``"1f1b"``.
      fns: the stages' objectives (:func:`jaxcomp.pipeline._residuals.stage_fns`).
      mesh: the ``(data,) stage`` mesh, or ``None`` for the single-device simulation.
      replicas: data replicas (``1`` without a ``data`` axis of size > 1; with an axis pair, the
        product of the two sizes).
      replica_mean: the optax transform averaging the replicas' gradients over ``data``, or
        ``None`` (``pmean``; also with one replica, where there is nothing to average).
      adaptive: the adaptive boundaries (:class:`jaxcomp.pipeline._adaptive.Adaptive`) or
        ``None``; ``links`` are then those of the mode combination the program runs.
      data_axes: the replicas' mesh axes: ``("data",)``, or a ``(slow, fast)`` pair of a
        hierarchical mesh (the replicas are the devices of both; ``replica_mean`` averages
        over the pair, e.g. dense over ``fast`` and compressed over ``slow``).
    """

    model: StagedModel
    links: tuple[Link, ...]
    num_microbatches: int
    schedule: str
    fns: tuple[Any, ...]  # _residuals.StageFns
    mesh: jax.sharding.Mesh | None
    replicas: int
    replica_mean: Any = None
    adaptive: Any = None
    data_axes: tuple[str, ...] = (_mesh.DATA,)

    @property
    def lead(self) -> tuple[int, ...]:
        num = self.model.num_stages
        return (num, self.replicas) if self.replicas > 1 else (num,)

    @property
    def axes(self) -> tuple[str, ...]:
        return (_mesh.STAGE, *self.data_axes) if self.replicas > 1 else (_mesh.STAGE,)

    @property
    def data(self) -> str | tuple[str, ...]:
        """The replicas' axis name for collectives (a tuple for a pair)."""
        return self.data_axes[0] if len(self.data_axes) == 1 else self.data_axes

    @property
    def replica_lead(self) -> tuple[int, ...]:
        """Leading dims of the averaging transform's state: ``(S, D)``; with a pair
        ``(S, slow size)``: it belongs to a slow worker (the fast axis is averaged first)."""
        if len(self.data_axes) == 2 and self.replicas > 1:
            return (self.model.num_stages, self.mesh.shape[self.data_axes[0]])
        return self.lead

    @property
    def replica_spec(self) -> P:
        """The transform state's spec: as the link states', or ``(stage, slow)`` with a pair."""
        if len(self.data_axes) == 2 and self.replicas > 1:
            return P(_mesh.STAGE, self.data_axes[0])
        return self.state_spec

    @property
    def state_spec(self) -> P:
        return P(_mesh.STAGE, self.data) if self.replicas > 1 else P(_mesh.STAGE)

    @property
    def batch_spec(self) -> P:
        return P(self.data) if self.replicas > 1 else P()
