"""EF21 (Richtárik et al. 2021) and AQ-SGD per-sample delta compression (Wang et al. 2022)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compressors import _base
from jaxcomp.feedback import _channel


class EF21SendState(NamedTuple):
    """Sender state of :func:`ef21` / :func:`aq_sgd`.

    Attributes:
      estimate: the sender's copy of what the receiver holds (``g`` in EF21, ``m_com`` in
        AQ-SGD), shaped as ``x`` or ``[num_samples, *x.shape[1:]]``.
      codec: the codec's own state.
    """

    estimate: jax.Array
    codec: _base.CodecState


class EF21RecvState(NamedTuple):
    """Receiver state: its estimate (``m_dec`` in AQ-SGD), a mirror of the sender's."""

    estimate: jax.Array


def ef21(
    codec: _base.Codec, *, num_samples: int | None = None, buffer_dtype=None
) -> _channel.Channel:
    r"""EF21: both ends keep an estimate and only the compressed *change* travels.

    .. math::
      m = C(x - g), \quad g' = g + D(m) \quad \text{(sender and receiver alike)},
      \quad \hat x = g'

    Sender and receiver apply the same update to the same value, so their estimates stay
    bit-identical; the receiver outputs its estimate. With a contractive codec the estimate
    tracks a slowly changing signal, and the error does not accumulate (unlike plain EF it
    needs no residual added to the *next* different signal).

    Args:
      codec: the compressor of the difference.
      num_samples: if given, one estimate per *sample id* (``[num_samples, ...]``), indexed by
        the ``ids`` passed to ``send``/``receive``. This is AQ-SGD (see :func:`aq_sgd`).
      buffer_dtype: dtype of the stored estimates (default: ``x``'s dtype).

    Returns:
      A :class:`Channel`. ``dense_send`` / ``dense_receive`` set the estimates to ``x`` (the
      uncompressed warm-up fills them).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors, feedback
      >>> ch = feedback.ef21(compressors.top_k(count=1))
      >>> x = jnp.array([1.0, 0.5])
      >>> s, r = ch.init(x)
      >>> for _ in range(2):
      ...     payload, s = ch.send(x, s)
      ...     x_hat, r = ch.receive(payload, r, x)
      >>> x_hat
      Array([1. , 0.5], dtype=float32)

    References:
      Richtárik et al., `EF21: A New, Simpler, Theoretically Better, and Practically Faster
      Error Feedback <https://arxiv.org/abs/2106.05203>`_, 2021.
    """
    return _markov_channel(codec, num_samples, buffer_dtype, "ef21")


def aq_sgd(codec: _base.Codec, num_samples: int, *, buffer_dtype=jnp.float16) -> _channel.Channel:
    r"""AQ-SGD: per-sample delta compression of activations against cached copies.

    For each sample :math:`\xi` of the micro-batch, both ends cache the last value they agreed
    on, :math:`m(\xi)`; only :math:`Q(a(\xi) - m(\xi))` travels and both add it to their copy:

    .. math::
      \text{msg} = Q(a(\xi) - m_{com}(\xi)),\ m_{com}(\xi) \mathrel{+}= D(\text{msg});\quad
      \hat a(\xi) = m_{dec}(\xi) + D(\text{msg}),\ m_{dec}(\xi) \leftarrow \hat a(\xi)

    This is EF21 with one estimate per sample id, stored in ``float16`` as the reference's
    cache. During the uncompressed warm-up (the reference's first epoch) the caller sends
    activations dense and ``dense_send`` / ``dense_receive`` fill both caches with them. With
    ``codec=top_k(...)`` this is Rudakov et al.'s AQ-SGD + TopK.

    Args:
      codec: compressor of the delta (the reference: 4-bit ``quantize(4, scale="feature")``).
      num_samples: number of distinct sample ids (the dataset size).
      buffer_dtype: storage dtype of the caches.

    Returns:
      A per-sample :class:`Channel`; ``send``/``receive`` require ``ids``.

    References:
      Wang et al., `Fine-tuning Language Models over Slow Networks using Activation Compression
      with Guarantees <https://arxiv.org/abs/2206.01299>`_, 2022.
    """
    _base.check_int_range("num_samples", num_samples, 1)
    return _markov_channel(codec, num_samples, buffer_dtype, "aq_sgd")


def _markov_channel(codec, num_samples, buffer_dtype, kind) -> _channel.Channel:
    if not isinstance(codec, _base.Codec):
        raise TypeError(f"{kind}() takes a Codec; got {type(codec).__name__}.")
    if num_samples is not None:
        _base.check_int_range("num_samples", num_samples, 1)
    per_sample = num_samples is not None
    suffix = ", per_sample" if per_sample and kind == "ef21" else ""
    name = f"{kind}({codec.name}{suffix})"

    def init(x):
        dtype = buffer_dtype or x.dtype
        # two buffers, not one shared object: callers may donate both states
        send = _channel.buffer_like(x, num_samples, dtype)
        recv = _channel.buffer_like(x, num_samples, dtype)
        return EF21SendState(send, codec.init(x)), EF21RecvState(recv)

    def advance(estimate, ids, delta_hat, like):
        # identical arithmetic at both ends keeps the mirrors bit-identical
        old = _channel.read_rows(estimate, ids, per_sample).astype(like.dtype)
        new_estimate = _channel.write_rows(estimate, ids, old + delta_hat, per_sample)
        return new_estimate, _channel.read_rows(new_estimate, ids, per_sample).astype(like.dtype)

    def send(x, send_state, key=None, ids=None):
        if per_sample:
            _channel.check_ids(ids, x, name)
        old = _channel.read_rows(send_state.estimate, ids, per_sample).astype(x.dtype)
        payload, codec_state, delta_hat = _base.compress_and_decode(
            codec, x - old, send_state.codec, key
        )
        estimate, _ = advance(send_state.estimate, ids, delta_hat, x)
        return payload, EF21SendState(estimate, codec_state)

    def receive(payload, recv_state, like, ids=None):
        if per_sample:
            _channel.check_ids(ids, like, name)
        estimate, x_hat = advance(recv_state.estimate, ids, codec.decompress(payload, like), like)
        return x_hat, EF21RecvState(estimate)

    def dense_send(x, send_state, ids=None):
        if per_sample:
            _channel.check_ids(ids, x, name)
        estimate = _channel.write_rows(send_state.estimate, ids, x, per_sample)
        return send_state._replace(estimate=estimate)

    def dense_receive(x, recv_state, ids=None):
        if per_sample:
            _channel.check_ids(ids, x, name)
        return EF21RecvState(_channel.write_rows(recv_state.estimate, ids, x, per_sample))

    return _channel.Channel(init, send, receive, dense_send, dense_receive, codec, name, per_sample)
