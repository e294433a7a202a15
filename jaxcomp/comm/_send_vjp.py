"""The ``custom_vjp`` behind :mod:`jaxcomp.comm._send`: one link's forward and backward exchange.

Each end of a channel works only on the device where it lives (under ``lax.cond``; per-sample
buffers stay outside the cond, only the microbatch's rows enter it), payloads move with the
``transport`` the caller supplies (a ``ppermute``, or nothing in the single-device simulation),
and the backward channel's state rides the cotangent of a token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.comm import _local
from jaxcomp.compressors import _base
from jaxcomp.feedback import _channel


class ChannelStates(NamedTuple):
    """The two ends of one channel as one device (or one simulated link) holds them.

    Attributes:
      send: the sender's state (e.g. an EF residual, an EF21 estimate, AQ-SGD's ``m_com``).
      recv: the receiver's state (e.g. AQ-SGD's ``m_dec``); ``EmptyState()`` for most channels.
    """

    send: Any
    recv: Any


class _Leaf(NamedTuple):
    shape: tuple[int, ...]
    dtype: Any
    varying: tuple[str, ...]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Described:
    """Shapes, dtypes and varying mesh axes of a state tree: a residual without arrays (static
    pytree data), saved instead of the values so that large states are not kept for the
    backward pass."""

    treedef: Any
    leaves: tuple[_Leaf, ...]


def _describe(tree: Any) -> _Described:
    leaves, treedef = jax.tree.flatten(tree)
    return _Described(
        treedef,
        tuple(
            _Leaf(tuple(x.shape), x.dtype, tuple(sorted(_local.varying_axes(x)))) for x in leaves
        ),
    )


def _zero_cotangent(described: _Described) -> Any:
    def zero(d):
        if not jnp.issubdtype(d.dtype, jnp.inexact):
            return np.zeros(d.shape, jax.dtypes.float0)
        z = jnp.zeros(d.shape, d.dtype)
        return _local.to_varying(z, d.varying) if d.varying else z

    return jax.tree.unflatten(described.treedef, [zero(d) for d in described.leaves])


def _zeros(struct: Any, like: jax.Array) -> Any:
    """Zeros shaped as ``struct``, varying over the same mesh axes as ``like`` (so that both
    branches of a ``lax.cond`` inside ``shard_map`` have the same type)."""
    axes = tuple(sorted(_local.varying_axes(like)))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), struct)
    return _local.to_varying(zeros, axes) if axes else zeros


def gated(active: Any, fn: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    """``fn()`` where ``active``; ``fallback()`` elsewhere (no work done on inactive devices)."""
    if active is True:
        return fn()
    return lax.cond(active, fn, fallback)


def fold_keys(key):
    """``(forward key, backward key)`` of one send: ``fold_in(key, 0)``, ``fold_in(key, 1)``."""
    if key is None:
        return None, None
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def sample_buffer_flags(channel: Any, state: Any) -> Any:
    """Flags the leaves of a channel end's state that hold one row per sample id: those under
    the fields the channel declares (``Channel.sample_fields``, e.g. AQ-SGD's caches)."""
    return _flags(state, channel.sample_fields if channel.per_sample else ())


def _flags(state: Any, fields: tuple[str, ...]) -> Any:
    """``True`` under a field named in ``fields``; other NamedTuple fields are searched in turn
    (a wrapping channel nests its inner channel's state, e.g. the pipeline's norm tracking)."""
    if not fields or not hasattr(state, "_fields"):
        return jax.tree.map(lambda _: False, state)
    return type(state)(
        *(
            jax.tree.map(lambda _: True, getattr(state, f)) if f in fields
            else _flags(getattr(state, f), fields)
            for f in state._fields
        )
    )  # fmt: skip


class StateEnd(NamedTuple):
    """One end of a channel in a :class:`ChannelStates` store: field ``"send"`` or ``"recv"``,
    optionally row ``slot`` of states stacked on a leading axis.

    An *end accessor* (this, or the pipeline's packed-state one) runs a channel end with
    ``run(active, fn, fallback, store, ids, x) -> (out, store)``: ``fn(state, ids) -> (out,
    state)`` where ``active``, ``(fallback(), state)`` elsewhere, the state read from and
    written back to ``store``.
    """

    field: str
    channel: Any
    slot: int | None = None

    def run(self, active, fn, fallback, store, ids, x):
        """Per-sample buffers (the fields the channel declares) stay out of the ``lax.cond``:
        only this microbatch's rows enter it (with local ids ``0..mb-1``) and are written back
        outside, unchanged where inactive, with the channel layer's id rule (an out-of-range id
        reads NaN and writes nothing; a repeated id writes its last occurrence). A cond that
        carried the whole buffer would copy it at every send (XLA does not update a
        conditional's operand in place). With an int ``slot`` only that row (of a per-sample
        buffer: only its rows at ``ids``) is read and written."""
        state, slot = getattr(store, self.field), self.slot
        flags = (
            sample_buffer_flags(self.channel, state)
            if ids is not None
            else jax.tree.map(lambda _: False, state)
        )
        by_rows = any(jax.tree.leaves(flags))
        if slot is None and (active is True or not by_rows):
            out, new = gated(active, lambda: fn(state, ids), lambda: (fallback(), state))
            return out, store._replace(**{self.field: new})
        prefix = () if slot is None else (slot,)

        def read(a, rows):
            if rows:
                return _channel.read_rows(a, ids, prefix)
            return a if slot is None else a[slot]

        def write(a, rows, new):
            if rows:
                return _channel.write_rows(a, ids, new, prefix)
            return new if slot is None else a.at[slot].set(new)

        part = jax.tree.map(read, state, flags)
        local_ids = jnp.arange(x.shape[0], dtype=ids.dtype) if by_rows else ids
        out, new = gated(active, lambda: fn(part, local_ids), lambda: (fallback(), part))
        return out, store._replace(**{self.field: jax.tree.map(write, state, flags, new)})


def encode(channel, x, store, send_end, key, ids, is_sender, compress):
    """The sender's half of :func:`exchange`: ``(payload, store)``, the payload zeros where
    ``is_sender`` is false (``x`` itself when ``compress`` is false, the channel observing it)."""
    if not compress:  # dense: the channel only observes x (EF21/AQ-SGD copy it)
        _, store = send_end.run(
            is_sender, lambda st, i: (None, channel.dense_send(x, st, i)), lambda: None,
            store, ids, x,
        )  # fmt: skip
        return x, store
    payload_struct = _base.payload_shape(channel.codec, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return send_end.run(
        is_sender, lambda st, i: channel.send(x, st, key, i), lambda: _zeros(payload_struct, x),
        store, ids, x,
    )  # fmt: skip


def decode(channel, received, x, store, recv_end, ids, is_receiver, compress):
    """The receiver's half of :func:`exchange`: ``(decoded, store)`` from the moved payload
    (zeros where ``is_receiver`` is false; ``x``: what was sent, for its shape and dtype)."""
    if not compress:
        _, store = recv_end.run(
            is_receiver, lambda st, i: (None, channel.dense_receive(received, st, i)),
            lambda: None, store, ids, x,
        )  # fmt: skip
        return received, store
    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return recv_end.run(
        is_receiver, lambda st, i: channel.receive(received, st, like, i),
        lambda: jnp.zeros_like(x), store, ids, x,
    )  # fmt: skip


def exchange(channel, x, store, ends, key, ids, is_sender, is_receiver, move, compress):
    """One channel's ``send -> move -> receive`` (:func:`encode`, ``move``, :func:`decode`),
    each end working only where it lives.

    Args:
      channel: the :class:`~jaxcomp.feedback.Channel`.
      x: what the sender sends (every device passes one of the same shape).
      store: where both ends' states live; ``ends`` are the sender's and the receiver's end
        accessors into it (:class:`StateEnd`, or the pipeline's packed ones).
      key: the codec's key; ids: sample ids of ``x``'s rows (or ``None``).
      is_sender, is_receiver: where each end lives (``True``, or a traced bool per device).
      move: ``move(payload) -> payload`` from sender to receiver.
      compress: ``False`` sends ``x`` dense and lets the channel observe it.

    Returns:
      ``(decoded, store, payload sent, payload received)`` (payloads ``None`` when dense).
    """
    send_end, recv_end = ends
    payload, store = encode(channel, x, store, send_end, key, ids, is_sender, compress)
    received = move(payload)
    y, store = decode(channel, received, x, store, recv_end, ids, is_receiver, compress)
    if not compress:
        return y, store, None, None
    return y, store, payload, received


def forward_encode(forward, compress, x, store, ends, key, ids, roles):
    """The source's half of :func:`send_forward`: ``(payload, store)``."""
    return encode(forward, x, store, ends[0], fold_keys(key)[0], ids, roles[0], compress)


def forward_decode(forward, compress, received, x, store, ends, ids, roles):
    """The target's half of :func:`send_forward`: ``(decoded, store)``."""
    return decode(forward, received, x, store, ends[1], ids, roles[1], compress)


def send_forward(forward, mode, compress, x, store, ends, key, ids, roles, move):
    """A link's forward: ``x`` over the forward channel from the source to the target
    (:func:`forward_encode`, ``move``, :func:`forward_decode`).

    ``roles`` is ``(is_source, is_target)``, ``move(tree, reverse)`` carries a payload (back
    when ``reverse``), ``key`` is the send's key (its forward key is ``fold_in(key, 0)``).

    Returns:
      ``(decoded, store, (sent, received))``: the payloads the shared-mask backward of this
      microbatch needs (``(None, None)`` otherwise).
    """
    sent, store = forward_encode(forward, compress, x, store, ends, key, ids, roles)
    received = move(sent, False)
    y, store = forward_decode(forward, compress, received, x, store, ends, ids, roles)
    return y, store, (sent, received) if mode == "shared_mask" and compress else (None, None)


def backward_encode(forward, backward, mode, compress, g, store, ends, payloads, key, ids, roles):
    """The target's half of :func:`send_backward`: ``(payload, store)``."""
    is_target = roles[1]
    if mode == "shared_mask" and compress:
        received = payloads[1]
        like = jax.ShapeDtypeStruct(g.shape, g.dtype)

        def gather():
            def decode(v):
                return forward.codec.decompress(received._replace(values=v), like)

            return jax.vjp(decode, received.values)[1](g)[0]

        return gated(is_target, gather, lambda: jnp.zeros_like(received.values)), store
    if backward is None:
        return g, store
    return encode(backward, g, store, ends[0], fold_keys(key)[1], ids, is_target, compress)


def backward_decode(forward, backward, mode, compress, moved, g, store, ends, payloads, ids,
                    roles):  # fmt: skip
    """The source's half of :func:`send_backward`: ``(decoded gradient, store)`` from the
    ``moved`` payload (``g``: the gradient sent, for its shape and dtype)."""
    is_source = roles[0]
    if mode == "shared_mask" and compress:
        sent = payloads[0]
        like = jax.ShapeDtypeStruct(g.shape, g.dtype)
        dx = gated(
            is_source,
            lambda: forward.codec.decompress(sent._replace(values=moved), like),
            lambda: jnp.zeros_like(g),
        )
        return dx, store
    if backward is None:
        return moved, store
    return decode(backward, moved, g, store, ends[1], ids, is_source, compress)


def send_backward(forward, backward, mode, compress, g, store, ends, payloads, key, ids, roles,
                  move):  # fmt: skip
    """A link's backward: the gradient ``g`` from the target back to the source
    (:func:`backward_encode`, ``move``, :func:`backward_decode`).

    ``"shared_mask"`` mode sends ``g`` at the forward's kept positions (the transpose of
    decoding the target's received payload's values; the source decodes them at its sent
    payload's positions); a ``None`` backward channel sends ``g`` dense; otherwise the backward
    channel (its ``ends`` in ``store``) compresses it with key ``fold_in(key, 1)``.

    Returns:
      ``(decoded gradient on the source, store)``.
    """
    args = (forward, backward, mode, compress)
    payload, store = backward_encode(*args, g, store, ends, payloads, key, ids, roles)
    moved = move(payload, True)
    return backward_decode(*args, moved, g, store, ends, payloads, ids, roles)


def make_link(forward, backward, mode, compress, transport, roles, slots):
    """Builds the custom_vjp function ``(x, fwd, token, key, ids) -> (y, fwd, token)``.

    ``slots`` is ``(source row, target row)`` of stacked states, or ``(None, None)``: the forward
    channel's sender lives at the source, the backward channel's at the target.
    """
    source_slot, target_slot = slots
    fwd_ends = (StateEnd("send", forward, source_slot), StateEnd("recv", forward, target_slot))
    bwd_ends = None
    if backward is not None:
        bwd_ends = (
            StateEnd("send", backward, target_slot),
            StateEnd("recv", backward, source_slot),
        )

    def forward_pass(x, fwd, key, ids):
        return send_forward(forward, mode, compress, x, fwd, fwd_ends, key, ids[0], roles(),
                            transport)  # fmt: skip

    def backward_pass(payloads, g, state, key, ids):
        return send_backward(forward, backward, mode, compress, g, state, bwd_ends, payloads,
                             key, ids[1], roles(), transport)  # fmt: skip

    @jax.custom_vjp
    def link(x, fwd, token, key, ids):
        y, fwd, _ = forward_pass(x, fwd, key, ids)
        return y, fwd, token

    def link_fwd(x, fwd, token, key, ids):
        y, new_fwd, payloads = forward_pass(x, fwd, key, ids)
        static = (_describe(fwd), _describe(token))
        return (y, new_fwd, token), (payloads, key, ids, static)

    def link_bwd(res, cts):
        payloads, key, ids, (fwd, token) = res
        g, _, state = cts
        dx, new_state = backward_pass(payloads, g, state, key, ids)
        dtypes = [d.dtype for d in token.leaves]
        new_state = jax.tree.unflatten(
            token.treedef, [n.astype(t) for n, t in zip(jax.tree.leaves(new_state), dtypes)]
        )
        return dx, _zero_cotangent(fwd), new_state, None, None

    link.defvjp(link_fwd, link_bwd)
    return link
