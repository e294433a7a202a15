"""Optax gradient transformations for communication-compressed data-parallel training.

* :func:`compressed_mean`: average per-worker gradients over the data axis through a codec or
  error-feedback channel (the collective follows the codec).
* :func:`accordion`: per-parameter switching between a low- and a high-compression codec in
  and out of critical learning regimes (Agarwal et al., 2021);
  :func:`accordion_batch_size`: the same detector choosing the batch size.
* :func:`ab_training`: AB-Training, group-local training of low-rank factors ``W = A·B`` with
  periodic syncs (Coquelin et al., 2024), configured by an :class:`ABConfig`.

Only gradient transformations and their states, metrics and configs live here; the step
builders that run them over a mesh (``data_parallel``, ``ab_data_parallel``, ``ab_mesh``, ...)
are in :mod:`jaxcomp.parallel`.
"""

from jaxcomp._regime import critical_regime
from jaxcomp.ab._config import ABConfig
from jaxcomp.ab._config import group_sizes
from jaxcomp.ab._metrics import ab_metrics
from jaxcomp.ab._metrics import ab_step_bytes
from jaxcomp.ab._schedule import ABPhase
from jaxcomp.ab._schedule import ABSchedule
from jaxcomp.ab._step import ABTrainingState
from jaxcomp.ab._transform import ab_training
from jaxcomp.ab._transform import ab_transform
from jaxcomp.transforms._accordion import HIGH_COMPRESSION
from jaxcomp.transforms._accordion import LOW_COMPRESSION
from jaxcomp.transforms._accordion import UNCOMPRESSED
from jaxcomp.transforms._accordion import AccordionLeaf
from jaxcomp.transforms._accordion import AccordionState
from jaxcomp.transforms._accordion import accordion
from jaxcomp.transforms._accordion import accordion_metrics
from jaxcomp.transforms._batch_size import AccordionBatchState
from jaxcomp.transforms._batch_size import accordion_batch_size
from jaxcomp.transforms._batch_size import batch_size_metrics
from jaxcomp.transforms._compressed_mean import CompressedMeanState
from jaxcomp.transforms._compressed_mean import compressed_mean

__all__ = (
    "ABConfig",
    "ABPhase",
    "ABSchedule",
    "ABTrainingState",
    "ab_metrics",
    "ab_step_bytes",
    "ab_training",
    "ab_transform",
    "group_sizes",
    "HIGH_COMPRESSION",
    "LOW_COMPRESSION",
    "UNCOMPRESSED",
    "AccordionBatchState",
    "AccordionLeaf",
    "AccordionState",
    "CompressedMeanState",
    "accordion",
    "accordion_batch_size",
    "accordion_metrics",
    "batch_size_metrics",
    "compressed_mean",
    "critical_regime",
)
