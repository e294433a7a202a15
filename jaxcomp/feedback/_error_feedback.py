"""Residual error feedback (Seide et al. 2014; Stich et al. 2018)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import _cpu
from jaxcomp import _validate
from jaxcomp.compressors import _base
from jaxcomp.compressors import _protocol
from jaxcomp.feedback import _channel
from jaxcomp.feedback import _compensate


class ErrorFeedbackState(NamedTuple):
    """Sender state of :func:`error_feedback`.

    Attributes:
      residual: what compression has dropped so far, shaped as ``x`` (or
        ``[num_samples, *x.shape[1:]]`` with per-sample buffers).
      codec: the codec's own state.
    """

    residual: jax.Array
    codec: _base.CodecState


class ErrorFeedbackMemory(NamedTuple):
    """Memory of error feedback around a multi-worker reduction.

    Attributes:
      residual: :class:`~jaxcomp.compressors.PerWorker` of ``[1, *shape]``: this worker's
        ``x + e - echo`` (what the reduction has not yet delivered of its signal).
    """

    residual: _protocol.PerWorker


def decayed(residual: jax.Array, decay: float) -> jax.Array:
    r""":math:`\beta\,(c - \hat c)` from :math:`c - \hat c`, shared by every path."""
    return residual if decay == 1.0 else decay * residual


def new_residual(corrected: jax.Array, decoded: jax.Array, decay: float) -> jax.Array:
    r"""The error-feedback update :math:`e' = \beta\,(c - \hat c)`."""
    return decayed(corrected - decoded, decay)


def error_feedback_reduction(decay: float = 1.0, residual_dtype=None) -> _compensate.Feedback:
    r"""Error feedback as a wrapper of any multi-worker reduction.

    .. math::
      c_w = x_w + e_w, \quad (\bar x, \mathrm{echo}_w) = \mathrm{reduce}(c), \quad
      e_w' = \beta\,(c_w - \mathrm{echo}_w)

    With a gathered codec ``echo`` is the worker's decoded payload (the residual is the
    channel's); with PowerSGD's protocol it is the averaged reconstruction (the reference's
    memory); on a dense path it is ``c`` itself, so the memory is sent along and cleared.
    The residual update is fused by XLA with the echo's decoding where the codec's decode is
    elementwise (quantize, sign, PowerSGD's factors): one pass, no decoded copy in memory.
    TopK (exact, per sample, blockwise) subtracts its kept values from ``c`` in place
    (``Codec.add_decoded``, a scatter into the donated residual) once the compression has
    read ``c`` (:func:`~jaxcomp.compressors.compress_into`): no dense decode of zeros, no
    temporary array. A round averaged uncompressed leaves the memory untouched.

    Args:
      decay: :math:`\beta \in (0, 1]`.
      residual_dtype: dtype of the residual (default: the array's).

    Returns:
      A :class:`~jaxcomp.feedback.Feedback` with :class:`ErrorFeedbackMemory` memory.
    """
    dtype_name = "" if residual_dtype is None else f", residual_dtype={jnp.dtype(residual_dtype)}"
    name = f"error_feedback(decay={decay:g}{dtype_name})"

    def init(like):
        return ErrorFeedbackMemory(_protocol.per_worker_zeros(like, residual_dtype))

    def reduce(x, memory, run, axis_name, in_place=False):
        e = _protocol.this_worker(memory.residual)
        _channel.check_buffer(e, x, False, residual_dtype is None, name)
        # in the per-worker layout [1, ...]: XLA then updates the (donated) residual in place
        residual = memory.residual.value.astype(x.dtype)
        # varying as x under shard_map (a state made inside the body is not): the loop carry
        # of computed_once takes x + e's type
        residual = _protocol.to_varying(residual, _protocol.varying_axes(x))
        if in_place:
            # c - echo made by the protocol: TopK subtracts its kept values from c in place.
            # c is written once, into the residual's buffer, and read there by the compression
            # (CPU: jaxcomp._cpu [fusion], computed_once)
            c = _cpu.computed_once(lambda e, x: x[None] + e, residual, x)[0]
            mean, echo, kept, aux = run(c, into=(c, -1))
            e_new = decayed(kept[None], decay).astype(e.dtype)
        else:
            # c - echo in one pass fused with the echo's decoding, in the [1, ...] layout; c is
            # written once, into the residual's buffer, and c - echo over it in place, after the
            # mean, which follows every reader of c (CPU: jaxcomp._cpu [fusion], computed_once
            # and after; what each avoids: docs/performance.md)
            c = _cpu.computed_once(lambda e, x: x[None] + e, residual, x)
            mean, echo, aux = run(c[0])
            e_new = _cpu.after(new_residual(c, echo[None], decay), mean).astype(e.dtype)
        memory = ErrorFeedbackMemory(_protocol.per_worker(e_new, axis_name, stacked=True))
        return mean, echo, memory, aux

    def dense(x, mean, memory, axis_name):
        del x, mean, axis_name
        return memory

    return _compensate.Feedback(init, reduce, dense, name)


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
      transfers (``dense_send``) leave the residual untouched. ``send`` accepts only the shape
      (and, without ``residual_dtype``, the dtype) given to ``init``. Its ``feedback`` is the
      same rule around a multi-worker reduction (:func:`error_feedback_reduction`; without
      per-sample buffers), which the data-parallel transforms run.

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
        _validate.check_int("num_samples", num_samples, 1)
    _validate.check_fraction("decay", decay)
    per_sample = num_samples is not None
    name = f"error_feedback({codec.name}{', per_sample' if per_sample else ''})"

    def init(x):
        dtype = residual_dtype or x.dtype
        residual = _channel.buffer_like(x, num_samples, dtype)
        return ErrorFeedbackState(residual, codec.init(x)), _base.EmptyState()

    def send(x, send_state, key=None, ids=None):
        if per_sample:
            _channel.check_ids(ids, x, name)
        _channel.check_buffer(send_state.residual, x, per_sample, residual_dtype is None, name)
        e = _channel.read_buffer(send_state.residual, ids, per_sample)
        corrected = x + e.astype(x.dtype)
        # the dense form, not compress_into: a scatter into the compressed array copies it
        payload, codec_state, x_hat = _base.compress_and_decode(
            codec, corrected, send_state.codec, key
        )
        new_e = new_residual(corrected, x_hat, decay)
        residual = _channel.write_buffer(send_state.residual, ids, new_e, per_sample)
        return payload, ErrorFeedbackState(residual, codec_state)

    def receive(payload, recv_state, like, ids=None):
        del ids
        return codec.decompress(payload, like), recv_state

    return _channel.Channel(
        init, send, receive, _channel._keep, _channel._keep, codec, name, per_sample,
        None if per_sample else error_feedback_reduction(decay, residual_dtype),
        ("residual",) if per_sample else (),
    )  # fmt: skip
