"""Pure compressors (codecs) with static-shape payloads in the dtypes that travel.

Every codec is a :class:`Codec` of three pure functions::

  state = codec.init(x)
  payload, state = codec.compress(x, state, key)
  x_hat = codec.decompress(payload, like)

See :mod:`jaxcomp.feedback` for error-feedback channels built on top of them.
"""

from jaxcomp.compressors._base import (
    Codec,
    CodecState,
    EmptyState,
    Reduction,
    dense_bytes,
    payload_shape,
    wire_bytes,
)
from jaxcomp.compressors._bitpack import pack, packed_size, unpack
from jaxcomp.compressors._cast import cast, identity
from jaxcomp.compressors._compose import ComposedState, compose
from jaxcomp.compressors._low_rank import (
    LowRankPayload,
    PowerSGDState,
    effective_rank,
    matrix_shape,
    orthogonalize,
    power_sgd,
)
from jaxcomp.compressors._quantize import QuantizedPayload, quantize, sign
from jaxcomp.compressors._sparse import RandKPayload, SparsePayload, kept_count, rand_k, top_k

__all__ = (
    "Codec",
    "CodecState",
    "ComposedState",
    "EmptyState",
    "LowRankPayload",
    "PowerSGDState",
    "QuantizedPayload",
    "RandKPayload",
    "Reduction",
    "SparsePayload",
    "cast",
    "compose",
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
    "unpack",
    "wire_bytes",
)
