"""Multi-layer perceptron and a small CNN (the digits defaults), as staged models."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from jaxcomp.models import _norm
from jaxcomp.models import _staged


class DenseBlock(nn.Module):
    """``Dense -> ReLU`` (flattens its input first)."""

    features: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        x = x.reshape(x.shape[0], -1)
        return nn.relu(nn.Dense(self.features)(x))


class Classifier(nn.Module):
    """A linear read-out (flattens its input first)."""

    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


class ConvBlock(nn.Module):
    """``Conv 3x3 -> LayerNorm -> ReLU`` with an optional 2x2 max-pool."""

    features: int
    pool: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        x = nn.Conv(self.features, (3, 3), padding="SAME")(x)
        x = nn.relu(_norm.layer_norm()(x))
        return nn.max_pool(x, (2, 2), (2, 2)) if self.pool else x


def mlp(
    input_shape: Sequence[int] = (64,),
    num_classes: int = 10,
    hidden: Sequence[int] = (256, 256, 256),
    *,
    cuts: Sequence[str] | None = None,
) -> _staged.StagedModel:
    """An MLP ``fc1 ... fcN -> head``; by default cut after every hidden layer.

    With the default three hidden layers this is the digits model of the main job: four
    stages, 256 activations per sample crossing each boundary.

    Args:
      input_shape: shape of one sample (flattened by the first layer).
      num_classes: outputs of the head.
      hidden: widths of the hidden layers, named ``fc1``, ``fc2``, ...
      cuts: segment names to cut after (default: every hidden layer).

    Returns:
      A :class:`StagedModel`.

    Example:
      >>> model = mlp()
      >>> model.num_stages
      4
    """
    segments = [(f"fc{i + 1}", DenseBlock(w)) for i, w in enumerate(hidden)]
    segments.append(("head", Classifier(num_classes)))
    default = tuple(n for n, _ in segments[:-1])
    return _staged.make_staged(
        "mlp",
        segments,
        cuts,
        default,
        input_shape=tuple(input_shape),
        input_dtype=jnp.float32,
        num_outputs=num_classes,
        task="classification",
    )


def small_cnn(
    input_shape: Sequence[int] = (8, 8, 1),
    num_classes: int = 10,
    channels: Sequence[int] = (32, 64),
    hidden: int = 128,
    *,
    cuts: Sequence[str] | None = None,
) -> _staged.StagedModel:
    """A small CNN ``conv1 -> conv2 (pool) -> fc -> head`` for 8x8 digits; 4 stages by default.

    Normalisation is LayerNorm, so the model has no mutable state and pipelines as is.
    """
    segments = [
        (f"conv{i + 1}", ConvBlock(c, pool=(i == len(channels) - 1)))
        for i, c in enumerate(channels)
    ]
    segments += [("fc", DenseBlock(hidden)), ("head", Classifier(num_classes))]
    default = tuple(n for n, _ in segments[:-1])
    return _staged.make_staged(
        "small_cnn",
        segments,
        cuts,
        default,
        input_shape=tuple(input_shape),
        input_dtype=jnp.float32,
        num_outputs=num_classes,
        task="classification",
    )
