"""Moving payloads over mesh axes, and measuring what moved.

* mesh axis names (:data:`STAGE`, :data:`DATA`, :data:`GROUP`, :data:`MEMBER`) and
  :func:`make_mesh`;
* per-worker gradients inside ``shard_map`` without the hidden all-reduce
  (:func:`local_value_and_grad`);
* the wire-byte meter that reads compiled HLO (:func:`measure_collectives`);
* compressed means over a data axis, the collective chosen by the codec
  (:func:`compressed_pmean`, :func:`init_reduce`).
"""

from jaxcomp.comm._hlo import (
    CollectiveRecord,
    CollectiveReport,
    collective_report,
    measure_collectives,
)
from jaxcomp.comm._local import local_value_and_grad, to_varying, varying_axes
from jaxcomp.comm._mesh import DATA, GROUP, MEMBER, STAGE, make_mesh
from jaxcomp.comm._reduce import DenseReduce
from jaxcomp.comm._reduce import GatherReduce
from jaxcomp.comm._reduce import LowRankReduce
from jaxcomp.comm._reduce import PsumReduce
from jaxcomp.comm._reduce import TwoPhaseReduce
from jaxcomp.comm._reduce import compressed_pmean
from jaxcomp.comm._reduce import dense_round
from jaxcomp.comm._reduce import init_reduce
from jaxcomp.comm._reduce import plan_path
from jaxcomp.comm._reduce import reduce_bytes

__all__ = (
    "DATA",
    "GROUP",
    "MEMBER",
    "STAGE",
    "CollectiveRecord",
    "CollectiveReport",
    "DenseReduce",
    "GatherReduce",
    "LowRankReduce",
    "PsumReduce",
    "TwoPhaseReduce",
    "collective_report",
    "compressed_pmean",
    "dense_round",
    "init_reduce",
    "local_value_and_grad",
    "make_mesh",
    "measure_collectives",
    "plan_path",
    "reduce_bytes",
    "to_varying",
    "varying_axes",
)
