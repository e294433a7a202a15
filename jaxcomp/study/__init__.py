"""Studies: grids of config overrides x seeds run one after another, their comparison report,
and the alpha-beta cost model that predicts whether compression pays on a given link.

* Studies (``configs/studies/NAME.py``, run with ``python -m jaxcomp.study run NAME --workdir
  DIR``): :func:`load_study`, :func:`cells`, :func:`direction_presets`,
  :func:`preset_overrides`, :func:`select`, :func:`run_study`.
* The report: :func:`write_report` (markdown table, CSVs, PNG plots), :func:`read_runs`,
  :func:`aggregate`.
* The cost model: :func:`network_link`, :func:`collective_time`, :func:`communication_time`,
  :func:`step_time`, :func:`pipeline_step_time`, :func:`predicted_speedups`.
"""

from jaxcomp.study._cost import DEFAULT_LATENCY_S
from jaxcomp.study._cost import GBIT_PER_S
from jaxcomp.study._cost import KINDS
from jaxcomp.study._cost import SCHEDULES
from jaxcomp.study._cost import Collective
from jaxcomp.study._cost import NetworkLink
from jaxcomp.study._cost import collective_time
from jaxcomp.study._cost import communication_time
from jaxcomp.study._cost import network_link
from jaxcomp.study._cost import pipeline_step_time
from jaxcomp.study._cost import predicted_speedups
from jaxcomp.study._cost import speedup
from jaxcomp.study._cost import step_time
from jaxcomp.study._grid import OPTIMIZERS
from jaxcomp.study._grid import PRESETS
from jaxcomp.study._grid import SMOKE
from jaxcomp.study._grid import Cell
from jaxcomp.study._grid import Study
from jaxcomp.study._grid import cell_config
from jaxcomp.study._grid import cells
from jaxcomp.study._grid import direction_presets
from jaxcomp.study._grid import load_study
from jaxcomp.study._grid import optimizer_axis
from jaxcomp.study._grid import preset_overrides
from jaxcomp.study._grid import select
from jaxcomp.study._report import Run
from jaxcomp.study._report import aggregate
from jaxcomp.study._report import read_runs
from jaxcomp.study._runner import run_study
from jaxcomp.study._write import write_report

__all__ = (
    "DEFAULT_LATENCY_S",
    "PRESETS",
    "SMOKE",
    "Cell",
    "Run",
    "Study",
    "aggregate",
    "cell_config",
    "cells",
    "direction_presets",
    "optimizer_axis",
    "OPTIMIZERS",
    "load_study",
    "preset_overrides",
    "select",
    "read_runs",
    "run_study",
    "write_report",
    "GBIT_PER_S",
    "KINDS",
    "SCHEDULES",
    "Collective",
    "NetworkLink",
    "collective_time",
    "communication_time",
    "network_link",
    "pipeline_step_time",
    "predicted_speedups",
    "speedup",
    "step_time",
)
