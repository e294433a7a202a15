"""VGG-16 for 32x32 images (the CIFAR variant used for AB-Training)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from jaxcomp import _validate
from jaxcomp.models import _norm as _norms
from jaxcomp.models import _staged

#: channels of the 13 convolutions, grouped into the five pooling blocks
VGG16_BLOCKS = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


class VGGBlock(nn.Module):
    """``[Conv 3x3 -> (norm ->) ReLU] * n -> MaxPool 2x2``; convs are named ``conv1``,
    ``conv2``, ..., their norms ``norm1``, ``norm2``, ..."""

    channels: tuple[int, ...]
    norm: str | None = None
    batch_axis: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        for i, c in enumerate(self.channels):
            x = nn.Conv(c, (3, 3), padding="SAME", name=f"conv{i + 1}")(x)
            if self.norm is not None:
                x = _norms.layer(self.norm, train, self.batch_axis, f"norm{i + 1}")(x)
            x = nn.relu(x)
        return nn.max_pool(x, (2, 2), (2, 2))


class FlatHead(nn.Module):
    """Flatten and a linear classifier (the 1x1x512 map of a 32x32 input -> classes)."""

    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        return nn.Dense(self.num_classes, name="fc")(x.reshape(x.shape[0], -1))


def vgg16(
    num_classes: int = 10,
    *,
    input_shape: Sequence[int] = (32, 32, 3),
    width_divisor: int = 1,
    norm: str | None = None,
    cuts: Sequence[str] | None = None,
) -> _staged.StagedModel:
    """VGG-16 without BatchNorm (timm's ``vgg16`` features, as AB-Training's CIFAR-10 runs: its
    SyncBatchNorm conversion finds no BatchNorm there), or with one after every conv
    (``norm="batch"``: timm's ``vgg16_bn``), with kuangliu's single linear classifier for
    32x32 inputs: 14.7M parameters.

    Segments ``block1 ... block5, head``; the first conv is ``block1/conv1`` and the classifier
    ``head/fc`` (the layers AB-Training keeps full-rank).

    Args:
      num_classes: classifier outputs.
      input_shape: image shape ``(H, W, C)``; H and W must be multiples of 32.
      width_divisor: divides every channel count (``8`` or ``16`` for tests).
      norm: ``None`` (the reference), ``"batch"`` (running statistics as model state, per
        worker or synchronised with :meth:`StagedModel.with_batch_axis`), ``"group"`` or
        ``"layer"``: a normalisation between each conv and its ReLU.
      cuts: segment names to cut after (default: none, one stage).

    References:
      Simonyan and Zisserman, `Very Deep Convolutional Networks for Large-Scale Image
      Recognition <https://arxiv.org/abs/1409.1556>`_, 2015.
    """
    if not isinstance(width_divisor, int) or width_divisor < 1 or 64 % width_divisor:
        raise ValueError(f"width_divisor must be a positive divisor of 64; got {width_divisor!r}.")
    if norm is not None:
        _validate.check_choice("norm", norm, _norms.NORMS)
    segments = [
        (f"block{i + 1}", VGGBlock(tuple(c // width_divisor for c in chans), norm))
        for i, chans in enumerate(VGG16_BLOCKS)
    ]
    segments.append(("head", FlatHead(num_classes)))
    return _staged.make_staged(
        "vgg16",
        segments,
        cuts,
        (),
        input_shape=tuple(input_shape),
        input_dtype=jnp.float32,
        num_outputs=num_classes,
        task="classification",
    )
