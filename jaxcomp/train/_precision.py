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

References:
  Micikevicius et al., *Mixed Precision Training*, ICLR 2018.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

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


def check_unscaled(config: ml_collections.ConfigDict, mode: str) -> None:
    """Raises for float16 compute in a mode that does not scale its loss.

    Raises:
      ValueError: naming the mode and what to use instead.
    """
    if scaled(config):
        raise ValueError(
            f"config.compute_dtype='float16' needs loss scaling, which the {mode} mode does not "
            "do; use 'bfloat16' (no scaling needed) or the dense or pipeline mode."
        )


def initial(config: ml_collections.ConfigDict) -> LossScale | tuple:
    """The state's loss scale: a :class:`LossScale` for float16, ``()`` otherwise."""
    if not scaled(config):
        return ()
    return LossScale(jnp.asarray(INITIAL_SCALE, jnp.float32), jnp.zeros((), jnp.int32))


def policy(config: ml_collections.ConfigDict, model: Any) -> Any:
    """``model`` under the config's compute dtype (unchanged for float32)."""
    if config.compute_dtype == "float32":
        return model
    return model.with_compute_dtype(config.compute_dtype)


def unscale(tree: Any, loss_scale: LossScale) -> Any:
    """``tree`` divided by the scale (exact: the scale is a power of two)."""
    return jax.tree.map(lambda g: g / loss_scale.scale.astype(g.dtype), tree)


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
