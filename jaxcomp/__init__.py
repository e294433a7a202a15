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

Imports only go down: compressors → feedback → comm → ab (AB-Training, re-exported by
transforms and parallel) → pipeline / transforms → parallel → models, data, train → bench,
study → lab.

The training harness (:mod:`jaxcomp.models`, :mod:`jaxcomp.data`, :mod:`jaxcomp.train`,
``python -m jaxcomp.main``), the studies (:mod:`jaxcomp.study`, ``python -m jaxcomp.study``)
and the network lab (:mod:`jaxcomp.lab`, ``python -m jaxcomp.lab``: real multi-host runs on
rate-limited links) are imported on first attribute access, so ``import jaxcomp`` stays
light (no Flax model zoo, scikit-learn, orbax or matplotlib); benchmarks run with
``python -m jaxcomp.bench``. What jaxcomp does only for XLA's CPU backend (the host allocator,
BLAS threads, compile options, CPU-only kernel forms) is private, behind one door
(``jaxcomp._cpu``), switched on by the entry points.
"""

# first: under `python -m jaxcomp.main` it records Ctrl-C from here on (importing JAX drops
# KeyboardInterrupt); otherwise it changes nothing
from jaxcomp import _early_signals  # noqa: F401, I001

import importlib
import warnings

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import parallel
from jaxcomp import pipeline
from jaxcomp import transforms
from jaxcomp.comm import measure_collectives
from jaxcomp.compressors import wire_bytes

__version__ = "0.1.0"

_LAZY_SUBPACKAGES = ("data", "models", "train", "study", "lab")
# no longer public (behind the CPU door): deprecated aliases for one release, not in __all__
_DEPRECATED = {"tune_host_malloc": "tune_host_malloc", "HostMalloc": "HostMalloc"}


def __getattr__(name):
    if name in _LAZY_SUBPACKAGES:
        return importlib.import_module(f"jaxcomp.{name}")
    if name in _DEPRECATED:
        warnings.warn(
            f"jaxcomp.{name} is deprecated and will be removed in the next release: the entry "
            "points set the host allocator (--host_malloc=keep or JAXCOMP_HOST_MALLOC=keep); "
            f"a script may call the private jaxcomp._cpu.{_DEPRECATED[name]}.",
            DeprecationWarning,
            stacklevel=2,
        )
        from jaxcomp import _cpu

        return getattr(_cpu, _DEPRECATED[name])
    raise AttributeError(f"module 'jaxcomp' has no attribute {name!r}")


__all__ = (
    "comm",
    "compressors",
    "data",
    "feedback",
    "lab",
    "measure_collectives",
    "models",
    "parallel",
    "pipeline",
    "study",
    "train",
    "transforms",
    "wire_bytes",
)
