"""jaxcomp: communication-compressed distributed training in JAX.

* :mod:`jaxcomp.compressors`: pure codecs with static, wire-dtype payloads.
* :mod:`jaxcomp.feedback`: error-feedback channels (EF, EF21, AQ-SGD) with explicit state.
* :mod:`jaxcomp.comm`: mesh axes, compressed sends and means, per-worker gradients, the HLO
  wire-byte meter.
* :mod:`jaxcomp.pipeline`: GPipe over a ``stage`` mesh axis with compressed boundaries, and its
  single-device simulation.
* :mod:`jaxcomp.transforms`: optax transforms — ``compressed_mean``, ``accordion``,
  ``accordion_batch_size``, ``ab_training``.

The training harness (``jaxcomp.models``, ``jaxcomp.data``, ``jaxcomp.train``, ``python -m
jaxcomp.main``) and benchmarks (``python -m jaxcomp.bench``) are imported on demand.
"""

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import pipeline
from jaxcomp import transforms
from jaxcomp.comm import measure_collectives
from jaxcomp.compressors import wire_bytes

__version__ = "0.1.0"

__all__ = (
    "comm",
    "compressors",
    "feedback",
    "measure_collectives",
    "pipeline",
    "transforms",
    "wire_bytes",
)
