"""The channel contract: a codec with explicit sender and receiver state.

A channel is what sits on one link (a pipeline boundary, one direction; or one worker's gradient
on its way into a reduction)::

  send_state, recv_state = channel.init(x)
  payload, send_state = channel.send(x, send_state, key, ids)
  x_hat, recv_state = channel.receive(payload, recv_state, like, ids)

``like`` (an array or ``ShapeDtypeStruct`` shaped as ``x``) tells the receiver what to decode
to; ``ids`` are the sample ids of the rows of ``x``, needed by per-sample buffers (AQ-SGD).

When a link runs *uncompressed* (AQ-SGD's warm-up epochs, evaluation with compression off) the
caller sends ``x`` dense and lets the channel observe it with ``dense_send`` / ``dense_receive``:
EF21 and AQ-SGD copy ``x`` into their estimates, residual EF leaves its residual untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.compressors import _base

SendState = Any
RecvState = Any


class Channel(NamedTuple):
    """Error compensation around a codec, with both ends' state explicit.

    Attributes:
      init: ``init(x) -> (send_state, recv_state)``.
      send: ``send(x, send_state, key=None, ids=None) -> (payload, send_state)``.
      receive: ``receive(payload, recv_state, like, ids=None) -> (x_hat, recv_state)``.
      dense_send: ``dense_send(x, send_state, ids=None) -> send_state``: the sender's update when
        ``x`` travels uncompressed.
      dense_receive: ``dense_receive(x, recv_state, ids=None) -> recv_state``: likewise at the
        receiver.
      codec: the underlying codec (its payload is what travels).
      name: description, e.g. ``"ef21(top_k(0.1, exact))"``.
      per_sample: whether ``ids`` are required.
      options: the factory's static arguments as :class:`~jaxcomp.compressors.Options`
        (e.g. error feedback's ``decay``),
        for layers that run the feedback themselves (PowerSGD's multi-worker protocol keeps
        its residual against the averaged reconstruction); ``None`` if none. Read-only.
    """

    init: Callable[[Any], tuple[SendState, RecvState]]
    send: Callable[..., tuple[Any, SendState]]
    receive: Callable[..., tuple[jax.Array, RecvState]]
    dense_send: Callable[..., SendState]
    dense_receive: Callable[..., RecvState]
    codec: _base.Codec
    name: str
    per_sample: bool = False
    options: Mapping[str, Any] | None = None


def _keep(x, state, ids=None):
    del x, ids
    return state


def plain(codec: _base.Codec) -> Channel:
    """Lifts a codec to a channel without feedback: the sender keeps the codec's state
    (e.g. PowerSGD's Q), the receiver keeps nothing.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors, feedback
      >>> ch = feedback.plain(compressors.quantize(8))
      >>> x = jnp.ones(4)
      >>> s, r = ch.init(x)
      >>> payload, s = ch.send(x, s)
      >>> x_hat, r = ch.receive(payload, r, x)
    """
    if not isinstance(codec, _base.Codec):
        raise TypeError(f"plain() takes a Codec; got {type(codec).__name__}.")

    def init(x):
        return codec.init(x), _base.EmptyState()

    def send(x, send_state, key=None, ids=None):
        del ids
        return codec.compress(x, send_state, key)

    def receive(payload, recv_state, like, ids=None):
        del ids
        return codec.decompress(payload, like), recv_state

    return Channel(init, send, receive, _keep, _keep, codec, codec.name, False)


def as_channel(codec_or_channel: _base.Codec | Channel) -> Channel:
    """Returns a channel unchanged and lifts a codec with :func:`plain`."""
    if isinstance(codec_or_channel, Channel):
        return codec_or_channel
    return plain(codec_or_channel)


def check_ids(ids: jax.Array | None, x: Any, name: str) -> None:
    """Trace-time checks for the sample ids of a per-sample channel."""
    if ids is None:
        raise ValueError(f"{name} keeps per-sample buffers: pass the sample ids of x's rows.")
    if tuple(ids.shape) != (x.shape[0],):
        raise ValueError(f"{name}: ids must have shape ({x.shape[0]},); got {tuple(ids.shape)}.")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name}: ids must be integers; got {ids.dtype}.")


def buffer_like(x: Any, num_samples: int | None, dtype) -> jax.Array:
    """Zeros shaped as ``x`` (one buffer per position) or ``[num_samples, *x.shape[1:]]``."""
    shape = tuple(x.shape) if num_samples is None else (num_samples, *tuple(x.shape)[1:])
    return jnp.zeros(shape, dtype)


def read_rows(buffer: jax.Array, ids: jax.Array | None, per_sample: bool) -> jax.Array:
    """The buffer rows for ``ids`` (or the whole buffer when not per sample)."""
    return buffer[ids] if per_sample else buffer


def write_rows(buffer, ids, rows, per_sample: bool):
    """Writes ``rows`` back at ``ids`` (or replaces the buffer), in the buffer's dtype."""
    rows = rows.astype(buffer.dtype)
    return buffer.at[ids].set(rows) if per_sample else rows
