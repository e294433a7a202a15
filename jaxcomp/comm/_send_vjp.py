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


def _gated(active: Any, fn: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    """``fn()`` where ``active``; ``fallback()`` elsewhere (no work done on inactive devices)."""
    if active is True:
        return fn()
    return lax.cond(active, fn, fallback)


def _keys(key):
    if key is None:
        return None, None
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def _buffer_flags(channel: Any, state: Any) -> Any:
    """Flags the leaves of a channel end's state that hold one row per sample id: those under
    the fields the channel declares (``Channel.sample_fields``, e.g. AQ-SGD's caches)."""
    fields = channel.sample_fields if channel.per_sample else ()
    if not fields or not hasattr(state, "_fields"):
        return jax.tree.map(lambda _: False, state)
    return type(state)(
        *(jax.tree.map(lambda _, f=f: f in fields, getattr(state, f)) for f in state._fields)
    )


def _end(active, fn, fallback, state, ids, x, channel, slot):
    """Runs one end of a channel, ``fn(state, ids) -> (out, state)``, where ``active``.

    Per-sample buffers (the fields the channel declares) stay out of the ``lax.cond``: only
    this microbatch's rows enter it (with local ids ``0..mb-1``) and are written back outside,
    unchanged where inactive, with the channel layer's id rule (an out-of-range id reads NaN
    and writes nothing; a repeated id writes its last occurrence). A cond that carried the
    whole buffer would copy it at every send (XLA does not update a conditional's operand in
    place). With an int ``slot``, every leaf has a leading stage axis and this end is row
    ``slot``: only that row (of a per-sample buffer: only its rows at ``ids``) is read and
    written.
    """
    flags = (
        _buffer_flags(channel, state) if ids is not None else jax.tree.map(lambda _: False, state)
    )
    by_rows = any(jax.tree.leaves(flags))
    if slot is None and (active is True or not by_rows):
        return _gated(active, lambda: fn(state, ids), lambda: (fallback(), state))
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
    out, new = _gated(active, lambda: fn(part, local_ids), lambda: (fallback(), part))
    return out, jax.tree.map(write, state, flags, new)


def _exchange(channel, x, state, key, ids, is_sender, is_receiver, move, compress, slots):
    """One channel's ``send -> move -> receive``, each end working only where it lives
    (``slots``: the rows of the sender's and the receiver's state, or ``(None, None)``).

    Returns ``(decoded, new ChannelStates, payload sent, payload received)``.
    """
    send_slot, recv_slot = slots
    if not compress:  # dense: the channel only observes x (EF21/AQ-SGD copy it)
        _, send_state = _end(
            is_sender, lambda st, i: (None, channel.dense_send(x, st, i)), lambda: None,
            state.send, ids, x, channel, send_slot,
        )  # fmt: skip
        received = move(x)
        _, recv_state = _end(
            is_receiver, lambda st, i: (None, channel.dense_receive(received, st, i)),
            lambda: None, state.recv, ids, x, channel, recv_slot,
        )  # fmt: skip
        return received, ChannelStates(send_state, recv_state), None, None

    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    payload_struct = _base.payload_shape(channel.codec, like)
    payload, send_state = _end(
        is_sender, lambda st, i: channel.send(x, st, key, i), lambda: _zeros(payload_struct, x),
        state.send, ids, x, channel, send_slot,
    )  # fmt: skip
    received = move(payload)
    y, recv_state = _end(
        is_receiver, lambda st, i: channel.receive(received, st, like, i),
        lambda: jnp.zeros_like(x), state.recv, ids, x, channel, recv_slot,
    )  # fmt: skip
    return y, ChannelStates(send_state, recv_state), payload, received


def make_link(forward, backward, mode, compress, transport, roles, slots):
    """Builds the custom_vjp function ``(x, fwd, token, key, ids) -> (y, fwd, token)``.

    ``slots`` is ``(source row, target row)`` of stacked states, or ``(None, None)``: the forward
    channel's sender lives at the source, the backward channel's at the target.
    """
    source_slot, target_slot = slots

    def forward_pass(x, fwd, key, ids):
        is_source, is_target = roles()
        y, states, sent, received = _exchange(
            forward, x, fwd, _keys(key)[0], ids[0], is_source, is_target,
            lambda tree: transport(tree, False), compress, (source_slot, target_slot),
        )  # fmt: skip
        return y, states, (sent, received) if mode == "shared_mask" else (None, None)

    def backward_pass(payloads, g, state, key, ids):
        is_source, is_target = roles()
        if mode == "shared_mask" and compress:
            # send g at the forward's kept positions: the transpose of decoding the values
            sent, received = payloads
            like = jax.ShapeDtypeStruct(g.shape, g.dtype)

            def gather():
                def decode(v):
                    return forward.codec.decompress(received._replace(values=v), like)

                return jax.vjp(decode, received.values)[1](g)[0]

            vals = _gated(is_target, gather, lambda: jnp.zeros_like(received.values))
            vals = transport(vals, True)
            dx = _gated(
                is_source,
                lambda: forward.codec.decompress(sent._replace(values=vals), like),
                lambda: jnp.zeros_like(g),
            )
            return dx, state
        if backward is None:
            return transport(g, True), state
        dx, state, _, _ = _exchange(
            backward, g, state, _keys(key)[1], ids[1], is_target, is_source,
            lambda tree: transport(tree, True), compress, (target_slot, source_slot),
        )  # fmt: skip
        return dx, state

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
