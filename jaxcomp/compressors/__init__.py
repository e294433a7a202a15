"""Pure compressors (codecs) with static-shape payloads in the dtypes that travel.

Every codec is a :class:`Codec` of three pure functions::

  state = codec.init(x)
  payload, state = codec.compress(x, state, key)
  x_hat = codec.decompress(payload, like)

See :mod:`jaxcomp.feedback` for error-feedback channels built on top of them.
"""

from jaxcomp.compressors._base import Codec
from jaxcomp.compressors._base import CodecState
from jaxcomp.compressors._base import EmptyState
from jaxcomp.compressors._base import Options
from jaxcomp.compressors._base import Reduction
from jaxcomp.compressors._base import compress_and_decode
from jaxcomp.compressors._base import decode_sum
from jaxcomp.compressors._base import dense_bytes
from jaxcomp.compressors._base import payload_shape
from jaxcomp.compressors._base import wire_bytes
from jaxcomp.compressors._bitpack import pack
from jaxcomp.compressors._bitpack import packed_size
from jaxcomp.compressors._bitpack import unpack
from jaxcomp.compressors._cast import cast
from jaxcomp.compressors._cast import identity
from jaxcomp.compressors._compose import ComposedState
from jaxcomp.compressors._compose import compose
from jaxcomp.compressors._low_rank import LowRankPayload
from jaxcomp.compressors._low_rank import PowerSGDState
from jaxcomp.compressors._low_rank import effective_rank
from jaxcomp.compressors._low_rank import matrix_shape
from jaxcomp.compressors._low_rank import orthogonalize
from jaxcomp.compressors._low_rank import power_sgd
from jaxcomp.compressors._low_rank import transposed_matmul
from jaxcomp.compressors._quantize import QuantizedPayload
from jaxcomp.compressors._quantize import quantize
from jaxcomp.compressors._quantize import sign
from jaxcomp.compressors._sparse import RandKPayload
from jaxcomp.compressors._sparse import SparsePayload
from jaxcomp.compressors._sparse import kept_count
from jaxcomp.compressors._sparse import rand_k
from jaxcomp.compressors._sparse import top_k

__all__ = (
    "Codec",
    "CodecState",
    "ComposedState",
    "EmptyState",
    "LowRankPayload",
    "Options",
    "PowerSGDState",
    "QuantizedPayload",
    "RandKPayload",
    "Reduction",
    "SparsePayload",
    "cast",
    "compose",
    "compress_and_decode",
    "decode_sum",
    "dense_bytes",
    "effective_rank",
    "identity",
    "kept_count",
    "matrix_shape",
    "orthogonalize",
    "pack",
    "packed_size",
    "payload_shape",
    "power_sgd",
    "quantize",
    "rand_k",
    "sign",
    "top_k",
    "transposed_matmul",
    "unpack",
    "wire_bytes",
)
