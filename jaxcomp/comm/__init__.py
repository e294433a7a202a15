"""Moving payloads over mesh axes, and measuring what moved.

* mesh axis names (:data:`STAGE`, :data:`DATA`, :data:`GROUP`, :data:`MEMBER`) and
  :func:`make_mesh`;
* per-worker gradients inside ``shard_map`` without the hidden all-reduce
  (:func:`local_value_and_grad`);
* the wire-byte meter that reads compiled HLO (:func:`measure_collectives`);
* compressed means over a data axis: :func:`plan_reduce` gives the
  :class:`~jaxcomp.compressors.ReduceProtocol` of one array (the codec's own, or a generic
  ``psum``/``all_gather``/two-phase path, wrapped in the channel's error compensation) and
  :func:`compressed_pmean` runs it inside any ``shard_map`` body;
* per-worker state on a mesh: :func:`place_state` and :func:`state_specs` (a device's own
  part on a ``(slow, fast)`` pair: :class:`PerDevice`);
* a compressed point-to-point send's channel states (:func:`init_channel_states`; the pipeline
  runs its sends, :mod:`jaxcomp.pipeline`);
* the collective-uniformity check: every ``cond``/``switch``/``while`` holding a collective over
  axis ``a`` is decided uniformly over ``a`` (:func:`check_collective_uniformity`).
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
from jaxcomp.comm._placement import PerDevice
from jaxcomp.comm._placement import place_state
from jaxcomp.comm._placement import state_specs
from jaxcomp.comm._reduce import DenseReduce
from jaxcomp.comm._reduce import GatherReduce
from jaxcomp.comm._reduce import PsumReduce
from jaxcomp.comm._reduce import TwoPhaseReduce
from jaxcomp.comm._reduce import dense_protocol
from jaxcomp.comm._reduce import gather_protocol
from jaxcomp.comm._reduce import psum_protocol
from jaxcomp.comm._reduce import two_phase_protocol
from jaxcomp.comm._reduce_plan import PATHS
from jaxcomp.comm._reduce_plan import compressed_pmean
from jaxcomp.comm._reduce_plan import dense_round
from jaxcomp.comm._reduce_plan import plan_path
from jaxcomp.comm._reduce_plan import plan_reduce
from jaxcomp.comm._send import ChannelStates
from jaxcomp.comm._send import init_channel_states
from jaxcomp.comm._uniformity import NonUniformCollectiveError
from jaxcomp.comm._uniformity import UniformityReport
from jaxcomp.comm._uniformity import Violation
from jaxcomp.comm._uniformity import check_collective_uniformity
from jaxcomp.comm._uniformity import collective_uniformity

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
    "NonUniformCollectiveError",
    "PATHS",
    "PerDevice",
    "PsumReduce",
    "TwoPhaseReduce",
    "UniformityReport",
    "Violation",
    "check_collective_uniformity",
    "collective_uniformity",
    "collective_report",
    "compressed_pmean",
    "dense_protocol",
    "dense_round",
    "gather_protocol",
    "init_channel_states",
    "local_value_and_grad",
    "make_mesh",
    "measure_collectives",
    "place_state",
    "plan_path",
    "plan_reduce",
    "psum_protocol",
    "state_specs",
    "to_varying",
    "two_phase_protocol",
    "varying_axes",
)
