"""What a pipeline call checks and derives before anything is compiled: the batch, cut into
microbatches, and the static shapes of one step (:class:`Static`), with every check on them."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compressors import _base
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _link_state
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _params


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
    batch: Batch


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
    parsed = parse_batch(batch, need)
    mb = check_batch(parsed, num_microbatches, replicas)
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


# ----------------------------------------------------------------------------------------------
# Batches: dicts with inputs, labels and sample ids, cut into microbatches.


INPUT_KEYS = ("x", "inputs")
LABEL_KEYS = ("label", "labels", "targets", "y")
ID_KEY = "ids"


class Batch(NamedTuple):
    """The three parts of a batch the pipeline reads.

    Attributes:
      inputs: ``[B, ...]`` array fed to stage 0.
      labels: pytree of ``[B, ...]`` arrays passed to ``loss_fn``.
      ids: ``int[B]`` sample ids (for per-sample channels) or ``None``.
    """

    inputs: jax.Array
    labels: Any
    ids: jax.Array | None


def _pick(batch: dict, keys: tuple[str, ...], what: str) -> Any:
    found = [k for k in keys if k in batch]
    if not found:
        raise ValueError(
            f"batch must hold the {what} under one of {keys}; got keys {sorted(batch)}."
        )
    if len(found) > 1:
        raise ValueError(f"batch holds the {what} under several keys {found}; keep one.")
    return batch[found[0]]


def parse_batch(batch: Any, need_ids: bool) -> Batch:
    """Reads ``x``/``inputs``, ``label``/``labels``/``targets``/``y`` and ``ids`` from a dict.

    Raises:
      ValueError: on missing keys, or missing ``ids`` when ``need_ids`` (AQ-SGD, per-sample EF).
    """
    if isinstance(batch, Batch):
        parsed = batch
    else:
        if not isinstance(batch, dict):
            raise TypeError(f"batch must be a dict; got {type(batch).__name__}.")
        parsed = Batch(
            _pick(batch, INPUT_KEYS, "inputs"),
            _pick(batch, LABEL_KEYS, "labels"),
            batch.get(ID_KEY),
        )
    if need_ids and parsed.ids is None:
        raise ValueError(
            "a link uses per-sample buffers (AQ-SGD or per-sample error feedback): the batch "
            f"must carry the sample ids of its rows under {ID_KEY!r}."
        )
    return parsed


def check_batch(batch: Batch, num_microbatches: int, replicas: int = 1) -> int:
    """Checks leading sizes and returns the microbatch size ``B / (replicas * M)``."""
    size = jnp.shape(batch.inputs)[0] if jnp.ndim(batch.inputs) else 0
    for name, tree in (("labels", batch.labels), ("ids", batch.ids)):
        for leaf in jax.tree.leaves(tree):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != size:
                raise ValueError(
                    f"batch {name} must have the inputs' leading size {size}; got shape "
                    f"{jnp.shape(leaf)}."
                )
    if batch.ids is not None:
        if jnp.ndim(batch.ids) != 1 or not jnp.issubdtype(batch.ids.dtype, jnp.integer):
            raise ValueError(
                "batch ids must be a 1-D integer array; got "
                f"{batch.ids.dtype}{list(jnp.shape(batch.ids))}."
            )
    per = replicas * num_microbatches
    if size == 0 or size % per:
        what = f"{replicas} replicas x {num_microbatches}" if replicas > 1 else num_microbatches
        raise ValueError(f"batch size {size} must be a positive multiple of {what} microbatches.")
    return size // per


def microbatches(tree: Any, num_microbatches: int) -> Any:
    """Reshapes every leaf's leading axis ``B`` into ``(M, B // M)``."""
    return jax.tree.map(
        lambda a: a.reshape(num_microbatches, a.shape[0] // num_microbatches, *a.shape[1:]), tree
    )


def unmicrobatch(tree: Any) -> Any:
    """Inverse of :func:`microbatches`."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)
