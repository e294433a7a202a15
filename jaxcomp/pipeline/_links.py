"""A boundary's link: its shapes and checks, the keys and bytes of its sends, and the sends.

**Sends.** The explicit schedules run a microbatch's backward send at a later tick than its forward
send, so a boundary is two calls rather than one ``custom_vjp``: :func:`send_forward` (stage ``b``
encodes with the link's forward channel, the payload moves to ``b + 1``, which decodes it) and
:func:`send_backward` (``b + 1`` encodes the gradient with the backward channel, or in
``"shared_mask"`` mode takes it at the forward's kept positions, and ``b`` decodes it). They are the
functions :func:`jaxcomp.comm._send.compressed_ppermute` is made of (the same channel calls, keys
and ids), with each end's state read from and written to the compact link-state buffers
(:mod:`jaxcomp.pipeline._link_state`). The tick program runs each as its two halves
(:func:`forward_halves`, :func:`backward_halves`) around one move per tick (both directions
together under 1F1B: :func:`jaxcomp.pipeline._ticks.tick_moves`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.comm import _hlo
from jaxcomp.comm import _mesh
from jaxcomp.comm import _send
from jaxcomp.comm import _send_vjp
from jaxcomp.compressors import _base
from jaxcomp.feedback import _channel
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _link_state


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(jnp.shape(x)), x.dtype)


def boundary_shapes(
    model: _config.StagedModel,
    stage_params: Sequence[Any],
    x_mb: Any,
    labels_mb: Any,
    states: Sequence[Any] | None = None,
) -> tuple[tuple[jax.ShapeDtypeStruct, ...], Any]:
    """Traces the stages on one microbatch (no FLOPs) and returns the ``S - 1`` boundary
    shapes and the ``loss_fn`` output structure, checking every hand-over. A stateful model is
    traced through its evaluation stages with ``states`` (same shapes as training, and free of
    the collectives a synchronised BatchNorm makes in training).

    Raises:
      ValueError: naming the stage whose input does not fit, a stage that drops the microbatch
        axis or returns something other than one array, or a loss that is not a scalar.
    """
    params = [jax.tree.map(_struct, p) for p in stage_params]
    h = _struct(x_mb)
    mb = h.shape[0]
    shapes = []
    stages = model.stages
    if getattr(model, "stateful", False):  # the state as a traced argument, not a constant
        stages = tuple((lambda ps, x, f=f: f(ps[0], ps[1], x)) for f in model.eval_stages)
        params = [(p, jax.tree.map(_struct, st)) for p, st in zip(params, states)]
    for s, fn in enumerate(stages):
        source = "the microbatch inputs" if s == 0 else f"stage {s - 1}'s output"
        try:
            out = jax.eval_shape(fn, params[s], h)
        except Exception as e:  # noqa: BLE001 - re-raised with the boundary named
            raise ValueError(
                f"boundary shape mismatch: stage {s} cannot take {source} "
                f"{h.dtype}{list(h.shape)}: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(out, jax.ShapeDtypeStruct):
            raise ValueError(f"stage {s} must return one array; got {jax.tree.structure(out)}.")
        if not out.shape or out.shape[0] != mb:
            raise ValueError(
                f"stage {s} must keep the leading microbatch axis of size {mb}; it returned "
                f"shape {out.shape}."
            )
        if s < len(stages) - 1:
            if not jnp.issubdtype(out.dtype, jnp.floating):
                raise ValueError(f"stage {s} must return floating activations; got {out.dtype}.")
            shapes.append(out)
        h = out
    labels = jax.tree.map(_struct, labels_mb)
    try:
        loss_out = jax.eval_shape(model.loss_fn, h, labels)
    except Exception as e:  # noqa: BLE001
        raise ValueError(
            f"loss_fn cannot take the last stage's output {h.dtype}{list(h.shape)} and the "
            f"labels: {type(e).__name__}: {e}"
        ) from e
    loss, metrics = loss_out if isinstance(loss_out, tuple) else (loss_out, {})
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
        raise ValueError(f"loss_fn must return a scalar loss (or (loss, metrics)); got {loss}.")
    if not isinstance(metrics, dict) or any(m.shape != () for m in jax.tree.leaves(metrics)):
        raise ValueError("loss_fn's metrics must be a dict of scalars.")
    return tuple(shapes), h


def needs_ids(links: Sequence[_config.Link]) -> bool:
    """Whether any channel keeps per-sample buffers (and so needs sample ids)."""
    return any(ch is not None and ch.per_sample for lk in links for ch in (lk.forward, lk.backward))


def check_links(links: Sequence[_config.Link], shapes: Sequence[Any]) -> None:
    """Shape-dependent link checks (shared-mask payloads, floating backward states)."""
    for b, (lk, shape) in enumerate(zip(links, shapes)):
        try:
            _send.check_link(lk.forward, lk.backward, lk.mode, shape)
            bwd = jax.eval_shape(lambda ch=lk.backward, x=shape: _send.init_channel_states(ch, x))
            _send.check_backward_state(bwd)
        except (ValueError, TypeError) as e:
            raise type(e)(f"links[{b}]: {e}") from e


def eval_links(links: Sequence[_config.Link]) -> tuple[_config.Link, ...]:
    """The links of compressed evaluation: each forward codec alone, no feedback, no backward."""
    return tuple(_config.Link(_channel.plain(lk.forward.codec), None) for lk in links)


def check_key(links: Sequence[_config.Link], key: Any, compress: bool) -> None:
    """Raises ``ValueError`` naming the first link with a stochastic codec when ``key`` is
    ``None`` (and the step compresses)."""
    if key is not None or not compress:
        return
    for b, lk in enumerate(links):
        for direction in ("forward", "backward"):
            channel = getattr(lk, direction)
            if channel is not None and channel.codec.stochastic:
                raise ValueError(
                    f"links[{b}].{direction} uses the stochastic codec {channel.codec.name}: "
                    "pass a PRNG key, step(params, batch, link_states, key)."
                )


def link_key(key: jax.Array | None, boundary: int, microbatch: Any) -> jax.Array | None:
    """The key of one send: ``fold_in(fold_in(key, boundary), microbatch)`` (``None`` stays)."""
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, boundary), microbatch)


def link_bytes(lk: _config.Link, shape: Any, compress: bool) -> tuple[int, int]:
    """Bytes one microbatch puts on the wire at this link: ``(forward, backward)``."""
    dense = _base.dense_bytes(shape)
    if not compress:
        return dense, dense
    fwd = _base.wire_bytes(_base.payload_shape(lk.forward.codec, shape))
    if lk.mode == "shared_mask":
        bwd = _base.wire_bytes(_base.payload_shape(lk.forward.codec, shape).values)
    elif lk.backward is None:
        bwd = dense
    else:
        bwd = _base.wire_bytes(_base.payload_shape(lk.backward.codec, shape))
    return fwd, bwd


def step_bytes(
    links: Sequence[_config.Link],
    shapes: Sequence[Any],
    num_microbatches: int,
    compress: bool,
    train: bool,
) -> dict[str, int]:
    r"""Bytes per step and pipeline replica that cross the boundaries (see
    :func:`jaxcomp.pipeline.distribute`): every send's payload once,

    .. math::
      M \sum_b \big(|\mathrm{payload}^{fwd}_b| + |\mathrm{payload}^{bwd}_b|\big)

    whatever the schedule (a tick's moves carry exactly its sending boundaries' payloads,
    none padded: :func:`jaxcomp.pipeline._ticks.move_boundaries`).

    Args:
      links, shapes: the boundaries' links and activation shapes.
      num_microbatches: ``M``.
      compress: the compressed program (``False``: dense payloads).
      train: with the backward sends (``False``: evaluation's forward ticks).

    Returns:
      ``{"wire_bytes", "forward_bytes", "backward_bytes", "dense_bytes"}``
      (``wire_bytes = forward + backward``; backward is 0 when ``train=False``;
      ``dense_bytes``: what the same sends cost uncompressed).
    """
    fwd = bwd = dense = 0
    for lk, shape in zip(links, shapes):
        f, b = link_bytes(lk, shape, compress)
        fwd += f
        bwd += b if train else 0
        dense += _base.dense_bytes(shape) * (2 if train else 1)
    m = num_microbatches
    return {
        "wire_bytes": m * (fwd + bwd),
        "forward_bytes": m * fwd,
        "backward_bytes": m * bwd,
        "dense_bytes": m * dense,
    }


def hlo_sent_bytes(hlo_text: str, mesh: jax.sharding.Mesh) -> dict[str, float]:
    r"""Bytes that cross in the ``collective-permute`` ops of a compiled pipeline program, and
    those of its boundary sends.

    The HLO meter (:func:`jaxcomp.comm.collective_report`) counts a ``collective-permute``'s
    operand once per execution (what one device sends); a tick's permute carries one payload
    per source-target pair, so each is counted here times its pairs. A permute is a boundary
    send when it is a ``ppermute`` of the program (its ``op_name`` ends in ``/ppermute``) and
    every pair goes one step along ``mesh``'s ``stage`` axis, within one pipeline replica (the
    other axes' coordinates equal); each pair's bytes count as forward (one stage up) or
    backward (one down) by its own direction, as a 1F1B tick moves both in one permute
    (:func:`jaxcomp.pipeline._ticks.tick_moves`). Device-id steps do not say that: on
    a ``(data, stage)`` mesh the permutes XLA's partitioner makes to gather a stage-sharded
    array (unpacking the gradient for unpacked parameters, pairs ``(s, 0)`` per replica) step
    by ``-1`` for ``s = 1``, and on a ``(stage, data)`` mesh a data-axis ``ppermute`` steps by
    ``±1`` while a boundary steps by the data size.

    Args:
      hlo_text: ``compiled.as_text()`` of a pipeline step or evaluation (with its op metadata,
        as JAX prints it).
      mesh: the mesh the program runs on (a ``stage`` axis; the pairs' ids are positions in
        ``mesh.devices``, row-major).

    Returns:
      ``{"total", "forward", "backward", "other", "permutes"}``: the bytes of every pair of
      every permute; of the boundary sends one stage up (``(b, b + 1)``) and one stage down
      (on a mesh with ``R`` data replicas, ``R`` times one pipeline replica's
      :func:`step_bytes`); of the permutes that are not boundary sends; and the number of
      boundary-send executions (the ticks' moves).

    Raises:
      ValueError: if the text's partitions are not ``mesh``'s devices, a pair names a device
        outside it, or a permute carries no ``op_name`` (metadata stripped: a boundary send
        could not be told from a resharding).

    Example:
      >>> sent = hlo_sent_bytes(compiled.as_text(), mesh)  # doctest: +SKIP
      >>> sent["forward"] == replicas * counts["forward_bytes"]  # doctest: +SKIP
      True
    """
    grid = mesh.devices.shape
    stage = mesh.axis_names.index(_mesh.STAGE)
    found = re.search(r"num_partitions=(\d+)", hlo_text)
    if found and int(found.group(1)) != mesh.devices.size:
        raise ValueError(
            f"the program runs on {found.group(1)} partitions, the mesh has "
            f"{mesh.devices.size} devices {dict(mesh.shape)}: pass the program's mesh."
        )

    def steps_of(pairs):
        steps = []
        for s, d in pairs:
            if max(s, d) >= mesh.devices.size:
                raise ValueError(
                    f"permute pair {(s, d)} names a device outside the mesh {dict(mesh.shape)}."
                )
            a, b = np.unravel_index(s, grid), np.unravel_index(d, grid)
            others = [i for i in range(len(grid)) if i != stage]
            if any(a[i] != b[i] for i in others):
                return None
            steps.append(int(b[stage]) - int(a[stage]))
        return steps if set(steps) <= {1, -1} else None

    out = {"total": 0.0, "forward": 0.0, "backward": 0.0, "other": 0.0, "permutes": 0}
    for r in _hlo.collective_report(hlo_text).records:
        if r.kind != "collective-permute":
            continue
        if not r.op_name:
            raise ValueError(
                f"collective-permute {r.name} has no op_name metadata: the meter tells the "
                "program's ppermutes from the partitioner's by it (compile with metadata)."
            )
        out["total"] += r.total_bytes * len(r.pairs)
        steps = steps_of(r.pairs) if r.op_name.rsplit("/", 1)[-1] == "ppermute" else None
        if steps is None:
            out["other"] += r.total_bytes * len(r.pairs)
            continue
        for step in steps:
            out["forward" if step == 1 else "backward"] += r.total_bytes
        out["permutes"] += r.executions
    return out


# ----------------------------------------------------------------------------------------------
# A boundary's sends as explicit calls (see the module docstring).


class Wire(NamedTuple):
    """How one boundary's ends meet in :func:`send_forward` and :func:`send_backward` (the
    simulation's; the tick program moves many boundaries at once, see :func:`forward_halves`).

    Attributes:
      is_source: stage ``b`` is here (``True`` in the simulation, a traced bool per device).
      is_target: stage ``b + 1`` is here.
      move: ``move(tree, reverse) -> tree``: the payload from ``b`` to ``b + 1`` (``reverse``:
        back): nothing in the simulation, or a ``ppermute`` with the boundary's pair.
      stacked: link-state buffers are ``[S, ...]`` (the simulation) rather than one device's.
    """

    is_source: Any
    is_target: Any
    move: Callable[[Any, bool], Any]
    stacked: bool


def _ends(layout, direction: str, boundary: int, stacked: bool):
    return tuple(
        _link_state.end_ref(layout, f"{direction}_{end}", boundary, stacked)
        for end in ("send", "recv")
    )


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
    ends = _ends(layout, "forward", boundary, wire.stacked)
    roles = (wire.is_source, wire.is_target)
    return _send_vjp.send_forward(
        lk.forward, lk.mode, compress, x, buffers, ends, key, ids, roles, wire.move
    )


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
    mode).
    """
    ends = _ends(layout, "backward", boundary, wire.stacked)
    roles = (wire.is_source, wire.is_target)
    return _send_vjp.send_backward(
        lk.forward, lk.backward, lk.mode, compress, g, buffers, ends, payloads, key, ids, roles,
        wire.move,
    )  # fmt: skip


def forward_halves(lk: _config.Link, boundary: int, layout, roles: tuple, compress: bool):
    """:func:`send_forward` as its two ends, for a caller that moves many boundaries' payloads
    in one collective (one device's link-state buffers; ``roles``: ``(is_source,
    is_target)``): ``encode(x, buffers, key, ids) -> (payload, buffers)`` on the source,
    ``decode(received, x, buffers, ids) -> (decoded, buffers)`` on the target. The shared-mask
    backward's payloads are ``(payload, received)``."""
    ends = _ends(layout, "forward", boundary, False)

    def encode(x, buffers, key, ids):
        return _send_vjp.forward_encode(lk.forward, compress, x, buffers, ends, key, ids, roles)

    def decode(received, x, buffers, ids):
        return _send_vjp.forward_decode(
            lk.forward, compress, received, x, buffers, ends, ids, roles
        )

    return encode, decode


def backward_halves(lk: _config.Link, boundary: int, layout, roles: tuple, compress: bool):
    """:func:`send_backward` as its two ends (see :func:`forward_halves`):
    ``encode(g, buffers, payloads, key, ids) -> (payload, buffers)`` on the target,
    ``decode(moved, g, buffers, payloads, ids) -> (decoded, buffers)`` on the source."""
    ends = _ends(layout, "backward", boundary, False)
    args = (lk.forward, lk.backward, lk.mode, compress)

    def encode(g, buffers, payloads, key, ids):
        return _send_vjp.backward_encode(*args, g, buffers, ends, payloads, key, ids, roles)

    def decode(moved, g, buffers, payloads, ids):
        return _send_vjp.backward_decode(*args, moved, g, buffers, ends, payloads, ids, roles)

    return encode, decode
