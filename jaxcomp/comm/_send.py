"""Compressed point-to-point sends whose backward pass is compressed too.

A pipeline boundary moves activations forward and activation-gradients backward. With a plain
``lax.ppermute`` the forward can carry a compressed payload, but the backward is ppermute's own
transpose: an *uncompressed* ``float32`` send of the cotangent (and integer payloads have no
gradient at all). :func:`compressed_ppermute` is a ``jax.custom_vjp`` that compresses both
directions, each with its own :class:`~jaxcomp.feedback.Channel` and explicit state.

State in both directions is explicit:

* the *forward* channel's states (sender end, receiver end) go in and come out as values;
* the *backward* channel's states cannot come out of the forward pass (the backward has not run
  yet), so they travel as the **cotangent of a token**. The token is an argument that the forward
  passes through unchanged; the backward reads the current backward state from the cotangent of
  the token *output* and returns the updated state as the cotangent of the token *input*. Chaining
  the token through several sends (a scan over microbatches) therefore carries the backward
  state from each backward send to the one before it. To start the chain, pass
  ``backward_token(state)`` (zeros) and add ``seed_backward_state(token_out, state)`` to the
  loss: its value is 0 and its gradient with respect to ``token_out`` is ``state``. After
  ``jax.grad``, the gradient with respect to the token input *is* the new backward state.

Every device runs the same program: the sender end updates only on ``source``, the receiver end
only on ``target``, and both compress/decompress under ``lax.cond`` so the other devices do no
work. The receiver gets zeros from ``ppermute`` when it is not the target.
"""

from __future__ import annotations

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

BACKWARD_MODES = ("independent", "shared_mask")


class ChannelStates(NamedTuple):
    """The two ends of one channel as one device (or one simulated link) holds them.

    Attributes:
      send: the sender's state (e.g. an EF residual, an EF21 estimate, AQ-SGD's ``m_com``).
      recv: the receiver's state (e.g. AQ-SGD's ``m_dec``); ``EmptyState()`` for most channels.
    """

    send: Any
    recv: Any


def init_channel_states(channel: _channel.Channel | _base.Codec | None, like: Any) -> ChannelStates:
    """Both ends' initial states for ``channel`` carrying arrays shaped like ``like``.

    A codec is lifted with :func:`~jaxcomp.feedback.plain`; ``None`` (no channel, e.g. the
    backward of a shared-mask link) gives empty states.
    """
    if channel is None:
        return ChannelStates(_base.EmptyState(), _base.EmptyState())
    channel = _channel.as_channel(channel)
    return ChannelStates(*channel.init(jax.ShapeDtypeStruct(like.shape, like.dtype)))


def backward_token(state: ChannelStates) -> ChannelStates:
    """The token to pass as ``bwd_token`` at the start of a chain: zeros shaped as ``state``."""
    return jax.tree.map(jnp.zeros_like, state)


def seed_backward_state(token_out: ChannelStates, state: ChannelStates) -> jax.Array:
    """``vdot(stop_gradient(state), token_out)``: add it to the loss to start the chain.

    Its value is 0 (the token carries zeros) and its gradient with respect to ``token_out`` is
    ``state``, the backward state the last send's backward pass starts from.
    """
    terms = [
        jnp.vdot(lax.stop_gradient(s).astype(jnp.float32), t.astype(jnp.float32))
        for s, t in zip(jax.tree.leaves(state), jax.tree.leaves(token_out))
    ]
    return sum(terms, jnp.zeros((), jnp.float32))


def check_backward_state(state: Any, name: str = "backward channel") -> None:
    """Raises ``ValueError`` unless every leaf is floating (it must ride a cotangent)."""
    for leaf in jax.tree.leaves(state):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise ValueError(
                f"{name} state leaves must be floating-point to travel as cotangents; "
                f"got {leaf.dtype}."
            )


