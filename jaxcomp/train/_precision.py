"""The trainer's mixed-precision policy (``config.compute_dtype``) and float16's loss scale.

``compute_dtype = "bfloat16"`` or ``"float16"`` runs the model under
:meth:`~jaxcomp.models.FlaxStagedModel.with_compute_dtype`: parameters, optimizer state and
gradients stay float32, every stage computes in the 16-bit dtype (in a pipeline the boundary
tensors of both directions, and so the link codecs' inputs, are 16-bit), the loss is float32.

float16's 5 exponent bits flush small activation-gradients to zero, so its loss is scaled
dynamically (the mixed-precision recipe of Micikevicius et al., 2018): the loss is multiplied
by ``scale`` before the backward pass and the gradients divided by it after. A step whose
gradients are not finite is skipped (as every non-finite step is) and halves the scale; after
:data:`GROWTH_INTERVAL` finite steps in a row the scale doubles. The scale is part of the
training state (:class:`LossScale`), so a resumed run continues with it.

In every mode the gradients are divided before anything reads them: before the optimizer in the
dense and pipeline modes, before the compressing average in the data-parallel mode (each
worker's own gradient, :func:`gradient_unscaled`: error feedback keeps unscaled residuals), and
before the AB update in the AB mode (``ab_data_parallel(loss_scaling=True)``). The skip decision
and the new scale are the same on every worker: in the data-parallel mode they are computed from
the workers' finiteness flags combined across devices (one global-view program), in the AB mode
on the host from every worker's flag; the modes keep the scale beside their own state
(:class:`ScaledState`).

References:
  Micikevicius et al., *Mixed Precision Training*, ICLR 2018.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

#: the first scale (2**15, as PyTorch's GradScaler and jmp start)
INITIAL_SCALE = 2.0**15
#: finite steps in a row after which the scale doubles
GROWTH_INTERVAL = 2000


class LossScale(NamedTuple):
    """float16's dynamic loss scale: the factor and the finite steps since it last changed."""

    scale: jax.Array  # float32[]
    good_steps: jax.Array  # int32[]


def scaled(config: ml_collections.ConfigDict) -> bool:
    """Whether the config's policy scales the loss (float16 compute)."""
    return config.compute_dtype == "float16"


class ScaledState(NamedTuple):
    """A mode's own training state with float16's loss scale beside it (the data-parallel and AB
    modes; the dense and pipeline modes hold the scale in their state)."""

    inner: Any
    loss_scale: LossScale


def initial(config: ml_collections.ConfigDict) -> LossScale | tuple:
    """The state's loss scale: a :class:`LossScale` for float16, ``()`` otherwise."""
    if not scaled(config):
        return ()
    return LossScale(jnp.asarray(INITIAL_SCALE, jnp.float32), jnp.zeros((), jnp.int32))


def placed_initial(mesh: jax.sharding.Mesh) -> LossScale:
    """The first :class:`LossScale`, replicated on ``mesh`` (placed from the host: no program)."""
    first = LossScale(np.asarray(INITIAL_SCALE, np.float32), np.asarray(0, np.int32))
    return jax.device_put(first, NamedSharding(mesh, P()))


def abstract_on(mesh: jax.sharding.Mesh) -> LossScale:
    """:func:`placed_initial`'s shapes, dtypes and shardings."""
    replicated = NamedSharding(mesh, P())
    return LossScale(jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
                     jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))  # fmt: skip


def policy(config: ml_collections.ConfigDict, model: Any) -> Any:
    """``model`` under the config's compute dtype (unchanged for float32)."""
    if config.compute_dtype == "float32":
        return model
    return model.with_compute_dtype(config.compute_dtype)


def unscale(tree: Any, loss_scale: LossScale) -> Any:
    """``tree`` divided by the scale (exact: the scale is a power of two)."""
    return jax.tree.map(lambda g: g / loss_scale.scale.astype(g.dtype), tree)


@jax.custom_vjp
def gradient_scaled(loss: jax.Array, scale: jax.Array) -> jax.Array:
    """``loss`` unchanged, its gradient multiplied by ``scale``: the backward pass runs on the
    scaled loss while the loss itself (a metric) stays unscaled."""
    return loss


def _scaled_fwd(loss, scale):
    return loss, scale


def _scaled_bwd(scale, g):
    return g * scale.astype(g.dtype), jnp.zeros_like(scale)


gradient_scaled.defvjp(_scaled_fwd, _scaled_bwd)


@jax.custom_vjp
def gradient_unscaled(tree: Any, scale: jax.Array) -> Any:
    """``tree`` unchanged, its gradient divided by ``scale``: applied to the float32 parameters
    where the loss reads them, the gradients come out unscaled (the division of
    :func:`unscale`, at the same point: after the 16-bit backward pass), before the caller's
    gradient transformation (a compressing average) sees them.

    Example:
      >>> def loss_fn(params, batch):  # doctest: +SKIP
      ...     params = gradient_unscaled(params, batch["loss_scale"][0])
      ...     return gradient_scaled(model_loss(params, batch), batch["loss_scale"][0])
    """
    return tree


def _unscaled_fwd(tree, scale):
    return tree, scale


def _unscaled_bwd(scale, g):
    return jax.tree.map(lambda x: x / scale.astype(x.dtype), g), jnp.zeros_like(scale)


gradient_unscaled.defvjp(_unscaled_fwd, _unscaled_bwd)


def adjust(loss_scale: LossScale, finite: jax.Array) -> LossScale:
    """The scale after a step: halved (at least 1) when its gradients were not finite,
    doubled after :data:`GROWTH_INTERVAL` finite steps in a row."""
    good = jnp.where(finite, loss_scale.good_steps + 1, 0)
    grow = good >= GROWTH_INTERVAL
    scale = jnp.where(
        finite,
        jnp.where(grow, loss_scale.scale * 2, loss_scale.scale),
        jnp.maximum(loss_scale.scale / 2, 1.0),
    )
    return LossScale(scale, jnp.where(grow, 0, good).astype(jnp.int32))
