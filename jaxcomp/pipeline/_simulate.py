"""The single-device program: each microbatch through every stage and back, links at the cuts.

Microbatch ``m`` runs forward through stages ``0 .. S - 1`` (each boundary's forward link
applied with :func:`jaxcomp.pipeline._exchange.send_forward`), then backward through
``S - 1 .. 0`` (each backward link applied with ``send_backward``), before microbatch ``m + 1``.
Every boundary therefore sees its forward sends in microbatch order and its backward sends in
microbatch order, with the same keys and ids, as in both distributed schedules: the channel
states go through the same sequence of updates, so the numbers are the same. Likewise each
stage's running state (BatchNorm statistics) is updated by microbatches ``0 .. M - 1`` in
order. Only one microbatch's activations are alive at a time. Link states keep the distributed
layout (row ``d`` is device ``d``'s ends).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.pipeline import _exchange
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _prepare
from jaxcomp.pipeline import _residuals

_WIRE = _exchange.Wire(True, True, lambda tree, reverse: tree, True)


def train(
    spec: Any,
    static: _prepare.Static,
    params: tuple[Any, ...],
    x: Any,
    labels: Any,
    ids: jax.Array | None,
    key: jax.Array | None,
    states: dict[str, jax.Array],
    compress: bool,
    model_state: tuple[Any, ...],
):
    """One training step on one device.

    Returns:
      ``(loss, metrics, grads, states, model_state)``: microbatch means, per-stage gradient
      pytrees, the new link-state buffers ``{dtype: [S, L]}`` and the stages' new running
      states (per-stage pytrees).
    """
    model, links, m_ = spec.model, spec.links, spec.num_microbatches
    num = model.num_stages

    def body(carry, m):
        states, grads, loss_sum, metrics_sum, mstate = carry
        labels_m = jax.tree.map(lambda a: a[m], labels)
        ids_m = None if ids is None else ids[m]
        h, pulls, payloads, mstate = x[m], [], [], list(mstate)
        for s in range(num):
            out, pull, (aux, mstate[s]) = _residuals.vjp(
                spec.fns[s], params[s], h, labels_m, mstate[s]
            )
            pulls.append(pull)
            if s < num - 1:
                h, states, kept = _exchange.send_forward(
                    links[s], s, out, states, static.state_layout, _links.link_key(key, s, m),
                    ids_m, _WIRE, compress,
                )  # fmt: skip
                payloads.append(kept)
        loss_sum = loss_sum + out
        metrics_sum = jax.tree.map(jnp.add, metrics_sum, aux)
        g = jnp.asarray(1.0 / m_, jnp.float32)
        new_grads = list(grads)
        for s in reversed(range(num)):
            got = pulls[s](g)
            new_grads[s] = jax.tree.map(jnp.add, grads[s], got[0])
            if s > 0:
                g, states = _exchange.send_backward(
                    links[s - 1], s - 1, got[1], states, static.state_layout, payloads[s - 1],
                    _links.link_key(key, s - 1, m), ids_m, _WIRE, compress,
                )  # fmt: skip
        return (states, tuple(new_grads), loss_sum, metrics_sum, tuple(mstate)), None

    zero = jnp.zeros((), jnp.float32)
    grads0 = tuple(jax.tree.map(jnp.zeros_like, p) for p in params)
    metrics0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), static.metrics)
    carry = (states, grads0, zero, metrics0, tuple(model_state))
    (states, grads, loss, metrics, model_state), _ = lax.scan(body, carry, jnp.arange(m_))
    return loss / m_, jax.tree.map(lambda v: v / m_, metrics), grads, states, model_state


def evaluate(
    spec: Any,
    static: _prepare.Static,
    links: tuple,
    params: tuple[Any, ...],
    x: Any,
    labels: Any,
    key: jax.Array | None,
    states: dict[str, jax.Array],
    compress: bool,
    model_state: tuple[Any, ...],
):
    """The forward pass of every microbatch with the stages' running states ``model_state``;
    returns ``(loss, metrics, outputs [M, mb, ...])``."""
    model, m_ = spec.model, spec.num_microbatches
    num = model.num_stages

    def body(carry, m):
        states, loss_sum, metrics_sum = carry
        h = x[m]
        for s in range(num - 1):
            y = spec.fns[s].stage(params[s], model_state[s], h)
            h, states, _ = _exchange.send_forward(
                links[s], s, y, states, static.state_layout, _links.link_key(key, s, m), None,
                _WIRE, compress,
            )  # fmt: skip
        y = spec.fns[num - 1].stage(params[num - 1], model_state[num - 1], h)
        loss, metrics = _prepare.split_loss(model.loss_fn(y, jax.tree.map(lambda a: a[m], labels)))
        loss_sum = loss_sum + loss.astype(jnp.float32)
        metrics_sum = jax.tree.map(lambda a, v: a + v.astype(jnp.float32), metrics_sum, metrics)
        return (states, loss_sum, metrics_sum), y

    zero = jnp.zeros((), jnp.float32)
    metrics0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), static.metrics)
    (_, loss, metrics), ys = lax.scan(body, (states, zero, metrics0), jnp.arange(m_))
    return loss / m_, jax.tree.map(lambda v: v / m_, metrics), ys
