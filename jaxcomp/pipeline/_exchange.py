"""One boundary's sends as explicit calls: activations forward, activation-gradients backward.

The explicit schedules run a microbatch's backward send at a later tick than its forward send,
so a boundary is two calls rather than one ``custom_vjp``: :func:`send_forward` (stage ``b``
encodes with the link's forward channel, the payload moves to ``b + 1``, which decodes it) and
:func:`send_backward` (``b + 1`` encodes the gradient with the backward channel, or in
``"shared_mask"`` mode takes it at the forward's kept positions, and ``b`` decodes it). They are
the functions :func:`jaxcomp.comm.compressed_ppermute` is made of (the same channel calls, keys
and ids), with each end's state read from and written to the compact link-state buffers
(:mod:`jaxcomp.pipeline._link_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax

from jaxcomp.comm import _send_vjp
from jaxcomp.pipeline import _config
from jaxcomp.pipeline import _end_ref
from jaxcomp.pipeline import _link_state


class Wire(NamedTuple):
    """How one boundary's ends meet.

    Attributes:
      is_source: stage ``b`` is here (``True`` in the simulation, a traced bool per device).
      is_target: stage ``b + 1`` is here.
      move: ``move(tree, reverse) -> tree``: the payload from ``b`` to ``b + 1`` (``reverse``:
        back); a ``ppermute`` with the single pair, or nothing in the simulation.
      stacked: link-state buffers are ``[S, ...]`` (the simulation) rather than one device's.
    """

    is_source: Any
    is_target: Any
    move: Callable[[Any, bool], Any]
    stacked: bool


def _ends(layout, direction: str, boundary: int, stacked: bool):
    return tuple(
        _end_ref.end_ref(layout, f"{direction}_{end}", boundary, stacked)
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
