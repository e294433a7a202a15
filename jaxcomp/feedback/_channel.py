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

A channel's state accepts only the shape and dtype it was initialised with (a clear error
names both). Per-sample buffers are declared (``Channel.sample_fields``) and indexed by sample
id with one rule everywhere (:func:`read_rows` / :func:`write_rows`): an id outside
``[0, num_samples)`` reads a NaN row and writes nothing (never a clamped or wrapped row): that
sample's output is NaN, and with a codec that couples rows (a tensor-wide quantization scale)
the whole batch's is, so the loss is non-finite rather than silently wrong. An id repeated
within one batch reads the row as it was before the batch at every occurrence and writes the
last occurrence's value (the same at both ends, so mirrors stay identical). Check ids on the
host before the step with :func:`check_sample_ids`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import _validate
from jaxcomp.compressors import _base
from jaxcomp.feedback import _compensate

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
      feedback: the channel's error compensation in its reduction form (a
        :class:`~jaxcomp.feedback.Feedback` that wraps any multi-worker reduction), or
        ``None`` for none (a plain codec).
      sample_fields: names of the send/receive state fields that hold one row per sample id
        (AQ-SGD's caches); the pipeline reads and writes only a batch's rows of them.
    """

    init: Callable[[Any], tuple[SendState, RecvState]]
    send: Callable[..., tuple[Any, SendState]]
    receive: Callable[..., tuple[jax.Array, RecvState]]
    dense_send: Callable[..., SendState]
    dense_receive: Callable[..., RecvState]
    codec: _base.Codec
    name: str
    per_sample: bool = False
    feedback: _compensate.Feedback | None = None
    sample_fields: tuple[str, ...] = ()


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

    return Channel(init, send, receive, _keep, _keep, codec, codec.name)


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


def check_sample_ids(ids: Any, num_samples: int, *, allow_duplicates: bool = False) -> None:
    """Host-side check of a batch's sample ids before a step (call it in the data pipeline).

    Inside ``jit`` ids cannot raise; there an out-of-range id reads a NaN row and writes
    nothing, and a repeated id writes its last occurrence (see the module docstring). This
    check turns both into errors where they can still be reported.

    Args:
      ids: integer array-like of sample ids (host values; not a tracer).
      num_samples: the buffers' number of rows; valid ids are ``0 .. num_samples - 1``.
      allow_duplicates: accept an id repeated within the batch.

    Raises:
      ValueError: naming the offending ids (out of range, or repeated).

    Example:
      >>> from jaxcomp import feedback
      >>> feedback.check_sample_ids([0, 5, 7], num_samples=8)
      >>> feedback.check_sample_ids([0, 8], num_samples=8)
      Traceback (most recent call last):
        ...
      ValueError: sample ids must be in [0, 8); got 8 (1 of 2 ids).
    """
    if isinstance(ids, jax.core.Tracer):
        raise TypeError("check_sample_ids runs on host values, before the jitted step.")
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"sample ids must be integers; got dtype {ids.dtype}.")
    flat = ids.reshape(-1)
    bad = flat[(flat < 0) | (flat >= num_samples)]
    if bad.size:
        shown = ", ".join(str(int(i)) for i in bad[:5]) + (", ..." if bad.size > 5 else "")
        raise ValueError(
            f"sample ids must be in [0, {num_samples}); got {shown} ({bad.size} of {flat.size} "
            "ids)."
        )
    if not allow_duplicates:
        values, counts = np.unique(flat, return_counts=True)
        repeated = values[counts > 1]
        if repeated.size:
            shown = ", ".join(str(int(i)) for i in repeated[:5])
            raise ValueError(
                f"sample ids repeat within one batch: {shown}. Every occurrence would read the "
                "same cached row and only the last would be written back; pass "
                "allow_duplicates=True if that is intended."
            )


def check_buffer(buffer: Any, x: Any, per_sample: bool, same_dtype: bool, name: str) -> None:
    """Raises ``ValueError`` naming both when ``x`` is not what ``buffer`` was built for.

    A buffer per position must have ``x``'s shape; a per-sample buffer ``x``'s shape after its
    leading (sample) axis. With ``same_dtype`` (the buffer took ``x``'s dtype at init) the
    dtypes must match too.
    """
    want = tuple(buffer.shape[1:]) if per_sample else tuple(buffer.shape)
    got = tuple(x.shape[1:]) if per_sample else tuple(x.shape)
    if want != got or (same_dtype and jnp.dtype(buffer.dtype) != jnp.dtype(x.dtype)):
        built = _validate.describe(buffer)
        what = "per-sample rows of " if per_sample else ""
        raise ValueError(
            f"{name}: the state was built for {what}{built}; got {_validate.describe(x)}. A "
            "channel state accepts only the shape and dtype it was initialised with."
        )


def buffer_like(x: Any, num_samples: int | None, dtype) -> jax.Array:
    """Zeros shaped as ``x`` (one buffer per position) or ``[num_samples, *x.shape[1:]]``."""
    shape = tuple(x.shape) if num_samples is None else (num_samples, *tuple(x.shape)[1:])
    return jnp.zeros(shape, dtype)


def _row_indices(ids: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """``(read, write)`` row indices: out-of-range ids point past the end (NaN on read, dropped
    on write); a repeated id writes only at its last occurrence."""
    ids = ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < num_rows)
    pos = jnp.arange(ids.shape[0])
    later_same = (ids[None, :] == ids[:, None]) & (pos[None, :] > pos[:, None])
    last = ~jnp.any(later_same, axis=1)
    return jnp.where(valid, ids, num_rows), jnp.where(valid & last, ids, num_rows)


def read_rows(buffer: jax.Array, ids: jax.Array, prefix: tuple = ()) -> jax.Array:
    """``buffer[*prefix, ids]``; an out-of-range id reads a row of NaN (never a clamped row)."""
    read, _ = _row_indices(ids, buffer.shape[len(prefix)])
    fill = jnp.nan if jnp.issubdtype(buffer.dtype, jnp.inexact) else 0
    return buffer.at[(*prefix, read)].get(mode="fill", fill_value=fill)


def write_rows(buffer: jax.Array, ids: jax.Array, rows: jax.Array, prefix: tuple = ()):
    """``buffer`` with ``rows`` written at ``[*prefix, ids]`` in its dtype; out-of-range ids
    are dropped and a repeated id writes its last occurrence."""
    _, write = _row_indices(ids, buffer.shape[len(prefix)])
    return buffer.at[(*prefix, write)].set(rows.astype(buffer.dtype), mode="drop")


def read_buffer(buffer: jax.Array, ids: jax.Array | None, per_sample: bool) -> jax.Array:
    """The buffer rows for ``ids`` (or the whole buffer when not per sample)."""
    return read_rows(buffer, ids) if per_sample else buffer


def write_buffer(buffer, ids, rows, per_sample: bool):
    """Writes ``rows`` back at ``ids`` (or replaces the buffer), in the buffer's dtype."""
    return write_rows(buffer, ids, rows) if per_sample else rows.astype(buffer.dtype)
