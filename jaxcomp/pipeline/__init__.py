"""Pipeline-parallel training with compressed activations and activation-gradients.

A model cut into ``S`` stages (:class:`StagedModel`) runs as a GPipe schedule over the ``stage``
axis of a ``shard_map`` mesh (:func:`gpipe`), or on one device with the same compression at the
cut points (:func:`simulate`). Each boundary has a :class:`Link`: a forward channel for the
activations, a backward channel for their gradients (any codec or feedback channel from
:mod:`jaxcomp.compressors` / :mod:`jaxcomp.feedback`), and the backward mode (independent or
shared TopK mask). Every link state goes in and out of the pure step function::

  pipe = pipeline.gpipe(model, pipeline.PipelineConfig(num_microbatches=8, links=links), mesh)
  link_states = pipe.init(params, batch)
  loss, grads, link_states, metrics = pipe.step(params, batch, link_states, key)
"""

from jaxcomp.pipeline._config import Link
from jaxcomp.pipeline._config import PipelineConfig
from jaxcomp.pipeline._config import StagedModel
from jaxcomp.pipeline._config import link
from jaxcomp.pipeline._config import pipeline_mesh
from jaxcomp.pipeline._gpipe import gpipe
from jaxcomp.pipeline._links import LinkState
from jaxcomp.pipeline._links import link_key
from jaxcomp.pipeline._params import PackedParams
from jaxcomp.pipeline._params import ParamLayout
from jaxcomp.pipeline._params import pack_params
from jaxcomp.pipeline._params import param_layout
from jaxcomp.pipeline._prepare import Pipeline
from jaxcomp.pipeline._schedule import bubble_fraction
from jaxcomp.pipeline._schedule import gpipe_segments
from jaxcomp.pipeline._simulate import simulate

__all__ = (
    "Link",
    "LinkState",
    "PackedParams",
    "ParamLayout",
    "Pipeline",
    "PipelineConfig",
    "StagedModel",
    "bubble_fraction",
    "gpipe",
    "gpipe_segments",
    "link",
    "link_key",
    "pack_params",
    "param_layout",
    "pipeline_mesh",
    "simulate",
)
