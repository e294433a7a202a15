"""Model lookup by name, for configs (``config.model_name`` + ``config.model`` kwargs)."""

from __future__ import annotations

import inspect
from typing import Any

from jaxcomp.models import _gpt
from jaxcomp.models import _mlp
from jaxcomp.models import _nnx
from jaxcomp.models import _resnet
from jaxcomp.models import _staged
from jaxcomp.models import _vgg

MODELS = {
    "mlp": _mlp.mlp,
    "small_cnn": _mlp.small_cnn,
    "resnet18": _resnet.resnet18,
    "vgg16": _vgg.vgg16,
    "gpt": _gpt.gpt,
    "nnx_mlp": _nnx.nnx_mlp,
}


def get_model(name: str, **kwargs: Any) -> _staged.StagedModel:
    """Builds the model ``name`` with ``kwargs``.

    Raises:
      ValueError: naming the unknown model or keyword and listing the allowed ones.

    Example:
      >>> get_model("mlp", hidden=(32, 32, 32)).num_stages
      4
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed models are {sorted(MODELS)}.")
    factory = MODELS[name]
    allowed = set(inspect.signature(factory).parameters)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(
            f"unknown argument(s) {unknown} for model {name!r}; allowed are {sorted(allowed)}."
        )
    return factory(**kwargs)