def check_link(
    forward: _channel.Channel, backward: _channel.Channel | None, mode: str, like: Any = None
) -> None:
    """Validates a link's configuration (and, given ``like``, the shared-mask payload)."""
    _base.check_choice("mode", mode, BACKWARD_MODES)
    if not isinstance(forward, _channel.Channel):
        raise TypeError(f"forward must be a Channel; got {type(forward).__name__}.")
    if mode == "shared_mask":
        if backward is not None:
            raise ValueError(
                "mode='shared_mask' sends the gradient at the forward's kept positions; it takes "
                f"no backward channel (got {backward.name})."
            )
        if like is not None:
            payload = _base.payload_shape(forward.codec, like)
            values = getattr(payload, "values", None)
            if not isinstance(values, jax.ShapeDtypeStruct) or not jnp.issubdtype(
                values.dtype, jnp.floating
            ):
                raise ValueError(
                    "mode='shared_mask' needs a forward codec whose payload has a floating "
                    f"'values' field (top_k, rand_k); {forward.codec.name} has none."
                )
    elif backward is not None and not isinstance(backward, _channel.Channel):
        raise TypeError(f"backward must be a Channel or None; got {type(backward).__name__}.")


class _Leaf(NamedTuple):
    shape: tuple[int, ...]
    dtype: Any
    varying: tuple[str, ...]


def _describe(tree: Any) -> Any:
    """Static shape, dtype and varying mesh axes of every leaf (kept instead of the values, so
    that large states are not saved as residuals for the backward pass)."""
    return jax.tree.map(
        lambda x: _Leaf(tuple(x.shape), x.dtype, tuple(sorted(_local.varying_axes(x)))), tree
    )


def _zero_cotangent(described: Any) -> Any:
    def zero(d):
        if not jnp.issubdtype(d.dtype, jnp.inexact):
            return np.zeros(d.shape, jax.dtypes.float0)
        z = jnp.zeros(d.shape, d.dtype)
        return _local.to_varying(z, d.varying) if d.varying else z

    return jax.tree.map(zero, described, is_leaf=lambda v: isinstance(v, _Leaf))


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


def _ids(ids, backward_ids):
    return ids, ids if backward_ids is None else backward_ids


def _keys(key):
    if key is None:
        return None, None
    return jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)


def _end(active, fn, fallback, state, ids, x, per_sample):
    """Runs one end of a channel, ``fn(state, ids) -> (out, state)``, where ``active``.

    Per-sample buffers (leaves shaped ``[N, *x.shape[1:]]``, e.g. AQ-SGD's caches) stay out of
    the ``lax.cond``: only this microbatch's rows enter it (with local ids ``0..mb-1``) and are
    written back outside, unchanged where inactive. A cond that carried the whole buffer would
    copy it at every send (XLA does not update a conditional's operand in place).
    """
    if active is True or not per_sample or ids is None:
        return _gated(active, lambda: fn(state, ids), lambda: (fallback(), state))
    flags = per_sample_leaves(per_sample, state, x)
    rows = jax.tree.map(lambda a, f: a[ids] if f else a, state, flags)
    local_ids = jnp.arange(x.shape[0], dtype=ids.dtype)
    out, new_rows = _gated(active, lambda: fn(rows, local_ids), lambda: (fallback(), rows))
    state = jax.tree.map(lambda a, f, r: a.at[ids].set(r) if f else r, state, flags, new_rows)
    return out, state


def per_sample_leaves(per_sample: bool, state: Any, like: Any, lead: int = 0) -> Any:
    """Flags the leaves of a channel state that are per-sample buffers ``[N, *like.shape[1:]]``
    (after ``lead`` leading axes), the ones indexed by sample ids."""
    feature, ndim = tuple(like.shape[1:]), len(like.shape) + lead
    return jax.tree.map(
        lambda a: per_sample and a.ndim == ndim and tuple(a.shape[lead + 1 :]) == feature, state
    )


def _exchange(channel, x, state, key, ids, is_sender, is_receiver, move, compress):
    """One channel's ``send -> move -> receive``, each end working only where it lives.

    Returns ``(decoded, new ChannelStates, payload sent, payload received)``.
    """
    per_sample = channel.per_sample
    if not compress:  # dense: the channel only observes x (EF21/AQ-SGD copy it)
        _, send_state = _end(
            is_sender, lambda st, i: (None, channel.dense_send(x, st, i)), lambda: None,
            state.send, ids, x, per_sample,
        )  # fmt: skip
        received = move(x)
        _, recv_state = _end(
            is_receiver, lambda st, i: (None, channel.dense_receive(received, st, i)),
            lambda: None, state.recv, ids, x, per_sample,
        )  # fmt: skip
        return received, ChannelStates(send_state, recv_state), None, None

    def send(st, i):
        return channel.send(x, st, key, i)

    like = jax.ShapeDtypeStruct(x.shape, x.dtype)
    payload_struct = jax.eval_shape(send, state.send, ids)[0]
    payload, send_state = _end(
        is_sender, send, lambda: _zeros(payload_struct, x), state.send, ids, x, per_sample
    )
    received = move(payload)
    y, recv_state = _end(
        is_receiver, lambda st, i: channel.receive(received, st, like, i),
        lambda: jnp.zeros_like(x), state.recv, ids, x, per_sample,
    )  # fmt: skip
    return y, ChannelStates(send_state, recv_state), payload, received


