"""Pure compressors (codecs) with static-shape payloads in the dtypes that travel.

Every codec is a :class:`Codec` of three pure functions::

  state = codec.init(x)
  payload, state = codec.compress(x, state, key)
  x_hat = codec.decompress(payload, like)

A codec may bring its own multi-worker averaging, a :class:`ReduceProtocol` (PowerSGD does);
see :mod:`jaxcomp.compressors._protocol` for that contract and its state layout
(:class:`PerWorker`). See :mod:`jaxcomp.feedback` for error-feedback channels built on top of them.
"""

from jaxcomp.compressors._base import Codec
from jaxcomp.compressors._base import CodecState
from jaxcomp.compressors._base import EmptyState
from jaxcomp.compressors._base import Reduction
from jaxcomp.compressors._base import add_decoded
from jaxcomp.compressors._base import compress_and_decode
from jaxcomp.compressors._base import compress_into
from jaxcomp.compressors._base import decode_sum
from jaxcomp.compressors._base import dense_bytes
from jaxcomp.compressors._base import payload_shape
from jaxcomp.compressors._base import wire_bytes
from jaxcomp.compressors._bitpack import packed_size
from jaxcomp.compressors._cast import cast
from jaxcomp.compressors._cast import identity
from jaxcomp.compressors._compose import ComposedState
from jaxcomp.compressors._compose import compose
from jaxcomp.compressors._low_rank import LowRankPayload
from jaxcomp.compressors._low_rank import PowerSGDState
from jaxcomp.compressors._low_rank import effective_rank
from jaxcomp.compressors._power_sgd import LowRankReduce
from jaxcomp.compressors._power_sgd import power_sgd
from jaxcomp.compressors._power_sgd import power_sgd_protocol
from jaxcomp.compressors._protocol import PerWorker
from jaxcomp.compressors._protocol import ReduceProtocol
from jaxcomp.compressors._protocol import axis_size
from jaxcomp.compressors._protocol import per_worker
from jaxcomp.compressors._protocol import this_worker
from jaxcomp.compressors._protocol import worker_key
from jaxcomp.compressors._quantize import QuantizedPayload
from jaxcomp.compressors._quantize import quantize
from jaxcomp.compressors._rand_k import RandKPayload
from jaxcomp.compressors._rand_k import rand_k
from jaxcomp.compressors._sign import sign
from jaxcomp.compressors._sparse import SparsePayload
from jaxcomp.compressors._sparse import kept_count
from jaxcomp.compressors._sparse import top_k

__all__ = (
    "Codec",
    "CodecState",
    "ComposedState",
    "EmptyState",
    "LowRankPayload",
    "LowRankReduce",
    "PerWorker",
    "PowerSGDState",
    "QuantizedPayload",
    "ReduceProtocol",
    "RandKPayload",
    "Reduction",
    "SparsePayload",
    "add_decoded",
    "axis_size",
    "cast",
    "compose",
    "compress_and_decode",
    "compress_into",
    "decode_sum",
    "dense_bytes",
    "effective_rank",
    "identity",
    "kept_count",
    "packed_size",
    "payload_shape",
    "per_worker",
    "power_sgd",
    "power_sgd_protocol",
    "quantize",
    "rand_k",
    "sign",
    "this_worker",
    "top_k",
    "wire_bytes",
    "worker_key",
)
