"""Moving payloads over mesh axes, and measuring what moved.

* mesh axis names (:data:`STAGE`, :data:`DATA`, :data:`GROUP`, :data:`MEMBER`) and
  :func:`make_mesh`;
* per-worker gradients inside ``shard_map`` without the hidden all-reduce
  (:func:`local_value_and_grad`);
* the wire-byte meter that reads compiled HLO (:func:`measure_collectives`).
"""

from jaxcomp.comm._hlo import CollectiveRecord
from jaxcomp.comm._hlo import CollectiveReport
from jaxcomp.comm._hlo import collective_report
from jaxcomp.comm._hlo import measure_collectives
from jaxcomp.comm._local import local_value_and_grad
from jaxcomp.comm._local import to_varying
from jaxcomp.comm._local import varying_axes
from jaxcomp.comm._mesh import DATA
from jaxcomp.comm._mesh import GROUP
from jaxcomp.comm._mesh import MEMBER
from jaxcomp.comm._mesh import STAGE
from jaxcomp.comm._mesh import make_mesh

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