def _make_link(
    forward: _channel.Channel,
    backward: _channel.Channel | None,
    mode: str,
    compress: bool,
    transport: Callable[[Any, bool], Any],
    roles: Callable[[], tuple[Any, Any]],
):
    """Builds the custom_vjp function ``(x, fwd, token, key, ids) -> (y, fwd, token)``."""

    def forward_pass(x, fwd, key, ids):
        is_source, is_target = roles()
        y, states, sent, received = _exchange(
            forward, x, fwd, _keys(key)[0], ids[0], is_source, is_target,
            lambda tree: transport(tree, False), compress,
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
            lambda tree: transport(tree, True), compress,
        )  # fmt: skip
        return dx, state

    static = {}  # filled when link_fwd is traced, read when link_bwd is

    @jax.custom_vjp
    def link(x, fwd, token, key, ids):
        y, fwd, _ = forward_pass(x, fwd, key, ids)
        return y, fwd, token

    def link_fwd(x, fwd, token, key, ids):
        static["fwd"], static["token"] = _describe(fwd), _describe(token)
        y, new_fwd, payloads = forward_pass(x, fwd, key, ids)
        return (y, new_fwd, token), (payloads, key, ids)

    def link_bwd(res, cts):
        payloads, key, ids = res
        g, _, state = cts
        dx, new_state = backward_pass(payloads, g, state, key, ids)
        new_state = jax.tree.map(
            lambda n, d: n.astype(d.dtype),
            new_state,
            static["token"],
            is_leaf=lambda v: isinstance(v, _Leaf),
        )
        return dx, _zero_cotangent(static["fwd"]), new_state, None, None

    link.defvjp(link_fwd, link_bwd)
    return link


