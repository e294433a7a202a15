"""The ops of one tick program, each traced once and reused by every tick that runs it.

A schedule runs stage ``s``'s forward in ``M`` ticks and its backward in ``M`` more; the fill
and drain ticks are unrolled (:mod:`jaxcomp.pipeline._ticks`), and each tick's ``lax.switch``
traced the op again: 9 traces of every stage per 4-stage training program (3 with the residual
plan's, 4 -> 1 per evaluation program), and a boundary's send once per tick. Here each
(stage, op) is a ``jax.jit(..., inline=True)`` made once per program: the first tick traces it,
every later tick with the same abstract inputs gets JAX's cached jaxpr, **inlined** into the
tick (the equations are emitted as they were traced, no call boundary), so the program XLA
compiles is the one the per-tick traces gave.

A stage op takes this device's packed parameters and running state (``{dtype: [L]}``) and
unpacks its stage's share inside, so the (un)packing is traced once too. A boundary's sends
(codec, feedback, link-state reads and writes, the ``ppermute``) are traced once per direction
the same way (:class:`LinkOps`).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.comm import _local
from jaxcomp.pipeline import _exchange
from jaxcomp.pipeline import _prepare
from jaxcomp.pipeline import _residuals


class StageOps(NamedTuple):
    """One program's per-stage ops (a tuple of ``S`` callables each, ``None`` where the
    program has no such op).

    Attributes:
      forward: training forward ``(local, model, h, labels) -> (out, aux, packed residuals,
        packed new state)``; the last stage's ``out`` is its float32 loss, ``aux`` its
        metrics (``None`` for the other stages).
      backward: ``(local, model, residual row, cotangent, labels) -> (packed d params, d x)``
        (``d x`` is ``None`` for stage 0).
      evaluate: ``(local, model, h, labels) -> y`` for a hidden stage, ``(loss, metrics, y)``
        for the last one (float32 loss and metrics).
    """

    forward: tuple | None
    backward: tuple | None
    evaluate: tuple | None


def _inline(fn):
    return jax.jit(fn, inline=True)


def stage_ops(prog: Any, plan: _residuals.ResidualPlan | None) -> StageOps:
    """The ops of every stage of ``prog`` (a :class:`jaxcomp.pipeline._ticks.Program`), with
    the residual ``plan`` of a training program (``None`` for evaluation).

    Make them once per program trace: JAX's trace cache is per function object, so a tick
    that made its own would trace the stage again.
    """
    st, num, axes = prog.static, prog.num_stages, prog.axes

    def unpack(s, local, model):
        return st.layout.unpack_stage(s, local), st.model_layout.unpack_stage(s, model)

    def evaluate(s):
        fns = prog.fns[s]

        def op(local, model, h, labels):
            params, state = unpack(s, local, model)
            y = fns.stage(params, state, h)
            if s < num - 1:
                return y
            loss, metrics = _prepare.split_loss(prog.loss_fn(y, labels))
            metrics = jax.tree.map(lambda v: v.astype(jnp.float32), metrics)
            return loss.astype(jnp.float32), metrics, y

        return _inline(op)

    def forward(s):
        fns = prog.fns[s]

        def op(local, model, h, labels):
            params, state = unpack(s, local, model)
            out, aux, res, new_state = _residuals.forward(plan, fns, s, params, h, labels, state)
            return out, aux, res, st.model_layout.pack_stage(s, new_state)

        return _inline(op)

    def backward(s):
        fns = prog.fns[s]

        def op(local, model, res_row, ct, labels):
            params, state = unpack(s, local, model)
            like = _local.to_varying(jnp.zeros(st.inputs[s].shape, st.inputs[s].dtype), axes)
            dp, dx = _residuals.backward(plan, fns, s, params, res_row, ct, like, labels, state)
            return st.layout.pack_stage(s, dp), dx

        return _inline(op)

    stages = range(num)
    if not prog.train:
        return StageOps(None, None, tuple(evaluate(s) for s in stages))
    return StageOps(tuple(forward(s) for s in stages), tuple(backward(s) for s in stages), None)


class LinkOps(NamedTuple):
    """One program's sends, per boundary (tuples of ``S - 1`` callables).

    Attributes:
      forward: ``(x, states, key, ids, is_source, is_target) -> (decoded, states, payloads)``
        (:func:`jaxcomp.pipeline._exchange.send_forward`).
      backward: ``(g, states, payloads, key, ids, is_source, is_target) -> (decoded,
        states)`` (:func:`jaxcomp.pipeline._exchange.send_backward`).
    """

    forward: tuple
    backward: tuple


def link_ops(prog: Any, move: Any) -> LinkOps:
    """The sends of every boundary of ``prog``; ``move(b)`` is boundary ``b``'s payload move
    (``move(tree, reverse) -> tree``). Make them once per program trace, as :func:`stage_ops`.
    """
    layout, compress = prog.static.state_layout, prog.compress

    def forward(b, lk):
        def op(x, states, key, ids, is_source, is_target):
            wire = _exchange.Wire(is_source, is_target, move(b), False)
            return _exchange.send_forward(lk, b, x, states, layout, key, ids, wire, compress)

        return _inline(op)

    def backward(b, lk):
        def op(g, states, payloads, key, ids, is_source, is_target):
            wire = _exchange.Wire(is_source, is_target, move(b), False)
            return _exchange.send_backward(
                lk, b, g, states, layout, payloads, key, ids, wire, compress
            )

        return _inline(op)

    links = tuple(enumerate(prog.links))
    return LinkOps(
        tuple(forward(b, lk) for b, lk in links), tuple(backward(b, lk) for b, lk in links)
    )
