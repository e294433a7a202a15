"""What the distributed and the simulated pipeline share: the :class:`Pipeline` interface and
the trace-time preparation (checks and static shapes) that runs before anything is compiled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compressors import _base
from jaxcomp.pipeline import _batch
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _link_state
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _params


class Pipeline(NamedTuple):
    """A pipeline's pure functions (from :func:`~jaxcomp.pipeline.gpipe` or
    :func:`~jaxcomp.pipeline.simulate`; both have the same signatures and numbers).

    ``step`` and ``evaluate`` validate their inputs and build the program in Python: wrap them
    in ``jax.jit`` once and reuse the jitted function (called bare, each call re-checks its
    inputs; the compiled program is reused).

    Attributes:
      init: ``init(params, batch, model_state=None) -> link_states``: every link end's
        initial state, as :class:`LinkStates` (each stage device holds the ends it owns); a
        stateful model (BatchNorm) passes its per-stage running state ``model_state`` (one
        pytree per stage, ``{}`` for a stage without), which the link states then carry.
      step: ``step(params, batch, link_states, key=None, compress=True, modes=None) ->
        (loss, grads, link_states, metrics)``: one training step's loss, gradients (in the form
        of ``params``: a per-stage sequence or :class:`PackedParams`) and new link states.
        ``key`` is required when a link's codec is stochastic. ``compress=False`` sends dense
        (AQ-SGD warm-up); mark it static under ``jax.jit``. With adaptive links
        (:func:`~jaxcomp.pipeline.adaptive_link`) the step runs the program of the modes in
        ``link_states``; under ``jax.jit`` pass them as the static
        ``modes=pipeline.link_modes(link_states)``.
      evaluate: ``evaluate(params, batch, key=None, compress=False, modes=None, states=None,
        stats="replica0") -> (loss, metrics, outputs)``: forward only, link states untouched;
        ``compress=True`` applies each forward codec without feedback (the paper's "compressed
        inference"; stochastic codecs use ``key``, by default ``jax.random.key(0)``);
        ``outputs`` is the last stage's output for the whole batch (e.g. logits, for
        accuracy). A stateful model needs ``states`` (the link states of its last step) and
        normalises with their running statistics, with data replicas replica 0's
        (``stats="replica0"``) or their mean (``"mean"``).
      bytes_per_step: ``bytes_per_step(params, batch, compress=True, train=True, modes=None,
        states=None) -> dict`` (``states``: a stateful model's link states) with the
        theoretical ``wire_bytes`` (payload bytes per step and pipeline replica, forward and
        backward) and ``dense_bytes`` (the same sends uncompressed). With adaptive links,
        ``evaluate`` and ``bytes_per_step`` use the links of ``modes`` (every boundary's low
        link by default).
      memory: ``memory(params, batch, states=None) -> dict``: the planned per-device memory
        of a training step (see :func:`jaxcomp.pipeline.gpipe`).
      num_stages: ``S``.
      num_microbatches: ``M``.
      links: one :class:`Link` per boundary.
      schedule: ``"gpipe"`` or ``"1f1b"``.
    """

    init: Callable[..., Any]
    step: Callable[..., Any]
    evaluate: Callable[..., Any]
    bytes_per_step: Callable[..., dict[str, int]]
    memory: Callable[..., dict[str, int]]
    num_stages: int
    num_microbatches: int
    links: tuple[_config.Link, ...]
    schedule: str


class Static(NamedTuple):
    """Everything derived from the shapes of (params, batch) at trace time (hashable)."""

    layout: _params.ParamLayout
    microbatch_size: int
    inputs: tuple[jax.ShapeDtypeStruct, ...]  # per stage: its input for one microbatch
    shapes: tuple[jax.ShapeDtypeStruct, ...]  # the S - 1 boundary activations
    final: jax.ShapeDtypeStruct  # last stage output (one microbatch)
    metrics_def: Any  # loss_fn metrics structure
    metrics_leaves: tuple[jax.ShapeDtypeStruct, ...]
    state_layout: _link_state.StateLayout
    mask_layout: _params.ParamLayout  # shared-mask payloads kept per microbatch
    payloads: tuple[Any, ...]  # per boundary: its shared-mask payload struct, or None
    model_layout: _params.ParamLayout  # per stage: its running state (e.g. BatchNorm statistics)

    @property
    def metrics(self) -> Any:
        return jax.tree.unflatten(self.metrics_def, self.metrics_leaves)


class Prepared(NamedTuple):
    static: Static
    batch: _batch.Batch


def split_loss(out: Any) -> tuple[jax.Array, dict]:
    """``loss_fn`` output as ``(loss, metrics)``."""
    if isinstance(out, tuple):
        loss, metrics = out
        return loss, dict(metrics)
    return out, {}


def _payload_layout(links, shapes, num):
    payloads = tuple(
        _base.payload_shape(lk.forward.codec, s) if lk.mode == "shared_mask" else None
        for lk, s in zip(links, shapes)
    )
    trees = [
        (payloads[d] if d < num - 1 else None, payloads[d - 1] if d > 0 else None)
        for d in range(num)
    ]
    return payloads, _params.param_layout(trees)


def prepare(
    model: _config.StagedModel,
    links: tuple[_config.Link, ...],
    num_microbatches: int,
    params: Any,
    batch: Any,
    *,
    replicas: int = 1,
    need_ids: bool | None = None,
    model_layout: _params.ParamLayout | None = None,
) -> Prepared:
    """Validates params and batch against the model and links (no FLOPs, nothing compiled).

    ``model_layout`` is the layout of a stateful model's per-stage state (required for one;
    ``None`` for a stateless model, whose stages then hold ``{}``).
    """
    layout = _params.param_layout(params)
    num = model.num_stages
    if layout.num_stages != num:
        raise ValueError(f"params hold {layout.num_stages} stages; the model has {num}.")
    model_layout = check_model_layout(model, model_layout)
    need = _links.needs_ids(links) if need_ids is None else need_ids
    parsed = _batch.parse_batch(batch, need)
    mb = _batch.check_batch(parsed, num_microbatches, replicas)
    x_mb = jax.ShapeDtypeStruct((mb, *parsed.inputs.shape[1:]), parsed.inputs.dtype)
    labels_mb = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((mb, *a.shape[1:]), a.dtype), parsed.labels
    )
    shapes, final = _links.boundary_shapes(
        model, layout.structs(), x_mb, labels_mb, model_layout.structs()
    )
    _links.check_links(links, shapes)
    metrics = jax.eval_shape(lambda y, lab: split_loss(model.loss_fn(y, lab))[1], final, labels_mb)
    inputs = (x_mb, *shapes)
    payloads, mask_layout = _payload_layout(links, shapes, num)
    leaves, treedef = jax.tree.flatten(metrics)
    static = Static(
        layout, mb, inputs, shapes, final, treedef, tuple(leaves),
        _link_state.state_layout(links, shapes, num), mask_layout, payloads, model_layout,
    )  # fmt: skip
    return Prepared(static, parsed)


def check_model_layout(
    model: _config.StagedModel, model_layout: _params.ParamLayout | None
) -> _params.ParamLayout:
    """The layout of the model's per-stage state: ``model_layout`` for a stateful model (which
    must have one, with a tree per stage), an empty one (``{}`` per stage) otherwise."""
    num = model.num_stages
    if not model.stateful:
        if model_layout is not None and model_layout.lengths:
            raise ValueError(
                "the states carry a model state (e.g. BatchNorm statistics) but this "
                "pipeline's model is not stateful."
            )
        return _params.param_layout(({},) * num)
    if model_layout is None:
        raise ValueError(
            "this pipeline's model is stateful (e.g. BatchNorm running statistics): pass its "
            "per-stage state to init (pipe.init(params, batch, model_state)) and the link "
            "states init returns to step and evaluate."
        )
    if model_layout.num_stages != num:
        raise ValueError(
            f"the model state holds {model_layout.num_stages} stages; the model has {num}."
        )
    return model_layout


def check_compress(compress: Any) -> bool:
    """``compress`` must be a Python bool (it selects the program); returns it."""
    if not isinstance(compress, bool):
        raise TypeError(
            f"compress must be a Python bool (under jax.jit mark it static: "
            f"jax.jit(pipe.step, static_argnames='compress')); got {type(compress).__name__}."
        )
    return compress


def with_bytes(
    metrics: dict, static: Static, links, num_microbatches: int, compress: bool, train: bool
) -> dict:
    """``metrics`` plus the static byte counts of the step (float32 scalars)."""
    counts = _links.step_bytes(links, static.shapes, num_microbatches, compress, train)
    return {**metrics, **{k: jnp.asarray(v, jnp.float32) for k, v in counts.items()}}


def eval_key(links: tuple[_config.Link, ...], key: Any, compress: bool) -> Any:
    """The evaluation key: ``key``, or a fixed ``key(0)`` when a stochastic forward codec
    compresses and none was given (compressed evaluation is then deterministic)."""
    if key is None and compress and any(lk.forward.codec.stochastic for lk in links):
        return jax.random.key(0)
    return key
