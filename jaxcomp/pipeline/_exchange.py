"""One boundary's sends as explicit calls: activations forward, activation-gradients backward.

The explicit schedules run a microbatch's backward send at a later tick than its forward send,
so a boundary is two calls rather than one ``custom_vjp``:

* :func:`send_forward`: stage ``b`` encodes the activation with the link's forward channel,
  the payload moves to stage ``b + 1``, which decodes it;
* :func:`send_backward`: stage ``b + 1`` encodes the gradient with the backward channel (or,
  in ``"shared_mask"`` mode, takes it at the positions the forward kept), the payload moves to
  stage ``b``, which decodes it.

Each end works only where it lives (under ``lax.cond`` inside ``shard_map``; everything runs in
the single-device simulation) and reads and writes its own state in the compact layout
(:mod:`jaxcomp.pipeline._link_state`). The channel calls, keys (``fold_in(key, 0)`` forward,
``fold_in(key, 1)`` backward of the send's key) and ids are those of
:func:`jaxcomp.comm.compressed_ppermute`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm import _local
from jaxcomp.compressors import _base
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _link_state


class Wire(NamedTuple):
    """How one boundary's ends meet.

    Attributes:
      is_source: stage ``b`` is here (``True`` in the simulation, a traced bool per device).
      is_target: stage ``b + 1`` is here.
      move: ``move(tree, reverse) -> tree``: the payload from ``b`` to ``b + 1`` (``reverse``:
        back); a ``ppermute`` with the single pair, or nothing in the simulation.
      stacked: link-state buffers are ``[S, L]`` (the simulation) rather than one device's.
    """

    is_source: Any
    is_target: Any
    move: Callable[[Any, bool], Any]
    stacked: bool


def _gated(active: Any, fn: Callable[[], Any], fallback: Callable[[], Any]) -> Any:
    if active is True:
        return fn()
    return lax.cond(active, fn, fallback)


def _zeros_like_struct(struct: Any, like: jax.Array) -> Any:
    """Zeros shaped as ``struct``, varying over the same mesh axes as ``like``."""
    axes = tuple(sorted(_local.varying_axes(like)))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), struct)
    return _local.to_varying(zeros, axes) if axes else zeros


def _end(active, fn, fallback, buffers, ref, ids):
    """Runs one end ``fn(state, local_ids) -> (out, state)`` where ``active``; the state is read
    from and written back to the packed ``buffers`` outside the ``lax.cond``."""
    rows = ids is not None and any(ref.per_sample)
    part = ref.read(buffers, ids if rows else None)
    local_ids = jnp.arange(ids.shape[0], dtype=ids.dtype) if rows else ids
    out, new = _gated(active, lambda: fn(part, local_ids), lambda: (fallback(), part))
    if not jax.tree.leaves(new):
        return out, buffers
    return out, ref.write(buffers, ids if rows else None, new)


def _exchange(channel, x, buffers, layout, roles, boundary, key, ids, wire, compress, reverse):
    """One channel's ``send -> move -> receive``. ``roles`` are the sender's and the
    receiver's role names; returns ``(decoded, buffers, sent payload, received payload)``."""
    send_ref = _link_state.end_ref(layout, roles[0], boundary, wire.stacked)
    recv_ref = _link_state.end_ref(layout, roles[1], boundary, wire.stacked)
    is_sender, is_receiver = (
        (wire.is_target, wire.is_source) if reverse else (wire.is_source, wire.is_target)
    )
    if not compress:  # dense: the channel only observes x (EF21 / AQ-SGD copy it)
        _, buffers = _end(
            is_sender, lambda st, i: (None, channel.dense_send(x, st, i)), lambda: None,
            buffers, send_ref, ids,
        )  # fmt: skip
        received = wire.move(x, reverse)
        _, buffers = _end(
            is_receiver, lambda st, i: (None, channel.dense_receive(received, st, i)),
            lambda: None, buffers, recv_ref, ids,
        )  # fmt: skip
        return received, buffers, None, None
    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    struct = _base.payload_shape(channel.codec, like)
    payload, buffers = _end(
        is_sender, lambda st, i: channel.send(x, st, key, i),
        lambda: _zeros_like_struct(struct, x), buffers, send_ref, ids,
    )  # fmt: skip
    received = wire.move(payload, reverse)
    y, buffers = _end(
        is_receiver, lambda st, i: channel.receive(received, st, like, i),
        lambda: jnp.zeros_like(x), buffers, recv_ref, ids,
    )  # fmt: skip
    return y, buffers, payload, received


def _keys(key):
    if key is None:
        return None, None
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def send_forward(
    lk: _config.Link,
    boundary: int,
    x: jax.Array,
    buffers: dict[str, jax.Array],
    layout: _link_state.StateLayout,
    key: jax.Array | None,
    ids: jax.Array | None,
    wire: Wire,
    compress: bool,
) -> tuple[jax.Array, dict[str, jax.Array], tuple[Any, Any]]:
    """Sends activation ``x`` over ``boundary``.

    Returns:
      ``(decoded, buffers, (sent, received))``: the decoded activation (on the target; zeros
      elsewhere), the updated link-state buffers, and the payloads the shared-mask backward of
      this microbatch needs (``(None, None)`` otherwise).
    """
    roles = ("forward_send", "forward_recv")
    y, buffers, sent, received = _exchange(
        lk.forward, x, buffers, layout, roles, boundary, _keys(key)[0], ids, wire, compress,
        False,
    )  # fmt: skip
    keep = lk.mode == "shared_mask" and compress
    return y, buffers, (sent, received) if keep else (None, None)


def send_backward(
    lk: _config.Link,
    boundary: int,
    g: jax.Array,
    buffers: dict[str, jax.Array],
    layout: _link_state.StateLayout,
    payloads: tuple[Any, Any],
    key: jax.Array | None,
    ids: jax.Array | None,
    wire: Wire,
    compress: bool,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sends activation-gradient ``g`` back over ``boundary``; returns ``(decoded, buffers)``.

    ``payloads`` are the forward's ``(sent, received)`` of the same microbatch (shared-mask
    mode only): the target sends ``g`` at the received payload's kept positions (the transpose
    of decoding its values), the source decodes them at its sent payload's positions.
    """
    if lk.mode == "shared_mask" and compress:
        sent, received = payloads
        like = jax.ShapeDtypeStruct(g.shape, g.dtype)
        codec = lk.forward.codec

        def gather():
            def decode(v):
                return codec.decompress(received._replace(values=v), like)

            return jax.vjp(decode, received.values)[1](g)[0]

        vals = _gated(wire.is_target, gather, lambda: jnp.zeros_like(received.values))
        vals = wire.move(vals, True)
        dx = _gated(
            wire.is_source,
            lambda: codec.decompress(sent._replace(values=vals), like),
            lambda: jnp.zeros_like(g),
        )
        return dx, buffers
    if lk.backward is None:
        return wire.move(g, True), buffers
    roles = ("backward_send", "backward_recv")
    dx, buffers, _, _ = _exchange(
        lk.backward, g, buffers, layout, roles, boundary, _keys(key)[1], ids, wire, compress,
        True,
    )  # fmt: skip
    return dx, buffers
