"""Pipeline-parallel training with compressed activations and activation-gradients.

A model cut into ``S`` stages (:class:`StagedModel`) runs as a GPipe or 1F1B schedule
(``PipelineConfig.schedule``) over the ``stage`` axis of a ``shard_map`` mesh
(:func:`distribute`), or on one device with the same compression at the cut points
(:func:`simulate`, same numbers for the same keys). Each boundary has a
:class:`Link`: a forward channel for the activations, a backward channel for their gradients
(any codec or feedback channel from :mod:`jaxcomp.compressors` / :mod:`jaxcomp.feedback`), and
the backward mode (``"independent"`` or ``"shared_mask"``)::

  config = pipeline.PipelineConfig(num_microbatches=8, links=links, schedule="1f1b")
  pipe = pipeline.distribute(model, config, mesh)
  params = pipeline.pack_params(stage_params, NamedSharding(mesh, P("stage")))
  link_states = pipe.init(params, batch)
  loss, grads, link_states, metrics = pipe.step(params, batch, link_states, key)
  loss, metrics, logits = pipe.evaluate(params, batch, compress=False)

Contracts:

* **Stages** are pure ``stage_fn(params, x) -> y`` on a microbatch (leading axis kept), with
  any parameter pytree and boundary shape per stage. ``loss_fn(y, labels) -> loss | (loss,
  metrics)`` on the last stage, microbatch means. A *stateful* model (BatchNorm running
  statistics: ``StagedModel(stateful=True, eval_stages=...)``, or a Flax model built with
  ``norm="batch"``) has stages ``stage_fn(params, state, x) -> (y, new_state)``; each stage's
  state lives in the link states on the stage's device (``pipe.init(params, batch,
  model_state)``), updated by every real microbatch's forward in microbatch order (never by a
  bubble tick), and ``pipe.evaluate(..., states=link_states)`` normalises with it.
* **Flax NNX**: :func:`nnx_stages` splits one ``nnx.Module`` per stage into the stage
  functions, parameters and (BatchNorm) model state, and merges the trained ones back.
* **Optimizers** apply to :class:`PackedParams` as to any pytree (elementwise updates and
  global norms are exact); :func:`unpacked` gives one the parameters by name, stage by stage
  (``optax.masked`` / ``multi_transform`` by name, per-leaf trust ratios).
* **Batches** are dicts with inputs under ``"x"``/``"inputs"``, labels under
  ``"label"``/``"labels"``/``"targets"``/``"y"`` and sample ids under ``"ids"`` (required by
  per-sample channels such as AQ-SGD). The batch is cut into ``M`` equal microbatches.
* **Link states** (:class:`LinkStates`, from ``pipe.init``) go in and out of every step: EF
  residuals and EF21 estimates in both directions, AQ-SGD caches at sender and receiver. Each
  device holds only the ends it owns (boundary ``b``'s activation sender and gradient receiver
  on stage ``b``, the other two on ``b + 1``), packed per dtype with a leading stage axis
  (``[S, D, ...]`` with ``D > 1`` data replicas); ``LinkStates.ends()`` reads them back as one
  :class:`LinkState` per boundary. With ``PipelineConfig.replica_mean`` they also carry each
  stage's state of the replica-averaging transform.
  ``compress=False`` sends dense and lets the channels observe it (AQ-SGD warm-up).
* **Metrics**: ``loss``, the ``loss_fn`` metrics, and the theoretical ``wire_bytes`` (forward +
  backward payloads per step) and ``dense_bytes``; exact counts from ``pipe.bytes_per_step``.
  With data replicas also ``data_wire_bytes`` / ``data_dense_bytes`` (the gradient average;
  with a ``(slow, fast)`` pair of data axes, ``distribute(..., data_axis=(slow, fast))``,
  ``data_wire_bytes`` is the slow axis's and ``data_fast_wire_bytes`` the fast one's).
  With per-sample buffers (AQ-SGD, per-sample EF/EF21) a compressed training step also reports
  ``cold_sends``: the sends whose sender's row this replica never filled (summed over
  boundaries, replicas and microbatches; each device keeps a local ``uint8`` flag per sample,
  ``seen[N rows]`` in the link states, never sent). It is 0 when every sample comes back to
  the replica that filled its row; a revisit that meets a cold row was fed to another replica
  or keyed by a wrong id, and AQ-SGD then sends plain compression of the whole activation.
"""

from jaxcomp._regime import HIGH_COMPRESSION
from jaxcomp._regime import LOW_COMPRESSION
from jaxcomp._regime import Detector
from jaxcomp.pipeline._adaptive import AdaptiveLink
from jaxcomp.pipeline._adaptive import DetectorState
from jaxcomp.pipeline._adaptive import adaptive_link
from jaxcomp.pipeline._adaptive import link_modes
from jaxcomp.pipeline._build import Pipeline
from jaxcomp.pipeline._build import distribute
from jaxcomp.pipeline._build import gpipe as gpipe  # deprecated alias of distribute; not in __all__
from jaxcomp.pipeline._build import simulate
from jaxcomp.pipeline._config import Link
from jaxcomp.pipeline._config import PipelineConfig
from jaxcomp.pipeline._config import StagedModel
from jaxcomp.pipeline._config import link
from jaxcomp.pipeline._config import pipeline_mesh
from jaxcomp.pipeline._link_state import LinkState
from jaxcomp.pipeline._link_state import LinkStates
from jaxcomp.pipeline._links import link_key
from jaxcomp.pipeline._nnx import NNXStages
from jaxcomp.pipeline._nnx import nnx_stages
from jaxcomp.pipeline._params import PackedParams
from jaxcomp.pipeline._params import ParamLayout
from jaxcomp.pipeline._params import pack_params
from jaxcomp.pipeline._params import param_layout
from jaxcomp.pipeline._params import unpacked
from jaxcomp.pipeline._schedule import SCHEDULES
from jaxcomp.pipeline._schedule import bubble_fraction
from jaxcomp.pipeline._schedule import gpipe_segments
from jaxcomp.pipeline._schedule import in_flight
from jaxcomp.pipeline._schedule import ticks

__all__ = (
    "HIGH_COMPRESSION",
    "LOW_COMPRESSION",
    "SCHEDULES",
    "AdaptiveLink",
    "Detector",
    "DetectorState",
    "Link",
    "LinkState",
    "LinkStates",
    "NNXStages",
    "PackedParams",
    "ParamLayout",
    "Pipeline",
    "PipelineConfig",
    "StagedModel",
    "adaptive_link",
    "bubble_fraction",
    "distribute",
    "gpipe_segments",
    "in_flight",
    "link",
    "link_key",
    "link_modes",
    "nnx_stages",
    "pack_params",
    "param_layout",
    "pipeline_mesh",
    "simulate",
    "ticks",
    "unpacked",
)