def compressed_ppermute(
    x: jax.Array,
    fwd_states: ChannelStates,
    bwd_token: ChannelStates,
    *,
    forward: _channel.Channel | _base.Codec,
    backward: _channel.Channel | _base.Codec | None = None,
    axis_name: str,
    source: int,
    target: int,
    key: jax.Array | None = None,
    ids: jax.Array | None = None,
    backward_ids: jax.Array | None = None,
    mode: str = "independent",
    compress: bool = True,
) -> tuple[jax.Array, ChannelStates, ChannelStates]:
    r"""Sends ``x`` from device ``source`` to ``target`` compressed, and its gradient back.

    Call inside ``jax.shard_map``. Forward: ``source`` sends ``forward.send(x)``; ``target``
    decodes it with ``forward.receive``. Backward (``jax.grad``): ``target`` sends the
    cotangent ``g`` of ``y`` back compressed,

    * ``mode="independent"``: with its own channel, ``backward.receive(backward.send(g))``
      (Rudakov et al.'s ResNet setup; ``backward=None`` sends ``g`` uncompressed);
    * ``mode="shared_mask"``: only the entries of ``g`` at the positions the forward kept,
      :math:`g \odot \mathrm{mask}`, which is the exact gradient of the sparsified forward and
      costs just the values (their positions are known at both ends). Needs a sparsifying
      forward codec (``top_k``, ``rand_k``) and ``backward=None``.

    With ``compress=False`` both directions travel dense and the channels see them through
    ``dense_send``/``dense_receive`` (AQ-SGD's warm-up fills its buffers this way).

    Args:
      x: the array to send (every device passes one of the same shape; only ``source``'s
        travels).
      fwd_states: the forward channel's :class:`ChannelStates` as this device holds them (the
        sender end is updated on ``source`` only, the receiver end on ``target`` only).
      bwd_token: a token shaped as the backward channel's :class:`ChannelStates`; see the
        module docstring: start a chain with :func:`backward_token` and
        :func:`seed_backward_state`; the gradient with respect to the first token is the new
        backward state.
      forward: channel (or codec, lifted with :func:`~jaxcomp.feedback.plain`) for ``x``.
      backward: channel (or codec) for the gradient, or ``None``.
      axis_name: the mesh axis (``jaxcomp.comm.STAGE``).
      source: sending index along ``axis_name``.
      target: receiving index along ``axis_name``.
      key: PRNG key; the forward uses ``fold_in(key, 0)``, the backward ``fold_in(key, 1)``.
      ids: sample ids of ``x``'s rows (for per-sample channels such as AQ-SGD).
      backward_ids: ids for the backward channel, if they differ (default: ``ids``).
      mode: ``"independent"`` or ``"shared_mask"``.
      compress: ``False`` sends both directions uncompressed.

    Returns:
      ``(y, fwd_states, bwd_token)``: ``y`` is the decoded ``x`` on ``target`` (zeros
      elsewhere), ``fwd_states`` the updated forward states, ``bwd_token`` the token to pass on.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp import comm, compressors
      >>> mesh = comm.make_mesh([("stage", 2)], jax.devices()[:2])
      >>> q8 = compressors.quantize(8)
      >>> states = comm.init_channel_states(q8, jnp.zeros(4))  # stateless: empty
      >>> def loss(x):  # device 0's x goes to device 1, which computes |x|^2
      ...     y, _, _ = comm.compressed_ppermute(
      ...         x, states, states, forward=q8, backward=q8,
      ...         axis_name="stage", source=0, target=1)
      ...     return jnp.sum(y ** 2)
      >>> grad = jax.jit(jax.shard_map(
      ...     jax.grad(loss), mesh=mesh, in_specs=P("stage"), out_specs=P("stage")))
      >>> [round(float(g), 1) for g in grad(jnp.arange(8.0))]  # 2 x on device 0, 8-bit both ways
      [0.0, 2.0, 4.0, 5.9, 0.0, 0.0, 0.0, 0.0]
      >>> comm.measure_collectives(grad, jnp.arange(8.0)).bytes_by_kind()  # 4 codes + scale, x2
      {'collective-permute': 16.0}

      With stateful channels, thread ``bwd_token`` as described in the module docstring
      (see :func:`jaxcomp.pipeline.gpipe` for a full pipeline).

    References:
      Rudakov et al., `Activations and Gradients Compression for Model-Parallel Training
      <https://arxiv.org/abs/2401.07788>`_, 2024.
    """
    forward = _channel.as_channel(forward)
    backward = None if backward is None else _channel.as_channel(backward)
    check_link(forward, backward, mode, x if mode == "shared_mask" and compress else None)
    check_backward_state(bwd_token)
    perm = [(source, target)]
    inverse = [(target, source)]

    def transport(tree, reverse):
        return lax.ppermute(tree, axis_name, inverse if reverse else perm)

    def roles():
        index = lax.axis_index(axis_name)
        return index == source, index == target

    link = _make_link(forward, backward, mode, compress, transport, roles)
    y, fwd_states, bwd_token = link(x, fwd_states, bwd_token, key, _ids(ids, backward_ids))
    return y, lax.stop_gradient(fwd_states), bwd_token


def compressed_transfer(
    x: jax.Array,
    fwd_states: ChannelStates,
    bwd_token: ChannelStates,
    *,
    forward: _channel.Channel | _base.Codec,
    backward: _channel.Channel | _base.Codec | None = None,
    key: jax.Array | None = None,
    ids: jax.Array | None = None,
    backward_ids: jax.Array | None = None,
    mode: str = "independent",
    compress: bool = True,
) -> tuple[jax.Array, ChannelStates, ChannelStates]:
    """:func:`compressed_ppermute` without the collective: sender and receiver in one program.

    The single-device simulation of a link: the same channel calls, keys and state updates as
    :func:`compressed_ppermute` with ``source``/``target`` both local, so a model with these at
    its cut points reproduces a distributed pipeline's numbers.
    """
    forward = _channel.as_channel(forward)
    backward = None if backward is None else _channel.as_channel(backward)
    check_link(forward, backward, mode, x if mode == "shared_mask" and compress else None)
    check_backward_state(bwd_token)
    link = _make_link(
        forward, backward, mode, compress, lambda tree, reverse: tree, lambda: (True, True)
    )
    y, fwd_states, bwd_token = link(x, fwd_states, bwd_token, key, _ids(ids, backward_ids))
    return y, lax.stop_gradient(fwd_states), bwd_token
