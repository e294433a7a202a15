"""The codec contract shared by every compressor, and the helpers they use.

A *codec* is three pure functions bundled in a :class:`Codec` NamedTuple::

  state = codec.init(x)                               # x: array or ShapeDtypeStruct
  payload, state = codec.compress(x, state, key)      # key: PRNG key, or None when deterministic
  x_hat = codec.decompress(payload, like)             # like: array or ShapeDtypeStruct of x

The payload is a pytree of arrays *in the dtypes that travel* (bit-packed ``uint8`` codes,
``uint16`` indices, ``float16`` scales) with shapes fixed by the codec's static parameters, so
the same payload shape appears on every device and can cross ``ppermute``/``all_gather``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.compressors import _protocol

Array = jax.Array
Payload = Any
CodecState = Any
Like = Any  # an array or a jax.ShapeDtypeStruct: only .shape and .dtype are read


class EmptyState(NamedTuple):
    """State of a stateless codec."""


class Reduction(enum.Enum):
    """How payloads from several workers can be combined (read by the collective layer).

    * ``SUM``: payload leaves are linear in the input and share their structure across
      workers (same indices, same scales), so ``psum`` of the payloads decodes to the sum.
    * ``GATHER``: payloads must be gathered and decoded one by one before summing
      (TopK, quantization with per-worker scales, sign, PowerSGD factors).

    A codec with its own multi-worker protocol (``Codec.protocol``, e.g. PowerSGD's two
    all-reduces) is averaged with that protocol instead.
    """

    SUM = "sum"
    GATHER = "gather"


class Codec(NamedTuple):
    """A pure compressor: ``init``, ``compress`` and ``decompress`` plus static facts.

    Attributes:
      init: ``init(x) -> state``.
      compress: ``compress(x, state, key) -> (payload, state)``.
      decompress: ``decompress(payload, like) -> x_hat`` with ``x_hat.shape == like.shape``.
      name: a short human-readable description, e.g. ``"quantize(4, tensor)"``.
      reduction: how payloads from several workers combine (:class:`Reduction`).
      stochastic: whether ``compress`` needs a PRNG key.
      psum: for ``Reduction.SUM`` codecs, ``psum(payload, axis_name) -> payload``: sums
        payloads over a mesh axis inside ``shard_map`` so that decoding the result gives the
        sum of the decoded inputs (e.g. a cast psums in its 16-bit float type, RandK psums its
        values and keeps the shared seed). ``None`` for other codecs.
      roundtrip: optional fast path ``roundtrip(x, state, key) -> (payload, state, x_hat)``
        giving the payload and what the receiver will decode, without unpacking the payload
        (error-feedback senders need both). Must equal ``decompress(compress(...))`` exactly.
        Use :func:`compress_and_decode` rather than calling it directly.
      decode_sum: optional fast path ``decode_sum(stacked, like) -> total`` for a receiver of
        gathered payloads: ``stacked`` holds a few payloads stacked on a leading axis and
        ``total`` is the sum of their ``decompress`` in (at least) ``float32``, equal to
        summing them one by one up to float summation order. Use :func:`decode_sum`.
      protocol: optional :class:`~jaxcomp.compressors.ReduceProtocol`, the codec's own way
        of averaging over workers (e.g. PowerSGD's two all-reduces with a shared warm-started
        Q), run by :func:`jaxcomp.comm.plan_reduce` and the transforms instead of a generic
        ``psum``/``all_gather`` of payloads. ``None``: the generic paths.
      add_decoded: optional fast path ``add_decoded(base, payload, sign) -> base + sign *
        decompress(payload, base)`` (``sign`` is ``1`` or ``-1``) for codecs whose decode is a
        scatter (e.g. exact TopK): it adds the kept values into ``base`` in place instead of
        decoding into a dense array of zeros and adding that. Must equal the dense form
        (``==``; a ``-0.0`` of ``base`` may stay ``-0.0``). Error feedback's residual and
        EF21's estimate use it through :func:`add_decoded`.
      echo_from_wire: on the ``all_gather`` path, decode the sender's own echo (error
        feedback's ``D(C(c))``, EF21's ``D(m)``) from its payload *as gathered*, behind the
        collective, for codecs whose elementwise decode XLA would otherwise fuse with the
        selection that made the payload and redo it per decoded entry (blockwise TopK's
        per-block arg-max: error feedback was 8x the plain step). Values are the same.
    """

    init: Callable[[Like], CodecState]
    compress: Callable[[Array, CodecState, Array | None], tuple[Payload, CodecState]]
    decompress: Callable[[Payload, Like], Array]
    name: str
    reduction: Reduction = Reduction.GATHER
    stochastic: bool = False
    psum: Callable[[Payload, str], Payload] | None = None
    roundtrip: Callable[..., tuple[Payload, CodecState, Array]] | None = None
    decode_sum: Callable[[Payload, Like], Array] | None = None
    protocol: _protocol.ReduceProtocol | None = None
    add_decoded: Callable[[Array, Payload, int], Array] | None = None
    echo_from_wire: bool = False


def compress_and_decode(
    codec: Codec, x: Array, state: CodecState, key: Array | None = None
) -> tuple[Payload, CodecState, Array]:
    """``(payload, new_state, decompress(payload, x))`` in one pass where the codec allows.

    Error-feedback senders need what the receiver will see. Decoding a bit-packed payload right
    after packing it lets XLA fuse unpack into pack and recompute the quantization once per
    unpacked element (10-30x slower on CPU); codecs with a ``roundtrip`` fast path decode from
    the unpacked codes instead, with identical results. Others decode with ``decompress``,
    which XLA fuses with an error-feedback residual where it is elementwise (blockwise TopK's
    mask, when its blocks divide the array); for a scatter (exact TopK) use
    :func:`compress_into`, which adds the kept values into the residual in place.
    """
    if codec.roundtrip is not None:
        return codec.roundtrip(x, state, key)
    payload, new_state = codec.compress(x, state, key)
    return payload, new_state, codec.decompress(payload, x)


def add_decoded(codec: Codec, base: Array, payload: Payload, sign: int) -> Array:
    """``base + sign * decompress(payload, base)``, in place where the codec allows.

    The form error feedback (``sign=-1``: ``c - echo``) and EF21 (``sign=1``: ``g + echo``)
    keep: with a ``Codec.add_decoded`` fast path (exact TopK: a scatter-add of the kept
    values into ``base``) no dense decoded array is made; otherwise the dense form, which XLA
    fuses into one pass where ``decompress`` is elementwise.

    Args:
      codec: the codec that made ``payload``.
      base: the array to add to, shaped and typed as the decoded payload.
      payload: one payload of ``codec`` for an array like ``base``.
      sign: ``1`` or ``-1``.

    Returns:
      An array like ``base``.
    """
    if sign not in (1, -1):
        raise ValueError(f"sign must be 1 or -1; got {sign!r}.")
    if codec.add_decoded is not None:
        return codec.add_decoded(base, payload, sign)
    decoded = codec.decompress(payload, base)
    return base + decoded if sign == 1 else base - decoded


def compress_into(
    codec: Codec, x: Array, state: CodecState, key: Array | None, base: Array, sign: int
) -> tuple[Payload, CodecState, Array, Array]:
    """:func:`compress_and_decode` plus ``base + sign * decoded``, the fastest way the codec has.

    What error feedback (``base = x, sign = -1``: the new residual) and EF21 (``base = g,
    sign = 1``: the new estimate) keep. With ``Codec.add_decoded`` (TopK) the sum is a scatter
    into ``base`` in place, and ``decoded`` is computed only if the caller uses it: a ``base``
    that is ``x`` itself should be made by :func:`jaxcomp._cpu._order.computed_once` (error
    feedback's ``c = x + e``), so that XLA writes it once and scatters into it after the
    compression's reads instead of copying it. Without ``add_decoded``: the codec's fused
    round trip, and the dense sum (one fused pass where decoding is elementwise).

    Returns:
      ``(payload, new_state, decompress(payload, x), base + sign * decompress(payload, x))``.
    """
    if codec.add_decoded is None:
        payload, state, decoded = compress_and_decode(codec, x, state, key)
        return payload, state, decoded, base + decoded if sign == 1 else base - decoded
    payload, state = codec.compress(x, state, key)
    into = add_decoded(codec, base, payload, sign)
    return payload, state, codec.decompress(payload, x), into


def decode_sum(codec: Codec, stacked: Payload, like: Like) -> Array:
    """Sum of ``decompress`` over payloads stacked on a leading axis, in (at least) ``float32``.

    What a receiver of ``all_gather``-ed payloads needs. Codecs with a ``decode_sum`` fast path
    decode all payloads in one fused pass (e.g. one scatter-add of every worker's TopK values,
    or bit-plane unpacking without a concatenate); others are decoded one by one and summed.
    Either way the loop over the leading axis is unrolled: pass a few payloads at a time.

    Args:
      codec: the codec that made the payloads.
      stacked: payloads stacked on a new leading axis (e.g. ``lax.all_gather``'s result).
      like: array or ``ShapeDtypeStruct`` of one decoded payload.

    Returns:
      ``sum_i decompress(stacked[i], like)``, shaped as ``like``, in
      ``promote_types(like.dtype, float32)``.
    """
    if codec.decode_sum is not None:
        return codec.decode_sum(stacked, like)
    return sum_decoded(codec.decompress, stacked, like)


def sum_decoded(decompress: Callable[[Payload, Like], Array], stacked: Payload, like: Like):
    """``sum_i decompress(stacked[i], like)`` in ``float32`` or wider, unrolled over ``i``."""
    acc_dtype = jnp.promote_types(like.dtype, jnp.float32)
    total = None
    for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        x = decompress(jax.tree.map(lambda s, i=i: s[i], stacked), like).astype(acc_dtype)
        total = x if total is None else total + x
    return total


def wire_bytes(payload: Payload) -> int:
    """Bytes a payload occupies on the wire: the sum over its leaves of ``size * itemsize``.

    Works on arrays and on ``jax.ShapeDtypeStruct`` trees (e.g. from ``jax.eval_shape``).

    Example:
      >>> import jax.numpy as jnp
      >>> wire_bytes({"codes": jnp.zeros(10, jnp.uint8), "scale": jnp.zeros((), jnp.float32)})
      14
    """
    return int(
        sum(
            math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
            for leaf in jax.tree.leaves(payload)
        )
    )


def payload_shape(codec: Codec, like: Like) -> Payload:
    """The payload's ``ShapeDtypeStruct`` tree for an input shaped like ``like`` (no FLOPs)."""
    like = jax.ShapeDtypeStruct(like.shape, like.dtype)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if codec.stochastic else None

    def run(x, k):
        return codec.compress(x, codec.init(x), k)[0]

    return jax.eval_shape(run, like, key)


def dense_bytes(like: Like) -> int:
    """Bytes of the uncompressed array ``like``."""
    return math.prod(like.shape) * np.dtype(like.dtype).itemsize


def check_float(x: Like, codec_name: str) -> None:
    """Raises ``TypeError`` unless ``x`` has a floating dtype."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{codec_name} compresses floating-point arrays; got dtype {x.dtype}.")


def check_key(key: Array | None, codec_name: str) -> None:
    """Raises ``ValueError`` when a stochastic codec is called without a PRNG key."""
    if key is None:
        raise ValueError(f"{codec_name} is stochastic: compress(x, state, key) needs a PRNG key.")


def index_dtype(num_positions: int) -> np.dtype:
    """The smallest unsigned integer dtype that can index ``num_positions`` positions."""
    if num_positions <= 1 << 8:
        return np.dtype(np.uint8)
    if num_positions <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def as_like(like: Like) -> jax.ShapeDtypeStruct:
    """Normalises an array or struct to a ``ShapeDtypeStruct``."""
    return jax.ShapeDtypeStruct(tuple(like.shape), like.dtype)
