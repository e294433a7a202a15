"""ResNet-18, CIFAR variant (3x3 stem, no max-pool), as in Rudakov et al.'s experiments."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from jaxcomp import _validate
from jaxcomp.models import _norm as _norms
from jaxcomp.models import _staged


class Stem(nn.Module):
    """``Conv 3x3 (stride 1) -> norm -> ReLU``."""

    features: int
    norm: str = "batch"
    batch_axis: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.features, (3, 3), padding="SAME", use_bias=False)(x)
        return nn.relu(_norms.layer(self.norm, train, self.batch_axis)(x))


class BasicBlock(nn.Module):
    """The two-conv residual block with a 1x1 projection shortcut when the shape changes."""

    features: int
    stride: int = 1
    norm: str = "batch"
    batch_axis: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        conv = functools.partial(nn.Conv, use_bias=False, padding="SAME")
        y = conv(self.features, (3, 3), strides=self.stride)(x)
        y = nn.relu(_norms.layer(self.norm, train, self.batch_axis)(y))
        y = conv(self.features, (3, 3))(y)
        y = _norms.layer(self.norm, train, self.batch_axis)(y)
        if self.stride != 1 or x.shape[-1] != self.features:
            x = conv(self.features, (1, 1), strides=self.stride)(x)
            x = _norms.layer(self.norm, train, self.batch_axis)(x)
        return nn.relu(y + x)


class ResLayer(nn.Module):
    """``blocks`` basic blocks; the first one may downsample."""

    features: int
    blocks: int = 2
    stride: int = 1
    norm: str = "batch"
    batch_axis: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        for i in range(self.blocks):
            stride = self.stride if i == 0 else 1
            x = BasicBlock(self.features, stride, self.norm, self.batch_axis)(x, train)
        return x


class PoolHead(nn.Module):
    """Global average pool and a linear classifier."""

    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


def resnet18(
    num_classes: int = 10,
    *,
    input_shape: Sequence[int] = (32, 32, 3),
    width: int = 64,
    blocks: Sequence[int] = (2, 2, 2, 2),
    norm: str = "batch",
    cuts: Sequence[str] | None = None,
) -> _staged.StagedModel:
    """ResNet-18 for 32x32 images (kuangliu/pytorch-cifar): 11.17M parameters at width 64.

    Segments ``stem, layer1, layer2, layer3, layer4, head``. Paper 1 cuts after layer1, layer2
    and layer3: ``stem+layer1 | layer2 | layer3 | layer4+head``, with per-sample activations of
    (32,32,64), (16,16,128) and (8,8,256) at the cuts.

    Args:
      num_classes: classifier outputs.
      input_shape: image shape ``(H, W, C)``.
      width: channels of layer1 (doubled at each later layer). ``width=8`` is the test size.
      blocks: basic blocks per layer.
      norm: ``"batch"`` (the reference; its running statistics are model state: per worker,
        or synchronised with :meth:`StagedModel.with_batch_axis`), ``"group"`` (groups of 8
        channels) or ``"layer"`` (see :func:`jaxcomp.models._norm.layer`).
      cuts: segment names to cut after (default: paper 1's ``layer1, layer2, layer3``);
        ``()`` for a single stage.

    Returns:
      A :class:`StagedModel`.

    References:
      He et al., `Deep Residual Learning for Image Recognition
      <https://arxiv.org/abs/1512.03385>`_, 2016.
    """
    _validate.check_choice("norm", norm, _norms.NORMS)
    segments = [("stem", Stem(width, norm))]
    for i, n in enumerate(blocks):
        segments.append((f"layer{i + 1}", ResLayer(width * 2**i, n, 1 if i == 0 else 2, norm)))
    segments.append(("head", PoolHead(num_classes)))
    return _staged.make_staged(
        "resnet18",
        segments,
        cuts,
        ("layer1", "layer2", "layer3"),
        input_shape=tuple(input_shape),
        input_dtype=jnp.float32,
        num_outputs=num_classes,
        task="classification",
    )
