"""Composition of codecs: compress one field of a payload with a second codec."""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxcomp.compressors import _base


class ComposedState(NamedTuple):
    """States of the outer and the inner codec."""

    outer: _base.CodecState
    inner: _base.CodecState


def compose(outer: _base.Codec, inner: _base.Codec, *, field: str = "values") -> _base.Codec:
    """Compresses field ``field`` of ``outer``'s payload with ``inner``.

    The typical use is TopK whose kept values are then quantized, e.g.
    ``compose(top_k(0.1), quantize(8))``: the payload holds the packed 8-bit codes and scale of
    the values plus the indices. Decoding runs ``inner.decompress`` then ``outer.decompress``.
    Non-finite and zero-size inputs, and payloads that do not fit ``like``, behave as in the
    two codecs (e.g. TopK keeps a NaN entry and quantizing the kept values makes them all
    non-finite).

    Args:
      outer: a codec whose payload is a NamedTuple with a field named ``field``
        (e.g. :class:`SparsePayload`, :class:`RandKPayload`, :class:`LowRankPayload`).
      inner: the codec applied to that field.
      field: the payload field to compress.

    Returns:
      A :class:`~jaxcomp.compressors.Codec`; its key (if any) is split between the two codecs.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.compose(compressors.top_k(0.5), compressors.quantize(8))
      >>> x = jnp.array([0.1, -3.0, 0.5, 2.0])
      >>> payload, _ = codec.compress(x, codec.init(x), None)
      >>> payload.values.codes.dtype, payload.indices.dtype
      (dtype('uint8'), dtype('uint8'))
    """
    if not isinstance(outer, _base.Codec) or not isinstance(inner, _base.Codec):
        raise TypeError("compose takes two Codec instances.")
    name = f"{outer.name}.{field}<-{inner.name}"
    stochastic = outer.stochastic or inner.stochastic

    def field_like(like):
        shapes = _base.payload_shape(outer, like)
        if not hasattr(shapes, "_fields") or field not in shapes._fields:
            raise ValueError(f"{outer.name} payloads have no field {field!r}.")
        return getattr(shapes, field)

    def init(x):
        return ComposedState(outer.init(x), inner.init(field_like(x)))

    def split(key):
        if not stochastic:
            return None, None
        _base.check_key(key, name)
        k1, k2 = jax.random.split(key)
        return (k1 if outer.stochastic else None), (k2 if inner.stochastic else None)

    def compress(x, state, key=None):
        k_outer, k_inner = split(key)
        payload, outer_state = outer.compress(x, state.outer, k_outer)
        sub, inner_state = inner.compress(getattr(payload, field), state.inner, k_inner)
        return payload._replace(**{field: sub}), ComposedState(outer_state, inner_state)

    def decompress(payload, like):
        sub = inner.decompress(getattr(payload, field), field_like(like))
        return outer.decompress(payload._replace(**{field: sub}), like)

    return _base.Codec(
        init, compress, decompress, name, _base.Reduction.GATHER, stochastic,
        echo_from_wire=outer.echo_from_wire or inner.echo_from_wire,
    )  # fmt: skip
