"""Flax models cut into pipeline stages at named points.

Every model is a :class:`FlaxStagedModel`: an ordered list of named segments cut after the
names in ``cuts``. It is a :class:`StagedModel` (the class of :mod:`jaxcomp.pipeline`, re-exported
here): ``stages`` are the pure ``stage_fn(params, x) -> y`` the pipeline runs, ``loss_fn`` the
mean cross-entropy, so ``pipeline.distribute(models.get_model(...), config, mesh)`` works as is;
``apply`` runs the whole model (with BatchNorm statistics, for data-parallel modes). A model
with BatchNorm (``resnet18(norm="batch")``, the default; ``vgg16(norm="batch")``) is a
*stateful* StagedModel: its stages take and return their running statistics
(``stateful_stage_fns``), which the pipeline keeps per stage.

=============  =========================================  ==================================
model          segments                                   default cuts (stages)
=============  =========================================  ==================================
``mlp``        ``fc1 fc2 fc3 head``                        every hidden layer (4)
``small_cnn``  ``conv1 conv2 fc head``                     every segment but the head (4)
``resnet18``   ``stem layer1 layer2 layer3 layer4 head``   ``layer1 layer2 layer3`` (4)
``vgg16``      ``block1 ... block5 head``                  none (1)
``gpt``        ``embed block0 ... block11 head``           ``block2 block5 block8`` (4)
``nnx_mlp``    ``fc1 fc2 fc3 head`` (Flax NNX)             every hidden layer (4)
=============  =========================================  ==================================

A Flax NNX model is an :class:`NNXStagedModel`: the same contract (one variables dict of
nested dicts per stage, the same stage functions), its segments built as NNX modules.

:func:`factored_dense` is AB-Training's factorised forward for any Flax model's ``nn.Dense``
layers (``parallel.ab_data_parallel(..., factored_forward=models.factored_dense)``).
"""

from jaxcomp.models._factored import factored_dense
from jaxcomp.models._gpt import gpt
from jaxcomp.models._mlp import mlp
from jaxcomp.models._mlp import small_cnn
from jaxcomp.models._nnx import NNXStagedModel
from jaxcomp.models._nnx import nnx_mlp
from jaxcomp.models._registry import MODELS
from jaxcomp.models._registry import get_model
from jaxcomp.models._resnet import resnet18
from jaxcomp.models._staged import Chain
from jaxcomp.models._staged import FlaxStagedModel
from jaxcomp.models._staged import StagedModel
from jaxcomp.models._staged import accuracy
from jaxcomp.models._staged import cross_entropy
from jaxcomp.models._vgg import vgg16

__all__ = (
    "MODELS",
    "Chain",
    "FlaxStagedModel",
    "NNXStagedModel",
    "StagedModel",
    "accuracy",
    "cross_entropy",
    "factored_dense",
    "get_model",
    "gpt",
    "mlp",
    "nnx_mlp",
    "resnet18",
    "small_cnn",
    "vgg16",
)
