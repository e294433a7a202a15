"""Residual error feedback (Seide et al. 2014; Stich et al. 2018)."""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxcomp.compressors import _base
from jaxcomp.feedback import _channel


class ErrorFeedbackState(NamedTuple):
    """Sender state of :func:`error_feedback`.

    Attributes:
      residual: what compression has dropped so far, shaped as ``x`` (or
        ``[num_samples, *x.shape[1:]]`` with per-sample buffers).
      codec: the codec's own state.
    """

    residual: jax.Array
    codec: _base.CodecState


def error_feedback(
    codec: _base.Codec,
    *,
    num_samples: int | None = None,
    decay: float = 1.0,
    residual_dtype=None,
) -> _channel.Channel:
    r"""Residual error feedback: the sender adds back what it dropped before.

    .. math::
      c = x + e, \quad \text{send}\ C(c), \quad e' = \beta\,(c - D(C(c)))

    With :math:`\beta = 1` the telescoping identity :math:`x + e = \hat x + e'` holds exactly
    (up to float rounding), so over many steps the sum of what was received equals the sum of
    what was sent minus the last residual. The receiver keeps no state.

    Args:
      codec: the compressor.
      num_samples: if given, keep one residual per *sample id* (``[num_samples, ...]``)
        instead of one per batch position; ``send`` then needs ``ids``. Rudakov et al.'s code
        keeps one buffer per position, which mixes samples when data are shuffled.
      decay: :math:`\beta \in (0, 1]`; below 1 the residual fades (a damped EF).
      residual_dtype: dtype of the residual (default: ``x``'s dtype).

    Returns:
      A :class:`Channel` whose sender state is an :class:`ErrorFeedbackState`. Uncompressed
      transfers (``dense_send``) leave the residual untouched.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors, feedback
      >>> ch = feedback.error_feedback(compressors.top_k(count=1))
      >>> x = jnp.array([1.0, 0.5])
      >>> s, r = ch.init(x)
      >>> payload, s = ch.send(x, s)
      >>> s.residual
      Array([0. , 0.5], dtype=float32)

    References:
      Seide et al., `1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
      Distributed Training of Speech DNNs`, 2014.
      Stich et al., `Sparsified SGD with Memory <https://arxiv.org/abs/1809.07599>`_, 2018.
    """
    if not isinstance(codec, _base.Codec):
        raise TypeError(f"error_feedback() takes a Codec; got {type(codec).__name__}.")
    if num_samples is not None:
        _base.check_int_range("num_samples", num_samples, 1)
    if not (isinstance(decay, (int, float)) and 0.0 < decay <= 1.0):
        raise ValueError(f"decay must be in (0, 1]; got {decay!r}.")
    per_sample = num_samples is not None
    name = f"error_feedback({codec.name}{', per_sample' if per_sample else ''})"

    def init(x):
        dtype = residual_dtype or x.dtype
        residual = _channel.buffer_like(x, num_samples, dtype)
        return ErrorFeedbackState(residual, codec.init(x)), _base.EmptyState()

    def send(x, send_state, key=None, ids=None):
        if per_sample:
            _channel.check_ids(ids, x, name)
        e = _channel.read_rows(send_state.residual, ids, per_sample)
        corrected = x + e.astype(x.dtype)
        payload, codec_state, x_hat = _base.compress_and_decode(
            codec, corrected, send_state.codec, key
        )
        new_e = corrected - x_hat
        if decay != 1.0:
            new_e = decay * new_e
        residual = _channel.write_rows(send_state.residual, ids, new_e, per_sample)
        return payload, ErrorFeedbackState(residual, codec_state)

    def receive(payload, recv_state, like, ids=None):
        del ids
        return codec.decompress(payload, like), recv_state

    options = _base.Options(num_samples=num_samples, decay=decay, residual_dtype=residual_dtype)
    return _channel.Channel(
        init, send, receive, _channel._keep, _channel._keep, codec, name, per_sample, options
    )
