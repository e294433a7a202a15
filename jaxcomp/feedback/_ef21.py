"""EF21 (Richtárik et al. 2021) and AQ-SGD per-sample delta compression (Wang et al. 2022)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import _validate
from jaxcomp.compressors import _base
from jaxcomp.compressors import _protocol
from jaxcomp.feedback import _channel
from jaxcomp.feedback import _compensate


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


class EF21Memory(NamedTuple):
    """Memory of EF21 around a multi-worker reduction.

    Attributes:
      estimate: :class:`~jaxcomp.compressors.PerWorker` of ``[1, *shape]``: this worker's
        estimate :math:`g_w` of its own signal (the sender's).
      mean: ``[*shape]``, replicated: the receivers' estimate :math:`G` of the mean, equal to
        the mean of the workers' estimates.
    """

    estimate: _protocol.PerWorker
    mean: jax.Array


def ef21_reduction(buffer_dtype=None) -> _compensate.Feedback:
    r"""EF21 as a wrapper of a multi-worker reduction that returns the exact mean of echoes.

    .. math::
      (\bar m, \mathrm{echo}_w) = \mathrm{reduce}(x_w - g_w), \quad
      g_w' = g_w + \mathrm{echo}_w, \quad G' = G + \bar m, \quad \text{output}\ G'

    Since :math:`\bar m` is the mean of the echoes, :math:`G = \tfrac1W \sum_w g_w` holds
    at every step. A round averaged uncompressed sets :math:`g_w = x_w` and :math:`G` to the
    mean.

    Args:
      buffer_dtype: dtype of the stored estimates (default: the array's).

    Returns:
      A :class:`~jaxcomp.feedback.Feedback` with :class:`EF21Memory` memory.
    """
    dtype_name = "" if buffer_dtype is None else f"buffer_dtype={jnp.dtype(buffer_dtype)}"
    name = f"ef21({dtype_name})"

    def init(like):
        estimate = _protocol.per_worker_zeros(like, buffer_dtype)
        return EF21Memory(estimate, jnp.zeros(like.shape, estimate.value.dtype))

    def reduce(x, memory, run, axis_name, in_place=False):
        del in_place  # the protocol's sum either way: g + echo needs no layout of its own
        g = _protocol.this_worker(memory.estimate)
        _channel.check_buffer(g, x, False, buffer_dtype is None, name)
        old = memory.estimate.value.astype(x.dtype)  # [1, ...]: updated in place by XLA
        # g + echo made by the protocol: a scatter into g for exact TopK, else one fused pass
        mean_delta, _, g_plus, aux = run(x - old[0], into=(old[0], 1))
        mean = memory.mean.astype(x.dtype) + mean_delta
        g_new = g_plus[None].astype(g.dtype)
        estimate = _protocol.per_worker(g_new, axis_name, stacked=True)
        out = EF21Memory(estimate, mean.astype(memory.mean.dtype))
        return mean, g_new[0].astype(x.dtype), out, aux

    def dense(x, mean, memory, axis_name):
        g = _protocol.per_worker(x.astype(memory.mean.dtype), axis_name)
        return EF21Memory(g, mean.astype(memory.mean.dtype))

    return _compensate.Feedback(init, reduce, dense, name, needs_exact_mean=True)


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
      uncompressed warm-up fills them). The state accepts only the shape (and, without
      ``buffer_dtype``, the dtype) given to ``init``. Without ``num_samples`` its ``feedback``
      runs EF21 around a multi-worker reduction (:func:`ef21_reduction`).

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
    _validate.check_int("num_samples", num_samples, 1)
    return _markov_channel(codec, num_samples, buffer_dtype, "aq_sgd")


def _markov_channel(codec, num_samples, buffer_dtype, kind) -> _channel.Channel:
    if not isinstance(codec, _base.Codec):
        raise TypeError(f"{kind}() takes a Codec; got {type(codec).__name__}.")
    if num_samples is not None:
        _validate.check_int("num_samples", num_samples, 1)
    per_sample = num_samples is not None
    suffix = ", per_sample" if per_sample and kind == "ef21" else ""
    name = f"{kind}({codec.name}{suffix})"

    def init(x):
        dtype = buffer_dtype or x.dtype
        # two buffers, not one shared object: callers may donate both states
        send = _channel.buffer_like(x, num_samples, dtype)
        recv = _channel.buffer_like(x, num_samples, dtype)
        return EF21SendState(send, codec.init(x)), EF21RecvState(recv)

    def check(estimate, x, ids):
        if per_sample:
            _channel.check_ids(ids, x, name)
        _channel.check_buffer(estimate, x, per_sample, buffer_dtype is None, name)

    def advance(estimate, ids, old, added):
        # old + D(m) by the same add_decoded at both ends keeps the mirrors bit-identical; each
        # row's output is its own new estimate (a repeated id's occurrences differ; its last
        # one is stored)
        new = added.astype(estimate.dtype)
        return _channel.write_buffer(estimate, ids, new, per_sample), new.astype(old.dtype)

    def send(x, send_state, key=None, ids=None):
        check(send_state.estimate, x, ids)
        old = _channel.read_buffer(send_state.estimate, ids, per_sample).astype(x.dtype)
        payload, codec_state, _, added = _base.compress_into(
            codec, x - old, send_state.codec, key, old, 1
        )
        estimate, _ = advance(send_state.estimate, ids, old, added)
        return payload, EF21SendState(estimate, codec_state)

    def receive(payload, recv_state, like, ids=None):
        check(recv_state.estimate, like, ids)
        old = _channel.read_buffer(recv_state.estimate, ids, per_sample).astype(like.dtype)
        added = _base.add_decoded(codec, old, payload, 1)
        estimate, x_hat = advance(recv_state.estimate, ids, old, added)
        return x_hat, EF21RecvState(estimate)

    def dense_send(x, send_state, ids=None):
        check(send_state.estimate, x, ids)
        estimate = _channel.write_buffer(send_state.estimate, ids, x, per_sample)
        return send_state._replace(estimate=estimate)

    def dense_receive(x, recv_state, ids=None):
        check(recv_state.estimate, x, ids)
        return EF21RecvState(_channel.write_buffer(recv_state.estimate, ids, x, per_sample))

    return _channel.Channel(
        init, send, receive, dense_send, dense_receive, codec, name, per_sample,
        None if per_sample else ef21_reduction(buffer_dtype), ("estimate",) if per_sample else (),
    )  # fmt: skip
