"""Moving payloads over mesh axes, and measuring what moved.

* mesh axis names (:data:`STAGE`, :data:`DATA`, :data:`GROUP`, :data:`MEMBER`) and
  :func:`make_mesh`;
* per-worker gradients inside ``shard_map`` without the hidden all-reduce
  (:func:`local_value_and_grad`);
* the wire-byte meter that reads compiled HLO (:func:`measure_collectives`);
* compressed means over a data axis, the collective chosen by the codec
  (:func:`compressed_pmean`, :func:`init_reduce`);
* compressed point-to-point sends whose backward is compressed too (:func:`compressed_ppermute`,
  and :func:`compressed_transfer`, its single-device simulation).
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
from jaxcomp.comm._send import ChannelStates
from jaxcomp.comm._send import backward_token
from jaxcomp.comm._send import compressed_ppermute
from jaxcomp.comm._send import compressed_transfer
from jaxcomp.comm._send import init_channel_states
from jaxcomp.comm._send import seed_backward_state

__all__ = (
    "DATA",
    "GROUP",
    "MEMBER",
    "STAGE",
    "ChannelStates",
    "CollectiveRecord",
    "CollectiveReport",
    "DenseReduce",
    "GatherReduce",
    "LowRankReduce",
    "PsumReduce",
    "TwoPhaseReduce",
    "backward_token",
    "collective_report",
    "compressed_pmean",
    "compressed_ppermute",
    "compressed_transfer",
    "dense_round",
    "init_channel_states",
    "init_reduce",
    "local_value_and_grad",
    "make_mesh",
    "measure_collectives",
    "plan_path",
    "reduce_bytes",
    "seed_backward_state",
    "to_varying",
    "varying_axes",
)
