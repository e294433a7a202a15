"""jaxcomp: communication-compressed distributed training in JAX.

* :mod:`jaxcomp.compressors`: pure codecs with static, wire-dtype payloads.
* :mod:`jaxcomp.feedback`: error-feedback channels (EF, EF21, AQ-SGD) with explicit state.
* :mod:`jaxcomp.comm`: mesh axes, compressed sends and means, per-worker gradients, the HLO
  wire-byte meter.
* :mod:`jaxcomp.pipeline`: GPipe over a ``stage`` mesh axis with compressed boundaries, and its
  single-device simulation.
* :mod:`jaxcomp.transforms`: optax gradient transformations only — ``compressed_mean``,
  ``accordion``, ``accordion_batch_size``, ``ab_training``.
* :mod:`jaxcomp.parallel`: step builders that run them over a mesh — ``data_parallel``,
  ``ab_data_parallel`` and the AB ``(group, member)`` mesh helpers.

Imports only go down: compressors → feedback → comm → pipeline / transforms → parallel →
models, data, train → bench, study.

The training harness (:mod:`jaxcomp.models`, :mod:`jaxcomp.data`, :mod:`jaxcomp.train`,
``python -m jaxcomp.main``) and the studies (:mod:`jaxcomp.study`, ``python -m jaxcomp.study``)
are imported on first attribute access, so ``import jaxcomp`` stays
light (no Flax model zoo, scikit-learn, orbax or matplotlib); benchmarks run with
``python -m jaxcomp.bench``. :func:`tune_host_malloc` keeps freed host memory mapped for
reuse (glibc; the command-line entry points call it; a CPU training script may too).
"""

# first: under `python -m jaxcomp.main` it records Ctrl-C from here on (importing JAX drops
# KeyboardInterrupt); otherwise it changes nothing
from jaxcomp import _early_signals  # noqa: F401, I001

import importlib

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import parallel
from jaxcomp import pipeline
from jaxcomp import transforms
from jaxcomp._host_malloc import HostMalloc
from jaxcomp._host_malloc import tune_host_malloc
from jaxcomp.comm import measure_collectives
from jaxcomp.compressors import wire_bytes

__version__ = "0.1.0"

_LAZY_SUBPACKAGES = ("data", "models", "train", "study")


def __getattr__(name):
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f"jaxcomp.{name}")
    raise AttributeError(f"module 'jaxcomp' has no attribute {name!r}")


__all__ = (
    "HostMalloc",
    "comm",
    "compressors",
    "data",
    "feedback",
    "measure_collectives",
    "models",
    "parallel",
    "pipeline",
    "study",
    "train",
    "transforms",
    "tune_host_malloc",
    "wire_bytes",
)
