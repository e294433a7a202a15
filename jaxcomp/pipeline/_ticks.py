"""The GPipe forward ticks as every stage device runs them inside ``shard_map``.

Each device holds its stage's packed parameters and, per boundary, the activation it last
received. At every tick a ``lax.switch`` on the device's stage index runs *only its own stage*
(or nothing, in a bubble), then each boundary active in this tick sends its activation with
:func:`jaxcomp.comm.compressed_ppermute` from stage ``b`` to ``b + 1``: one ``ppermute`` per
boundary with the single pair ``(b, b + 1)``, so every payload travels at its exact size
(the other devices supply zeros of the right shape and send nothing). ``jax.grad`` of the
ticks runs the backward in reverse tick order, with the gradients compressed by the same links.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.comm import _send
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _params
from jaxcomp.pipeline import _prepare
from jaxcomp.pipeline import _schedule


class TickContext(NamedTuple):
    """Static description of one pipeline program."""

    model: _config.StagedModel
    links: tuple[_config.Link, ...]
    num_microbatches: int
    layout: _params.ParamLayout
    shapes: tuple[jax.ShapeDtypeStruct, ...]
    final: jax.ShapeDtypeStruct
    metrics: Any
    axes: tuple[str, ...]  # mesh axes every per-device value varies over
    compress: bool
    collect_outputs: bool


class TickResult(NamedTuple):
    loss_sum: jax.Array
    metrics_sum: Any
    fwd_states: tuple[_send.ChannelStates, ...]
    tokens: tuple[_send.ChannelStates, ...]
    outputs: jax.Array | None


def _take(tree: Any, i: Any) -> Any:
    if isinstance(i, int):
        return jax.tree.map(lambda a: a[i], tree)
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _clamp(i: Any, hi: int) -> Any:
    """``i`` clipped to ``[0, hi]``; Python ints stay static (unrolled ticks)."""
    return min(max(i, 0), hi) if isinstance(i, int) else jnp.clip(i, 0, hi)


def _zeros(struct: Any, axes: tuple[str, ...]) -> Any:
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), struct)
    return _local.to_varying(zeros, axes)


def _branches(ctx: TickContext, active: tuple[bool, ...]):
    """A branch per active stage plus a final idle branch, all with the same output type (only
    the stages active in a tick are compiled into it)."""
    stages, num = ctx.model.stages, len(ctx.model.stages)
    final = ctx.final if ctx.collect_outputs else None

    def idle(local, x_t, recv, labels_t):
        del local, x_t, recv, labels_t
        outs = tuple(_zeros(s, ()) for s in ctx.shapes)
        loss, metrics = jnp.zeros((), jnp.float32), _zeros(ctx.metrics, ())
        return _local.to_varying((outs, loss, metrics, _zeros(final, ())), ctx.axes)

    def make(s):
        def branch(local, x_t, recv, labels_t):
            params = ctx.layout.unpack_stage(s, local)
            y = stages[s](params, x_t if s == 0 else recv[s - 1])
            outs = tuple(
                y if b == s else jnp.zeros(sh.shape, sh.dtype) for b, sh in enumerate(ctx.shapes)
            )
            if s < num - 1:
                loss, metrics = jnp.zeros((), jnp.float32), _zeros(ctx.metrics, ())
                out = _zeros(final, ())
            else:
                loss, metrics = _prepare.split_loss(ctx.model.loss_fn(y, labels_t))
                loss = loss.astype(jnp.float32)
                metrics = jax.tree.map(lambda v: v.astype(jnp.float32), metrics)
                out = y if final is not None else None
            return _local.to_varying((outs, loss, metrics, out), ctx.axes)

        return branch

    return [make(s) for s in range(num) if active[s]] + [idle]


def run_ticks(
    ctx: TickContext,
    local: dict[str, jax.Array],
    x: Any,
    labels: Any,
    ids: jax.Array | None,
    key: jax.Array | None,
    fwd_states: tuple[_send.ChannelStates, ...],
    tokens: tuple[_send.ChannelStates, ...],
) -> TickResult:
    """Runs the ``M + S - 1`` forward ticks on this device (inside ``shard_map``).

    Args:
      ctx: the static program description.
      local: this stage's packed parameter vectors ``{dtype: [length]}``.
      x: ``[M, mb, ...]`` inputs; labels: pytree of ``[M, mb, ...]``; ids: ``[M, mb]`` or None.
      key: PRNG key (or ``None`` for deterministic codecs).
      fwd_states: per boundary, the forward channel's states as this device holds them.
      tokens: per boundary, the backward-state tokens (see :mod:`jaxcomp.comm._send`).

    Returns:
      A :class:`TickResult`; ``loss_sum`` and ``metrics_sum`` are summed over microbatches and
      non-zero on the last stage only.
    """
    num, m_ = len(ctx.model.stages), ctx.num_microbatches
    stage = lax.axis_index(_mesh.STAGE)
    outputs = None
    if ctx.collect_outputs:
        outputs = _zeros(jax.ShapeDtypeStruct((m_, *ctx.final.shape), ctx.final.dtype), ctx.axes)
    carry = (
        tuple(_zeros(s, ctx.axes) for s in ctx.shapes),
        tuple(fwd_states),
        tuple(tokens),
        _zeros(jax.ShapeDtypeStruct((), jnp.float32), ctx.axes),
        _zeros(ctx.metrics, ctx.axes),
        outputs,
    )

    def tick(carry, t, active):
        recv, fwd, tok, loss_sum, metrics_sum, outputs = carry
        recv, fwd, tok = list(recv), list(fwd), list(tok)
        slots, position = [], 0
        for is_active in active:  # stage -> its branch, idle stages -> the last branch
            slots.append(position if is_active else sum(active))
            position += is_active
        index = jnp.asarray(slots, jnp.int32)[stage]
        last_m = t - (num - 1)  # the microbatch the last stage works on (when active)
        x_t = _take(x, _clamp(t, m_ - 1))
        labels_t = _take(labels, _clamp(last_m, m_ - 1))
        outs, loss_t, metrics_t, final = lax.switch(
            index, _branches(ctx, active), local, x_t, tuple(recv), labels_t
        )
        for b, lk in enumerate(ctx.links):
            if not active[b]:
                continue  # stage b idles: boundary b sends nothing this tick
            m = t - b
            recv[b], fwd[b], tok[b] = _send.compressed_ppermute(
                outs[b],
                fwd[b],
                tok[b],
                forward=lk.forward,
                backward=lk.backward,
                axis_name=_mesh.STAGE,
                source=b,
                target=b + 1,
                key=_links.link_key(key, b, m),
                ids=None if ids is None else _take(ids, m),
                mode=lk.mode,
                compress=ctx.compress,
            )
        loss_sum = loss_sum + loss_t
        metrics_sum = jax.tree.map(jnp.add, metrics_sum, metrics_t)
        if outputs is not None and active[num - 1]:
            outputs = lax.dynamic_update_index_in_dim(outputs, final, last_m, 0)
        return tuple(recv), tuple(fwd), tuple(tok), loss_sum, metrics_sum, outputs

    for seg in _schedule.gpipe_segments(num, m_):
        if seg.length == 1:
            carry = tick(carry, seg.start, seg.active)
        else:
            ts = jnp.arange(seg.start, seg.start + seg.length, dtype=jnp.int32)
            carry, _ = lax.scan(lambda c, t, a=seg.active: (tick(c, t, a), None), carry, ts)
    _, fwd, tok, loss_sum, metrics_sum, outputs = carry
    return TickResult(loss_sum, metrics_sum, fwd, tok, outputs)
