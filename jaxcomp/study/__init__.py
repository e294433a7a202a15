"""Studies: grids of config overrides x seeds run one after another, their comparison report,
and the alpha-beta cost model that predicts whether compression pays on a given link.

* :mod:`~jaxcomp.study` cost model: :func:`link`, :func:`collective_time`,
  :func:`communication_time`, :func:`step_time`, :func:`pipeline_step_time`,
  :func:`predicted_speedups`.
"""

from jaxcomp.study._cost import DEFAULT_LATENCY_S
from jaxcomp.study._cost import GBIT_PER_S
from jaxcomp.study._cost import KINDS
from jaxcomp.study._cost import SCHEDULES
from jaxcomp.study._cost import Collective
from jaxcomp.study._cost import Link
from jaxcomp.study._cost import collective_time
from jaxcomp.study._cost import communication_time
from jaxcomp.study._cost import link
from jaxcomp.study._cost import pipeline_step_time
from jaxcomp.study._cost import predicted_speedups
from jaxcomp.study._cost import speedup
from jaxcomp.study._cost import step_time

__all__ = (
    "DEFAULT_LATENCY_S",
    "GBIT_PER_S",
    "KINDS",
    "SCHEDULES",
    "Collective",
    "Link",
    "collective_time",
    "communication_time",
    "link",
    "pipeline_step_time",
    "predicted_speedups",
    "speedup",
    "step_time",
)
