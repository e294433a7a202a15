"""Moving payloads over mesh axes, and measuring what moved.

* mesh axis names (:data:`STAGE`, :data:`DATA`, :data:`GROUP`, :data:`MEMBER`) and
  :func:`make_mesh`;
* per-worker gradients inside ``shard_map`` without the hidden all-reduce
  (:func:`local_value_and_grad`);
* the wire-byte meter that reads compiled HLO (:func:`measure_collectives`).
"""

from jaxcomp.comm._hlo import (
    CollectiveRecord,
    CollectiveReport,
    collective_report,
    measure_collectives,
)
from jaxcomp.comm._local import local_value_and_grad, to_varying, varying_axes
from jaxcomp.comm._mesh import DATA, GROUP, MEMBER, STAGE, make_mesh

__all__ = (
    "DATA",
    "GROUP",
    "MEMBER",
    "STAGE",
    "CollectiveRecord",
    "CollectiveReport",
    "collective_report",
    "local_value_and_grad",
    "make_mesh",
    "measure_collectives",
    "to_varying",
    "varying_axes",
)
