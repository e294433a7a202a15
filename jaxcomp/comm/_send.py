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

These sends are not exported: the pipeline runs its boundaries as two explicit calls per
microbatch at the ticks of its schedule (:func:`jaxcomp.pipeline._links.send_forward`, made of
the same :mod:`jaxcomp.comm._send_vjp` pieces), not inside one ``jax.grad``; they stay here, with
their tests, as the ``custom_vjp`` form of the same protocol.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _validate
from jaxcomp._bits import move_as_bits
from jaxcomp.comm import _send_vjp
from jaxcomp.comm._send_vjp import ChannelStates
from jaxcomp.compressors import _base
from jaxcomp.feedback import _channel

BACKWARD_MODES = ("independent", "shared_mask")


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
    _validate.check_choice("mode", mode, BACKWARD_MODES)
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


def _run_link(x, fwd_states, bwd_token, forward, backward, mode, compress, key, ids,
              backward_ids, transport, roles, slots):  # fmt: skip
    """What both public sends share: checks, the custom_vjp link, stop_gradient on the states."""
    forward = _channel.as_channel(forward)
    backward = None if backward is None else _channel.as_channel(backward)
    check_link(forward, backward, mode, x if mode == "shared_mask" and compress else None)
    check_backward_state(bwd_token)
    link = _send_vjp.make_link(forward, backward, mode, compress, transport, roles, slots)
    ids = (ids, ids if backward_ids is None else backward_ids)
    y, fwd_states, bwd_token = link(x, fwd_states, bwd_token, key, ids)
    return y, lax.stop_gradient(fwd_states), bwd_token


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
      >>> from jaxcomp.comm import _send
      >>> mesh = comm.make_mesh([("stage", 2)], jax.devices()[:2])
      >>> q8 = compressors.quantize(8)
      >>> states = comm.init_channel_states(q8, jnp.zeros(4))  # stateless: empty
      >>> def loss(x):  # device 0's x goes to device 1, which computes |x|^2
      ...     y, _, _ = _send.compressed_ppermute(
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
      (see :func:`jaxcomp.pipeline.distribute` for a full pipeline).

    References:
      Rudakov et al., `Activations and Gradients Compression for Model-Parallel Training
      <https://arxiv.org/abs/2401.07788>`_, 2024.
    """
    perm, inverse = [(source, target)], [(target, source)]

    def transport(tree, reverse):
        pairs = inverse if reverse else perm
        return move_as_bits(lambda t: lax.ppermute(t, axis_name, pairs), tree)

    def roles():  # traced after the link's own checks
        _check_indices(axis_name, source, target)
        index = lax.axis_index(axis_name)
        return index == source, index == target

    return _run_link(x, fwd_states, bwd_token, forward, backward, mode, compress, key, ids,
                     backward_ids, transport, roles, (None, None))  # fmt: skip


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
    slots: tuple[int, int] | None = None,
) -> tuple[jax.Array, ChannelStates, ChannelStates]:
    """:func:`compressed_ppermute` without the collective: sender and receiver in one program.

    The single-device simulation of a link: the same channel calls, keys and state updates as
    :func:`compressed_ppermute` with ``source``/``target`` both local, so a model with these at
    its cut points reproduces a distributed pipeline's numbers.

    Args:
      x, fwd_states, bwd_token, forward, backward, key, ids, backward_ids, mode, compress: as
        for :func:`compressed_ppermute`.
      slots: ``(source, target)`` when every state leaf stacks all stages' ends on a leading
        axis (the layout of :func:`jaxcomp.pipeline.distribute`'s link states): the forward's sender
        end is row ``source`` and its receiver row ``target``, the backward's the other way
        round. Only those rows are read and written, and of a per-sample buffer only the rows
        at ``ids``, so a large AQ-SGD cache is never copied. ``None``: the states are the ends.

    Returns:
      ``(y, fwd_states, bwd_token)`` as for :func:`compressed_ppermute`.
    """
    if slots is not None:
        _check_slots(slots, (fwd_states, bwd_token))
    else:
        slots = (None, None)
    return _run_link(
        x, fwd_states, bwd_token, forward, backward, mode, compress, key, ids, backward_ids,
        lambda tree, reverse: tree, lambda: (True, True), slots,
    )  # fmt: skip


def _check_indices(axis_name: str, source: Any, target: Any) -> None:
    size = lax.axis_size(axis_name)
    for name, index in (("source", source), ("target", target)):
        if isinstance(index, bool) or not (isinstance(index, int) and 0 <= index < size):
            raise ValueError(
                f"{name} must be an index along {axis_name!r} in [0, {size}); got {index!r}."
            )
    if source == target:
        raise ValueError(f"source and target must differ; got {source} for both.")


def _check_slots(slots: Any, states: Any) -> None:
    ok = isinstance(slots, tuple) and len(slots) == 2
    ok = ok and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in slots)
    if not ok:
        raise ValueError(
            f"slots must be a pair of non-negative ints (source, target); got {slots!r}."
        )
    for leaf in jax.tree.leaves(states):
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] <= max(slots):
            raise ValueError(
                f"slots={slots} index the leading axis of every state leaf; got a leaf of shape "
                f"{jnp.shape(leaf)}."
            )
